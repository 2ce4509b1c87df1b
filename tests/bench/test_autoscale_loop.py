"""The closed-loop replay runs the operator's own decision against the simulated
router: it scales up on a queue, drains and removes replicas after the load, and a
timetable becomes the right intervals; the day-shaped trace is the bench's."""

from __future__ import annotations

import random

import pytest

from fleetgate.operator import autoscale
from fleetgate_tools.bench import daytrace
from fleetgate_tools.bench.autoscale_loop import HpaScaler, main, run_loop, timetable_replicas
from fleetgate_tools.bench.autoscale_oracle import Fleet, Job, Replica

RANK = {"critical": 0, "standard": 1}


def test_a_timetable_becomes_intervals_last_asked_first_removed() -> None:
    assert timetable_replicas(1, [(44.0, 2), (111.0, 1)]) == [Replica(44.0, 111.0)]
    assert timetable_replicas(1, [(48.0, 3), (90.0, 2), (111.0, 1)]) == [
        Replica(48.0, 90.0),
        Replica(48.0, 111.0),
    ]
    (r,) = timetable_replicas(0, [(5.0, 1)])
    assert r.up_s == 5.0 and r.down_s == float("inf")


def test_the_decision_scales_up_on_a_surge_and_drains_back_after_it() -> None:
    # 1 slot of 0.9 s: one request a second is held, three a second from 10 s to 30 s
    # need three replicas; nothing after 30 s
    jobs = [Job(float(t), "standard", 0.9) for t in range(10)]
    jobs += [Job(10 + k / 3, "standard", 0.9) for k in range(60)]
    fleet = Fleet(1, 1, 2.0, 0.0, RANK)
    policy = autoscale.Policy(
        min_replicas=1, max_replicas=4, cold_start=3.0, target_in_flight=1.0,
        up_window=0.0, down_window=5.0,
    )  # fmt: skip
    r = run_loop(jobs, fleet, policy, {"standard": 3.0}, 60.0)
    ups = [(t, n) for t, n, why in r.changes if why.startswith("ScaledUp")]
    downs = [(t, n) for t, n, why in r.changes if why.startswith("ScaledDown")]
    assert ups and 10.0 < ups[0][0] <= 14.0 and max(n for _, n in ups) >= 3
    # back to one replica within the scale-down window (and a drain) after the surge
    assert downs and downs[-1][1] == 1 and 30.0 < downs[-1][0] <= 40.0
    assert all(x < float("inf") for x in r.ttft)  # every request was served
    # the extra replicas cost less than running the peak all along
    assert 60.0 < r.replica_seconds < 3 * 60.0
    # and without scaling the surge misses its objective
    fixed = autoscale.Policy(min_replicas=1, max_replicas=1, cold_start=3.0,
                             target_in_flight=1.0)  # fmt: skip
    alone = run_loop(jobs, fleet, fixed, {"standard": 3.0}, 60.0)
    assert alone.replica_seconds == 60.0
    assert alone.attainment["standard"] < r.attainment["standard"]


def test_the_day_trace_is_the_seeded_one_with_its_critical_bursts() -> None:
    phases = daytrace.trace(1.0, 3.0)
    assert [p.name for p in phases] == ["quiet", "ramp", "peak", "idle"]
    a = daytrace.arrivals(phases, random.Random(3))
    assert a == daytrace.arrivals(phases, random.Random(3))
    assert not [x for x in a if x.phase == "idle"]
    # a burst of 8 critical requests every 10 s of the peak (70-110 s), from 75 s
    for b in (75.0, 85.0, 95.0, 105.0):
        burst = [x for x in a if b <= x.t < b + 0.08 and x.cls == "critical"]
        assert len(burst) >= 8
    quiet = [x for x in a if x.phase == "quiet"]
    assert 80 < len(quiet) < 160  # 3 req/s for 40 s


def test_the_command_runs_seeds_of_a_timetable(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--seeds", "2", "--timetable", "44:2,111:1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("2 seeds: replica-s mean ")
    assert "(0.49x static)" in out or "(0.50x static)" in out
    with pytest.raises(SystemExit):
        main(["--timetable", "soon"])
    assert "want SECONDS:REPLICAS" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--hpa-target", "4", "--slots", "4"])
    assert "0 < --hpa-target, --versus-hpa < --slots" in capsys.readouterr().err


def demand() -> autoscale.Demand:
    return autoscale.Demand()


def test_the_hpa_acts_at_its_syncs_only_and_skips_within_its_tolerance() -> None:
    hpa = HpaScaler(2.0, 1, 10, sync_s=15.0, phase_s=5.0)
    assert hpa(1.0, demand(), 1, [4]) == (1, "between syncs")
    # at its sync (5 s): 4 per pod against 2 -> twice the pods
    assert hpa(5.0, demand(), 1, [4])[0] == 2
    assert hpa(6.0, demand(), 2, [4])[0] == 2  # next sync at 20 s
    assert hpa(20.0, demand(), 2, [2, 2.2])[0] == 2  # ratio 1.05: within 10%


def test_the_hpa_counts_pods_not_ready_as_idle_on_a_scale_up_and_limits_it() -> None:
    hpa = HpaScaler(1.0, 1, 20, sync_s=15.0)
    # 3 pods asked for, one Ready running 4: 4 over 3 pods -> 4 (not 3 x 4 = 12)
    assert hpa(0.0, demand(), 3, [4])[0] == 4
    # a scale-up is limited to max(4 pods, 100%) a sync: 2 pods at 10 -> at most 6
    assert HpaScaler(1.0, 1, 50)(0.0, demand(), 2, [10, 10])[0] == 6


def test_the_hpa_scales_down_to_the_highest_recommendation_of_its_window() -> None:
    hpa = HpaScaler(1.0, 1, 10, sync_s=1.0, down_window_s=10.0)
    assert hpa(0.0, demand(), 3, [1, 1, 1])[0] == 3
    assert hpa(1.0, demand(), 3, [0, 0, 1])[0] == 3  # 3 was recommended 1 s ago
    assert hpa(11.5, demand(), 3, [0, 0, 1])[0] == 1  # the window has passed


def test_paired_mean_is_the_mean_of_the_differences_with_an_interval_around_it() -> None:
    from fleetgate_tools.bench.autoscale_loop import paired_mean

    mean, lo, hi = paired_mean([-3.0, -1.0, -2.0, -2.0])
    assert mean == -2.0 and -3.0 <= lo < mean < hi <= -1.0
    assert paired_mean([5.0] * 10) == (5.0, 5.0, 5.0)


def test_the_command_pairs_the_decision_with_the_hpa(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--seeds", "3", "--target-in-flight", "4", "--versus-hpa", "1"]) == 0
    first, second = capsys.readouterr().out.splitlines()
    assert first.startswith("3 seeds: replica-s mean ") and "<= 0.6x static too on " in first
    assert second.startswith("against the HPA at target 1 (paired by seed; 95% bootstrap")
    assert "at least as good on replica-s, standard and critical on " in second
    # a seed counted as a win meets every goal and is at least as good on all three
    every = int(first.rsplit("<= 0.6x static too on ", 1)[1])
    level = int(second.split("standard and critical on ", 1)[1].split(" of ", 1)[0])
    won = int(second.rsplit("at <= its replica-s, on ", 1)[1])
    assert 0 <= won <= min(every, level)
    with pytest.raises(SystemExit):
        main(["--versus-hpa", "4", "--slots", "4"])
    assert "--versus-hpa < --slots" in capsys.readouterr().err
