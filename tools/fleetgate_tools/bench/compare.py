"""Contender against baseline, with bootstrap confidence intervals (pure).

For every (workload, load factor) the baseline is the best peer router (lowest
median steady-state TTFT p90 over seeds, among the peers that failed at most
``BASELINE_MAX_FAILED`` of their steady requests when any did) when a peer ran, else the first
contender of the command line. Every other contender is compared with it, and
a contender run with several router replicas (``NAME@2r``) also with itself
at one replica (``NAME``; the issue's "within 2 points of one replica"), on
the SAME seeds (paired: each repeat replays one schedule), see
:func:`fleetgate_tools.bench.stats.paired_bootstrap`:

* TTFT p50 / p90 / p99 as ratios contender / baseline (lower is better);
* prompt-token hit rate from the answers' ``usage.prompt_tokens_details.
  cached_tokens`` (sum cached / sum prompt tokens over the steady requests) as a
  difference in points (higher is better), and as a ratio;
* the share of failed steady requests as a difference in points (lower is
  better): the TTFT figures leave failed requests out, this one does not.

A ratio's verdict is ``win`` or ``loss`` only when its interval excludes 1 (a
difference's: 0); otherwise ``no clear difference``. Only steady-state requests
(sent after the warm-up) count; a request without a TTFT (failed) is left out of
the TTFT figures and counted in the report's error column instead.
"""

from __future__ import annotations

import dataclasses
import math
import random
import statistics
from collections.abc import Mapping, Sequence

from fleetgate_tools.bench.stats import (
    Cluster,
    Combine,
    Interval,
    RequestResult,
    Statistic,
    difference,
    paired_bootstrap,
    percentile_stat,
    ratio,
    ratio_of_sums,
    steady,
    verdict,
)
from fleetgate_tools.bench.summary import RunRecord

#: Fewer steady sessions than this in a seed: no interval (``n/a``), whatever
#: the point estimate.
MIN_SESSIONS = 30
#: A percentile's interval also needs this many sessions ABOVE the percentile
#: (p90: 50 sessions, p99: 500): the bootstrap cannot draw values beyond the
#: largest observed, so an interval for a p99 of a few dozen requests would
#: claim wins it cannot support.
MIN_TAIL = 5


def min_sessions(figure: str) -> int:
    """The fewest steady sessions per seed for an interval of ``figure``."""
    for q in (50, 90, 99):
        if figure.startswith(f"ttft_p{q}_"):
            return max(MIN_SESSIONS, math.ceil(MIN_TAIL / (1 - q / 100) - 1e-9))
    return MIN_SESSIONS


@dataclasses.dataclass(frozen=True, slots=True)
class Figure:
    name: str
    """``ttft_p90_ratio``, ``hit_rate_diff``, ..."""
    interval: Interval | None
    verdict: str
    per_seed: tuple[float, ...]
    """The figure on each seed's own data (the range the report shows)."""
    lower_is_better: bool


@dataclasses.dataclass(frozen=True, slots=True)
class Comparison:
    workload: str
    load_factor: float
    contender: str
    baseline: str
    seeds: int
    figures: tuple[Figure, ...]

    def figure(self, name: str) -> Figure | None:
        return next((f for f in self.figures if f.name == name), None)


def _is_peer(name: str) -> bool:
    return not name.startswith("fleetgate")


def ttft_clusters(results: Sequence[RequestResult]) -> Mapping[str, Cluster]:
    out: dict[str, list[tuple[float, ...]]] = {}
    for r in results:
        if r.ok and r.ttft is not None:
            out.setdefault(r.session_id, []).append((r.ttft,))
    return out


def usage_clusters(results: Sequence[RequestResult]) -> Mapping[str, Cluster]:
    out: dict[str, list[tuple[float, ...]]] = {}
    for r in results:
        if r.ok and r.prompt_tokens and r.cached_tokens is not None:
            out.setdefault(r.session_id, []).append(
                (float(r.cached_tokens), float(r.prompt_tokens))
            )
    return out


def error_clusters(results: Sequence[RequestResult]) -> Mapping[str, Cluster]:
    """Per session, (failed, 1) for every request: the error rate's observations."""
    out: dict[str, list[tuple[float, ...]]] = {}
    for r in results:
        out.setdefault(r.session_id, []).append((0.0 if r.ok else 1.0, 1.0))
    return out


