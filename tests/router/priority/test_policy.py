"""One drain step: shed, dispatch without overfilling, preempt once per waiter."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from fleetgate.router.priority.class_queue import QueueItem
from fleetgate.router.priority.config import PriorityConfig
from fleetgate.router.priority.policy import Dispatch, Preempt, drain
from fleetgate.router.priority.preemption import InFlight
from fleetgate.router.priority.queue import AdmissionQueue, Shed
from fleetgate.router.priority.saturation import SaturationThresholds, SaturationView

CFG = PriorityConfig()
T = SaturationThresholds()


def _views(*in_flight: int, max_running: int = 2) -> list[SaturationView]:
    return [
        SaturationView(f"e{i}", 0.1, 0, n, n, 0.0, max_running) for i, n in enumerate(in_flight)
    ]


def _first(item: QueueItem[str], available: tuple[str, ...]) -> str:
    return available[0]


def _run(
    q: AdmissionQueue[str],
    now: float,
    views: Sequence[SaturationView],
    in_flight: Sequence[InFlight] = (),
    preempting_for: tuple[str, ...] = (),
) -> list[object]:
    return list(
        drain(
            q,
            now,
            config=CFG,
            thresholds=T,
            views_for=lambda item: views,
            pick=_first,
            in_flight=in_flight,
            preempting_for=preempting_for,
        )
    )


def _offer(q: AdmissionQueue[str], rid: str, cls: str, now: float) -> None:
    assert isinstance(q.offer(rid, CFG.get(cls), "t", now, rid), QueueItem)


def test_dispatch_fills_free_slots_in_order_without_overfilling() -> None:
    q: AdmissionQueue[str] = AdmissionQueue(CFG)
    for i in range(5):
        _offer(q, f"b{i}", "batch", 0.0)
    _offer(q, "c0", "critical", 0.0)
    actions = _run(q, 0.0, _views(1, 0))  # 1 + 2 free slots
    assert [(a.item.request_id, a.endpoint) for a in actions if isinstance(a, Dispatch)] == [
        ("c0", "e0"),
        ("b0", "e1"),
        ("b1", "e1"),
    ]
    assert len(actions) == 3 and len(q) == 3


def test_expired_are_shed_first() -> None:
    q: AdmissionQueue[str] = AdmissionQueue(CFG)
    _offer(q, "x", "sheddable", 0.0)
    _offer(q, "b", "batch", 0.0)
    actions = _run(q, 11.0, _views(0, 2))
    assert isinstance(actions[0], Shed) and actions[0].status == 429
    assert isinstance(actions[1], Dispatch) and actions[1].item.request_id == "b"


def _busy(rid: str, cls: str, gen: int, endpoint: str = "e0", pre: int = 0) -> InFlight:
    return InFlight(rid, endpoint, cls, CFG.get(cls).level, 100, gen, pre, 0.0)


def test_preempts_one_distinct_victim_per_overdue_waiter() -> None:
    q: AdmissionQueue[str] = AdmissionQueue(CFG)
    _offer(q, "c0", "critical", 0.0)
    _offer(q, "c1", "critical", 0.0)
    _offer(q, "c2", "critical", 0.1)  # not overdue at 0.2 (threshold 0.125 s)
    running = [_busy("b0", "batch", 5), _busy("b1", "batch", 50, "e1"), _busy("s0", "standard", 1)]
    actions = _run(q, 0.2, _views(2, 2), running)
    preempts = [a for a in actions if isinstance(a, Preempt)]
    assert [(p.for_item.request_id, p.victim.request_id) for p in preempts] == [
        ("c0", "s0"),  # score 101/2 = 50.5, the best victim
        ("c1", "b0"),  # 105/6 = 17.5 > 150/51
    ]
    assert all(not isinstance(a, Dispatch) for a in actions)


def test_no_second_preemption_for_a_waiter_already_served() -> None:
    q: AdmissionQueue[str] = AdmissionQueue(CFG)
    _offer(q, "c0", "critical", 0.0)
    running = [_busy("b0", "batch", 5)]
    assert _run(q, 1.0, _views(2, 2), running, preempting_for=("c0",)) == []


def test_parked_and_non_preempting_classes_never_preempt() -> None:
    q: AdmissionQueue[str] = AdmissionQueue(CFG)
    q.park("s-parked", CFG.get("standard"), "t", arrival=0.0, now=0.0, payload="p")
    _offer(q, "b", "batch", 0.0)
    running = [_busy("x", "sheddable", 1)]
    assert _run(q, 20.0, _views(2, 2), running) == []  # within both queue limits


def test_bad_pick_is_an_error() -> None:
    q: AdmissionQueue[str] = AdmissionQueue(CFG)
    _offer(q, "b", "batch", 0.0)
    with pytest.raises(ValueError, match="pick"):
        drain(
            q,
            0.0,
            config=CFG,
            thresholds=T,
            views_for=lambda item: _views(0),
            pick=lambda item, available: "elsewhere",
            in_flight=(),
        )
