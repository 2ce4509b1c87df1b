"""The router counters a benchmark reads: preemptions, resumes, wasted work, decisions."""

from __future__ import annotations

from typing import Any

import httpx

from fleetgate_tools.bench.runner import decision_counts, prediction_error_medians, router_counters

EXPOSITION = """\
# HELP fleetgate_preemptions_total In-flight requests cancelled to make room.
# TYPE fleetgate_preemptions_total counter
fleetgate_preemptions_total{class="batch",model="m"} 3.0
fleetgate_preemptions_total{class="standard",model="m"} 1.0
# TYPE fleetgate_resumes_total counter
fleetgate_resumes_total{cause="preempted",class="batch",model="m"} 4.0
# TYPE fleetgate_resume_refed_tokens_total counter
fleetgate_resume_refed_tokens_total{class="batch",model="m"} 250.0
fleetgate_resume_refed_tokens_total{class="standard",model="m"} 50.0
fleetgate_resume_refed_tokens_created{class="batch",model="m"} 1.7e9
"""


async def _counters(text: str) -> dict[str, float]:
    transport = httpx.MockTransport(lambda request: httpx.Response(200, text=text))
    async with httpx.AsyncClient(transport=transport) as client:
        return await router_counters(client, "http://127.0.0.1:1")


async def test_sums_every_label_set_of_each_counter() -> None:
    got = await _counters(EXPOSITION)
    assert got == {"preemptions": 4.0, "resumes": 4.0, "resume_refed_tokens": 300.0}


async def test_declared_counter_without_samples_is_zero_and_absent_one_is_missing() -> None:
    text = "# TYPE fleetgate_preemptions_total counter\n"
    assert await _counters(text) == {"preemptions": 0.0}
    assert await _counters("# a peer router's metrics\nsome_other_total 5\n") == {}


def test_preempted_ids_come_from_the_routers_preemption_log_lines() -> None:
    from fleetgate_tools.bench.runner import preempted_ids

    log = (
        "2026-11-29 18:00:01,2 INFO fleetgate.router.priority: preempt batch-3/0 for crit-1/0: "
        "waited 1.000s >= 1.000s; preempt batch-3/0 (batch, frees 400 KV tokens)\n"
        "2026-11-29 18:00:01,3 INFO fleetgate.router.proxy: /v1/chat/completions model=m "
        "status=200 endpoint=vllm-0 dur_ms=3.1\n"
        "2026-11-29 18:00:02,0 INFO fleetgate.router.priority: preempt batch-9/0 for crit-2/0: x\n"
    )
    assert preempted_ids(log) == {"batch-3/0", "batch-9/0"}
    assert preempted_ids("") == set()


def test_fleetgate_contender_logs_at_info_so_preemptions_are_traceable() -> None:
    from pathlib import Path

    from fleetgate_tools.bench import contenders as cmod

    argv = cmod.command(
        cmod.CONTENDERS["fleetgate"],
        port=1,
        metrics_port=2,
        backends=[("vllm", "http://127.0.0.1:3")],
        config_path=Path("/tmp/x.yaml"),
    )
    assert argv[argv.index("--log-level") + 1] == "info"


async def test_twin_replay_covers_every_preempted_request_and_counts_its_mismatch() -> None:
    """Twins replayed straight against an emulated engine (deterministic text)."""
    from fleetgate.sim import EngineSpec, run_fleet
    from fleetgate_tools.bench import loadgen, scenarios
    from fleetgate_tools.bench.runner import TWIN_SAMPLE, twin_mismatches

    sc = scenarios.make("priority-storm", engines=1, duration_s=3.0, time_scale=1.0, seed=4)
    sessions = [s for s in sc.sessions() if len(s.turns) == 1]
    assert len(sessions) > TWIN_SAMPLE + 3
    async with run_fleet([EngineSpec(kind="vllm")], model=scenarios.MODEL) as fleet:
        url = fleet.engines[0].url
        # what an unloaded engine answers: the "run" whose outputs are checked
        first = await loadgen.run_sessions(
            url, scenarios.MODEL, [s for s in sessions], deadline_s=120, keep_text=True
        )
        assert all(r.ok for r in first), [r.error for r in first if not r.ok][:3]
        # three late sessions were "preempted"; one of them came back with other text
        late = sorted(first, key=lambda r: r.sent_at)[-3:]
        late[0].text = (late[0].text or "") + " tampered"
        preempted = {loadgen.request_id(r.session_id, 0) for r in late}
        got = await twin_mismatches(url, sc, first, 120.0, None, preempted)
    assert got["resumed_compared"] == 3
    assert got["resumed_mismatches"] == 1
    assert got["mismatches"] == 1
    assert got["twin_compared"] == 3 + TWIN_SAMPLE


