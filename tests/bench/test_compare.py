"""Contender vs baseline comparisons with intervals (compare.py, report.py), no processes."""

from __future__ import annotations

import random

from fleetgate_tools.bench import compare, report
from fleetgate_tools.bench.stats import RequestResult
from fleetgate_tools.bench.summary import EngineWindow, RunRecord


def _record(
    contender: str, repeat: int, mean_ttft: float, hit: float, seed: int, warm_ttft: float = 50.0
) -> RunRecord:
    rng = random.Random(seed)
    results = []
    for i in range(300):
        sent = i / 30.0  # 10 modelled seconds
        r = RequestResult(f"s{i}", 0, "standard", sent, status=200)
        # the warm-up (first second) is slow: it must not count
        r.ttft = warm_ttft if sent < 1.0 else rng.expovariate(1 / mean_ttft)
        r.prompt_tokens = 100
        r.cached_tokens = sum(rng.random() < hit for _ in range(100))
        results.append(r)
    engine = EngineWindow("vllm", "http://127.0.0.1:1", 1000.0, 1000.0 * hit, 10.0, 1000.0, 0.0)
    return RunRecord(
        "shared-prefix", contender, repeat, 1.0, 10.0, 4.0, [engine], results, 1.0, warmup_s=1.0
    )


def test_fleetgate_against_the_best_peer_with_intervals_over_seeds() -> None:
    records = []
    for rep in range(3):
        records += [
            _record("fleetgate", rep, 0.5, 0.7, 10 + rep),
            _record("vllm-router-cache_aware", rep, 1.0, 0.5, 20 + rep),
            _record("sglang-router-cache_aware", rep, 2.0, 0.5, 30 + rep),
        ]
    out = compare.compare(records, random.Random(1), replicates=200)
    by_name = {c.contender: c for c in out}
    # the best peer (lowest median p90) is the baseline; it is not compared with itself
    assert set(by_name) == {"fleetgate", "sglang-router-cache_aware"}
    fg = by_name["fleetgate"]
    assert fg.baseline == "vllm-router-cache_aware" and fg.seeds == 3
    p90 = fg.figure("ttft_p90_ratio")
    assert p90 is not None and p90.interval is not None
    assert p90.interval.low < 0.5 < p90.interval.high and p90.verdict == "win"
    assert len(p90.per_seed) == 3 and min(p90.per_seed) <= p90.interval.estimate <= max(
        p90.per_seed
    )
    hit = fg.figure("hit_rate_diff")
    assert hit is not None and hit.interval is not None and hit.verdict == "win"
    assert 0.15 < hit.interval.low and hit.interval.high < 0.25
    slow = by_name["sglang-router-cache_aware"].figure("ttft_p90_ratio")
    assert slow is not None and slow.verdict == "loss"
    lines = report.comparison_table(out)
    row = next(line for line in lines if "| fleetgate |" in line)
    assert "vllm-router-cache_aware" in row and "**win**" in row and " seeds " in row
    assert compare.as_dict(fg)["figures"]["ttft_p90_ratio"]["verdict"] == "win"  # type: ignore[index]


def test_warm_up_requests_are_left_out() -> None:
    """Both sides equal after the warm-up, very different during it: no clear difference."""
    a = _record("fleetgate", 0, 1.0, 0.5, 1, warm_ttft=0.001)
    b = _record("fleetgate-approx", 0, 1.0, 0.5, 1, warm_ttft=100.0)
    (c,) = compare.compare([b, a], random.Random(2), replicates=100)
    assert c.baseline == "fleetgate-approx"  # no peer: the first contender
    for name in ("ttft_p50_ratio", "ttft_p90_ratio", "hit_rate_diff"):
        f = c.figure(name)
        assert f is not None and f.verdict == "no clear difference", name


def test_failed_runs_and_missing_usage_are_not_compared() -> None:
    a = _record("fleetgate", 0, 1.0, 0.5, 1)
    b = _record("vllm-router-cache_aware", 0, 1.0, 0.5, 2)
    for r in b.results:
        r.cached_tokens = None
    broken = RunRecord(
        "shared-prefix", "sglang-router-cache_aware", 0, 1.0, 10.0, 4.0, [], [], None, error="x"
    )
    (c,) = compare.compare([a, b, broken], random.Random(3), replicates=50)
    assert c.contender == "fleetgate"
    hit = c.figure("hit_rate_diff")
    assert hit is not None and hit.interval is None and hit.verdict == "n/a"
    assert report.figure_cell(hit, True) == "n/a"


def test_goal_lines_carry_the_interval_of_their_ratio() -> None:
    from fleetgate_tools.bench.summary import aggregate, summarise_run

    records = [
        _record("fleetgate", 0, 0.5, 0.7, 1),
        _record("vllm-router-cache_aware", 0, 1.0, 0.5, 2),
    ]
    aggs = aggregate([summarise_run(r, lambda _c: 1.0) for r in records])
    comparisons = compare.compare(records, random.Random(4), replicates=200)
    lines = report.goal_lines("shared-prefix", aggs, comparisons)
    p90 = next(line for line in lines if "TTFT p90" in line)
    assert "95% CI [" in p90 and ", win)" in p90
    hit = next(line for line in lines if "hit rate" in line)
    assert "usage hit rate difference (95% CI [+" in hit and "points, win)" in hit
    # without comparisons: the old lines, no interval
    assert all("CI" not in line for line in report.goal_lines("shared-prefix", aggs))


