"""How often the autoscaler's ramp test fires on flat traffic, and how soon it sees a
ramp: a Monte Carlo of the decision's own test (pure, seconds of CPU).

    python bench/bench_trend.py [--runs 2000] [--significance 2,2.5,3] [--min-samples 3,5]

Each run draws Poisson arrival counts per 1 s tick: 40 s flat at ``--base`` req/s, then a
ramp to 5x over 30 s (the heavy autoscale trace's quiet and ramp phases), and applies
``_ramp(_since_traffic(rates), span)`` at every tick as :func:`decide` does, with the
span of a 15 s cold start (20 s). Reported per significance and fewest samples of a
ramp (``RAMP_SIGNIFICANCE``, ``RAMP_MIN_SAMPLES``): the share of runs with a ramp
anywhere in the flat 40 s (a false positive: the test runs at every tick over
overlapping windows and tries every breakpoint, so this is far above the one-sided rate
of one test), and the seconds into the ramp it is first seen (p10/p50/p90).
"""

from __future__ import annotations

import argparse
import random

from fleetgate.operator import autoscale


def one_run(rng: random.Random, base: float, span: float) -> tuple[int | None, int | None]:
    rates: list[tuple[float, float]] = []
    false_at = seen_at = None
    for t in range(1, 71):
        rate = base if t <= 40 else base + (t - 40) / 30 * 4 * base
        n, s = 0, rng.expovariate(rate)
        while s < 1.0:
            n, s = n + 1, s + rng.expovariate(rate)
        rates.append((float(t), float(n)))
        if autoscale._ramp(autoscale._since_traffic(rates), span) is not None:
            if t <= 40 and false_at is None:
                false_at = t
            if t > 40 and seen_at is None:
                seen_at = t - 40
    return false_at, seen_at


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=2000)
    ap.add_argument("--base", type=float, default=3.0, help="flat req/s (ramp to 5x)")
    ap.add_argument("--cold-start", type=float, default=15.0)
    ap.add_argument("--significance", default="2,2.5,3", help="standard errors to try")
    ap.add_argument("--min-samples", default="3,5", help="fewest samples of a ramp to try")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    span = max(args.cold_start, autoscale.MIN_TREND_SPAN_SECONDS)
    print("| standard errors | samples | false ramp in 40 s flat | seen after p10/p50/p90 (s) |")
    print("|---|---|---|---|")
    for sig in (float(x) for x in args.significance.split(",")):
        for samples in (int(x) for x in args.min_samples.split(",")):
            # the module constants the test reads
            autoscale.RAMP_SIGNIFICANCE, autoscale.RAMP_MIN_SAMPLES = sig, samples
            rng = random.Random(args.seed)
            runs = [one_run(rng, args.base, span) for _ in range(args.runs)]
            false = sum(f is not None for f, _ in runs) / len(runs)
            seen = sorted(s if s is not None else 99 for _, s in runs)
            q = [seen[len(seen) * k // 10] for k in (1, 5, 9)]
            print(f"| {sig:g} | {samples} | {false:.1%} | {q[0]} / {q[1]} / {q[2]} |")


if __name__ == "__main__":
    main()
