"""From raw runs to the figures a report shows (pure: no I/O, no clock).

One :class:`RunRecord` is one contender on one freshly started fleet: the
load generator's results (latencies already in modelled seconds), the engine
counters before and after (:class:`EngineWindow`, from the engines' own
/metrics via ``fleetgate.engines`` adapters) and the router's CPU seconds.
:func:`summarise_run` turns it into a flat :class:`RunSummary`;
:func:`aggregate` takes the median of repeats and keeps (min, max) as spread.

Definitions (the report repeats them):

* hit rate = sum over engines of delta ``prefix_hit_tokens`` / delta
  ``prefix_query_tokens`` (what the ENGINES report, not the router's belief);
* imbalance = max / mean of per-engine delta ``generation_tokens``;
* goodput = requests per modelled second that finished without error and met
  their class's TTFT objective;
* router CPU = utime + stime of the contender process(es) over the run.

Every figure but router CPU covers the steady state only: requests sent after
the run's warm-up (``RunRecord.warmup_s``) and engine counters read from the end
of the warm-up to the end of the run.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from fleetgate_tools.bench.stats import (
    ClassSummary,
    RequestResult,
    imbalance,
    median_and_spread,
    percentile,
    steady,
    summarise_class,
)


@dataclasses.dataclass(frozen=True, slots=True)
class EngineWindow:
    """One engine's counter deltas over a run (None = not reported)."""

    kind: str
    url: str
    prefix_query_tokens: float | None
    prefix_hit_tokens: float | None
    generation_tokens: float | None
    prompt_tokens: float | None
    preemptions: float | None


@dataclasses.dataclass(slots=True)
class RunRecord:
    workload: str
    contender: str
    repeat: int
    load_factor: float
    duration_s: float
    """Modelled seconds of arrivals."""
    time_scale: float
    engines: list[EngineWindow]
    results: list[RequestResult]
    router_cpu_s: float | None
    error: str | None = None
    """Set when the run could not happen (contender failed to start, ...)."""
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Workload-specific totals (preemptions, resumes, mismatches)."""
    warmup_s: float = 0.0
    """Modelled seconds of warm-up: requests sent earlier are left out of every
    latency, throughput and hit-rate figure (the engines' counters are read at
    the end of the warm-up instead of at the start)."""


@dataclasses.dataclass(frozen=True, slots=True)
class RunSummary:
    workload: str
    contender: str
    repeat: int
    load_factor: float
    classes: tuple[ClassSummary, ...]
    requests: int
    errors: int
    ttft_p50: float | None
    ttft_p90: float | None
    ttft_p99: float | None
    itl_p50: float | None
    output_tokens_per_s: float
    goodput: float
    attainment: float | None
    hit_rate: float | None
    imbalance: float | None
    router_cpu_s: float | None
    engine_preemptions: float | None
    extra: dict[str, Any]
    error: str | None = None
    usage_hit_rate: float | None = None
    """Sum of the answers' ``cached_tokens`` / sum of their ``prompt_tokens``."""
    warmup_requests: int = 0
    """Requests sent during the warm-up (not in any figure)."""
    warmup_errors: int = 0
    """Of those, the failed ones (shown so that no error goes unseen)."""


def hit_rate(engines: Iterable[EngineWindow]) -> float | None:
    es = [e for e in engines if e.prefix_query_tokens is not None]
    queries = sum(e.prefix_query_tokens or 0.0 for e in es)
    hits = sum(e.prefix_hit_tokens or 0.0 for e in es)
    return hits / queries if queries > 0 else None


