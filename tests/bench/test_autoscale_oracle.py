"""The clairvoyant replica schedule: its simulated router queues and orders as stated,
and the search finds the latest ask and earliest removal that still meet the goals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fleetgate_tools.bench.autoscale_oracle import (
    Fleet,
    Job,
    Replica,
    cheapest_common_schedule,
    evaluate,
    jobs_from_outcomes,
    main,
    simulate,
)

RANK = {"critical": 0, "standard": 1}


def fleet(base: int = 1, slots: int = 1, cold: float = 2.0, first: float = 0.0) -> Fleet:
    return Fleet(base, slots, cold, first, RANK)


def test_a_request_waits_for_a_busy_slot_and_the_first_token_time_is_added() -> None:
    jobs = [Job(0.0, "standard", 1.0), Job(0.0, "standard", 1.0), Job(0.5, "standard", 1.0)]
    ttft, _ = simulate(jobs, fleet(first=0.01), [])
    assert ttft == pytest.approx([0.01, 1.01, 1.51])


def test_a_freed_slot_goes_to_the_more_urgent_class_first() -> None:
    jobs = [Job(0.0, "standard", 1.0), Job(0.1, "standard", 1.0), Job(0.2, "critical", 1.0)]
    ttft, _ = simulate(jobs, fleet(), [])
    # the critical request arrived last but takes the slot freed at 1.0
    assert ttft == pytest.approx([0.0, 1.9, 0.8])


def test_an_extra_replica_takes_work_only_between_ready_and_removal() -> None:
    jobs = [Job(t, "standard", 1.0) for t in (0.0, 0.0, 3.0, 3.0, 6.0, 6.0)]
    # asked at 0, ready at 2 (cold start), removed at 5
    ttft, last = simulate(jobs, fleet(cold=2.0), [Replica(0.0, 5.0)])
    assert ttft == pytest.approx([0.0, 1.0, 0.0, 0.0, 0.0, 1.0])
    assert last == [4.0]


def test_replica_seconds_count_the_cold_start_and_the_work_after_removal() -> None:
    jobs = [Job(t, "standard", 1.0) for t in (0.0, 2.0, 2.0)]
    plan = evaluate(jobs, fleet(cold=2.0), [Replica(0.0, 2.5)], {"standard": 0.5}, 10.0)
    # base 10 s; the extra from its ask (0) to its last completion (3.0 > removal 2.5)
    assert plan.replica_seconds == pytest.approx(13.0)
    assert plan.attainment == {"standard": 1.0}


def burst(cold: float, start: int = 20) -> list[Job]:
    """One request a second, two a second for 10 s from ``start``: one 1-slot replica
    holds the first, the second needs another."""
    jobs = [Job(float(t), "standard", 0.9) for t in range(40)]
    jobs += [Job(t + 0.5, "standard", 0.9) for t in range(start, start + 10)]
    return sorted(jobs, key=lambda j: j.t)


def test_the_cheapest_schedule_asks_a_cold_start_ahead_and_removes_when_the_burst_ends() -> None:
    cold = 3.0
    f = fleet(cold=cold)
    goals = {"standard": 1.0}
    objectives = {"standard": 0.45}
    plan = cheapest_common_schedule([(burst(cold), f)], 2, objectives, goals, 40.0, step_s=0.5)
    assert plan is not None
    # one extra replica is enough; ready at 21.0 it takes the 21.0 arrival while the
    # 20.5 one waited 0.4 s (< 0.45) for the base replica: ready at 21.5, 21.0 would wait 0.5
    assert len(plan.extras) == 1
    (r,) = plan.extras
    assert r.up_s == 18.0
    assert 29.5 <= r.down_s <= 30.0
    assert plan.attainment == {"standard": 1.0}
    # one grid step later breaks the goal: the search stopped at the boundary
    later = evaluate(burst(cold), f, [Replica(r.up_s + 0.5, r.down_s)], objectives, 40.0)
    assert later.attainment["standard"] < 1.0
    assert plan.replica_seconds == pytest.approx(40.0 + (r.down_s - r.up_s) + 0.4, abs=0.5)


def test_one_schedule_for_several_runs_meets_the_goals_on_each() -> None:
    f = fleet(cold=3.0)
    objectives, goals = {"standard": 0.45}, {"standard": 1.0}
    early, late = burst(3.0, start=20), burst(3.0, start=24)
    alone = [cheapest_common_schedule([(j, f)], 1, objectives, goals, 40.0) for j in (early, late)]
    assert [p.extras[0].up_s for p in alone if p] == [18.0, 22.0]
    common = cheapest_common_schedule([(early, f), (late, f)], 1, objectives, goals, 40.0)
    assert common is not None
    (r,) = common.extras
    # ready for the earlier burst, kept to the end of the later one
    assert r.up_s == 18.0 and r.down_s >= 33.5
    assert common.attainment == {"standard": 1.0}


def test_a_looser_objective_lets_the_schedule_skip_the_extra_replica() -> None:
    # the burst's backlog grows 0.8 s a second for 10 s: an 8.5 s wait meets 10 s
    plan = cheapest_common_schedule(
        [(burst(3.0), fleet(cold=3.0))], 2, {"standard": 10.0}, {"standard": 1.0}, 40.0
    )
    assert plan is not None and plan.extras == ()
    assert plan.replica_seconds == 40.0


def test_no_schedule_when_even_the_static_peak_misses() -> None:
    jobs = [Job(0.0, "standard", 5.0)] * 4
    assert (
        cheapest_common_schedule([(jobs, fleet())], 1, {"standard": 1.0}, {"standard": 1.0}, 10.0)
        is None
    )


def outcome(
    sent: float, phase: str, ttft: float | None, done: float, cls: str = "standard"
) -> dict[str, object]:
    return {"sent_s": sent, "cls": cls, "phase": phase, "ttft_s": ttft, "done_s": done}


def test_jobs_from_a_run_hold_a_slot_after_the_first_token_and_skip_the_cold_request() -> None:
    outcomes = [
        outcome(1.0, "quiet", 0.01, 1.5),
        outcome(2.0, "quiet", 0.03, 2.53),
        outcome(3.0, "quiet", 0.02, 3.52),
        outcome(50.0, "peak", 1.0, 51.6, "critical"),  # queued 1 s: not slot time
        outcome(140.0, "cold", 0.02, 140.5),
    ]
    jobs, first = jobs_from_outcomes(outcomes, "measured")
    assert first == 0.02
    assert [j.t for j in jobs] == [1.0, 2.0, 3.0, 50.0]
    assert [j.service_s for j in jobs] == pytest.approx([0.51, 0.52, 0.52, 0.62])
    assert jobs[-1].cls == "critical"
    # the default: the quiet phase's median time after the first token for every job
    jobs, _ = jobs_from_outcomes(outcomes)
    assert [j.service_s for j in jobs] == pytest.approx([0.52] * 4)
    with pytest.raises(ValueError, match="slot"):
        jobs_from_outcomes(outcomes, "mean")


def test_the_command_reads_a_bench_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    outcomes = [outcome(t / 4, "quiet", 0.01, t / 4 + 0.5) for t in range(40 * 4)]
    doc = {
        "args": {
            "scale": 1.0,
            "peak_replicas": 2,
            "min_replicas": 1,
            "max_num_seqs": 4,
            "cold_start": 15.0,
            "pool": "vllm",
        },  # fmt: skip
        "results": [{"contender": "fleetgate-autoscale", "outcomes": outcomes}],
    }
    path = tmp_path / "run.json"
    path.write_text(json.dumps(doc))
    assert main([str(path)]) == 0
    row = capsys.readouterr().out.splitlines()[-1].split(" | ")
    # 4 req/s of 0.5 s on 4 slots: the base replica alone, over the 140 s horizon
    assert row[1:4] == ["15", "140.0", "0.50"]
    with pytest.raises(SystemExit):
        main([str(path), "--goal", "standard=high"])
    assert "want CLASS=SHARE" in capsys.readouterr().err
