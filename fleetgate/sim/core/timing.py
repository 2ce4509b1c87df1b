"""Step-time model, named hardware profiles, and the engine-model factory.

Step time
---------
One iteration of an engine costs::

    t = fixed + a * prefill_tokens + b * decode_seqs + c * kv_tokens_read

times ``1 + jitter * u`` with ``u`` uniform in [-1, 1] drawn from the engine's
injected, seeded ``random.Random`` (so a seed reproduces every duration).
``fixed`` is the weight-streaming + launch cost of a forward pass (what a
batch-1 decode step costs), ``a`` the compute cost per prompt token, ``b`` the
per-sequence overhead of a decode, ``c`` the attention cost per KV token read
(every scheduled request reads its whole context). This is what makes
throughput rise with batch size (``fixed`` is amortised) until the KV cache
caps the batch.

Calibration (figures used; all approximate, meant to give realistic *shapes*)
-----------------------------------------------------------------------------
* NVIDIA NIM LLM benchmarking, "Performance" page
  (https://docs.nvidia.com/nim/benchmarking/llm/1.0.0/performance), NIM uses
  the TensorRT-LLM backend:

  - Llama-3.1-8b-instruct, NIM 1.8.0 (one H100): concurrency 1 -> TTFT
    10.26 ms, ITL 4.63 ms; concurrency 100 -> TTFT 119.97 ms, ITL 7.57 ms,
    12 214.97 tok/s. Hence ``trtllm-llama8b-h100``: fixed 4.4 ms, b 20 us;
    a 30 us/token assumes the table's prompts are a few hundred tokens (the
    page's excerpt we read does not show the sequence lengths).
  - Llama-3.1-70b-instruct, NIM 1.3.0: concurrency 1 -> TTFT 25.05 ms, ITL
    13.21 ms; concurrency 100 -> ITL 23.28 ms, 4 092.34 tok/s. Hence
    ``trtllm-llama70b-4xh100``: fixed 12.9 ms, b 90 us, a 60 us/token.

* vLLM's CI performance dashboard (buildkite vllm/performance-benchmark build
  9515, H200): ``latency_llama8B_tp1`` 833 ms and ``latency_llama70B_tp4``
  2 077 ms for 32 prompt + 128 output tokens at batch 8, i.e. ~6.5 ms and
  ~16 ms per step on the faster H200. The vLLM blog (2024-09-05, "vLLM
  v0.6.0") reports Llama 8B on 1xH100 and 70B on 4xH100 as the reference
  setups. We scale those steps to H100 (about 1.3x slower memory bandwidth)
  and BF16 weights: ``vllm-llama8b-h100`` fixed 6.2 ms, a 60 us/token;
  ``vllm-llama70b-4xh100`` fixed 17 ms, a 100 us/token. vLLM is therefore
  modelled ~30-40 % slower per step than the TensorRT-LLM (FP8 NIM) figures,
  matching the direction of those published numbers.

* ``c`` (attention) from KV bytes per token over H100 HBM bandwidth
  (3.35 TB/s): Llama-3.1-8B BF16 KV is 128 KiB/token -> ~0.04 us; 70B over
  4 GPUs ~82 KiB/GPU/token -> ~0.025 us, plus overhead.

* KV blocks: ~450 k tokens of KV on an 80 GB H100 for 8B (vLLM: 28 000
  16-token blocks; TensorRT-LLM: 14 000 32-token blocks) and ~400 k tokens for
  70B on 4xH100 (25 000 / 12 500 blocks). Limits: vLLM ``max_num_seqs`` 256,
  ``max_num_batched_tokens`` 8192; ``trtllm-serve`` ``max_batch_size`` 2048,
  ``max_num_tokens`` 8192.

The ``test`` profile is tiny and fast (1 ms steps, 64 blocks) for unit tests.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Mapping
from typing import Literal

from fleetgate.sim.core import kv_trtllm, sched_vllm
from fleetgate.sim.core.adp import AttentionDpModel
from fleetgate.sim.core.api import EngineModel
from fleetgate.sim.core.engine_base import EngineConfig
from fleetgate.sim.core.sched_trtllm import TrtllmEngine
from fleetgate.sim.core.sched_vllm import VllmEngine

EngineKind = Literal["vllm", "trtllm"]
ENGINE_KINDS: tuple[EngineKind, ...] = ("vllm", "trtllm")


@dataclasses.dataclass(frozen=True, slots=True)
class Profile:
    """A named hardware/model setup: step-time constants plus engine defaults.

    ``engine`` is the engine the figures belong to (``None``: any engine).
    ``block_size`` 0 means the engine's default (vLLM 16, TensorRT-LLM 32).
    ``queue_policy`` is vLLM's ``--scheduling-policy`` / TRT's
    ``waiting_queue_policy``; ``capacity_policy`` only affects TensorRT-LLM.
    """

    name: str
    engine: EngineKind | None
    fixed_s: float
    prefill_token_s: float
    decode_seq_s: float
    kv_token_s: float
    jitter: float = 0.03
    num_blocks: int = 1024
    block_size: int = 0
    max_running: int = 256
    max_step_tokens: int = 8192
    max_model_len: int = 131072
    queue_policy: Literal["fcfs", "priority"] = "fcfs"
    capacity_policy: Literal["GUARANTEED_NO_EVICT", "MAX_UTILIZATION"] = "GUARANTEED_NO_EVICT"
    prefix_caching: bool = True
    chunked_prefill: bool = True
    mean_output_tokens: float = 256.0
    attention_dp_ranks: int = 1
    """TensorRT-LLM attention data parallelism: ranks of one replica, each with the
    limits and KV cache above (:class:`~fleetgate.sim.core.adp.AttentionDpModel`)."""
    adp_cache_routing: bool = False
    """The engine places a request on the rank holding its prefix (else by load)."""

    def step_seconds(
        self, prefill_tokens: int, decode_seqs: int, kv_tokens: int, rng: random.Random
    ) -> float:
        """The :class:`~fleetgate.sim.core.engine_base.CostModel` of this profile."""
        base = (
            self.fixed_s
            + self.prefill_token_s * prefill_tokens
            + self.decode_seq_s * decode_seqs
            + self.kv_token_s * kv_tokens
        )
        if self.jitter:
            base *= 1.0 + self.jitter * (2.0 * rng.random() - 1.0)
        return max(base, 0.0)

    def lone_prefill_seconds(self, uncached_tokens: int, cached_tokens: int = 0) -> float:
        """Seconds to the first token of a prompt alone on an idle engine: its
        ``uncached_tokens`` (at least one: the engine computes the last prompt token
        even on a full hit) in steps of ``max_step_tokens``, each reading the context
        so far, at the mean step time (no jitter). A lower bound on a loaded engine's
        TTFT for that prompt, used by the benchmark's TTFT floor."""
        left = max(1, uncached_tokens)
        done = max(0, cached_tokens)
        seconds = 0.0
        while left > 0:
            n = min(left, self.max_step_tokens) if self.chunked_prefill else left
            seconds += self.fixed_s + self.prefill_token_s * n + self.kv_token_s * (done + n)
            done += n
            left -= n
        return seconds


