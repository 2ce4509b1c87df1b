"""trtllm-serve's two metrics endpoints for one emulated engine.

* JSON ``/metrics``: a list of ``IterationStats`` (camelCase keys of the executor's
  JSON serialisation), one per engine iteration, **drained** on read; the queue is
  bounded at 1000 like ``iter_stats_max_iterations``.
* ``/prometheus/metrics``: the ``trtllm_*`` families of TensorRT-LLM's
  ``metrics/collector.py`` (request histograms, ``request_success`` by finish reason,
  KV-cache and scheduler gauges).
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from fleetgate.engines.trtllm.versions import release_for
from fleetgate.sim.core.api import EngineModel, EngineStats, FinishReason, StepResult
from fleetgate.sim.generation import EngineOptions, GenRequest
from fleetgate.sim.metrics_common import HistogramState, counter, gauge, histogram

__all__ = ["LATENCY_BUCKETS", "STATS_QUEUE", "TrtllmMetrics"]

STATS_QUEUE = 1000
LATENCY_BUCKETS = [0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 240.0, 480.0]


@dataclasses.dataclass(slots=True)
class _Live:
    arrival: float
    first: float | None = None
    scheduled: float | None = None


class TrtllmMetrics(Collector):
    """Request observer, drained iteration-stats queue and ``trtllm_*`` collector."""

    def __init__(self, options: EngineOptions, model: EngineModel, created: float) -> None:
        self.options = options
        self.model = model
        self.created = created
        self.iterations: collections.deque[dict[str, Any]] = collections.deque(maxlen=STATS_QUEUE)
        self.success: dict[str, int] = {"stop": 0, "length": 0, "abort": 0}
        self.hist = {
            "e2e_request_latency_seconds": HistogramState(LATENCY_BUCKETS),
            "time_to_first_token_seconds": HistogramState(LATENCY_BUCKETS),
            "time_per_output_token_seconds": HistogramState(LATENCY_BUCKETS),
            "request_queue_time_seconds": HistogramState(LATENCY_BUCKETS),
        }
        self._live: dict[str, _Live] = {}
        self._iter = 0
        self._prev_alloc = 0
        self.release = release_for(options.version or "main")
        # main: JSON /metrics serves a buffer refilled when a request completes
        self._pending: collections.deque[dict[str, Any]] = collections.deque(maxlen=STATS_QUEUE)
        # The collector sets the trtllm_* gauges from iteration stats when a request
        # completes; between completions a scrape sees the last completion's values.
        self._gauges: EngineStats = model.stats()
        # ...and the families it reads straight from the newest iteration row
        self._last_row: dict[str, Any] | None = None
        self._row: dict[str, Any] | None = None
        self._completed_iterations = 0  # numCompletedRequests summed over the rows
        self._completed_at_refresh = 0
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    def on_admit(self, request: GenRequest, now: float) -> None:
        self._live[request.request_id] = _Live(now)

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
        if live is not None and live.first is None:
            live.first = now
            self.hist["time_to_first_token_seconds"].observe(now - live.arrival)
            if scheduled_at is not None:
                live.scheduled = min(max(scheduled_at, live.arrival), now)

    def on_finish(
        self, request: GenRequest, reason: FinishReason, completion_tokens: int, now: float
    ) -> None:
        live = self._live.pop(request.request_id, None)
        if live is None:
            return
        self._completed()
        self.success[reason] = self.success.get(reason, 0) + 1
        self.hist["e2e_request_latency_seconds"].observe(now - live.arrival)
        if live.scheduled is not None:
            # queue time = arrival until first scheduled (the model's scheduling instant)
            self.hist["request_queue_time_seconds"].observe(live.scheduled - live.arrival)
        if live.first is not None and completion_tokens > 1:
            self.hist["time_per_output_token_seconds"].observe(
                (now - live.first) / (completion_tokens - 1)
            )

    def on_abort(self, request: GenRequest, completion_tokens: int, now: float) -> None:
        if self._live.pop(request.request_id, None) is not None:
            self._completed()
            self.success["abort"] += 1

    def _completed(self) -> None:
        """A request ended: the points at which the real collector refreshes."""
        self._gauges = self.model.stats()
        self._row, self._completed_at_refresh = self._last_row, self._completed_iterations
        if self.release.json_metrics == "completion-buffer":
            self.iterations.extend(self._pending)
            self._pending.clear()

    def on_step(self, now: float, result: StepResult) -> None:
        s = self.model.stats()
        self._iter += 1
        new = sum(1 for e in result.events if e.first)
        done = sum(1 for e in result.events if e.finish_reason is not None)
        alloc_total = s.reused_blocks + s.missed_blocks
        alloc_new, self._prev_alloc = alloc_total - self._prev_alloc, alloc_total
        queried = s.reused_blocks + s.missed_blocks
        queue = self.iterations if self.release.json_metrics == "drain" else self._pending
        self._completed_iterations += done
        self._last_row = row = {
            "timestamp": time.strftime("%m-%d-%Y %H:%M:%S", time.gmtime()),
            "iter": self._iter,
            "iterLatencyMS": result.duration * 1000.0,
            "newActiveRequestsQueueLatencyMS": 0.0,
            "numNewActiveRequests": new,
            "numActiveRequests": s.running,
            "numQueuedRequests": s.waiting,
            "numCompletedRequests": done,
            "maxNumActiveRequests": s.max_running,
            "maxBatchSizeStatic": s.max_running,
            "maxBatchSizeTunerRecommended": s.max_running,
            "maxBatchSizeRuntime": s.max_running,
            "maxNumTokensStatic": 8192,
            "maxNumTokensTunerRecommended": 8192,
            "maxNumTokensRuntime": 8192,
            "gpuMemUsage": s.blocks_used * s.block_size * 131072,
            "cpuMemUsage": 0,
            "pinnedMemUsage": 0,
            "kvCacheStats": {
                "maxNumBlocks": s.blocks_total,
                "freeNumBlocks": s.blocks_free,
                "usedNumBlocks": s.blocks_used,
                "tokensPerBlock": s.block_size,
                "allocTotalBlocks": alloc_total,
                "allocNewBlocks": max(0, alloc_new),
                "reusedBlocks": s.reused_blocks,
                "missedBlocks": s.missed_blocks,
                "cacheHitRate": (s.reused_blocks / queried) if queried else 0.0,
            },
            "staticBatchingStats": None,
            "inflightBatchingStats": {
                "numScheduledRequests": s.running,
                "numContextRequests": new,
                "numGenRequests": max(0, s.running - new),
                "numPausedRequests": s.paused,
                "numCtxTokens": 0,
                "microBatchId": 0,
                "avgNumDecodedTokensPerIter": 1.0,
            },
            "specDecodingStats": None,
        }
        queue.extend(self._rank_rows(row))

    def _rank_rows(self, row: dict[str, Any]) -> list[dict[str, Any]]:
        """``row`` as main writes it: tagged ``attentionDpRank`` (0 without attention
        DP), and with attention DP one row per rank: each copies rank 0's scalars and KV
        figures, carries its own scheduled, context, generation and paused counts, and
        all but rank 0's zero the queue-owned ones (``adp_iter_stats.py``)."""
        ranks = getattr(self.model, "rank_figures", None)
        if self.release.line != "main":
            return [row]
        if ranks is None:
            return [{**row, "attentionDpRank": 0}]
        rows = []
        for r, (s, new) in enumerate(ranks()):
            ifb = {
                **row["inflightBatchingStats"],
                "numScheduledRequests": s.running,
                "numContextRequests": new,
                "numGenRequests": max(0, s.running - new),
                "numPausedRequests": s.paused,
            }
            out = {**row, "attentionDpRank": r, "inflightBatchingStats": ifb}
            if r:
                out.update(numQueuedRequests=0, numCompletedRequests=0, numNewActiveRequests=0,
                           newActiveRequestsQueueLatencyMS=0.0)  # fmt: skip
            rows.append(out)
        return rows

    def drain(self) -> list[dict[str, Any]]:
        out = list(self.iterations)
        self.iterations.clear()
        return out

    def collect(self) -> Iterator[Metric]:
        if not self.release.prometheus_load_gauges:
            yield from self._request_families()
            return
        s = self._gauges
        base = {"model_name": self.options.model_name, "engine_type": "undefined"}
        c = self.created

        def one(v: float) -> list[tuple[dict[str, str], float]]:
            return [(base, float(v))]

        queried = s.reused_blocks + s.missed_blocks
        yield gauge("trtllm_num_requests_running", "Number of running requests.", one(s.running))
        yield gauge("trtllm_num_requests_waiting", "Number of waiting requests.", one(s.waiting))
        yield gauge(
            "trtllm_max_num_active_requests",
            "Maximum number of active requests",
            one(s.max_running),
        )
        yield gauge(
            "trtllm_kv_cache_utilization",
            "KV cache utilization.",
            one(s.blocks_used / s.blocks_total if s.blocks_total else 0.0),
        )
        yield gauge(
            "trtllm_kv_cache_hit_rate",
            "KV cache hit rate.",
            one(s.reused_blocks / queried if queried else 0.0),
        )
        yield gauge("trtllm_kv_cache_max_blocks", "Max KV cache blocks.", one(s.blocks_total))
        yield gauge("trtllm_kv_cache_free_blocks", "Free KV cache blocks.", one(s.blocks_free))
        yield gauge("trtllm_kv_cache_used_blocks", "Used KV cache blocks.", one(s.blocks_used))
        yield gauge(
            "trtllm_kv_cache_tokens_per_block", "Tokens per KV cache block.", one(s.block_size)
        )
        yield counter(
            "trtllm_kv_cache_reused_blocks", "Reused KV cache blocks.", one(s.reused_blocks), c
        )
        yield counter(
            "trtllm_kv_cache_missed_blocks", "Missed KV cache blocks.", one(s.missed_blocks), c
        )
        yield gauge("trtllm_num_scheduled_requests", "Scheduled requests.", one(s.running))
        row = self._row
        if row is not None:  # the collector's families read from the iteration row itself
            ifb = row["inflightBatchingStats"]
            yield counter(
                "trtllm_num_requests_completed",
                "Total number of completed requests across iterations",
                one(self._completed_at_refresh),
                c,
            )
            yield gauge(
                "trtllm_iteration_latency_seconds",
                "Iteration latency in seconds",
                one(row["iterLatencyMS"] / 1000.0),
            )
            yield gauge(
                "trtllm_gpu_memory_usage_bytes",
                "GPU memory usage in bytes",
                one(row["gpuMemUsage"]),
            )
            yield gauge(
                "trtllm_num_context_requests",
                "Number of context requests",
                one(ifb["numContextRequests"]),
            )
            yield gauge(
                "trtllm_num_generation_requests",
                "Number of generation requests",
                one(ifb["numGenRequests"]),
            )
        yield gauge("trtllm_num_paused_requests", "Paused requests.", one(s.paused))
        yield counter("trtllm_prompt_tokens", "Prompt tokens processed.", one(s.prompt_tokens), c)
        yield counter(
            "trtllm_generation_tokens", "Generation tokens processed.", one(s.generation_tokens), c
        )
        yield counter(
            "trtllm_prompt_cached_tokens",
            "Prompt tokens served from the KV cache.",
            one(s.prefix_hit_tokens),
            c,
        )
        yield from self._request_families()

    def _request_families(self) -> Iterator[Metric]:
        """Per-request families: the only ones before main (1.1.0rc5 exposition)."""
        base = {"model_name": self.options.model_name, "engine_type": "undefined"}
        c = self.created
        yield counter(
            "trtllm_request_success",
            "Count of successfully processed requests.",
            [({**base, "finished_reason": k}, float(v)) for k, v in self.success.items()],
            c,
        )
        for name, state in self.hist.items():
            yield histogram(
                "trtllm_" + name, f"Histogram of {name.replace('_', ' ')}.", [(base, state)], c
            )

    def render(self) -> bytes:
        return generate_latest(self.registry)
