"""trtllm-serve's ``/prometheus/metrics`` (``trtllm_*`` families) -> :class:`LoadSnapshot`."""

from __future__ import annotations

from fleetgate.engines._common import (
    PromScanner,
    decode_pair,
    nonneg_count,
    require_some,
    unit_fraction,
)
from fleetgate.engines.base import LoadSnapshot
from fleetgate.engines.trtllm.sources import (
    PLACEHOLDER,
    PROMETHEUS,
    prefix_tokens,
    total,
    unique_int,
)

__all__ = ["parse_prometheus"]

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


def parse_prometheus(body: bytes, now: float) -> LoadSnapshot:
    found = _TRTLLM_SCANNER.scan(body)
    require_some(body, found, b"trtllm_")
    block_size = unique_int(found[_T_TPB], _T_TPB)
    blocks_total = nonneg_count(total(found[_T_MAX_BLOCKS], _T_MAX_BLOCKS), _T_MAX_BLOCKS)
    kv_samples = found[_T_KV]
    if kv_samples:
        kv: float | None = sum(unit_fraction(s.value, _T_KV) for s in kv_samples) / len(kv_samples)
    else:
        used = total(found[_T_USED_BLOCKS], _T_USED_BLOCKS)
        kv = (
            unit_fraction(used / blocks_total, _T_USED_BLOCKS)
            if used is not None and blocks_total
            else None
        )
    queries, hits = prefix_tokens(
        total(found[_T_REUSED], _T_REUSED), total(found[_T_MISSED], _T_MISSED), block_size
    )
    models = sorted(
        {
            s.labels["model_name"]
            for s in (*found[_T_RUNNING], *found[_T_WAITING], *kv_samples)
            if s.labels.get("model_name", PLACEHOLDER) != PLACEHOLDER
        }
    )
    decode_sum, decode_count = decode_pair(
        found[_T_TPOT_SUM], found[_T_TPOT_COUNT], "trtllm_time_per_output_token_seconds"
    )
    return LoadSnapshot(
        scraped_at=now,
        kv_usage=kv,
        running=nonneg_count(total(found[_T_RUNNING], _T_RUNNING), _T_RUNNING),
        waiting=nonneg_count(total(found[_T_WAITING], _T_WAITING), _T_WAITING),
        paused=nonneg_count(total(found[_T_PAUSED], _T_PAUSED), _T_PAUSED),
        prefix_query_tokens=queries,
        prefix_hit_tokens=hits,
        prompt_tokens=total(found[_T_PROMPT], _T_PROMPT),
        generation_tokens=total(found[_T_GENERATION], _T_GENERATION),
        decode_seconds_sum=decode_sum,
        decode_observations=decode_count,
        block_size=block_size,
        blocks_total=blocks_total,
        blocks_free=nonneg_count(total(found[_T_FREE_BLOCKS], _T_FREE_BLOCKS), _T_FREE_BLOCKS),
        max_running=nonneg_count(total(found[_T_MAX_ACTIVE], _T_MAX_ACTIVE), _T_MAX_ACTIVE),
        models=tuple(models),
        source=PROMETHEUS.name,
    )
