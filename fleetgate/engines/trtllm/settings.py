"""TensorRT-LLM settings of an ``InferenceService`` (``spec.engine.trtllm``, camelCase).

Each field says which trtllm-serve flag or LLM-API options key it becomes; the
launch module decides, per TensorRT-LLM version, which of them may be written.
Pure: pydantic only.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel

__all__ = ["TrtllmSettings"]

_MODEL_CONFIG = ConfigDict(
    frozen=True, extra="forbid", populate_by_name=True, alias_generator=to_camel
)


_KV_EVENTS_RULE = (
    "!has(self.kvEvents) || !self.kvEvents || !has(self.enableBlockReuse) || self.enableBlockReuse"
)
_KV_EVENTS_MESSAGE = (
    "kvEvents is on but enableBlockReuse is off: an engine without block reuse has no "
    "cached blocks to report; turn block reuse on or set kvEvents: false"
)
_ADP_RULE = (
    "!has(self.enableAttentionDp) || !self.enableAttentionDp || "
    "!has(self.backend) || self.backend == 'pytorch'"
)
_ADP_MESSAGE = (
    "enableAttentionDp needs backend pytorch: attention data parallelism is a feature of "
    "TensorRT-LLM's PyTorch backend"
)
#: Events the executor keeps between two drains of ``/kv_cache_events``.
KV_EVENT_BUFFER = 4096


class TrtllmSettings(BaseModel):
    """TensorRT-LLM settings as embedded in an ``InferenceService`` spec (camelCase keys).

    ``None`` means "leave trtllm-serve's own default": the flag is not passed.
    """

    model_config = ConfigDict(
        **_MODEL_CONFIG,
        json_schema_extra={
            "x-kubernetes-validations": [
                {"rule": _KV_EVENTS_RULE, "message": _KV_EVENTS_MESSAGE},
                {"rule": _ADP_RULE, "message": _ADP_MESSAGE},
            ]
        },
    )

    backend: Literal["pytorch", "tensorrt"] = Field(
        default="pytorch",
        description="trtllm-serve backend; --backend. 'pytorch' is needed for the JSON "
        "iteration stats and the Prometheus endpoint.",
    )
    max_batch_size: int | None = Field(
        default=None,
        ge=1,
        le=65_536,
        description="Maximum requests scheduled together; --max_batch_size.",
    )
    max_num_tokens: int | None = Field(
        default=None,
        ge=1,
        le=10_000_000,
        description="Maximum batched tokens per iteration; --max_num_tokens.",
    )
    kv_cache_free_gpu_memory_fraction: float = Field(
        default=0.9,
        gt=0.0,
        le=1.0,
        description="Fraction of free GPU memory given to the KV cache; "
        "kv_cache_config.free_gpu_memory_fraction.",
    )
    capacity_scheduler_policy: Literal["GUARANTEED_NO_EVICT", "MAX_UTILIZATION"] = Field(
        default="GUARANTEED_NO_EVICT",
        description="GUARANTEED_NO_EVICT never pauses a started request; MAX_UTILIZATION "
        "packs more and may pause; scheduler_config.capacity_scheduler_policy.",
    )
    enable_block_reuse: bool = Field(
        default=True,
        description="KV block reuse across requests (prefix caching); "
        "kv_cache_config.enable_block_reuse.",
    )
    tokens_per_block: int = Field(
        default=32,
        ge=1,
        le=1024,
        description="Tokens per KV block; kv_cache_config.tokens_per_block.",
    )
    waiting_queue_policy: Literal["fcfs", "priority"] = Field(
        default="priority",
        description="Waiting-queue order; 'priority' honours the request 'priority' field "
        "(higher is sooner) that the router sets; scheduler_config.waiting_queue_policy.",
    )
    enable_attention_dp: bool = Field(
        default=False,
        description="Attention data parallelism (MoE models such as DeepSeek): each of the "
        "replica's parallelism.tensor GPUs is a rank with its own requests and its own KV "
        "cache; enable_attention_dp. With kvEvents the router follows every rank's events "
        "(main: rank r publishes on 5557 + r, replay on 5567 + r; 1.3: one drain holds all "
        "ranks) and, where the line has it, the engine places each request on the rank "
        "holding its prefix (attention_dp_config.enable_kv_cache_aware_routing).",
    )
    kv_events: bool | None = Field(
        default=None,
        description="Publish KV-cache events (blocks stored / removed) for the router's exact "
        "prefix view. TensorRT-LLM 1.3 (and main with backend tensorrt): "
        f"kv_cache_config.event_buffer_max_size {KV_EVENT_BUFFER}, drained by the router "
        "from POST /kv_cache_events. main (1.4+) with backend pytorch: the streaming "
        "ZeroMQ publisher, kv_cache_config.kv_events_config (port 5557 'kv-events', replay "
        "5567 'kv-replay') with use_kv_cache_manager_v2: true. Not written for 1.0-1.2 "
        "(not verified there). Unset: on when enableBlockReuse is on.",
    )

    @model_validator(mode="after")
    def _kv_events_need_block_reuse(self) -> TrtllmSettings:
        if self.kv_events and not self.enable_block_reuse:
            raise ValueError(_KV_EVENTS_MESSAGE)
        return self

    @model_validator(mode="after")
    def _attention_dp_needs_pytorch(self) -> TrtllmSettings:
        if self.enable_attention_dp and self.backend != "pytorch":
            raise ValueError(_ADP_MESSAGE)
        return self

    @property
    def kv_events_on(self) -> bool:
        """Events are kept: asked for, or by default with block reuse."""
        return self.enable_block_reuse if self.kv_events is None else self.kv_events
