"""TensorRT-LLM adapter (trtllm-serve, and Triton's tensorrtllm backend for metrics).

Sources. "engines.md" is /work/shared/reference/engines.md:

* Settings and YAML: engines.md §6 (``CapacitySchedulerPolicy``, ``SchedulerConfig``,
  ``KvCacheConfig`` defaults: ``tokens_per_block`` 32, ``free_gpu_memory_fraction`` 0.9,
  ``enable_block_reuse`` True); trtllm-serve's click options (``--backend``, ``--tp_size``,
  ``--pp_size``, ``--max_batch_size``, ``--max_num_tokens``, ``--revision``,
  ``--extra_llm_api_options``) as read in ``tensorrt_llm/commands/serve.py``.
* Metrics: engines.md §4 (JSON ``/metrics``: a list drained on read; ``/prometheus/metrics``
  mounted only with ``return_perf_metrics: true``, ``trtllm_*`` families), §5 (Triton
  ``nv_trt_llm_*`` families with a category label), §8.2 (the signal table).
  ``kvCacheStats.reusedBlocks``/``missedBlocks`` are cumulative: TRT's own Prometheus
  collector turns them into counters by differencing (``metrics/collector.py``), so
  prefix counters in tokens are ``blocks * tokensPerBlock``.
* Decode speed (``decode_seconds_sum``/``decode_observations``, ratio of deltas =
  seconds per output token). ``prometheus``: the ``trtllm_time_per_output_token_seconds``
  histogram (engines.md §4, since 1.1.0rc5; the emulator ``fleetgate/sim/trtllm_app.py``
  observes it per finished request), one observation = one request's mean TPOT.
  ``iteration-stats``: an iteration's ``iterLatencyMS`` is the gap each request in its
  generation phase saw, so the counters add ``latency x numGenRequests`` and
  ``numGenRequests`` over every drained iteration (token-weighted, like vLLM's ITL;
  context requests' first tokens are TTFT, and several speculative tokens per iteration
  are not accounted). They count from the router's first read and survive empty drains.
  ``triton``: unknown (engines.md §5 lists no per-token latency family).
* Priority: engines.md §4 "Priority (main)" and §6: ``priority: float`` in [0, 1],
  higher first, default 0.5.
* Errors: engines.md §4 "Errors": flat ``{"object": "error", ...}`` bodies, validation
  ``400 {"error": "<str>"}``, "Maximum queue size" surfacing as a 400 = overload.

Metric sources, in order of preference (the first is the default):

1. ``prometheus`` (``/prometheus/metrics``): never drains, so any number of router
   replicas may scrape it; carries running/waiting/KV/blocks in TRT main.
2. ``iteration-stats`` (JSON ``/metrics``, ``drains=True``): works on every release with
   ``enable_iter_perf_stats``; exactly one poller per engine.
3. ``triton`` (Triton's ``/metrics``; Triton serves it on its metrics port, 8002 by default,
   not on the HTTP port, which a scraper must account for).

Draining JSON policy (:meth:`TrtllmAdapter.parse_metrics`). The executor appends one
``IterationStats`` per iteration; a read returns and removes all queued ones.
* Non-empty list: the element with the highest ``iter`` (the latest) wins; earlier ones
  are older states of the same gauges, and its counters are cumulative.
* Empty list: no iteration completed since the last read. Between iterations nothing
  is scheduled, finished or freed, so capacity (block counts, block size, batch
  limit) and cumulative counters are carried over from ``previous`` when ``previous``
  came from this same source. Live figures depend on what ``previous`` said:
  - previous idle (running == waiting == 0): the executor does not iterate without
    work, so silence means still idle: running = waiting = 0 (paused 0 when known),
    and KV usage/free blocks are carried;
  - previous busy, or no usable previous: silence with work outstanding means a stalled
    iteration or a second reader draining the queue; neither lets us state counts, so
    running/waiting/paused/KV usage/free blocks are ``None`` (unknown, never 0).

Caveat (both trtllm-serve sources): the figures describe the *last iteration*. TRT's
collector sets the ``trtllm_*`` gauges from iteration stats, and the executor does not
iterate without work, so after the last request finishes the gauges may keep their last
busy values until the next request arrives. Nothing in one scrape can reveal that; a
router that sees no change for long should weigh its own in-flight count instead.

Pure: no I/O, no clock reads; the Prometheus scanner is vllm.py's :class:`PromScanner`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from fleetgate.engines._common import (
    PromSample,
    PromScanner,
    check_error_status,
    clamp_level,
    decode_pair,
    error_json,
    finite,
    json_int,
    json_number,
    json_section,
    nonneg_count,
    require_some,
    text_message,
    unit_fraction,
    validate_launch,
)
from fleetgate.engines.base import (
    LEVEL_MAX,
    ContainerPlan,
    ErrorInfo,
    LaunchSpec,
    LoadSnapshot,
    MetricsParseError,
    MetricsSource,
    Probe,
)

__all__ = [
    "ADAPTER",
    "CONFIG_FILE",
    "ITERATION_STATS",
    "PROMETHEUS",
    "TRITON",
    "TrtllmAdapter",
    "TrtllmSettings",
]

_MODEL_CONFIG = ConfigDict(
    frozen=True, extra="forbid", populate_by_name=True, alias_generator=to_camel
)


class TrtllmSettings(BaseModel):
    """TensorRT-LLM settings as embedded in an ``InferenceService`` spec (camelCase keys).

    ``None`` means "leave trtllm-serve's own default": the flag is not passed.
    """

    model_config = _MODEL_CONFIG

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


PROMETHEUS = MetricsSource(name="prometheus", path="/prometheus/metrics", format="prometheus")
ITERATION_STATS = MetricsSource(name="iteration-stats", path="/metrics", format="json", drains=True)
TRITON = MetricsSource(name="triton", path="/metrics", format="prometheus", port=8002)

#: File name of the LLM-API options YAML inside ``ContainerPlan.config_mount_path``.
CONFIG_FILE = "extra-llm-api-options.yaml"

#: trtllm-serve's subcommands; a model path equal to one needs an explicit ``serve``.
_SUBCOMMANDS = frozenset(
    {"serve", "grpc", "disaggregated", "disaggregated_mpi_worker", "mm_embedding_serve"}
)

# ------------------------------------------------------------------ trtllm-serve Prometheus
_T_RUNNING = "trtllm_num_requests_running"
_T_WAITING = "trtllm_num_requests_waiting"
_T_PAUSED = "trtllm_num_paused_requests"
_T_KV = "trtllm_kv_cache_utilization"
_T_MAX_BLOCKS = "trtllm_kv_cache_max_blocks"
_T_FREE_BLOCKS = "trtllm_kv_cache_free_blocks"
_T_USED_BLOCKS = "trtllm_kv_cache_used_blocks"
_T_TPB = "trtllm_kv_cache_tokens_per_block"
_T_REUSED = "trtllm_kv_cache_reused_blocks_total"
_T_MISSED = "trtllm_kv_cache_missed_blocks_total"
_T_PROMPT = "trtllm_prompt_tokens_total"
_T_GENERATION = "trtllm_generation_tokens_total"
_T_MAX_ACTIVE = "trtllm_max_num_active_requests"
_T_TPOT_SUM = "trtllm_time_per_output_token_seconds_sum"
_T_TPOT_COUNT = "trtllm_time_per_output_token_seconds_count"
_TRTLLM_SCANNER = PromScanner(
    (
        _T_RUNNING,
        _T_WAITING,
        _T_PAUSED,
        _T_KV,
        _T_MAX_BLOCKS,
        _T_FREE_BLOCKS,
        _T_USED_BLOCKS,
        _T_TPB,
        _T_REUSED,
        _T_MISSED,
        _T_PROMPT,
        _T_GENERATION,
        _T_MAX_ACTIVE,
        _T_TPOT_SUM,
        _T_TPOT_COUNT,
    )
)

# ------------------------------------------------------------------ Triton
_NV_REQUEST = "nv_trt_llm_request_metrics"
_NV_KV = "nv_trt_llm_kv_cache_block_metrics"
_NV_IFB = "nv_trt_llm_inflight_batcher_metrics"
_TRITON_SCANNER = PromScanner((_NV_REQUEST, _NV_KV, _NV_IFB))

#: Label values TRT's collector uses until the server knows better (engines.md §4).
_PLACEHOLDER = "undefined"


def _total(samples: Sequence[PromSample], what: str) -> float | None:
    return sum(finite(s.value, what) for s in samples) if samples else None


def _unique_int(samples: Sequence[PromSample], what: str) -> int | None:
    values = {int(finite(s.value, what)) for s in samples}
    return values.pop() if len(values) == 1 else None


def _prefix_tokens(
    reused: float | None, missed: float | None, tokens_per_block: int | None
) -> tuple[float | None, float | None]:
    """(query tokens, hit tokens) from cumulative block counters."""
    if tokens_per_block is None or reused is None:
        return None, None
    hits = reused * tokens_per_block
    queries = None if missed is None else (reused + missed) * tokens_per_block
    return queries, hits


def _parse_trtllm_prometheus(body: bytes, now: float) -> LoadSnapshot:
    found = _TRTLLM_SCANNER.scan(body)
    require_some(body, found, b"trtllm_")
    block_size = _unique_int(found[_T_TPB], _T_TPB)
    blocks_total = nonneg_count(_total(found[_T_MAX_BLOCKS], _T_MAX_BLOCKS), _T_MAX_BLOCKS)
    kv_samples = found[_T_KV]
    if kv_samples:
        kv: float | None = sum(unit_fraction(s.value, _T_KV) for s in kv_samples) / len(kv_samples)
    else:
        used = _total(found[_T_USED_BLOCKS], _T_USED_BLOCKS)
        kv = (
            unit_fraction(used / blocks_total, _T_USED_BLOCKS)
            if used is not None and blocks_total
            else None
        )
    queries, hits = _prefix_tokens(
        _total(found[_T_REUSED], _T_REUSED), _total(found[_T_MISSED], _T_MISSED), block_size
    )
    models = sorted(
        {
            s.labels["model_name"]
            for s in (*found[_T_RUNNING], *found[_T_WAITING], *kv_samples)
            if s.labels.get("model_name", _PLACEHOLDER) != _PLACEHOLDER
        }
    )
    decode_sum, decode_count = decode_pair(
        found[_T_TPOT_SUM], found[_T_TPOT_COUNT], "trtllm_time_per_output_token_seconds"
    )
    return LoadSnapshot(
        scraped_at=now,
        kv_usage=kv,
        running=nonneg_count(_total(found[_T_RUNNING], _T_RUNNING), _T_RUNNING),
        waiting=nonneg_count(_total(found[_T_WAITING], _T_WAITING), _T_WAITING),
        paused=nonneg_count(_total(found[_T_PAUSED], _T_PAUSED), _T_PAUSED),
        prefix_query_tokens=queries,
        prefix_hit_tokens=hits,
        prompt_tokens=_total(found[_T_PROMPT], _T_PROMPT),
        generation_tokens=_total(found[_T_GENERATION], _T_GENERATION),
        decode_seconds_sum=decode_sum,
        decode_observations=decode_count,
        block_size=block_size,
        blocks_total=blocks_total,
        blocks_free=nonneg_count(_total(found[_T_FREE_BLOCKS], _T_FREE_BLOCKS), _T_FREE_BLOCKS),
        max_running=nonneg_count(_total(found[_T_MAX_ACTIVE], _T_MAX_ACTIVE), _T_MAX_ACTIVE),
        models=tuple(models),
        source=PROMETHEUS.name,
    )


def _parse_triton(body: bytes, now: float) -> LoadSnapshot:
    """Triton: one series per (family, category value, model); models are summed."""
    found = _TRITON_SCANNER.scan(body)
    require_some(body, found, b"nv_trt_llm_")
    per_model: dict[str, dict[str, float]] = {}
    for family, category in (
        (_NV_REQUEST, "request_type"),
        (_NV_KV, "kv_cache_block_type"),
        (_NV_IFB, "inflight_batcher_specific_metric"),
    ):
        for s in found[family]:
            kind = s.labels.get(category)
            if kind is None:
                raise MetricsParseError(f"{family} sample without a {category} label")
            model = s.labels.get("model", "")
            per_model.setdefault(model, {})[f"{family}:{kind}"] = finite(s.value, family)

    def total(key: str) -> float | None:
        values = [m[key] for m in per_model.values() if key in m]
        return sum(values) if values else None

    block_sizes = {
        m[f"{_NV_KV}:tokens_per"] for m in per_model.values() if f"{_NV_KV}:tokens_per" in m
    }
    block_size = int(block_sizes.pop()) if len(block_sizes) == 1 else None
    fractions = [
        (unit_fraction(m[f"{_NV_KV}:fraction"], _NV_KV), m.get(f"{_NV_KV}:max"))
        for m in per_model.values()
        if f"{_NV_KV}:fraction" in m
    ]
    kv: float | None = None
    if fractions:
        weights = [w for _, w in fractions]
        if all(w is not None and w > 0 for w in weights):
            kv = sum(f * (w or 0.0) for f, w in fractions) / sum(w or 0.0 for w in weights)
        else:
            kv = sum(f for f, _ in fractions) / len(fractions)
    reused = total(f"{_NV_KV}:reused")
    return LoadSnapshot(
        scraped_at=now,
        kv_usage=kv,
        running=nonneg_count(total(f"{_NV_REQUEST}:active"), "active requests"),
        waiting=nonneg_count(total(f"{_NV_REQUEST}:waiting"), "waiting requests"),
        paused=nonneg_count(total(f"{_NV_IFB}:paused_requests"), "paused requests"),
        # Triton reports reused blocks but no misses: hits are known, queries are not.
        prefix_hit_tokens=None if reused is None or block_size is None else reused * block_size,
        block_size=block_size,
        blocks_total=nonneg_count(total(f"{_NV_KV}:max"), "max blocks"),
        blocks_free=nonneg_count(total(f"{_NV_KV}:free"), "free blocks"),
        max_running=nonneg_count(total(f"{_NV_REQUEST}:max"), "max requests"),
        models=tuple(sorted(m for m in per_model if m)),
        source=TRITON.name,
    )


# ------------------------------------------------------------------ JSON iteration stats
def _latest(items: list[Any]) -> Mapping[str, Any]:
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise MetricsParseError(f"iteration stats element {i} is not an object: {item!r}")
    iters = [json_number(item, "iter", "iteration stats") for item in items]
    if all(i is not None for i in iters):
        best = max(range(len(items)), key=lambda i: (iters[i] or 0.0, i))
        latest: Mapping[str, Any] = items[best]
        return latest
    last: Mapping[str, Any] = items[-1]
    return last


def _parse_iteration_stats(body: bytes, now: float, previous: LoadSnapshot | None) -> LoadSnapshot:
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise MetricsParseError(f"iteration stats are not JSON: {exc}") from exc
    if not isinstance(data, list):
        raise MetricsParseError(f"iteration stats must be a JSON list, got {type(data).__name__}")
    if not data:
        return _carry_over(now, previous)
    stats = _latest(data)
    decode_sum, decode_count = _decode_iterations(data, previous)
    kv = json_section(stats, "kvCacheStats")
    ifb = json_section(stats, "inflightBatchingStats")
    max_blocks = json_int(kv, "maxNumBlocks", "kvCacheStats")
    used_blocks = json_number(kv, "usedNumBlocks", "kvCacheStats")
    tokens_per_block = json_int(kv, "tokensPerBlock", "kvCacheStats")
    usage = None
    if max_blocks and used_blocks is not None:
        usage = unit_fraction(used_blocks / max_blocks, "usedNumBlocks/maxNumBlocks")
    queries, hits = _prefix_tokens(
        json_number(kv, "reusedBlocks", "kvCacheStats"),
        json_number(kv, "missedBlocks", "kvCacheStats"),
        tokens_per_block,
    )
    return LoadSnapshot(
        scraped_at=now,
        kv_usage=usage,
        running=json_int(stats, "numActiveRequests", "iteration stats"),
        waiting=json_int(stats, "numQueuedRequests", "iteration stats"),
        paused=json_int(ifb, "numPausedRequests", "inflightBatchingStats"),
        prefix_query_tokens=queries,
        prefix_hit_tokens=hits,
        decode_seconds_sum=decode_sum,
        decode_observations=decode_count,
        block_size=tokens_per_block,
        blocks_total=max_blocks,
        blocks_free=json_int(kv, "freeNumBlocks", "kvCacheStats"),
        max_running=json_int(stats, "maxNumActiveRequests", "iteration stats"),
        source=ITERATION_STATS.name,
    )


def _decode_iterations(
    items: list[Any], previous: LoadSnapshot | None
) -> tuple[float | None, float | None]:
    """Decode latency counters accumulated over drained iterations (module docstring)."""
    total = count = None
    if previous is not None and previous.source == ITERATION_STATS.name:
        total, count = previous.decode_seconds_sum, previous.decode_observations
    for item in items:
        latency_ms = json_number(item, "iterLatencyMS", "iteration stats")
        ifb = json_section(item, "inflightBatchingStats")
        gen = json_number(ifb, "numGenRequests", "inflightBatchingStats")
        if latency_ms is None or gen is None:
            continue
        total = (total or 0.0) + latency_ms / 1000.0 * gen
        count = (count or 0.0) + gen
    if total is None or count is None:
        return None, None
    return total, count


def _carry_over(now: float, previous: LoadSnapshot | None) -> LoadSnapshot:
    """An empty drain: see the module docstring for the policy."""
    if previous is None or previous.source != ITERATION_STATS.name:
        return LoadSnapshot(scraped_at=now, source=ITERATION_STATS.name)
    idle = previous.running == 0 and previous.waiting == 0
    return LoadSnapshot(
        scraped_at=now,
        kv_usage=previous.kv_usage if idle else None,
        running=0 if idle else None,
        waiting=0 if idle else None,
        paused=(0 if previous.paused is not None else None) if idle else None,
        prefix_query_tokens=previous.prefix_query_tokens,
        prefix_hit_tokens=previous.prefix_hit_tokens,
        preemptions=previous.preemptions,
        prompt_tokens=previous.prompt_tokens,
        generation_tokens=previous.generation_tokens,
        decode_seconds_sum=previous.decode_seconds_sum,
        decode_observations=previous.decode_observations,
        block_size=previous.block_size,
        blocks_total=previous.blocks_total,
        blocks_free=previous.blocks_free if idle else None,
        max_running=previous.max_running,
        models=previous.models,
        source=ITERATION_STATS.name,
    )


# ------------------------------------------------------------------ errors
_QUEUE_FULL = "maximum queue size"


def _trt_message(data: Any, body: bytes, status: int) -> tuple[str, str | None]:
    if isinstance(data, dict):
        error = data.get("error")
        if isinstance(error, str):  # request validation: 400 {"error": "<str(exc)>"}
            return error, None
        if isinstance(error, dict):  # nested envelope (vLLM-style), accepted defensively
            return str(error.get("message", "")) or f"HTTP {status}", _str_or_none(
                error.get("type")
            )
        if "message" in data:  # the flat ErrorResponse
            return str(data["message"]) or f"HTTP {status}", _str_or_none(data.get("type"))
        if "detail" in data:  # FastAPI routing errors
            detail = data["detail"]
            return (detail if isinstance(detail, str) else json.dumps(detail)), None
    return text_message(body, status), None


def _str_or_none(value: Any) -> str | None:
    return None if value is None else str(value)


class TrtllmAdapter:
    """The :class:`~fleetgate.engines.base.EngineAdapter` for TensorRT-LLM's trtllm-serve."""

    name = "trtllm"
    aliases: tuple[str, ...] = ("tensorrt-llm", "tensorrt_llm", "trt-llm")
    default_block_size = 32
    settings_model: type[BaseModel] = TrtllmSettings
    metrics_sources = (PROMETHEUS, ITERATION_STATS, TRITON)
    #: trtllm-serve's ``CompletionRequest.prompt`` is
    #: ``Union[List[int], List[List[int]], str, List[str]]`` (serve/openai_protocol.py).
    accepts_token_ids_prompt = True
    #: trtllm-serve documents no field that returns generated token ids
    #: (engines.md section 4), so resumes continue from text.
    returns_token_ids = False
    #: engines.md documents no way to make trtllm-serve continue a partial assistant
    #: message (vLLM's ``continue_final_message``): it would answer it as a new turn,
    #: so a chat that must resume from text goes to an engine that can (see
    #: ``fleetgate.router.admission``).
    continues_final_message = False

    def parse_metrics(
        self, source: MetricsSource, body: bytes, now: float, previous: LoadSnapshot | None
    ) -> LoadSnapshot:
        """Parse one scrape of ``source`` (one of :attr:`metrics_sources`, matched by name)."""
        if source.name == PROMETHEUS.name and source.format == "prometheus":
            return _parse_trtllm_prometheus(body, now)
        if source.name == ITERATION_STATS.name and source.format == "json":
            return _parse_iteration_stats(body, now, previous)
        if source.name == TRITON.name and source.format == "prometheus":
            return _parse_triton(body, now)
        known = ", ".join(f"{s.name} ({s.format})" for s in self.metrics_sources)
        raise MetricsParseError(
            f"unknown trtllm metrics source {source.name!r} ({source.format}); known: {known}"
        )

    def priority_fields(self, level: int) -> dict[str, Any]:
        """``{"priority": 0.5 + level / (2 * LEVEL_MAX)}``: higher first, default 0.5.

        The level is clamped to [LEVEL_MIN, LEVEL_MAX] and the value to [0, 1].
        """
        value = 0.5 + clamp_level(level) / (2 * LEVEL_MAX)
        return {"priority": min(1.0, max(0.0, value))}

    def error_body(
        self, status: int, message: str, err_type: str, param: str | None = None
    ) -> dict[str, Any]:
        """trtllm-serve's flat ``ErrorResponse``."""
        return {
            "object": "error",
            "message": message,
            "type": err_type,
            "param": param,
            "code": status,
        }

    def classify_error(self, status: int, body: bytes) -> ErrorInfo:
        """Flat, ``{"error": str}``, nested, FastAPI or text bodies.

        ``overload``: the executor's "Maximum queue size ... reached" (a 400 through
        trtllm-serve; engines.md §4, not verified at runtime) and 429. Other 4xx are
        ``client``; 5xx (e.g. 503 "LLM is unavailable") are ``server``.
        """
        check_error_status(status)
        message, err_type = _trt_message(error_json(body), body, status)
        kind: Literal["overload", "client", "server"]
        if status == 429 or _QUEUE_FULL in message.lower():
            kind = "overload"
        elif status >= 500:
            kind = "server"
        else:
            kind = "client"
        return ErrorInfo(status=status, kind=kind, message=message, type=err_type)

    def container(self, launch: LaunchSpec) -> ContainerPlan:
        """``trtllm-serve <model> ...`` plus the LLM-API options YAML as a config file."""
        validate_launch(launch, TrtllmSettings)
        settings = (
            launch.settings if isinstance(launch.settings, TrtllmSettings) else TrtllmSettings()
        )
        mount = str(ContainerPlan.__dataclass_fields__["config_mount_path"].default)
        args: list[str] = ["serve"] if launch.model_path in _SUBCOMMANDS else []
        args += [
            launch.model_path,
            "--host",
            "0.0.0.0",
            "--port",
            str(launch.port),
            "--backend",
            settings.backend,
            "--tp_size",
            str(launch.tensor_parallel),
            "--pp_size",
            str(launch.pipeline_parallel),
        ]
        if settings.max_batch_size is not None:
            args += ["--max_batch_size", str(settings.max_batch_size)]
        if settings.max_num_tokens is not None:
            args += ["--max_num_tokens", str(settings.max_num_tokens)]
        if launch.revision:
            args += ["--revision", launch.revision]
        args += ["--extra_llm_api_options", f"{mount}/{CONFIG_FILE}"]
        args += launch.extra_args
        health = Probe("/health")
        return ContainerPlan(
            command=("trtllm-serve",),
            args=tuple(args),
            port=launch.port,
            startup_probe=health,
            readiness_probe=health,
            liveness_probe=health,
            metrics_path=PROMETHEUS.path,
            needs_shared_memory=True,
            config_files={CONFIG_FILE: llm_api_options_yaml(settings)},
            config_mount_path=mount,
        )


def llm_api_options_yaml(settings: TrtllmSettings) -> str:
    """The ``--extra_llm_api_options`` YAML (engines.md §4 and §6 field names)."""
    options = {
        "kv_cache_config": {
            "free_gpu_memory_fraction": settings.kv_cache_free_gpu_memory_fraction,
            "enable_block_reuse": settings.enable_block_reuse,
            "tokens_per_block": settings.tokens_per_block,
        },
        "scheduler_config": {
            "capacity_scheduler_policy": settings.capacity_scheduler_policy,
            "waiting_queue_policy": settings.waiting_queue_policy,
        },
        # JSON /metrics needs iteration stats; /prometheus/metrics is mounted only
        # with per-request perf metrics on.
        "enable_iter_perf_stats": True,
        "return_perf_metrics": True,
    }
    return yaml.safe_dump(options, sort_keys=False)


ADAPTER = TrtllmAdapter()
