"""Triton's tensorrtllm backend: ``nv_trt_llm_*`` families -> :class:`LoadSnapshot`."""

from __future__ import annotations

from fleetgate.engines._common import PromScanner, finite, nonneg_count, require_some, unit_fraction
from fleetgate.engines.base import LoadSnapshot, MetricsParseError
from fleetgate.engines.trtllm.sources import TRITON

__all__ = ["parse_triton"]

_NV_REQUEST = "nv_trt_llm_request_metrics"
_NV_KV = "nv_trt_llm_kv_cache_block_metrics"
_NV_IFB = "nv_trt_llm_inflight_batcher_metrics"
_TRITON_SCANNER = PromScanner((_NV_REQUEST, _NV_KV, _NV_IFB))


def parse_triton(body: bytes, now: float) -> LoadSnapshot:
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
