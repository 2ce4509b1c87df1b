"""Summaries, medians of repeats, Markdown and PNG rendering on synthetic runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleetgate_tools.bench import report
from fleetgate_tools.bench.stats import RequestResult
from fleetgate_tools.bench.summary import (
    EngineWindow,
    RunRecord,
    aggregate,
    hit_rate,
    median,
    summarise_run,
)


def _res(cls: str, ttft: float | None, status: int = 200, tokens: int = 10) -> RequestResult:
    r = RequestResult("s", 0, cls, 0.0, status=status, ttft=ttft, output_tokens=tokens)
    r.itl = [0.01]
    return r


def _eng(hit: float, query: float, gen: float) -> EngineWindow:
    return EngineWindow("vllm", "http://127.0.0.1:1", query, hit, gen, 100.0, 0.0)


def _record(contender: str, ttfts: list[float], repeat: int = 0, **kw: object) -> RunRecord:
    rec = RunRecord(
        workload=str(kw.get("workload", "shared-prefix")),
        contender=contender,
        repeat=repeat,
        load_factor=1.0,
        duration_s=10.0,
        time_scale=4.0,
        engines=[_eng(300, 1000, 100), _eng(100, 1000, 300)],
        results=[_res("standard", t) for t in ttfts],
        router_cpu_s=1.5,
    )
    return rec


def test_summarise_run_figures() -> None:
    rec = _record("fleetgate", [0.1, 0.2, 0.3, 2.0])
    rec.results.append(_res("standard", None, status=503))
    s = summarise_run(rec, lambda cls: 1.0)
    assert (s.requests, s.errors) == (5, 1)
    assert s.ttft_p50 == 0.2 and s.ttft_p99 == 2.0
    assert s.goodput == pytest.approx(3 / 10.0)
    assert s.attainment == pytest.approx(3 / 5)
    assert s.hit_rate == pytest.approx(400 / 2000)
    assert s.imbalance == pytest.approx(300 / 200)
    assert s.output_tokens_per_s == pytest.approx(40 / 10.0)
    assert s.router_cpu_s == 1.5


def test_hit_rate_unknown_when_no_engine_reports_queries() -> None:
    assert hit_rate([EngineWindow("trtllm", "u", None, None, 5.0, None, None)]) is None
    assert hit_rate([_eng(0, 0, 1)]) is None


def test_aggregate_takes_median_and_spread_and_keeps_failures_apart() -> None:
    runs = [
        summarise_run(_record("fleetgate", [t], repeat=i), lambda c: 1.0)
        for i, t in enumerate([0.1, 0.5, 0.3])
    ]
    failed = _record("vllm-router-cache_aware", [])
    failed.error = "ProcessError: vllm-router exited with code 1"
    runs.append(summarise_run(failed, lambda c: 1.0))
    aggs = {a.contender: a for a in aggregate(runs)}
    fg = aggs["fleetgate"]
    assert fg.repeats == 3 and fg.failed == 0
    assert fg.metrics["ttft_p90"] == (0.3, 0.1, 0.5)
    peer = aggs["vllm-router-cache_aware"]
    assert peer.failed == 1 and peer.errors == ("ProcessError: vllm-router exited with code 1",)
    assert report.cell(fg, "ttft_p90", "{:.3f}") == "0.300 (0.100-0.500)"
    md = report.render_markdown(list(aggs.values()), title="t", command="fleetgate bench run x")
    assert "| vllm-router-cache_aware | did not run: ProcessError" in md
    assert "fleetgate bench run x" in md


def test_goal_verdicts_say_met_and_missed() -> None:
    fast = [summarise_run(_record("fleetgate", [0.1, 0.2]), lambda c: 1.0)]
    slow = [summarise_run(_record("vllm-router-cache_aware", [1.0, 1.0]), lambda c: 1.0)]
    lines = report.goal_lines("shared-prefix", aggregate(fast + slow))
    text = "\n".join(lines)
    assert "TTFT p90 <= 0.7x best peer (vllm-router-cache_aware 1.000 s)" in text
    assert "0.20x -> **met**" in text
    # equal hit rates meet ">=", imbalance 1.5 misses 1.3
    assert "hit rate >= best peer" in text and "-> **met**" in text
    assert "imbalance <= 1.3: fleetgate 1.50 -> **missed**" in text
    reverse = report.goal_lines(
        "shared-prefix",
        aggregate(
            [summarise_run(_record("fleetgate", [1.0]), lambda c: 1.0)]
            + [summarise_run(_record("sglang-router-cache_aware", [0.1]), lambda c: 1.0)]
        ),
    )
    assert any("10.00x -> **missed**" in line for line in reverse)
    no_peer = report.goal_lines("shared-prefix", aggregate(fast))
    assert no_peer == ["- goals not checked: no peer router ran"]


def test_priority_tables_and_goal() -> None:
    rec = _record("fleetgate", [], workload="priority-storm")
    rec.results = [_res("critical", 0.1), _res("critical", 0.9), _res("batch", 5.0)]
    rec.extra = {"mismatches": 0, "twin_compared": 3, "priority_header": "integer levels"}
    peer = _record("vllm-router-round_robin", [], workload="priority-storm")
    peer.results = [_res("critical", 0.9), _res("batch", 1.0)]
    objective = {"critical": 0.5, "batch": 10.0}.__getitem__
    aggs = aggregate([summarise_run(rec, objective), summarise_run(peer, objective)])
    md = report.render_markdown(aggs, title="t", command="c")
    assert "| fleetgate | critical | 2 | 0 | 0.100 | 0.900 | 50.0% |" in md
    assert "| contender | mismatches | twin_compared |" in md
    assert "critical TTFT objective met for >= 99%: fleetgate 50.0%" in md
    assert "best peer vllm-router-round_robin 0.0%" in md
    assert median(aggs[0], "critical.ttft_objective_attainment") == 0.5


@pytest.mark.parametrize(("batch_e2e", "verdict"), [(1.2, "**met**"), (4.0, "**missed**")])
def test_batch_goodput_goal_compares_completed_tokens_per_second(
    batch_e2e: float, verdict: str
) -> None:
    def run(contender: str, e2e: float) -> RunRecord:
        rec = _record(contender, [], workload="priority-storm")
        rec.results = [_res("critical", 0.1), _res("batch", 1.0), _res("batch", 1.0)]
        for r, sent in zip(rec.results[1:], (0.0, 1.0), strict=True):
            r.sent_at, r.e2e = sent, e2e
        return rec

    objective = {"critical": 0.5, "batch": 10.0}.__getitem__
    runs = [run("fleetgate", batch_e2e), run("fleetgate-no-preemption", 1.0)]
    runs.append(run("vllm-router-round_robin", 1.0))
    md = report.render_markdown(
        aggregate([summarise_run(r, objective) for r in runs]), title="t", command="c"
    )
    # no preemption: 20 tokens in 2 s; fleetgate: 20 tokens in 1 + e2e seconds
    mine = 20 / (1.0 + batch_e2e)
    assert (
        f"batch goodput >= 80% of the no-preemption run: {mine:.0f} vs 10 completed batch "
        f"tokens/s = {mine / 10:.0%} -> {verdict}"
    ) in md


def test_write_plots_makes_one_png_per_workload(tmp_path: Path) -> None:
    runs = [
        summarise_run(_record("fleetgate", [0.1, 0.2]), lambda c: 1.0),
        summarise_run(_record("vllm-router-round_robin", [0.3]), lambda c: 1.0),
        summarise_run(_record("fleetgate", [0.1], workload="agentic"), lambda c: 1.0),
    ]
    paths = report.write_plots(aggregate(runs), tmp_path)
    assert sorted(p.name for p in paths) == ["agentic.png", "shared-prefix.png"]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert p.stat().st_size > 10_000


def test_headline_keeps_fleetgate_and_peers_only() -> None:
    runs = [
        summarise_run(_record(name, [0.2]), lambda c: 1.0)
        for name in ("fleetgate", "fleetgate-random", "sglang-router-cache_aware")
    ]
    lines = report.headline_table(aggregate(runs))
    rows = [line.split(" | ")[1] for line in lines[2:]]
    assert rows == ["**fleetgate**", "sglang-router-cache_aware"]
    assert "| shared-prefix | **fleetgate** | 0.200 | 0.200 | 0.200 | 20.0% | 1.50 |" in lines[2]
