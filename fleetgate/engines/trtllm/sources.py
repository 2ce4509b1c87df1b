"""Where trtllm-serve (and Triton) publish load, and helpers the parsers share.

1. ``prometheus`` (``/prometheus/metrics``): never drains, so any number of router
   replicas may scrape it.
2. ``iteration-stats`` (JSON ``/metrics``, ``drains=True``): exactly one poller per engine.
3. ``triton`` (Triton's ``/metrics`` on its metrics port, 8002 by default, not the HTTP port).
"""

from __future__ import annotations

from collections.abc import Sequence

from fleetgate.engines._common import PromSample, finite
from fleetgate.engines.base import MetricsSource

__all__ = [
    "ITERATION_STATS",
    "PLACEHOLDER",
    "PROMETHEUS",
    "TRITON",
    "prefix_tokens",
    "total",
    "unique_int",
]

PROMETHEUS = MetricsSource(name="prometheus", path="/prometheus/metrics", format="prometheus")
ITERATION_STATS = MetricsSource(name="iteration-stats", path="/metrics", format="json", drains=True)
TRITON = MetricsSource(name="triton", path="/metrics", format="prometheus", port=8002)

#: The label value TensorRT-LLM's collector uses until the server knows better.
PLACEHOLDER = "undefined"


def total(samples: Sequence[PromSample], what: str) -> float | None:
    return sum(finite(s.value, what) for s in samples) if samples else None


def unique_int(samples: Sequence[PromSample], what: str) -> int | None:
    values = {int(finite(s.value, what)) for s in samples}
    return values.pop() if len(values) == 1 else None


def prefix_tokens(
    reused: float | None, missed: float | None, tokens_per_block: int | None
) -> tuple[float | None, float | None]:
    """(query tokens, hit tokens) from cumulative block counters."""
    if tokens_per_block is None or reused is None:
        return None, None
    hits = reused * tokens_per_block
    queries = None if missed is None else (reused + missed) * tokens_per_block
    return queries, hits
