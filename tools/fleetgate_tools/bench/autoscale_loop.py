"""The autoscaling decision in a closed loop with a simulated router, in seconds of CPU.

``fleetgate.operator.autoscale.decide`` (the operator's own decision, unchanged) runs
every ``tick_s`` on the demand a simulated router reports: what runs on the engines,
its class queue, the arrivals and completions of the tick. Its replicas come up a
cold start after they are asked for and go as the operator removes them: a replica
that is not Ready yet at once, Ready ones drained first (no new work; removed once
idle, all of a scale-down together). The router is the clairvoyant reference's
(:mod:`fleetgate_tools.bench.autoscale_oracle`): one class-priority queue over the
ready replicas' slots.

What it is for: a change to the decision can be tried on many seeds of the day-shaped
trace in seconds before it is run on the cluster (``bench/bench_autoscale.py``, 3
minutes a seed). It is no substitute for that run: the cluster has a real router (its
own queue per engine, probes, scrapes), controllers and timing; the replay of the
cluster runs' own schedules says how near the simulated router comes
(bench/results/autoscale-cold15.md).
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from fleetgate.operator import autoscale
from fleetgate_tools.bench import daytrace
from fleetgate_tools.bench.autoscale_oracle import (
    GOALS,
    OBJECTIVES_S,
    RANK,
    Fleet,
    Job,
    Replica,
    SlotRouter,
    attainment,
    evaluate,
)


@dataclass(eq=False)
class _Replica:
    asked: float
    ready: float
    draining: bool = False
    removed: float | None = None


@dataclass
class LoopResult:
    replica_seconds: float
    attainment: dict[str, float]
    changes: list[tuple[float, int, str]] = field(default_factory=list)
    """(time, replicas asked for, the decision's reason) at every change."""
    ttft: list[float] = field(default_factory=list)


class Scaler(Protocol):
    def __call__(
        self, now: float, demand: autoscale.Demand, current: int, ready_busy: Sequence[int]
    ) -> tuple[int, str]:
        """Desired replicas and why, from the tick's demand, the replicas asked for and
        what each Ready replica runs."""
        ...


class FleetgateScaler:
    """``fleetgate.operator.autoscale.decide`` with its state carried between ticks."""

    def __init__(self, policy: autoscale.Policy) -> None:
        self.policy = policy
        self.state = autoscale.State()

    def __call__(
        self, now: float, demand: autoscale.Demand, current: int, ready_busy: Sequence[int]
    ) -> tuple[int, str]:
        d = autoscale.decide(self.policy, demand, current, len(ready_busy), now, self.state)
        self.state = d.state
        return d.desired, d.reason


class HpaScaler:
    """The HorizontalPodAutoscaler's documented algorithm (autoscaling/v2, "Algorithm
    details") on a per-pod average: every ``sync_s`` (from ``phase_s``) it reads each
    Ready pod's engine in-flight count (what the engine runs: the router queues the
    rest), sets pods not Ready aside (0 on a scale-up), skips within ``tolerance`` of
    the target, limits a scale-up to max(4 pods, 100%) per 15 s, and scales down to the
    highest recommendation of ``down_window_s``. Prometheus' scrape and the adapter are
    taken as instantaneous."""

    def __init__(
        self,
        target: float,
        min_replicas: int,
        max_replicas: int,
        sync_s: float = 15.0,
        phase_s: float = 0.0,
        down_window_s: float = 10.0,
        tolerance: float = 0.1,
    ) -> None:
        self.target, self.lo, self.hi = target, min_replicas, max_replicas
        self.sync_s, self.next_sync = sync_s, phase_s
        self.down_window_s, self.tolerance = down_window_s, tolerance
        self.recs: list[tuple[float, int]] = []

    def __call__(
        self, now: float, demand: autoscale.Demand, current: int, ready_busy: Sequence[int]
    ) -> tuple[int, str]:
        if now < self.next_sync:
            return current, "between syncs"
        self.next_sync += self.sync_s * math.ceil((now - self.next_sync + 1e-9) / self.sync_s)
        if not ready_busy:
            return current, "no metrics"
        ratio = sum(ready_busy) / len(ready_busy) / self.target
        if abs(ratio - 1) <= self.tolerance:
            want = current
        elif ratio > 1:
            # pods not Ready count as 0 on a scale-up (and can undo it)
            ratio = sum(ready_busy) / max(current, len(ready_busy)) / self.target
            want = math.ceil(current * ratio - 1e-9) if ratio > 1 + self.tolerance else current
            want = min(want, max(current + 4, 2 * current))
        else:
            want = math.ceil(len(ready_busy) * ratio - 1e-9)
        want = max(self.lo, min(self.hi, want))
        self.recs = [(t, r) for t, r in self.recs if t > now - self.down_window_s]
        self.recs.append((now, want))
        if want < current:
            want = min(current, max(r for _, r in self.recs))
        return want, f"per-pod {sum(ready_busy) / len(ready_busy):.2f} / target {self.target:g}"


def run_loop(
    jobs: Sequence[Job],
    fleet: Fleet,
    policy: autoscale.Policy | Scaler,
    objectives: dict[str, float],
    horizon_s: float,
    tick_s: float = 1.0,
    ask_delay_s: float = 0.5,
    tick_phase_s: float = 0.0,
) -> LoopResult:
    """Replay ``jobs`` through the simulated router with ``decide`` (a ``Policy``) or
    another scaler scaling it; ``fleet.base`` replicas are Ready at 0,
    ``fleet.cold_start_s`` is the modelled cold start (``policy.cold_start`` is what
    the decision plans with), ``ask_delay_s`` the time from a decision to its pod
    (controllers, scheduling), ``tick_phase_s`` when within a tick the decisions run
    (the operator's ticks keep no phase with the trace: at phase 0 every critical burst,
    at whole seconds, started and finished between two in-flight samples and Little's
    law read ~0.44 s for 0.48 s slots)."""
    scaler = FleetgateScaler(policy) if isinstance(policy, autoscale.Policy) else policy
    reps = [_Replica(0.0, 0.0) for _ in range(fleet.base)]
    busy = [0] * fleet.base  # slots in use, per replica (index into reps)
    router = SlotRouter(jobs, fleet)
    events: list[tuple[float, int, int]] = [(j.t, 2, i) for i, j in enumerate(jobs)]
    events += [(k * tick_s + tick_phase_s, 3, 0) for k in range(1, int(horizon_s / tick_s) + 1)]
    heapq.heapify(events)
    arrived = completed = 0
    changes: list[tuple[float, int, str]] = []

    def live() -> list[int]:
        return [k for k, r in enumerate(reps) if r.removed is None]

    def settle_drains(now: float) -> None:
        draining = [k for k in live() if reps[k].draining]
        if draining and all(busy[k] == 0 for k in draining):
            for k in draining:
                reps[k].removed = now

    while events:
        now, kind, a = heapq.heappop(events)
        if now > horizon_s and kind == 3:
            continue
        if kind == 0:
            busy[a] -= 1
            completed += 1
            settle_drains(now)
        elif kind == 1:
            pass  # a replica became Ready: dispatch below
        elif kind == 2:
            arrived += 1
            router.arrive(a)
        else:
            rs = live()
            ready = [k for k in rs if reps[k].ready <= now]
            demand = autoscale.Demand(
                in_flight=float(sum(busy[k] for k in rs)),
                queued=float(len(router.queue)) if ready else 0.0,
                held=0.0 if ready else float(len(router.queue)),
                arrival_rate=arrived / tick_s,
                completion_rate=completed / tick_s,
            )
            arrived = completed = 0
            current = len(rs)
            desired, reason = scaler(now, demand, current, [busy[k] for k in ready])
            if desired > current:
                for _ in range(desired - current):
                    asked = now + ask_delay_s
                    reps.append(_Replica(asked, asked + fleet.cold_start_s))
                    busy.append(0)
                    heapq.heappush(events, (asked + fleet.cold_start_s, 1, len(reps) - 1))
                for k in rs:
                    reps[k].draining = False  # demand back: the drain is called off
                changes.append((now, desired, reason))
            elif desired < current:
                starting = [k for k in rs if reps[k].ready > now]
                if starting:  # the ReplicaSet removes a pod that is not Ready first
                    reps[max(starting, key=lambda k: reps[k].asked)].removed = now
                else:
                    wanted = current - desired
                    victims = sorted(rs, key=lambda k: (not reps[k].draining, busy[k]))[:wanted]
                    for k in rs:
                        reps[k].draining = k in victims
                    settle_drains(now)
                changes.append((now, desired, reason))
        open_ = [k for k in live() if reps[k].ready <= now and not reps[k].draining]
        for done, k in router.dispatch(now, open_, busy):
            heapq.heappush(events, (done, 0, k))
    total = 0.0
    for r in reps:
        end = horizon_s if r.removed is None else min(r.removed, horizon_s)
        total += max(0.0, end - max(r.asked, 0.0))
    return LoopResult(total, attainment(jobs, router.ttft, objectives), changes, router.ttft)


def parse_timetable(text: str) -> list[tuple[float, int]]:
    """``'46.5:2,111:1'`` -> [(46.5, 2), (111.0, 1)] in time order (ValueError with the
    expected form otherwise)."""
    try:
        steps = [(float(t), int(n)) for t, n in (x.split(":") for x in text.split(","))]
    except ValueError:
        raise ValueError(
            f"{text!r}: want SECONDS:REPLICAS[,SECONDS:REPLICAS...], e.g. 46.5:2,111:1"
        ) from None
    if any(t < 0 or n < 0 for t, n in steps):
        raise ValueError(f"{text!r}: seconds and replicas must be >= 0")
    return sorted(steps)


def timetable_replicas(base: int, timetable: Sequence[tuple[float, int]]) -> list[Replica]:
    """A replica count over time (``(from, replicas)`` steps, starting at ``base``) as
    extra-replica intervals: the last asked for is the first removed."""
    out: list[Replica] = []
    up: list[float] = []
    n = base
    for t, want in sorted(timetable):
        while n < want:
            up.append(t)
            n += 1
        while n > want and n > base:
            out.append(Replica(up.pop(), t))
            n -= 1
    return out + [Replica(u, math.inf) for u in up]


def generated_jobs(seed: int, base_rate: float, scale: float, slot_s: float) -> list[Job]:
    """The day-shaped trace's arrivals of ``seed`` (as bench_autoscale.py draws them),
    every request holding a slot ``slot_s``."""
    plan = daytrace.arrivals(daytrace.trace(scale, base_rate), random.Random(seed))
    return [Job(a.t, a.cls, slot_s) for a in plan]


def paired_mean(diffs: Sequence[float], draws: int = 2000) -> tuple[float, float, float]:
    """The mean of per-seed differences and its 95% bootstrap interval over seeds
    (resampled with a fixed generator, so a rerun prints the same interval)."""
    rng = random.Random(7)
    n = len(diffs)
    means = sorted(sum(rng.choice(diffs) for _ in range(n)) / n for _ in range(draws))
    return sum(diffs) / n, means[int(0.025 * draws)], means[int(0.975 * draws) - 1]


def main(argv: Sequence[str] | None = None) -> int:
    import argparse
    import statistics

    parser = argparse.ArgumentParser(
        prog="python -m fleetgate_tools.bench.autoscale_loop",
        description="The autoscaling decision (or a fixed timetable) on the day-shaped "
        "trace, many seeds, with a simulated router: replica-seconds and attainment.",
    )
    parser.add_argument("--seeds", type=int, default=40, help="seeds 0..N-1")
    parser.add_argument("--base-rate", type=float, default=3.0)
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--slots", type=int, default=4, help="per replica (maxNumSeqs)")
    parser.add_argument("--slot-time", type=float, default=0.48,
                        help="seconds a request holds a slot (heavy trace: ~0.48)")  # fmt: skip
    parser.add_argument("--cold-start", type=float, default=15.0)
    parser.add_argument("--min-replicas", type=int, default=1)
    parser.add_argument("--max-replicas", type=int, default=3)
    parser.add_argument("--target-in-flight", type=float, default=2.0)
    parser.add_argument("--scale-down-window", type=float, default=10.0)
    parser.add_argument("--hpa-target", type=float, default=None,
                        help="run the HPA's algorithm on the engines' in-flight count "
                        "per pod at this target instead of fleetgate's decision")  # fmt: skip
    parser.add_argument("--hpa-sync", type=float, default=15.0,
                        help="the HPA's sync period; its phase is drawn per seed")  # fmt: skip
    parser.add_argument("--versus-hpa", type=float, default=None, metavar="TARGET",
                        help="also run the HPA's algorithm at this target on every "
                        "seed (same arrivals, tick phase); print the paired "
                        "differences")  # fmt: skip
    parser.add_argument("--timetable", default=None, metavar="SECONDS:REPLICAS,...",
                        help="run this schedule instead of the decision")  # fmt: skip
    parser.add_argument("--verbose", action="store_true", help="one line per seed")
    args = parser.parse_args(argv)
    if args.seeds < 1 or args.slots < 1 or args.slot_time <= 0 or args.cold_start < 0:
        parser.error("want --seeds >= 1, --slots >= 1, --slot-time > 0, --cold-start >= 0")
    hpa_targets = [t for t in (args.hpa_target, args.versus_hpa) if t is not None]
    if any(not (0 < t < args.slots and args.hpa_sync > 0) for t in hpa_targets):
        # the simulated router never lets a request wait inside an engine, so a pod's
        # in-flight count stops at its slots: a target there would never scale (on the
        # cluster the router lets a few wait in the engine, and it does)
        parser.error("want 0 < --hpa-target, --versus-hpa < --slots and --hpa-sync > 0")
    table = None
    if args.timetable:
        try:
            table = parse_timetable(args.timetable)
        except ValueError as e:
            parser.error(f"--timetable {e}")
    horizon = sum(p.seconds for p in daytrace.trace(args.scale, args.base_rate))
    fleet = Fleet(args.min_replicas, args.slots, args.cold_start, 0.005, RANK)
    policy = autoscale.Policy(
        min_replicas=args.min_replicas, max_replicas=args.max_replicas,
        cold_start=args.cold_start + 1, target_in_flight=args.target_in_flight,
        up_window=0.0, down_window=args.scale_down_window,
    )  # fmt: skip
    seconds, standard, critical = [], [], []
    versus: list[tuple[float, float, float]] = []  # the HPA's (replica-s, standard, critical)

    def hpa(seed: int, target: float) -> HpaScaler:
        phase = random.Random(10_000 + seed).uniform(0, args.hpa_sync)
        return HpaScaler(target, args.min_replicas, args.max_replicas, args.hpa_sync, phase,
                         args.scale_down_window)  # fmt: skip

    for seed in range(args.seeds):
        jobs = generated_jobs(seed, args.base_rate, args.scale, args.slot_time)
        if table is not None:
            plan = evaluate(jobs, fleet, timetable_replicas(args.min_replicas, table),
                            OBJECTIVES_S, horizon)  # fmt: skip
            rs, att, how = plan.replica_seconds, dict(plan.attainment), ""
        else:
            scaler: autoscale.Policy | Scaler = policy
            if args.hpa_target is not None:
                scaler = hpa(seed, args.hpa_target)
            tick_phase = random.Random(20_000 + seed).uniform(0, 1)
            r = run_loop(jobs, fleet, scaler, OBJECTIVES_S, horizon, tick_phase_s=tick_phase)
            rs, att = r.replica_seconds, r.attainment
            how = " ".join(f"{t:g}:{n}" for t, n, _ in r.changes)
        if args.versus_hpa is not None:
            tick_phase = random.Random(20_000 + seed).uniform(0, 1)
            h = run_loop(jobs, fleet, hpa(seed, args.versus_hpa), OBJECTIVES_S, horizon,
                         tick_phase_s=tick_phase)  # fmt: skip
            versus.append((h.replica_seconds, h.attainment["standard"], h.attainment["critical"]))
        seconds.append(rs)
        standard.append(att["standard"])
        critical.append(att["critical"])
        if args.verbose:
            print(f"seed {seed}: {rs:.1f} replica-s, critical {att['critical']:.1%}, "
                  f"standard {att['standard']:.1%} {how}")  # fmt: skip
    static = args.max_replicas * horizon

    def attained(s: float, c: float) -> bool:
        return s >= GOALS["standard"] and c >= GOALS["critical"]

    met = [attained(s, c) for s, c in zip(standard, critical, strict=True)]
    goals = [m and rs <= 0.6 * static for m, rs in zip(met, seconds, strict=True)]
    every = sum(goals)
    print(f"{args.seeds} seeds: replica-s mean {statistics.mean(seconds):.1f} "
          f"({statistics.mean(seconds) / static:.2f}x static), standard attainment median "
          f"{statistics.median(standard):.1%} (min {min(standard):.1%}), critical min "
          f"{min(critical):.1%}; both goals met on {sum(met)} of {args.seeds}, and "
          f"<= 0.6x static too on {every}")  # fmt: skip
    if versus:
        d_rs = paired_mean([a - h[0] for a, h in zip(seconds, versus, strict=True)])
        d_st = paired_mean([100 * (a - h[1]) for a, h in zip(standard, versus, strict=True)])
        h_met = sum(1 for _, s, c in versus if attained(s, c))
        level = sum(1 for a, s, c, h in zip(seconds, standard, critical, versus, strict=True)
                    if a <= h[0] and s >= h[1] and c >= h[2])  # fmt: skip
        # the goals of one run, the comparison included: the absolute ones, and
        # better attainment than the HPA at equal or lower replica-seconds
        won = sum(1 for g, a, s, c, h in zip(goals, seconds, standard, critical, versus,
                                             strict=True)
                  if g and a <= h[0] and s > h[1] and c >= h[2])  # fmt: skip
        print(f"against the HPA at target {args.versus_hpa:g} (paired by seed; 95% bootstrap "
              f"over seeds): replica-s {d_rs[0]:+.1f} [{d_rs[1]:+.1f}, {d_rs[2]:+.1f}], "
              f"standard attainment {d_st[0]:+.1f} [{d_st[1]:+.1f}, {d_st[2]:+.1f}] points; "
              f"both goals on {sum(met)} against {h_met}; at least as good on replica-s, "
              f"standard and critical on {level} of {args.seeds}; every goal, with better "
              f"standard attainment than the HPA at <= its replica-s, on {won}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