def test_two_replicas_are_compared_with_one_replica_of_the_same_router() -> None:
    records = [
        _record("fleetgate", 0, 0.5, 0.7, 1),
        _record("fleetgate@2r", 0, 0.5, 0.6, 2),
        _record("vllm-router-cache_aware", 0, 1.0, 0.5, 3),
        _record("vllm-router-cache_aware@2r", 0, 1.0, 0.5, 4),
    ]
    out = compare.compare(records, random.Random(5), replicates=200)
    pairs = {(c.contender, c.baseline) for c in out}
    assert pairs == {
        ("fleetgate", "vllm-router-cache_aware"),
        ("fleetgate@2r", "fleetgate"),
        ("vllm-router-cache_aware@2r", "vllm-router-cache_aware"),
    }
    two = next(c for c in out if c.contender == "fleetgate@2r")
    hit = two.figure("hit_rate_diff")
    assert hit is not None and hit.interval is not None and hit.verdict == "loss"
    assert -0.15 < hit.interval.low < -0.1 < hit.interval.high < -0.05
    same = next(c for c in out if c.contender == "vllm-router-cache_aware@2r").figure(
        "hit_rate_diff"
    )
    assert same is not None and same.verdict == "no clear difference"


def test_a_run_with_few_sessions_has_no_intervals() -> None:
    a = _record("fleetgate", 0, 0.5, 0.7, 1)
    b = _record("vllm-router-cache_aware", 0, 1.0, 0.5, 2)
    for r in (a, b):
        r.results = r.results[:40]  # 30 in the warm-up, 10 steady
    (c,) = compare.compare([a, b], random.Random(6), replicates=50)
    assert all(f.interval is None and f.verdict == "n/a" for f in c.figures)


def test_summary_counts_warm_up_requests_and_their_errors_apart() -> None:
    from fleetgate_tools.bench.summary import summarise_run

    rec = _record("fleetgate", 0, 1.0, 0.5, 1)
    rec.results[0].status = 503  # sent at 0 s: in the warm-up
    rec.results[-1].status = 503  # sent late: steady
    s = summarise_run(rec, lambda _c: 1.0)
    assert s.warmup_requests == 30 and s.warmup_errors == 1
    assert s.requests == 270 and s.errors == 1


def test_tail_percentiles_need_enough_sessions_above_them() -> None:
    assert compare.min_sessions("ttft_p50_ratio") == 30
    assert compare.min_sessions("ttft_p90_ratio") == 50
    assert compare.min_sessions("ttft_p99_ratio") == 500
    assert compare.min_sessions("hit_rate_diff") == 30
    # 270 steady sessions: p50/p90 get intervals, p99 does not
    a = _record("fleetgate", 0, 0.5, 0.7, 1)
    b = _record("vllm-router-cache_aware", 0, 1.0, 0.5, 2)
    (c,) = compare.compare([a, b], random.Random(7), replicates=50)
    p99 = c.figure("ttft_p99_ratio")
    p90 = c.figure("ttft_p90_ratio")
    assert p99 is not None and p99.interval is None and p99.verdict == "n/a"
    assert p90 is not None and p90.interval is not None
    assert report.figure_cell(p99, False).endswith("(no interval)")
    assert report.figure_cell(p99, False).endswith("(no interval)")


def test_error_rate_difference_counts_what_the_ttft_ratios_leave_out() -> None:
    a = _record("fleetgate", 0, 1.0, 0.5, 1)
    b = _record("vllm-router-cache_aware", 0, 1.0, 0.5, 2)
    for r in a.results[100:200]:  # 100 of 270 steady requests fail
        r.status = 503
    (c,) = compare.compare([a, b], random.Random(8), replicates=200)
    err = c.figure("error_rate_diff")
    assert err is not None and err.interval is not None and err.verdict == "loss"
    assert err.interval.low < 100 / 270 < err.interval.high
    assert "**loss**" in report.figure_cell(err, True)


def test_a_peer_that_fails_its_requests_fast_is_not_the_baseline() -> None:
    """A peer whose requests fail at once has the lowest TTFT of the requests it did
    answer; the baseline is the fastest peer among those that served."""
    records = []
    for rep in range(2):
        refusing = _record("vllm-router-cache_aware", rep, 0.01, 0.0, 20 + rep)
        for r in refusing.results[40:]:
            r.status, r.ttft = 400, None  # 400 from the engine: the peer's extra fields
        records += [
            _record("fleetgate", rep, 0.5, 0.7, 10 + rep),
            refusing,
            _record("sglang-router-cache_aware", rep, 2.0, 0.5, 30 + rep),
        ]
    out = compare.compare(records, random.Random(1), replicates=100)
    assert {c.contender: c.baseline for c in out}["fleetgate"] == "sglang-router-cache_aware"
    # when every peer fails that much, the fastest is the baseline again
    only = [r for r in records if r.contender != "sglang-router-cache_aware"]
    out = compare.compare(only, random.Random(1), replicates=100)
    assert {c.contender: c.baseline for c in out}["fleetgate"] == "vllm-router-cache_aware"
