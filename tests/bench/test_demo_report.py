"""``fleetgate demo``'s report without running a fleet: the side-by-side table, the
plot's title, settings and labels, where the outputs go, the progress display."""

from __future__ import annotations

import argparse
import io
import random
from pathlib import Path

import pytest

from fleetgate_tools import demo
from fleetgate_tools.bench import scenarios
from fleetgate_tools.bench.stats import RequestResult
from fleetgate_tools.bench.summary import EngineWindow, RunRecord, summarise_run

PORTS = {
    "fleetgate": [41001, 41002, 41003, 41004, 41005],
    "base": [52001, 52002, 52003, 52004, 52005],
}


def scenario(duration: float = 30.0) -> scenarios.Scenario:
    return scenarios.make(
        demo.WORKLOAD, engines=demo.ENGINES, duration_s=duration, time_scale=8, seed=0
    )


def fake_run(name: str, crit_ttft: float, hit: float, preempt: bool) -> demo.Run:
    """A run record shaped like the harness's, with chosen latencies."""
    sc = scenario()
    rng = random.Random(name)
    kinds = sc.engine_kinds()
    engines = [
        EngineWindow(k, f"http://127.0.0.1:{p}", 1000.0, 1000.0 * hit, 5000.0 + 500 * i, 900.0, 0.0)
        for i, (k, p) in enumerate(zip(kinds, PORTS[name], strict=True))
    ]
    results = []
    for s in sc.sessions():
        for k, _turn in enumerate(s.turns):
            base = {"critical": crit_ttft, "standard": 0.3, "batch": 2.0}[s.priority_class or ""]
            port = PORTS[name][rng.randrange(5)]
            results.append(
                RequestResult(
                    s.session_id,
                    k,
                    s.priority_class or "standard",
                    s.start_s + k,
                    status=200,
                    ttft=base * rng.uniform(0.5, 1.5),
                    e2e=base + 1.0,
                    output_tokens=50,
                    prompt_tokens=400,
                    cached_tokens=int(400 * hit),
                    endpoint=f"127.0.0.1:{port}",
                )
            )
    extra: dict[str, object] = {"priority_header": "class names" if preempt else "not sent"}
    if preempt:
        extra |= {
            "preemptions": 12.0,
            "resumes": 12.0,
            "twin_compared": 20,
            "mismatches": 0,
            "resumed_compared": 12,
            "resumed_mismatches": 0,
        }
    record = RunRecord(
        "flood", name, 0, 1.0, sc.duration_s, 8.0, engines, results, 3.0, extra=dict(extra)
    )
    label = "fleetgate" if name == "fleetgate" else "round robin"
    return label, record, summarise_run(record, sc.objective)


def runs() -> list[demo.Run]:
    return [fake_run("fleetgate", 0.2, 0.45, True), fake_run("base", 2.0, 0.25, False)]


def test_flood_is_sized_from_the_fleet_capacity_at_any_duration() -> None:
    for wall in (5.0, 30.0, 120.0):
        sc = scenario(wall)
        assert sc.slots() == 40
        sessions = sc.sessions()
        batch = [s for s in sessions if s.priority_class == "batch"]
        early = [s for s in batch if s.start_s <= 0.05 * sc.duration_s]
        # twice the fleet's slots arrive at once, however short the run
        assert len(early) >= 2 * sc.slots()
        crit = [s for s in sessions if s.priority_class == "critical"]
        assert len(crit) >= 16
        assert all(s.start_s < sc.duration_s for s in sessions)
    assert scenario(30).objective("critical") == 0.5
    assert scenario(30).objective("standard") == 2.0


def test_objectives_are_the_routers_default_classes() -> None:
    from fleetgate.router.priority.config import DEFAULT_CLASSES

    sc = scenario()
    for cls in DEFAULT_CLASSES:
        if cls.name in demo.CLASSES:
            assert sc.objective(cls.name) == cls.ttft_objective_s