def test_decision_counts_sum_each_reason_over_models_and_deciding_plugins() -> None:
    text = """\
# TYPE fleetgate_decisions_total counter
fleetgate_decisions_total{decided_by="scorer:prefix-affinity",model="m",reason="affinity-hit"} 7.0
fleetgate_decisions_total{decided_by="picker:tie-break",model="m",reason="affinity-hit"} 1.0
fleetgate_decisions_total{decided_by="scorer:load",model="m",reason="spill"} 2.0
fleetgate_decisions_total{decided_by="scorer:prefix-affinity",model="m",reason="cold"} 3.0
fleetgate_decisions_created{decided_by="scorer:load",model="m",reason="spill"} 1.7e9
"""
    assert decision_counts(text) == {
        "decisions_affinity_hit": 8.0,
        "decisions_spill": 2.0,
        "decisions_cold": 3.0,
    }
    assert decision_counts("some_other_total 5\n") == {}


def test_decision_counts_also_by_the_cache_view_that_decided() -> None:
    text = """\
fleetgate_decisions_total{model="m",reason="affinity-hit",source="events"} 5.0
fleetgate_decisions_total{model="m",reason="affinity-hit",source="approximate"} 2.0
fleetgate_decisions_total{decided_by="scorer:load",model="m",reason="cold",source="events"} 1.0
"""
    assert decision_counts(text) == {
        "decisions_affinity_hit": 7.0,
        "decisions_cold": 1.0,
        "decisions_by_events": 6.0,
        "decisions_by_approximate": 2.0,
    }


def test_prediction_error_median_per_view_from_the_histogram_over_the_window() -> None:
    def exposition(events: list[int], approx: list[int]) -> str:
        edges = ("0.0", "0.01", "0.02", "0.05", "0.1", "+Inf")
        lines = []
        for source, counts in (("events", events), ("approximate", approx)):
            for le, n in zip(edges, counts, strict=True):
                lines.append(
                    "fleetgate_cache_prediction_error_ratio_bucket"
                    f'{{le="{le}",source="{source}"}} {float(n)}'
                )
        return "\n".join(lines) + "\n"

    before = decision_counts(exposition([2, 2, 2, 2, 2, 2], [0, 0, 0, 0, 0, 0]))
    after = decision_counts(exposition([32, 62, 82, 92, 102, 102], [0, 0, 10, 10, 10, 40]))
    window: dict[str, Any] = {k: n - before.get(k, 0.0) for k, n in after.items()}
    got = prediction_error_medians(window)
    # events: 100 in the window, 30 exact (le 0.0), 60 by 0.01 -> the 50th falls in
    # (0.0, 0.01]: 0.0 + 0.01 * (50 - 30) / (60 - 30)
    assert got["prediction_error_p50_events"] == round(0.01 * 20 / 30, 4)
    # approximate: 40, only 10 by 0.1 -> the median is past the last finite edge
    assert got["prediction_error_p50_approximate"] == 0.1
    assert not [k for k in window if "bucket" in k]  # popped: no raw buckets in reports
    assert prediction_error_medians({}) == {}


def test_decision_counts_also_count_how_queued_requests_left_the_queue() -> None:
    text = """\
fleetgate_queue_dispatches_total{class="standard",how="ahead",model="m"} 4.0
fleetgate_queue_dispatches_total{class="critical",how="ahead",model="m"} 1.0
fleetgate_queue_dispatches_total{class="standard",how="head-elsewhere",model="m"} 2.0
fleetgate_queue_dispatches_created{class="standard",how="ahead",model="m"} 1.7e9
"""
    assert decision_counts(text) == {
        "queue_dispatch_ahead": 5.0,
        "queue_dispatch_head_elsewhere": 2.0,
    }