PROFILES: dict[str, Profile] = {
    p.name: p
    for p in (
        Profile(
            name="vllm-llama8b-h100",
            engine="vllm",
            fixed_s=6.2e-3,
            prefill_token_s=60e-6,
            decode_seq_s=25e-6,
            kv_token_s=0.05e-6,
            num_blocks=28_000,
        ),
        Profile(
            name="vllm-llama70b-4xh100",
            engine="vllm",
            fixed_s=17e-3,
            prefill_token_s=100e-6,
            decode_seq_s=110e-6,
            kv_token_s=0.04e-6,
            num_blocks=25_000,
        ),
        Profile(
            name="trtllm-llama8b-h100",
            engine="trtllm",
            fixed_s=4.4e-3,
            prefill_token_s=30e-6,
            decode_seq_s=20e-6,
            kv_token_s=0.04e-6,
            num_blocks=14_000,
            max_running=2048,
        ),
        Profile(
            name="trtllm-llama70b-4xh100",
            engine="trtllm",
            fixed_s=12.9e-3,
            prefill_token_s=60e-6,
            decode_seq_s=90e-6,
            kv_token_s=0.03e-6,
            num_blocks=12_500,
            max_running=2048,
        ),
        Profile(
            name="test",
            engine=None,
            fixed_s=1e-3,
            prefill_token_s=2e-6,
            decode_seq_s=20e-6,
            kv_token_s=0.01e-6,
            jitter=0.0,
            num_blocks=64,
            max_running=8,
            max_step_tokens=256,
            max_model_len=512,
        ),
    )
}


def _coerce(name: str, current: object, value: object) -> object:
    """Convert an override (possibly a CLI string) to the field's type."""
    try:
        if isinstance(current, bool):
            if isinstance(value, str):
                lowered = value.strip().lower()
                if lowered not in ("true", "false", "1", "0", "yes", "no"):
                    raise ValueError(value)
                return lowered in ("true", "1", "yes")
            return bool(value)
        if isinstance(current, int):
            if isinstance(value, float) and not value.is_integer():
                raise ValueError(value)
            return int(value)  # type: ignore[call-overload]
        if isinstance(current, float):
            return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError(f"override {name}={value!r}: expected {type(current).__name__}") from None
    return value


