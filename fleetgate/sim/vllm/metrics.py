"""vLLM's ``/metrics`` for one emulated engine (vLLM 0.32's exposition).

Family names, HELP texts, types, label names (``model_name``, ``engine``), the
pre-created ``finished_reason`` values, bucket boundaries and family order follow
the real vLLM 0.32 exposition (``tests/conformance/test_metrics.py`` checks them).

Sources of values:

* gauges and token/prefix/preemption counters: the model's
  :class:`~fleetgate.sim.core.api.EngineStats` at scrape time;
* request histograms and ``request_success``: :class:`VllmMetrics` as the
  :class:`~fleetgate.sim.generation.RequestObserver` of the engine;
* ``iteration_tokens_total``: per-step deltas of prompt+generation tokens.

A client abort is **not** counted in ``request_success{finished_reason="abort"}``
and not in ``e2e_request_latency`` (as real vLLM 0.32 does), but its TTFT was.
The phase histograms use the instant the model first scheduled the request
(``TokenEvent.scheduled_at``), as vLLM's ``RequestStateStats`` do, observed
when a request finishes: queue = scheduled - arrival, prefill = first token -
scheduled, decode = last token - first token, inference = last token -
scheduled (so inference = prefill + decode). Client aborts observe none of them.
The ``python_*``/``process_*`` families are the emulator process's own; the
``http_*`` instrumentator series are not emulated.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Protocol

from prometheus_client import (
    CollectorRegistry,
    GCCollector,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from fleetgate.sim.core.api import EngineStats, FinishReason, StepResult
from fleetgate.sim.generation import EngineOptions, GenRequest
from fleetgate.sim.metrics_common import HistogramState, counter, gauge, histogram, one_two_five

__all__ = ["CONTENT_TYPE", "VllmMetrics"]

CONTENT_TYPE = "text/plain; version=1.0.0; charset=utf-8"
"""As recorded (``metrics_*.json`` response headers)."""

TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]  # fmt: skip
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0]  # fmt: skip
E2E_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]  # fmt: skip
ITER_BUCKETS = [1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0,
                8192.0, 16384.0]  # fmt: skip
N_BUCKETS = [1.0, 2.0, 5.0, 10.0, 20.0]
PREEMPT_BUCKETS = [1.0, 2.0, 3.0, 4.0, 5.0, 10.0, 20.0]
FINISHED_REASONS = ("stop", "length", "abort", "error", "repetition")

_H = {
    "request_prompt_tokens": "Number of prefill tokens processed.",
    "request_generation_tokens": "Number of generation tokens processed.",
    "iteration_tokens_total": "Histogram of number of tokens per engine_step.",
    "request_max_num_generation_tokens": (
        "Histogram of maximum number of requested generation tokens."
    ),
    "request_params_n": "Histogram of the n request parameter.",
    "request_params_max_tokens": "Histogram of the max_tokens request parameter.",
    "time_to_first_token_seconds": "Histogram of time to first token in seconds.",
    "inter_token_latency_seconds": "Histogram of inter-token latency in seconds.",
    "request_time_per_output_token_seconds": (
        "Histogram of time_per_output_token_seconds per request."
    ),
    "e2e_request_latency_seconds": "Histogram of e2e request latency in seconds.",
    "request_queue_time_seconds": "Histogram of time spent in WAITING phase for request.",
    "request_inference_time_seconds": "Histogram of time spent in RUNNING phase for request.",
    "request_prefill_time_seconds": "Histogram of time spent in PREFILL phase for request.",
    "request_decode_time_seconds": "Histogram of time spent in DECODE phase for request.",
    "request_num_preemptions": "Histogram of the number of times a request was preempted.",
    "request_prefill_kv_computed_tokens": (
        "Histogram of new KV tokens computed during prefill (excluding cached tokens)."
    ),
}


@dataclasses.dataclass(slots=True)
class _Live:
    arrival: float
    first: float | None = None
    last: float | None = None
    cached: int = 0
    scheduled: float | None = None


class VllmMetrics(Collector):
    """Request observer + Prometheus collector for one emulated vLLM engine."""

    def __init__(self, options: EngineOptions, stats: _StatsSource, created: float) -> None:
        self.options = options
        self._stats = stats
        self.created = created
        self.success = dict.fromkeys(FINISHED_REASONS, 0)
        self.rejections = {"max_num_queued_reqs": 0, "max_num_queued_tokens": 0}
        len_buckets = one_two_five(options.max_model_len)
        self.hist: dict[str, HistogramState] = {
            "request_prompt_tokens": HistogramState(len_buckets),
            "request_generation_tokens": HistogramState(len_buckets),
            "iteration_tokens_total": HistogramState(ITER_BUCKETS),
            "request_max_num_generation_tokens": HistogramState(len_buckets),
            "request_params_n": HistogramState(N_BUCKETS),
            "request_params_max_tokens": HistogramState(len_buckets),
            "time_to_first_token_seconds": HistogramState(TTFT_BUCKETS),
            "inter_token_latency_seconds": HistogramState(ITL_BUCKETS),
            "request_time_per_output_token_seconds": HistogramState(ITL_BUCKETS),
            "e2e_request_latency_seconds": HistogramState(E2E_BUCKETS),
            "request_queue_time_seconds": HistogramState(E2E_BUCKETS),
            "request_inference_time_seconds": HistogramState(E2E_BUCKETS),
            "request_prefill_time_seconds": HistogramState(E2E_BUCKETS),
            "request_decode_time_seconds": HistogramState(E2E_BUCKETS),
            "request_num_preemptions": HistogramState(PREEMPT_BUCKETS),
            "request_prefill_kv_computed_tokens": HistogramState(len_buckets),
        }
        self._live: dict[str, _Live] = {}
        self._last_tokens = 0
        self.registry = CollectorRegistry(auto_describe=False)
        # The exposition starts with these, as in the recordings (values are the shared
        # emulator process's, since all engines live in one process).
        GCCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        ProcessCollector(registry=self.registry)
        self.registry.register(self)

    # -- RequestObserver ----------------------------------------------------

    def on_admit(self, request: GenRequest, now: float) -> None:
        self._live[request.request_id] = _Live(arrival=now)

    def on_tokens(
        self,
        request: GenRequest,
        count: int,
        now: float,
        first: bool,
        cached: int,
        scheduled_at: float | None = None,
    ) -> None:
        live = self._live.get(request.request_id)
        if live is None:
            return
        if live.first is None:
            live.first = now
            live.cached = cached
            # clamp into [arrival, first token]: the model's clock and the observer's
            # are the same driver clock, so this only guards rounding
            if scheduled_at is not None:
                live.scheduled = min(max(scheduled_at, live.arrival), now)
            self.hist["time_to_first_token_seconds"].observe(now - live.arrival)
        elif live.last is not None:
            gap = (now - live.last) / count
            for _ in range(count):
                self.hist["inter_token_latency_seconds"].observe(gap)
        live.last = now

    def on_finish(
        self, request: GenRequest, reason: FinishReason, completion_tokens: int, now: float
    ) -> None:
        live = self._live.pop(request.request_id, None)
        if live is None:
            return
        self.success[reason] = self.success.get(reason, 0) + 1
        prompt = len(request.prompt_token_ids)
        h = self.hist
        h["request_prompt_tokens"].observe(prompt)
        h["request_generation_tokens"].observe(completion_tokens)
        h["request_max_num_generation_tokens"].observe(request.max_tokens)
        h["request_params_n"].observe(1)
        h["request_params_max_tokens"].observe(request.max_tokens)
        h["e2e_request_latency_seconds"].observe(now - live.arrival)
        h["request_num_preemptions"].observe(0)
        h["request_prefill_kv_computed_tokens"].observe(max(0, prompt - live.cached))
        if live.scheduled is not None and live.first is not None:
            h["request_queue_time_seconds"].observe(live.scheduled - live.arrival)
            h["request_prefill_time_seconds"].observe(live.first - live.scheduled)
            h["request_inference_time_seconds"].observe(now - live.scheduled)
        if live.first is not None:
            h["request_decode_time_seconds"].observe(now - live.first)
            if completion_tokens > 1:
                h["request_time_per_output_token_seconds"].observe(
                    (now - live.first) / (completion_tokens - 1)
                )

    def on_abort(self, request: GenRequest, completion_tokens: int, now: float) -> None:
        self._live.pop(request.request_id, None)

    def on_step(self, now: float, result: StepResult) -> None:
        stats = self._stats.stats()
        total = stats.prompt_tokens + stats.generation_tokens
        delta = total - self._last_tokens
        self._last_tokens = total
        if delta > 0:
            self.hist["iteration_tokens_total"].observe(delta)

    # -- exposition ---------------------------------------------------------

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def collect(self) -> Iterator[Metric]:
        s: EngineStats = self._stats.stats()
        base = {"model_name": self.options.model_name, "engine": self.options.engine_index}
        c = self.created

        def one(v: float) -> list[tuple[dict[str, str], float]]:
            return [(base, v)]

        def by(label: str, values: dict[str, float]) -> list[tuple[dict[str, str], float]]:
            return [({**base, label: k}, v) for k, v in values.items()]

        mfu = "(for Model Flops Utilization calculations)."
        yield counter(
            "vllm:estimated_flops_per_gpu",
            f"Estimated number of floating point operations per GPU {mfu}",
            one(0),
            c,
        )
        yield counter(
            "vllm:estimated_read_bytes_per_gpu",
            f"Estimated number of bytes read from memory per GPU {mfu}",
            one(0),
            c,
        )
        yield counter(
            "vllm:estimated_write_bytes_per_gpu",
            f"Estimated number of bytes written to memory per GPU {mfu}",
            one(0),
            c,
        )
        yield gauge(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            one(s.running),
        )
        waiting = s.waiting + s.paused
        yield gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed.", one(waiting)
        )
        yield gauge(
            "vllm:num_requests_waiting_by_reason",
            "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for "
            "scheduling capacity; 'deferred' = deferred by transient constraints (LoRA budget, "
            "KV transfer, blocked status). Sum of all reasons equals vllm:num_requests_waiting.",
            by("reason", {"capacity": waiting, "deferred": 0}),
        )
        yield gauge(
            "vllm:engine_sleep_state",
            "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is "
            "awake; weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep "
            "level 2.",
            by("sleep_state", {"awake": 1, "weights_offloaded": 0, "discard_all": 0}),
        )
        yield gauge(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            one(s.kv_usage),
        )
        yield counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            one(s.prefix_query_tokens),
            c,
        )
        yield counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            one(s.prefix_hit_tokens),
            c,
        )
        ext = "from KV connector cross-instance cache sharing, in terms of number of"
        yield counter(
            "vllm:external_prefix_cache_queries",
            f"External prefix cache queries {ext} queried tokens.",
            one(0),
            c,
        )
        yield counter(
            "vllm:external_prefix_cache_hits",
            f"External prefix cache hits {ext} cached tokens.",
            one(0),
            c,
        )
        yield counter(
            "vllm:mm_cache_queries",
            "Multi-modal cache queries, in terms of number of queried items.",
            one(0),
            c,
        )
        yield counter(
            "vllm:mm_cache_hits",
            "Multi-modal cache hits, in terms of number of cached items.",
            one(0),
            c,
        )
        yield counter(
            "vllm:num_preemptions",
            "Cumulative number of preemption from the engine.",
            one(s.preemptions),
            c,
        )
        yield counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", one(s.prompt_tokens), c
        )
        hits = s.prefix_hit_tokens
        yield counter(
            "vllm:prompt_tokens_by_source",
            "Number of prompt tokens by source.",
            by(
                "source",
                {
                    "local_compute": max(0, s.prompt_tokens - hits),
                    "local_cache_hit": hits,
                    "external_kv_transfer": 0,
                },
            ),
            c,
        )
        yield counter(
            "vllm:prompt_tokens_cached",
            "Number of cached prompt tokens (local + external).",
            one(hits),
            c,
        )
        yield counter(
            "vllm:prompt_tokens_cached_by_source",
            "Prefix-cache hit tokens by the cache tier that supplied them: device (local HBM), "
            "host (offloaded to DRAM), disk, p2p (transferred from another vLLM instance) or "
            "external_unspecified. Counted at admission; sums to vllm:prefix_cache_hits + "
            "vllm:external_prefix_cache_hits.",
            by(
                "source",
                {"device": hits, "host": 0, "p2p": 0, "disk": 0, "external_unspecified": 0},
            ),
            c,
        )
        yield counter(
            "vllm:generation_tokens",
            "Number of generation tokens processed.",
            one(s.generation_tokens),
            c,
        )
        yield counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            by("finished_reason", {k: float(v) for k, v in self.success.items()}),
            c,
        )
        yield counter(
            "vllm:admission_rejections",
            "Number of admission attempts rejected by a queue limit, by reason.",
            [
                ({"model_name": self.options.model_name, "reason": r}, float(n))
                for r, n in self.rejections.items()
            ],
            c,
        )
        for name, state in self.hist.items():
            yield histogram("vllm:" + name, _H[name], [(base, state)], c)
        yield gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            [(self._cache_config_labels(s), 1.0)],
        )

    def _cache_config_labels(self, s: EngineStats) -> dict[str, str]:
        """The 37 labels of vLLM 0.32's ``vllm:cache_config_info`` (every ``CacheConfig``
        field plus ``engine``, as in a real 0.32 exposition after start).

        Values follow the emulated config where it has one (block size and count, the
        override when ``--num-gpu-blocks`` was given, prefix caching, the KV size in
        tokens, ``kv_cache_max_concurrency`` = that size / ``max_model_len``, and
        ``user_specified_block_size`` when ``--block-size`` was given); the
        rest are vLLM 0.32's defaults for a text-only attention model (e.g.
        ``gpu_memory_utilization="0.92"``). ``kv_cache_memory_bytes`` is "None": the
        emulator stands for a GPU server sized by memory utilisation, whereas the
        recorded CPU build reports its ``VLLM_CPU_KVCACHE_SPACE`` (1 GiB) there.
        """
        o = self.options
        size = s.blocks_total * s.block_size
        override = o.num_gpu_blocks_override
        concurrency = size / o.max_model_len if o.max_model_len else 0.0
        return {
            "_block_size_resolved": "True",
            "block_size": str(s.block_size),
            "cache_dtype": "auto",
            "cache_hit_alignment_tokens": "None",
            "effective_attention_block_size": str(s.block_size),
            "enable_mamba_shared_prefix_checkpoint": "False",
            "enable_prefix_caching": str(o.prefix_caching),
            "engine": o.engine_index,
            "gpu_memory_utilization": "0.92",
            "hash_block_size": "None",
            "is_attention_free": "False",
            "kv_cache_dtype_skip_layers": "[]",
            "kv_cache_layout": "None",
            "kv_cache_max_concurrency": repr(round(concurrency, 2)),
            "kv_cache_memory_bytes": "None",
            "kv_cache_size_tokens": str(size),
            "kv_offloading_backend": "native",
            "kv_offloading_size": "None",
            "kv_sharing_fast_prefill": "False",
            "mamba_block_size": "None",
            "mamba_cache_dtype": "auto",
            "mamba_cache_mode": "none",
            "mamba_page_size_padded": "None",
            "mamba_ssm_cache_dtype": "float32",
            "num_cpu_blocks": "None",
            "num_gpu_blocks": str(s.blocks_total),
            "num_gpu_blocks_override": "None" if override is None else str(override),
            "prefix_cache_retention_interval": "0",
            "prefix_caching_hash_algo": "sha256",
            "prefix_match_unit": "None",
            "replayssm_buffer_len": "16",
            "skip_page_size_padded": "None",
            "sliding_window": "None",
            "swa_bounded_replay": "True",
            "use_kda_recoverssm": "False",
            "use_replayssm": "False",
            "user_specified_block_size": str(o.user_specified_block_size),
        }


class _StatsSource(Protocol):
    """Anything with ``stats() -> EngineStats`` (an EngineModel)."""

    def stats(self) -> EngineStats: ...
