"""trtllm-serve's JSON ``/metrics`` (drained iteration stats) -> :class:`LoadSnapshot`."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from fleetgate.engines._common import json_int, json_number, json_section, unit_fraction
from fleetgate.engines.base import LoadSnapshot, MetricsParseError
from fleetgate.engines.trtllm.sources import ITERATION_STATS, prefix_tokens

__all__ = ["parse_iteration_stats"]


def _latest(items: list[Any]) -> Mapping[str, Any]:
    """The newest iteration's row (the last one without ``iter``s). With attention DP
    current main writes one row per rank per iteration (``attentionDpRank``; the others
    copy rank 0's scalars and KV figures but zero the queued count, which is rank 0's:
    ``adp_iter_stats.py``, read in TensorRT-LLM's source): rank 0's row, lowest rank
    first."""
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise MetricsParseError(f"iteration stats element {i} is not an object: {item!r}")
    iters = [json_number(item, "iter", "iteration stats") for item in items]
    if all(i is not None for i in iters):
        ranks = [json_number(item, "attentionDpRank", "iteration stats") or 0.0 for item in items]
        best = max(range(len(items)), key=lambda i: (iters[i] or 0.0, -ranks[i], i))
        latest: Mapping[str, Any] = items[best]
        return latest
    last: Mapping[str, Any] = items[-1]
    return last


def parse_iteration_stats(body: bytes, now: float, previous: LoadSnapshot | None) -> LoadSnapshot:
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
    queries, hits = prefix_tokens(
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
    if previous is None:
        # the first read: no iteration completed since the executor started (or since
        # another reader drained): it iterates whenever it has work, so it is idle;
        # capacity and KV use are unknown until its first iteration
        return LoadSnapshot(scraped_at=now, running=0, waiting=0, source=ITERATION_STATS.name)
    if previous.source != ITERATION_STATS.name:
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