#: Engine-native setting names accepted as overrides, mapped to :class:`Profile` fields.
ALIASES: dict[str, str] = {
    "num_gpu_blocks": "num_blocks",
    "max_num_seqs": "max_running",
    "max_batch_size": "max_running",
    "max_num_batched_tokens": "max_step_tokens",
    "max_num_tokens": "max_step_tokens",
    "tokens_per_block": "block_size",
    "scheduling_policy": "queue_policy",
    "waiting_queue_policy": "queue_policy",
    "capacity_scheduler_policy": "capacity_policy",
    "enable_prefix_caching": "prefix_caching",
    "enable_block_reuse": "prefix_caching",
    "enable_chunked_prefill": "chunked_prefill",
    "enable_chunked_context": "chunked_prefill",
}


def resolve_profile(name: str, overrides: Mapping[str, object] | None = None) -> Profile:
    """The named profile with ``overrides`` applied.

    Keys are :class:`Profile` field names or the engine-native names in
    :data:`ALIASES` (``max_num_seqs``, ``max_batch_size``, ...). String values
    are converted to the field's type (CLI ``--set key=value``); policy names
    are case-insensitive (``FCFS``, ``max_utilization``).
    """
    try:
        profile = PROFILES[name]
    except KeyError:
        raise ValueError(
            f"unknown profile {name!r}; known: {', '.join(sorted(PROFILES))}"
        ) from None
    if not overrides:
        return profile
    fields = {f.name for f in dataclasses.fields(Profile)} - {"name", "engine"}
    changes: dict[str, object] = {}
    for raw_key, value in overrides.items():
        key = ALIASES.get(raw_key, raw_key)
        if key not in fields:
            raise ValueError(
                f"unknown profile setting {raw_key!r}; known: {', '.join(sorted(fields))}"
            )
        if key in changes:
            raise ValueError(f"profile setting {key!r} given twice (as {raw_key!r})")
        if key == "queue_policy" and isinstance(value, str):
            value = value.strip().lower()
        elif key == "capacity_policy" and isinstance(value, str):
            value = value.strip().upper()
        changes[key] = _coerce(raw_key, getattr(profile, key), value)
    return dataclasses.replace(profile, **changes)  # type: ignore[arg-type]


def engine_config(kind: EngineKind, profile: Profile) -> EngineConfig:
    """The engine-neutral scheduler settings of ``profile`` for ``kind``."""
    default_block = (
        sched_vllm.DEFAULT_BLOCK_SIZE if kind == "vllm" else kv_trtllm.DEFAULT_BLOCK_SIZE
    )
    return EngineConfig(
        num_blocks=profile.num_blocks,
        block_size=profile.block_size or default_block,
        max_running=profile.max_running,
        max_step_tokens=profile.max_step_tokens,
        max_model_len=profile.max_model_len,
        queue_policy=profile.queue_policy,
        prefix_caching=profile.prefix_caching,
        chunked_prefill=profile.chunked_prefill,
        mean_output_tokens=profile.mean_output_tokens,
        capacity_policy=profile.capacity_policy,
    )


def build_engine_model(
    kind: str,
    profile: str = "test",
    overrides: Mapping[str, object] | None = None,
    seed: int = 0,
) -> EngineModel:
    """An :class:`EngineModel` for ``kind`` ('vllm' | 'trtllm') and a named profile.

    Raises ``ValueError`` with a one-line message for an unknown engine,
    profile or setting, a profile made for the other engine, or settings that
    cannot work (e.g. ``max_model_len`` larger than the KV cache).
    """
    if kind not in ENGINE_KINDS:
        raise ValueError(f"unknown engine {kind!r}; known: {', '.join(ENGINE_KINDS)}")
    resolved = resolve_profile(profile, overrides)
    if resolved.engine is not None and resolved.engine != kind:
        raise ValueError(f"profile {profile!r} is for {resolved.engine}, not {kind}")
    config = engine_config(kind, resolved)
    rng = random.Random(seed)
    if resolved.attention_dp_ranks != 1:
        if kind != "trtllm" or resolved.attention_dp_ranks < 1:
            raise ValueError("attention_dp_ranks: a positive count, for trtllm only")
        ranks = [
            TrtllmEngine(config, resolved, random.Random(seed * 1009 + r))
            for r in range(resolved.attention_dp_ranks)
        ]
        return AttentionDpModel(ranks, cache_aware=resolved.adp_cache_routing)
    if kind == "vllm":
        return VllmEngine(config, resolved, rng)
    return TrtllmEngine(config, resolved, rng)


__all__ = [
    "ALIASES",
    "ENGINE_KINDS",
    "PROFILES",
    "Profile",
    "build_engine_model",
    "engine_config",
    "resolve_profile",
]