def test_summary_table_is_side_by_side_with_engine_names_not_ports() -> None:
    lines = demo.summary_table(runs(), scenario())
    head = lines[0]
    assert "fleetgate" in head and "round robin" in head
    crit = next(line for line in lines if line.startswith("critical: TTFT <= 0.5 s met"))
    cells = crit.split("met", 1)[1].split()
    assert cells[0] == "100%" and cells[2] == "0%"
    pre = next(line for line in lines if line.startswith("router preemptions"))
    assert "12, 12 resumed" in pre and "none (priority classes not sent)" in pre
    planned = sum(len(s.turns) for s in scenario().sessions() if s.priority_class == "standard")
    turns = next(line for line in lines if line.startswith(f"chat turns sent (of {planned})"))
    assert turns.split(")", 1)[1].split() == [str(planned)] * 2
    replay = next(line for line in lines if line.startswith("answers = unloaded replay"))
    assert "20 of 20 (12 of 12 resumed)" in replay
    loads = [line for line in lines if "generated tokens per engine" in line]
    assert len(loads) == 2
    for line in loads:
        assert "vLLM 1" in line and "TRT-LLM 2" in line and "vLLM 3" in line
        assert "@" not in line and "410" not in line and "520" not in line


def test_plot_has_title_settings_objectives_and_per_run_labels(tmp_path: Path) -> None:
    fig = demo.build_figure(runs(), scenario(), 30.0)
    texts = [t.get_text() for t in fig.findobj() if hasattr(t, "get_text")]
    joined = "\n".join(texts)
    assert "fleetgate demo: fleetgate vs round robin" in joined
    assert "round robin: a plain load balancer" in joined
    assert "router preemptions 12, 12 resumed" in joined
    assert "3 vLLM + 2 TensorRT-LLM" in joined and "40 slots" in joined
    assert "30 s of traffic = 3.75 modelled s" in joined
    assert "critical 0.5, standard 2, batch 60" in joined
    assert "objective 0.5 s" in joined and "traffic ends" in joined
    assert "round robin: batch requests sent, not finished" in joined
    assert "100%\n60 of 60" in joined, "critical: share and count on the bar"
    assert "critical\nTTFT <= 0.5 s" in joined
    # engines are named by kind and position, the same for both runs: no ports
    assert "TRT-LLM 1" in joined and "vLLM 3" in joined
    assert not any(str(p) in joined for ps in PORTS.values() for p in ps)
    titles = [ax.get_title() for ax in fig.axes if ax.get_title()]
    assert len(titles) == 4
    png = demo.plot(runs(), scenario(), 30.0, tmp_path / "d" / "x.png")
    assert png is not None and png.read_bytes()[:4] == b"\x89PNG"


def test_outputs_default_to_the_cache_never_the_checkout(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("FLEETGATE_CACHE", str(tmp_path / "cache"))
    assert demo.default_out() == tmp_path / "cache" / "demo"
    monkeypatch.delenv("FLEETGATE_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert demo.default_out() == tmp_path / "home" / ".cache" / "fleetgate" / "demo"
    parser = argparse.ArgumentParser()
    demo.build_parser(parser)
    args = parser.parse_args([])
    assert args.out is None and args.plot is None and args.baseline == "round-robin"


def test_progress_explains_the_time_past_the_traffic() -> None:
    out = io.StringIO()
    bar = demo.Progress("fleetgate", 10.0, out)
    t = bar.start
    assert "starting 5 emulated engines" in bar.line(t)
    bar.phase, bar.phase_at["sending"] = "sending", t + 2
    bar.sent, bar.done = 30, 20
    line = bar.line(t + 7)
    assert "5/10 s of traffic" in line and "10 in flight" in line
    line = bar.line(t + 15)
    assert "traffic sent; the fleet works through the backlog" in line and "+3 s" in line
    assert "/10 s" not in line, "no 13/10 s counter"
    bar.phase, bar.phase_at["checking"] = "checking", t + 16
    assert "checking answers" in bar.line(t + 18)
    assert bar.timings(t + 20) == "start-up 2 s, traffic 10 s, backlog 4 s, answer check 4 s"
