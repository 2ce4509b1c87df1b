"""Small pieces the emulator's Prometheus expositions share.

The emulator builds ``prometheus_client`` metric families itself (a custom
collector per engine) instead of registering ``Counter``/``Histogram``
objects: engine counters come from :class:`~fleetgate.sim.core.api.EngineStats`
at scrape time, and histograms are plain :class:`HistogramState` values owned
by one engine, so nothing is global and every engine has its own registry.

``prometheus_client`` renders ``<name>_created`` samples as separate gauge
families, exactly like the real vLLM exposition (the fixtures' ``*.prom.txt``).
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Iterable, Sequence

from prometheus_client.metrics_core import Metric

__all__ = ["HistogramState", "counter", "gauge", "histogram", "one_two_five", "sorted_labels"]


def sorted_labels(labels: dict[str, str]) -> dict[str, str]:
    return dict(sorted(labels.items()))


def one_two_five(max_value: int) -> list[float]:
    """vLLM's 1-2-5 bucket series up to ``max_value`` (``build_1_2_5_buckets``)."""
    out: list[float] = []
    exp = 0
    while True:
        for m in (1, 2, 5):
            v = m * 10**exp
            if v > max_value:
                return out
            out.append(float(v))
        exp += 1


@dataclasses.dataclass(slots=True)
class HistogramState:
    """Cumulative-at-render histogram with fixed upper bounds (``+Inf`` implied)."""

    bounds: Sequence[float]
    counts: list[int] = dataclasses.field(default_factory=list)
    total: float = 0.0
    n: int = 0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value
        self.n += 1

    def cumulative(self) -> list[tuple[str, float]]:
        out: list[tuple[str, float]] = []
        acc = 0
        for bound, c in zip(self.bounds, self.counts, strict=False):
            acc += c
            out.append((_le(bound), float(acc)))
        out.append(("+Inf", float(self.n)))
        return out


def _le(bound: float) -> str:
    return repr(float(bound))


def gauge(name: str, doc: str, samples: Iterable[tuple[dict[str, str], float]]) -> Metric:
    m = Metric(name, doc, "gauge")
    for labels, value in samples:
        m.add_sample(name, sorted_labels(labels), float(value))
    return m


def counter(
    name: str, doc: str, samples: Iterable[tuple[dict[str, str], float]], created: float
) -> Metric:
    """A counter family ``name`` (without ``_total``) with ``_created`` samples."""
    m = Metric(name, doc, "counter")
    rows = [(sorted_labels(labels), float(value)) for labels, value in samples]
    for labels, value in rows:
        m.add_sample(name + "_total", labels, value)
    for labels, _ in rows:
        m.add_sample(name + "_created", labels, created)
    return m


def histogram(
    name: str, doc: str, rows: Iterable[tuple[dict[str, str], HistogramState]], created: float
) -> Metric:
    m = Metric(name, doc, "histogram")
    for labels, state in rows:
        base = sorted_labels(labels)
        for le, value in state.cumulative():
            m.add_sample(name + "_bucket", sorted_labels({**base, "le": le}), value)
        m.add_sample(name + "_count", base, float(state.n))
        m.add_sample(name + "_sum", base, state.total)
        m.add_sample(name + "_created", base, created)
    return m
