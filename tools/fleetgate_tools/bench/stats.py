"""Summaries of load-generator results (pure)."""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Iterable, Sequence


@dataclasses.dataclass(slots=True)
class RequestResult:
    session_id: str
    turn: int
    priority_class: str
    sent_at: float
    """Seconds since the run started."""
    status: int = 0
    ttft: float | None = None
    e2e: float | None = None
    itl: list[float] = dataclasses.field(default_factory=list)
    output_tokens: int = 0
    cached_tokens: int | None = None
    prompt_tokens: int | None = None
    """From the answer's usage, when it has one."""
    endpoint: str | None = None
    """The router's ``x-fleetgate-endpoint`` answer header: where the answer began."""
    error: str | None = None
    text: str | None = None
    """The streamed answer, kept only when the caller asks (twin-run comparisons)."""

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile, q in [0, 100]; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, min(len(ordered), int(-(-q * len(ordered) // 100))))
    return ordered[rank - 1]


@dataclasses.dataclass(frozen=True, slots=True)
class ClassSummary:
    priority_class: str
    requests: int
    errors: int
    ttft_p50: float | None
    ttft_p90: float | None
    ttft_p99: float | None
    itl_p50: float | None
    itl_p99: float | None
    output_tokens: int
    ttft_objective_attainment: float | None
    """Fraction of requests (errors count as misses) whose TTFT met the objective."""
    tokens_per_s: float | None = None
    """Completed output tokens per second over the class's span (first request sent
    to last answer finished): the class's goodput in tokens. Unlike tokens over the
    arrival window it falls when work finishes later (preempted, queued)."""


def summarise_class(
    name: str, results: Iterable[RequestResult], ttft_objective_s: float | None
) -> ClassSummary:
    rs = list(results)
    ttfts = [r.ttft for r in rs if r.ok and r.ttft is not None]
    itls = [g for r in rs if r.ok for g in r.itl]
    attained = None
    done = [r for r in rs if r.ok and r.e2e is not None]
    tokens_per_s = None
    if done:
        span = max(r.sent_at + (r.e2e or 0.0) for r in done) - min(r.sent_at for r in done)
        tokens_per_s = sum(r.output_tokens for r in done) / span if span > 0 else None
    if ttft_objective_s is not None and rs:
        met = sum(1 for r in rs if r.ok and r.ttft is not None and r.ttft <= ttft_objective_s)
        attained = met / len(rs)
    return ClassSummary(
        priority_class=name,
        requests=len(rs),
        errors=sum(1 for r in rs if not r.ok),
        ttft_p50=percentile(ttfts, 50),
        ttft_p90=percentile(ttfts, 90),
        ttft_p99=percentile(ttfts, 99),
        itl_p50=percentile(itls, 50),
        itl_p99=percentile(itls, 99),
        output_tokens=sum(r.output_tokens for r in rs if r.ok),
        ttft_objective_attainment=attained,
        tokens_per_s=tokens_per_s,
    )


def goodput(results: Iterable[RequestResult], ttft_objective_s: float, duration_s: float) -> float:
    """Requests per second that completed without error within the TTFT objective."""
    good = sum(1 for r in results if r.ok and r.ttft is not None and r.ttft <= ttft_objective_s)
    return good / duration_s if duration_s > 0 else 0.0


def imbalance(per_engine: Sequence[float]) -> float | None:
    """max/mean of per-engine work (1.0 is perfectly even); None when no work."""
    if not per_engine:
        return None
    mean = statistics.fmean(per_engine)
    return max(per_engine) / mean if mean > 0 else None


def median_and_spread(values: Sequence[float]) -> tuple[float, float, float] | None:
    """(median, min, max) of repeated runs."""
    if not values:
        return None
    return statistics.median(values), min(values), max(values)