def _sum_or_none(values: Iterable[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def usage_hit_rate(results: Iterable[RequestResult]) -> float | None:
    pairs = [
        (r.cached_tokens, r.prompt_tokens)
        for r in results
        if r.ok and r.prompt_tokens and r.cached_tokens is not None
    ]
    prompt = sum(p for _, p in pairs)
    return sum(c for c, _ in pairs) / prompt if prompt else None


def summarise_run(record: RunRecord, objective: Callable[[str], float]) -> RunSummary:
    """Figures of the steady state: requests sent after ``record.warmup_s``."""
    rs = steady(record.results, record.warmup_s)
    by_class: dict[str, list[RequestResult]] = {}
    for r in rs:
        by_class.setdefault(r.priority_class, []).append(r)
    classes = tuple(
        summarise_class(name, by_class[name], objective(name)) for name in sorted(by_class)
    )
    ok = [r for r in rs if r.ok and r.ttft is not None]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    itls = [g for r in rs if r.ok for g in r.itl]
    good = sum(1 for r in ok if r.ttft is not None and r.ttft <= objective(r.priority_class))
    d = record.duration_s - record.warmup_s
    gen = [e.generation_tokens for e in record.engines if e.generation_tokens is not None]
    return RunSummary(
        workload=record.workload,
        contender=record.contender,
        repeat=record.repeat,
        load_factor=record.load_factor,
        classes=classes,
        requests=len(rs),
        errors=sum(1 for r in rs if not r.ok),
        ttft_p50=percentile(ttfts, 50),
        ttft_p90=percentile(ttfts, 90),
        ttft_p99=percentile(ttfts, 99),
        itl_p50=percentile(itls, 50),
        output_tokens_per_s=sum(r.output_tokens for r in rs if r.ok) / d if d > 0 else 0.0,
        goodput=good / d if d > 0 else 0.0,
        attainment=good / len(rs) if rs else None,
        hit_rate=hit_rate(record.engines),
        imbalance=imbalance(gen) if len(gen) == len(record.engines) else None,
        router_cpu_s=record.router_cpu_s,
        engine_preemptions=_sum_or_none(e.preemptions for e in record.engines),
        extra=dict(record.extra),
        error=record.error,
        usage_hit_rate=usage_hit_rate(rs),
        warmup_requests=len(record.results) - len(rs),
        warmup_errors=sum(1 for r in record.results if not r.ok) - sum(1 for r in rs if not r.ok),
    )


Spread = tuple[float, float, float]
"""(median, min, max) over repeats."""


@dataclasses.dataclass(frozen=True, slots=True)
class Aggregate:
    """Medians of repeats (with min/max) for one (workload, contender, load)."""

    workload: str
    contender: str
    load_factor: float
    repeats: int
    failed: int
    errors: tuple[str, ...]
    metrics: dict[str, Spread | None]
    """Flat metric name -> spread; class metrics as ``<class>.<field>``."""


#: Flat metrics taken from a RunSummary (name, getter).
RUN_METRICS: tuple[str, ...] = (
    "requests",
    "errors",
    "ttft_p50",
    "ttft_p90",
    "ttft_p99",
    "itl_p50",
    "output_tokens_per_s",
    "goodput",
    "attainment",
    "hit_rate",
    "usage_hit_rate",
    "imbalance",
    "router_cpu_s",
    "engine_preemptions",
    "warmup_requests",
    "warmup_errors",
)
CLASS_METRICS: tuple[str, ...] = (
    "requests",
    "errors",
    "ttft_p50",
    "ttft_p90",
    "ttft_p99",
    "ttft_objective_attainment",
    "tokens_per_s",
)


def flat_metrics(s: RunSummary) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for name in RUN_METRICS:
        value = getattr(s, name)
        out[name] = None if value is None else float(value)
    for c in s.classes:
        for name in CLASS_METRICS:
            value = getattr(c, name)
            out[f"{c.priority_class}.{name}"] = None if value is None else float(value)
    for key, value in s.extra.items():
        if isinstance(value, int | float) and not isinstance(value, bool):
            out[f"extra.{key}"] = float(value)
    return out


def aggregate(summaries: Sequence[RunSummary]) -> list[Aggregate]:
    """Group by (workload, contender, load factor), medians over successful repeats."""
    groups: dict[tuple[str, str, float], list[RunSummary]] = {}
    for s in summaries:
        groups.setdefault((s.workload, s.contender, s.load_factor), []).append(s)
    out = []
    for (workload, contender, lf), runs in groups.items():
        good = [r for r in runs if r.error is None]
        values: dict[str, list[float]] = {}
        keys: list[str] = []
        for r in good:
            for k, v in flat_metrics(r).items():
                if k not in values:
                    values[k] = []
                    keys.append(k)
                if v is not None and not math.isnan(v):
                    values[k].append(v)
        out.append(
            Aggregate(
                workload=workload,
                contender=contender,
                load_factor=lf,
                repeats=len(runs),
                failed=len(runs) - len(good),
                errors=tuple(sorted({r.error for r in runs if r.error})),
                metrics={k: median_and_spread(values[k]) for k in keys},
            )
        )
    return out


def median(a: Aggregate, key: str) -> float | None:
    spread = a.metrics.get(key)
    return None if spread is None else spread[0]
