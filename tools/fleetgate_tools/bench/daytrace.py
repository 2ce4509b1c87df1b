"""The day-shaped trace of ``bench/bench_autoscale.py``: phases and seeded arrivals.

Quiet (base rate) 40 s, ramp (base -> 5 x base) 30 s, peak (5 x base, plus a burst of 8
critical requests every 10 s) 40 s, idle 30 s, durations x ``scale``; open loop, Poisson
arrivals of a piecewise-linear rate (thinning), 20% ``critical`` and 80% ``standard``.
Shared by the cluster bench, the clairvoyant reference and the closed-loop replay of
the autoscaling decision, so all three see the same arrivals for a seed.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Phase:
    name: str
    seconds: float
    rate_from: float
    rate_to: float
    critical_burst_every_s: float | None = None


def trace(scale: float, base: float) -> list[Phase]:
    return [
        Phase("quiet", 40 * scale, base, base),
        Phase("ramp", 30 * scale, base, 5 * base),
        Phase("peak", 40 * scale, 5 * base, 5 * base, critical_burst_every_s=10 * scale),
        Phase("idle", 30 * scale, 0.0, 0.0),
    ]


@dataclass(frozen=True)
class Arrival:
    t: float
    cls: str
    phase: str


def arrivals(phases: list[Phase], rng: random.Random, burst: int = 8) -> list[Arrival]:
    """Poisson arrivals of a piecewise-linear rate (thinning), plus critical bursts."""
    out: list[Arrival] = []
    start = 0.0
    for p in phases:
        peak = max(p.rate_from, p.rate_to)
        t = start
        while peak > 0:
            t += rng.expovariate(peak)
            if t >= start + p.seconds:
                break
            rate = p.rate_from + (p.rate_to - p.rate_from) * (t - start) / p.seconds
            if rng.random() < rate / peak:
                cls = "critical" if rng.random() < 0.2 else "standard"
                out.append(Arrival(t, cls, p.name))
        if p.critical_burst_every_s:
            b = start + p.critical_burst_every_s / 2
            while b < start + p.seconds:
                out += [Arrival(b + 0.01 * k, "critical", p.name) for k in range(burst)]
                b += p.critical_burst_every_s
        start += p.seconds
    return sorted(out, key=lambda a: a.t)
