"""Summaries of load-generator results and bootstrap confidence intervals (pure)."""

from __future__ import annotations

import dataclasses
import math
import random
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence


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


# ------------------------------------------------------------ confidence intervals
#
# Two runs of one repeat replay the SAME seeded schedule (same sessions), so a
# comparison is paired: a bootstrap replicate draws session ids with replacement
# (a session is the cluster: its turns are not independent) and evaluates BOTH
# contenders on the same draw. Across seeds, each replicate resamples every seed
# independently and takes the median over seeds of the per-seed figure, so the
# interval covers the variation between requests within a run and the median's
# sampling across the seeds. The interval is the percentile interval of the
# replicates (Efron & Tibshirani, ch. 13); randomness is injected (``rng``).

Cluster = Sequence[tuple[float, ...]]
"""One cluster's observations (a session's requests), each a tuple of numbers."""
Statistic = Callable[[list[tuple[float, ...]]], float | None]
"""Observations -> a figure (None when undefined, e.g. no values)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Interval:
    estimate: float
    """The figure on the original (not resampled) data."""
    low: float
    high: float
    level: float
    replicates: int
    """Replicates where the figure was defined (of those drawn)."""

    def excludes(self, value: float) -> bool:
        return value < self.low or value > self.high


def _flatten(clusters: Mapping[str, Cluster], keys: Sequence[str]) -> list[tuple[float, ...]]:
    out: list[tuple[float, ...]] = []
    for k in keys:
        out.extend(clusters.get(k, ()))
    return out


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, None when either is missing or b is 0."""
    if a is None or b is None or b == 0:
        return None
    return a / b


def difference(a: float | None, b: float | None) -> float | None:
    if a is None or b is None:
        return None
    return a - b


Combine = Callable[[float | None, float | None], float | None]


def _quantile(sorted_values: Sequence[float], q: float) -> float:
    """Linear-interpolation quantile of sorted values, q in [0, 1]."""
    if not sorted_values:
        raise ValueError("no values")
    pos = q * (len(sorted_values) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    frac = pos - lo
    return sorted_values[lo] * (1 - frac) + sorted_values[hi] * frac


def _paired_figure(
    a: Mapping[str, Cluster],
    b: Mapping[str, Cluster],
    keys: Sequence[str],
    stat: Statistic,
    combine: Combine,
) -> float | None:
    return combine(stat(_flatten(a, keys)), stat(_flatten(b, keys)))


def paired_bootstrap(
    runs: Sequence[tuple[Mapping[str, Cluster], Mapping[str, Cluster]]],
    stat: Statistic,
    combine: Combine,
    rng: random.Random,
    *,
    replicates: int = 1000,
    level: float = 0.95,
    min_clusters: int = 1,
) -> Interval | None:
    """CI of ``median over runs of combine(stat(A_run), stat(B_run))``.

    ``runs``: one (A clusters, B clusters) pair per seed, keyed by cluster id
    (session id); the clusters drawn are those of either side (a session one
    contender never finished still counts for the other). One run: the plain
    paired cluster bootstrap over requests. None when a run has fewer than
    ``min_clusters`` clusters, or the figure is undefined on the original data
    or on more than half of the replicates.
    """
    if not runs:
        raise ValueError("no runs")
    if not 0 < level < 1 or replicates < 1:
        raise ValueError("level must be in (0, 1) and replicates >= 1")
    keysets = [sorted(set(a) | set(b)) for a, b in runs]
    if any(len(keys) < min_clusters for keys in keysets):
        return None  # too few sessions for a percentile interval to mean anything
    point = [
        _paired_figure(a, b, keys, stat, combine)
        for (a, b), keys in zip(runs, keysets, strict=True)
    ]
    defined = [p for p in point if p is not None]
    if len(defined) != len(point):
        return None
    estimate = statistics.median(defined)
    values: list[float] = []
    for _ in range(replicates):
        per_run: list[float] = []
        for (a, b), keys in zip(runs, keysets, strict=True):
            draw = [keys[rng.randrange(len(keys))] for _ in keys] if keys else []
            fig = _paired_figure(a, b, draw, stat, combine)
            if fig is None:
                break
            per_run.append(fig)
        else:
            values.append(statistics.median(per_run))
    if len(values) * 2 < replicates:
        return None
    values.sort()
    tail = (1 - level) / 2
    return Interval(
        estimate, _quantile(values, tail), _quantile(values, 1 - tail), level, len(values)
    )


def verdict(ci: Interval | None, neutral: float, lower_is_better: bool) -> str:
    """``win`` / ``loss`` only when the interval excludes ``neutral`` (1 for a ratio,
    0 for a difference); else ``no clear difference`` (or ``n/a``)."""
    if ci is None:
        return "n/a"
    if not ci.excludes(neutral):
        return "no clear difference"
    better = ci.high < neutral if lower_is_better else ci.low > neutral
    return "win" if better else "loss"


def percentile_stat(q: float, column: int = 0) -> Statistic:
    """The nearest-rank ``q`` percentile of one column of the observations."""

    def stat(obs: list[tuple[float, ...]]) -> float | None:
        return percentile([o[column] for o in obs], q)

    return stat


def ratio_of_sums(num: int, den: int) -> Statistic:
    """sum(column ``num``) / sum(column ``den``) (e.g. cached / prompt tokens)."""

    def stat(obs: list[tuple[float, ...]]) -> float | None:
        d = sum(o[den] for o in obs)
        return sum(o[num] for o in obs) / d if d > 0 else None

    return stat


def steady(results: Iterable[RequestResult], warmup_s: float) -> list[RequestResult]:
    """The requests SENT at or after ``warmup_s`` (same clock as ``sent_at``):
    the steady-state sample, without the start-up transient of empty caches."""
    return [r for r in results if r.sent_at >= warmup_s]
