"""Preemption: trigger conditions and victim choice."""

from __future__ import annotations

from typing import Any

import pytest

from fleetgate.router.priority.config import PriorityConfig
from fleetgate.router.priority.preemption import InFlight, Waiting, choose_victim

CFG = PriorityConfig()
LEVEL = {c.name: c.level for c in CFG.classes}
# critical: ttft 0.5 s, fraction 0.25 -> may preempt after 0.125 s


def _run(rid: str, cls: str = "batch", **kw: Any) -> InFlight:
    base: dict[str, Any] = {
        "request_id": rid,
        "endpoint": "e1",
        "class_name": cls,
        "level": LEVEL[cls],
        "prompt_tokens": 100,
        "generated_tokens": 10,
        "preemptions": 0,
        "started_at": 0.0,
    }
    base.update(kw)
    return InFlight(**base)


CRIT_WAITING = Waiting(request_id="w", class_name="critical", enqueued_at=0.0)


@pytest.mark.parametrize(
    ("in_flight", "victim"),
    [
        pytest.param(
            [_run("small", prompt_tokens=10, generated_tokens=0), _run("big", prompt_tokens=300)],
            "big",
            id="most-kv-per-lost-work",  # 10/1 = 10 vs 310/11 = 28.2
        ),
        pytest.param(
            [_run("fresh", generated_tokens=0), _run("old", generated_tokens=500)],
            "fresh",
            id="least-generated",
        ),
        pytest.param(
            [_run("std", cls="standard", generated_tokens=0), _run("b", generated_tokens=50)],
            "std",
            id="score-beats-class",
        ),
        pytest.param([_run("a", started_at=1.0), _run("b", started_at=2.0)], "b", id="tie-newest"),
        pytest.param([_run("std", cls="standard"), _run("b")], "b", id="tie-lower-level-first"),
        pytest.param(
            [_run("x", preemptions=3), _run("y", prompt_tokens=1, generated_tokens=5)],
            "y",
            id="never-one-preempted-max-times",
        ),
        pytest.param(
            [_run("x", resumable=False), _run("y", prompt_tokens=1, generated_tokens=5)],
            "y",
            id="skip-unresumable",
        ),
        pytest.param(
            [_run("shed", cls="sheddable", preemptions=2), _run("b", preemptions=2)],
            "b",
            id="per-class-limits",
        ),
    ],
)
def test_victim_choice(in_flight: list[InFlight], victim: str) -> None:
    d = choose_victim(CFG, CRIT_WAITING, in_flight, 1.0, pool_saturated=True)
    assert d.preempt and d.victim is not None
    assert d.victim.request_id == victim
    assert victim in d.reason and "score" in d.reason


def test_tie_at_equal_score_goes_to_newest_then_id() -> None:
    runs = [_run("small", prompt_tokens=10, generated_tokens=0), _run("big")]
    assert runs[0].score == runs[1].score == 10.0
    d = choose_victim(CFG, CRIT_WAITING, runs, 1.0, pool_saturated=True)
    assert d.victim is not None and d.victim.request_id == "big"  # equal start: id order


@pytest.mark.parametrize(
    ("config", "waiting", "in_flight", "now", "saturated", "eligible", "why"),
    [
        pytest.param(
            PriorityConfig(preemption_enabled=False),
            CRIT_WAITING,
            [_run("b")],
            1.0,
            True,
            None,
            "disabled",
            id="disabled",
        ),
        pytest.param(
            CFG,
            Waiting("w", "batch", 0.0),
            [_run("s", cls="sheddable")],
            100.0,
            True,
            None,
            "never preempts",
            id="class-without-fraction",
        ),
        pytest.param(
            CFG,
            CRIT_WAITING,
            [_run("b")],
            0.1,
            True,
            None,
            "threshold",
            id="not-overdue-yet",
        ),
        pytest.param(
            CFG,
            CRIT_WAITING,
            [_run("b")],
            1.0,
            False,
            None,
            "capacity is free",
            id="not-full",
        ),
        pytest.param(
            CFG,
            Waiting("w", "critical", 0.0, parked=True),
            [_run("b")],
            9.0,
            True,
            None,
            "parked",
            id="parked-never-preempts",
        ),
        pytest.param(
            CFG,
            Waiting("w", "standard", 0.0),
            [_run("s", cls="standard"), _run("c", cls="critical")],
            5.0,
            True,
            None,
            "no in-flight",
            id="only-equal-or-higher",
        ),
        pytest.param(
            CFG,
            CRIT_WAITING,
            [_run("b", preemptions=3)],
            1.0,
            True,
            None,
            "no in-flight",
            id="all-at-limit",
        ),
        pytest.param(
            CFG,
            CRIT_WAITING,
            [_run("b", endpoint="e9")],
            1.0,
            True,
            {"e1"},
            "no in-flight",
            id="victim-on-ineligible-endpoint",
        ),
        pytest.param(
            CFG,
            CRIT_WAITING,
            [
                InFlight(
                    request_id="gone",
                    endpoint="e1",
                    class_name="removed",
                    level=-9,
                    prompt_tokens=1,
                    generated_tokens=0,
                    preemptions=0,
                    started_at=0.0,
                )
            ],
            1.0,
            True,
            None,
            "no in-flight",
            id="class-removed-by-reload",
        ),
    ],
)
def test_no_preemption(
    config: PriorityConfig,
    waiting: Waiting,
    in_flight: list[InFlight],
    now: float,
    saturated: bool,
    eligible: set[str] | None,
    why: str,
) -> None:
    d = choose_victim(
        config, waiting, in_flight, now, pool_saturated=saturated, eligible_endpoints=eligible
    )
    assert not d.preempt and d.victim is None
    assert why in d.reason


def test_threshold_is_fraction_of_objective() -> None:
    runs = [_run("b")]
    assert not choose_victim(CFG, CRIT_WAITING, runs, 0.124, pool_saturated=True).preempt
    assert choose_victim(CFG, CRIT_WAITING, runs, 0.125, pool_saturated=True).preempt
    std = Waiting("w", "standard", 10.0)  # ttft 2 s x 0.5 = 1 s
    assert not choose_victim(CFG, std, runs, 10.99, pool_saturated=True).preempt
    assert choose_victim(CFG, std, runs, 11.0, pool_saturated=True).preempt


def test_needed_tokens_prefers_a_victim_that_frees_enough() -> None:
    runs = [
        _run("tiny", prompt_tokens=20, generated_tokens=0),  # score 20, frees 20
        _run("large", prompt_tokens=600, generated_tokens=99),  # score 6.99, frees 699
    ]
    w = Waiting("w", "critical", 0.0, needed_tokens=500)
    d = choose_victim(CFG, w, runs, 1.0, pool_saturated=True)
    assert d.victim is not None and d.victim.request_id == "large"
    w = Waiting("w", "critical", 0.0, needed_tokens=5000)  # nobody frees enough: best score
    d = choose_victim(CFG, w, runs, 1.0, pool_saturated=True)
    assert d.victim is not None and d.victim.request_id == "tiny"