#: (figure name, clusters, statistic, combine, neutral, lower is better)
FIGURES: tuple[tuple[str, str, Statistic, Combine, float, bool], ...] = (
    ("ttft_p50_ratio", "ttft", percentile_stat(50), ratio, 1.0, True),
    ("ttft_p90_ratio", "ttft", percentile_stat(90), ratio, 1.0, True),
    ("ttft_p99_ratio", "ttft", percentile_stat(99), ratio, 1.0, True),
    ("hit_rate_diff", "usage", ratio_of_sums(0, 1), difference, 0.0, False),
    ("hit_rate_ratio", "usage", ratio_of_sums(0, 1), ratio, 1.0, False),
    ("error_rate_diff", "errors", ratio_of_sums(0, 1), difference, 0.0, True),
)


#: A peer that fails more of its steady requests than this is no baseline: its TTFT
#: figures leave the failures out, so a router that refuses fast would look fastest.
BASELINE_MAX_FAILED = 0.05


def _median_failed(records: Sequence[RunRecord]) -> float:
    shares = []
    for rec in records:
        sample = steady(rec.results, rec.warmup_s)
        if sample:
            shares.append(sum(not r.ok for r in sample) / len(sample))
    return statistics.median(shares) if shares else 1.0


def _median_p90(records: Sequence[RunRecord]) -> float | None:
    values = []
    for rec in records:
        ttfts = [c[0][0] for c in ttft_clusters(steady(rec.results, rec.warmup_s)).values()]
        p = percentile_stat(90)([(t,) for t in ttfts])
        if p is not None:
            values.append(p)
    return statistics.median(values) if values else None


def compare(
    records: Sequence[RunRecord],
    rng: random.Random,
    *,
    replicates: int = 1000,
    level: float = 0.95,
) -> list[Comparison]:
    """Every contender against its workload's baseline (see the module doc)."""
    ok = [r for r in records if r.error is None]
    groups: dict[tuple[str, float], dict[str, dict[int, RunRecord]]] = {}
    for r in ok:
        groups.setdefault((r.workload, r.load_factor), {}).setdefault(r.contender, {})[r.repeat] = r
    order = list(dict.fromkeys(r.contender for r in records))
    out: list[Comparison] = []
    for (workload, lf), by_contender in groups.items():
        names = [n for n in order if n in by_contender]
        single = [n for n in names if "@" not in n]
        peers = []
        for n in single:
            peer_runs = list(by_contender[n].values())
            p90 = _median_p90(peer_runs) if _is_peer(n) else None
            if p90 is not None:
                peers.append((_median_failed(peer_runs) > BASELINE_MAX_FAILED, p90, n))
        # the fastest peer among those that served (a peer failing over 5% of its
        # requests is a baseline only when every peer does)
        best = min(peers)[2] if peers else (single or names)[0]
        todo = [(n, best) for n in single if n != best]
        # NAME@<n>r (router replicas) against the same contender with one replica
        todo += [(n, n.split("@")[0]) for n in names if "@" in n and n.split("@")[0] in names]
        for name, baseline in todo:
            seeds = sorted(set(by_contender[name]) & set(by_contender[baseline]))
            if not seeds:
                continue
            pairs = [
                (
                    steady(by_contender[name][s].results, by_contender[name][s].warmup_s),
                    steady(by_contender[baseline][s].results, by_contender[baseline][s].warmup_s),
                )
                for s in seeds
            ]
            figures = []
            for fname, kind, stat, combine, neutral, lower in FIGURES:
                make = {"ttft": ttft_clusters, "usage": usage_clusters, "errors": error_clusters}[
                    kind
                ]
                runs = [(make(a), make(b)) for a, b in pairs]
                if any(not x or not y for x, y in runs):
                    figures.append(Figure(fname, None, "n/a", (), lower))
                    continue
                ci = paired_bootstrap(
                    runs,
                    stat,
                    combine,
                    rng,
                    replicates=replicates,
                    level=level,
                    min_clusters=min_sessions(fname),
                )
                per_seed = []
                for x, y in runs:
                    fig = combine(
                        stat([o for c in x.values() for o in c]),
                        stat([o for c in y.values() for o in c]),
                    )
                    if fig is not None:
                        per_seed.append(fig)
                figures.append(
                    Figure(fname, ci, verdict(ci, neutral, lower), tuple(per_seed), lower)
                )
            out.append(Comparison(workload, lf, name, baseline, len(seeds), tuple(figures)))
    return out


def as_dict(c: Comparison) -> dict[str, object]:
    return {
        "workload": c.workload,
        "load_factor": c.load_factor,
        "contender": c.contender,
        "baseline": c.baseline,
        "seeds": c.seeds,
        "figures": {
            f.name: {
                "estimate": f.interval.estimate if f.interval else None,
                "low": f.interval.low if f.interval else None,
                "high": f.interval.high if f.interval else None,
                "level": f.interval.level if f.interval else None,
                "per_seed": list(f.per_seed),
                "verdict": f.verdict,
            }
            for f in c.figures
        },
    }
