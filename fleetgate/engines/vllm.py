"""vLLM (V1 engine) adapter: settings, metrics parsing, priority, errors, container.

Sources (all in /work/shared/reference/engines.md, "engines.md" below, and the real
vLLM 0.32 recordings in /work/shared/fixtures/vllm-0.32-cpu/):

* Settings and flags: engines.md §2 ("Priority": ``--scheduling-policy fcfs|priority``;
  "Prefix caching": on by default, ``DEFAULT_BLOCK_SIZE = 16``).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

__all__ = ["VllmSettings"]

_MODEL_CONFIG = ConfigDict(
    frozen=True, extra="forbid", populate_by_name=True, alias_generator=to_camel
)


class VllmSettings(BaseModel):
    """vLLM engine settings as embedded in an ``InferenceService`` spec (camelCase keys).

    ``None`` means "leave vLLM's own default": the flag is not passed at all.
    """

    model_config = _MODEL_CONFIG

    max_model_len: int | None = Field(
        default=None,
        ge=1,
        le=10_000_000,
        description="Context length (prompt + output tokens); --max-model-len. "
        "Unset: taken from the model config.",
    )
    gpu_memory_utilization: float = Field(
        default=0.9,
        gt=0.0,
        le=1.0,
        description="Fraction of GPU memory vLLM may use for weights, activations and KV "
        "cache; --gpu-memory-utilization.",
    )
    enable_prefix_caching: bool = Field(
        default=True,
        description="Reuse KV blocks across requests sharing a prefix; "
        "--enable-prefix-caching / --no-enable-prefix-caching.",
    )
    scheduling_policy: Literal["fcfs", "priority"] = Field(
        default="priority",
        description="Waiting-queue order; 'priority' honours the request 'priority' field "
        "(lower is sooner) that the router sets; --scheduling-policy.",
    )
    max_num_seqs: int | None = Field(
        default=None,
        ge=1,
        le=65_536,
        description="Maximum concurrently running sequences; --max-num-seqs.",
    )
    max_num_batched_tokens: int | None = Field(
        default=None,
        ge=1,
        le=10_000_000,
        description="Token budget of one scheduler step; --max-num-batched-tokens.",
    )
    block_size: int | None = Field(
        default=None,
        ge=1,
        le=1024,
        description="Tokens per KV block; --block-size. Unset: 16 on GPU, 128 on CPU.",
    )
    enable_chunked_prefill: bool | None = Field(
        default=None,
        description="Split long prefills across steps; --enable-chunked-prefill / "
        "--no-enable-chunked-prefill. Unset: vLLM's default.",
    )
