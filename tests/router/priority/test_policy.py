"""One drain step: shed, dispatch without overfilling, preempt once per waiter."""

from __future__ import annotations

from collections.abc import Callable, Sequence

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


def test_running_requests_are_listed_only_when_an_overdue_item_can_preempt() -> None:
    """``in_flight`` as a function of a level: called once, with the level of the most
    urgent overdue item, and the preemptions are those of the list form."""
    running = [_busy("b0", "batch", 5), _busy("b1", "batch", 50, "e1"), _busy("s0", "standard", 1)]
    asked: list[int] = []

    def lister(below: int) -> list[InFlight]:
        asked.append(below)
        return [r for r in running if r.level < below]

    def preempts(in_flight: object, now: float) -> list[tuple[str, str]]:
        q: AdmissionQueue[str] = AdmissionQueue(CFG)
        _offer(q, "c0", "critical", 0.0)
        _offer(q, "c1", "critical", 0.0)
        _offer(q, "b9", "batch", 0.0)
        got = drain(
            q,
            now,
            config=CFG,
            thresholds=T,
            views_for=lambda item: _views(2, 2),
            pick=_first,
            in_flight=in_flight,  # type: ignore[arg-type]
        )
        return [(a.for_item.request_id, a.victim.request_id) for a in got if isinstance(a, Preempt)]

    assert preempts(lister, 0.05) == [] and asked == []  # nobody overdue yet
    listed = preempts(lister, 0.2)
    assert asked == [CFG.get("critical").level]
    assert listed == preempts(running, 0.2) == [("c0", "s0"), ("c1", "b0")]


def test_the_lowest_class_never_asks_for_running_requests() -> None:
    """Nothing runs below the lowest level, so its overdue items cannot preempt."""
    lowest = min(CFG.classes, key=lambda c: c.level)
    cfg = PriorityConfig(
        classes=tuple(
            c.model_copy(update={"preempt_after_fraction": 0.1}) if c is lowest else c
            for c in CFG.classes
        )
    )
    q: AdmissionQueue[str] = AdmissionQueue(cfg)
    assert isinstance(q.offer("x", cfg.get(lowest.name), "t", 0.0, "x"), QueueItem)
    assert cfg.get(lowest.name).preempt_after_s is not None

    def lister(below: int) -> list[InFlight]:
        raise AssertionError(f"asked for running requests below {below}")

    got = drain(
        q,
        5.0,  # past its 1 s preemption threshold, within its 10 s queue time
        config=cfg,
        thresholds=T,
        views_for=lambda item: _views(2, 2),
        pick=_first,
        in_flight=lister,
    )
    assert got == []  # the pool is saturated: nothing dispatched, shed or preempted


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


# -- affinity dispatch (prefer=) ---------------------------------------------


def _affinity_run(
    q: AdmissionQueue[str],
    now: float,
    views: Sequence[SaturationView],
    holders: dict[str, str | None],
    config: PriorityConfig | None = None,
) -> list[tuple[str, str]]:
    asked: list[str] = []

    def prefer(item: QueueItem[str]) -> frozenset[str]:
        asked.append(item.request_id)
        want = holders.get(item.request_id)
        return frozenset() if want is None else frozenset({want})

    actions = drain(
        q,
        now,
        config=config or CFG,
        thresholds=T,
        views_for=lambda item: views,
        pick=_first,
        in_flight=(),
        prefer=prefer,
    )
    return [(a.item.request_id, a.endpoint) for a in actions if isinstance(a, Dispatch)]


def test_a_free_engine_goes_to_the_first_queued_request_that_holds_its_prefix_there() -> None:
    q: AdmissionQueue[str] = AdmissionQueue(CFG)
    for rid in ("a0", "a1", "b0", "a2"):
        _offer(q, rid, "standard", 0.0)
    # e0 is full, e1 has one free slot: the head a0 (and a1) wait for e0, b0 takes e1
    got = _affinity_run(q, 0.5, _views(2, 1), {"a0": "e0", "a1": "e0", "b0": "e1", "a2": "e0"})
    assert got == [("b0", "e1")]
    assert [i.request_id for i in q.ordered()] == ["a0", "a1", "a2"]
    # e0 frees a slot: the oldest request that prefers it goes first
    got = _affinity_run(q, 0.6, _views(1, 2), {"a0": "e0", "a1": "e0", "a2": "e0"})
    assert got == [("a0", "e0")]


def test_no_slot_idles_while_the_class_has_work() -> None:
    q: AdmissionQueue[str] = AdmissionQueue(CFG)
    for rid in ("a0", "a1"):
        _offer(q, rid, "standard", 0.0)
    # nobody prefers the free e1: the head takes it rather than leave it idle
    assert _affinity_run(q, 0.1, _views(2, 1), {"a0": "e0", "a1": "e0"}) == [("a0", "e1")]


def test_a_request_without_a_holder_takes_the_free_engine_before_the_waiting_head() -> None:
    q: AdmissionQueue[str] = AdmissionQueue(CFG)
    for rid in ("a0", "cold"):
        _offer(q, rid, "standard", 0.0)
    assert _affinity_run(q, 0.1, _views(2, 1), {"a0": "e0", "cold": None}) == [("cold", "e1")]


WAIT1 = PriorityConfig(affinity_wait_s=1.0)


def test_passed_over_for_affinity_wait_a_request_takes_any_free_engine() -> None:
    q: AdmissionQueue[str] = AdmissionQueue(WAIT1)
    for rid in ("a0", "b0", "b1", "b2"):
        _offer(q, rid, "standard", 5.0)
    holders: dict[str, str | None] = {"a0": "e0", "b0": "e1", "b1": "e1", "b2": "e1"}
    # queued 5 s already, but never passed over: it still waits for e0
    assert _affinity_run(q, 10.0, _views(2, 1), holders, WAIT1) == [("b0", "e1")]
    assert _affinity_run(q, 10.5, _views(2, 1), holders, WAIT1) == [("b1", "e1")]
    # passed over since 10.0: at 11.0 it takes the free e1
    assert _affinity_run(q, 11.0, _views(2, 1), holders, WAIT1) == [("a0", "e1")]


def test_by_default_a_passed_over_request_waits_ten_seconds_for_its_holder() -> None:
    """The default bound is long (10 s): in an overloaded fleet a holder's own backlog
    takes seconds to drain, and a 1 s bound sent a third of the queued questions to
    engines without their document (shared-prefix, 4 engines, load 1: hit rate 43.9%
    against 51.2% with no bound, bench/results/shared-prefix-4-affinity-wait-*.md)."""
    assert CFG.affinity_wait_s == 10.0
    q: AdmissionQueue[str] = AdmissionQueue(CFG)
    for rid in ("a0", "b0", "b1", "b2", "b3"):
        _offer(q, rid, "standard", 0.0)
    holders: dict[str, str | None] = {"a0": "e0", "b0": "e1", "b1": "e1", "b2": "e1", "b3": "e1"}
    assert _affinity_run(q, 1.0, _views(2, 1), holders) == [("b0", "e1")]  # a0 passed over
    assert _affinity_run(q, 2.5, _views(2, 1), holders) == [("b1", "e1")]  # still waits
    assert _affinity_run(q, 10.9, _views(2, 1), holders) == [("b2", "e1")]
    assert _affinity_run(q, 11.0, _views(2, 1), holders) == [("a0", "e1")]  # 10 s: any engine


def test_affinity_dispatch_never_lets_a_lower_class_overtake() -> None:
    q: AdmissionQueue[str] = AdmissionQueue(CFG)
    _offer(q, "s0", "standard", 0.0)
    _offer(q, "b0", "batch", 0.0)
    # the batch request prefers the free engine, the standard head does not: the head
    # still goes first (followers are only of the head's own class)
    assert _affinity_run(q, 0.1, _views(2, 1), {"s0": "e0", "b0": "e1"}) == [("s0", "e1")]


def test_affinity_window_bounds_how_far_behind_the_head_a_match_is_sought() -> None:
    cfg = PriorityConfig(affinity_window=2)
    q: AdmissionQueue[str] = AdmissionQueue(cfg)
    for rid in ("a0", "a1", "a2", "b0"):
        assert isinstance(q.offer(rid, cfg.get("standard"), "t", 0.0, rid), QueueItem)
    holders: dict[str, str | None] = {"a0": "e0", "a1": "e0", "a2": "e0", "b0": "e1"}
    assert _affinity_run(q, 0.1, _views(2, 1), holders, cfg) == [("a0", "e1")]


def test_affinity_wait_null_dispatches_strictly_in_order() -> None:
    cfg = PriorityConfig(affinity_wait_s=None)
    q: AdmissionQueue[str] = AdmissionQueue(cfg)
    for rid in ("a0", "b0"):
        assert isinstance(q.offer(rid, cfg.get("standard"), "t", 0.0, rid), QueueItem)
    assert _affinity_run(q, 0.1, _views(2, 1), {"a0": "e0", "b0": "e1"}, cfg) == [("a0", "e1")]


def test_affinity_dispatch_fills_every_free_slot_once() -> None:
    q: AdmissionQueue[str] = AdmissionQueue(CFG)
    for rid in ("a0", "a1", "b0", "b1", "b2"):
        _offer(q, rid, "standard", 0.0)
    holders: dict[str, str | None] = {r: ("e0" if r[0] == "a" else "e1") for r in q_ids(q)}
    # e0 full, e1 has two free slots: b0 and b1 take them, b2 and the a's wait
    assert _affinity_run(q, 0.1, _views(2, 0), holders) == [("b0", "e1"), ("b1", "e1")]
    assert len(q) == 3


def q_ids(q: AdmissionQueue[str]) -> list[str]:
    return [i.request_id for i in q.ordered()]


def test_each_dispatch_says_how_its_item_was_chosen() -> None:
    q: AdmissionQueue[str] = AdmissionQueue(WAIT1)
    for rid in ("a0", "b0", "a1"):
        _offer(q, rid, "standard", 0.0)

    def hows(now: float, views: Sequence[SaturationView]) -> list[tuple[str, str, str]]:
        actions = drain(
            q, now, config=WAIT1, thresholds=T, views_for=lambda item: views, pick=_first,
            in_flight=(), prefer=lambda item: {"a": {"e0"}, "b": {"e1"}}[item.request_id[0]],
        )  # fmt: skip
        return [(a.item.request_id, a.endpoint, a.how) for a in actions if isinstance(a, Dispatch)]

    assert hows(0.1, _views(2, 1)) == [("b0", "e1", "ahead")]  # a0 passed over at 0.1
    assert hows(0.2, _views(2, 1)) == [("a0", "e1", "head-elsewhere")]
    _offer(q, "b1", "standard", 0.3)
    assert hows(0.3, _views(2, 1)) == [("b1", "e1", "ahead")]  # a1 passed over at 0.3
    _offer(q, "b2", "standard", 0.4)
    assert hows(1.3, _views(2, 1)) == [("a1", "e1", "waited-out")]


def test_a_free_engine_nobody_waits_for_goes_to_the_request_with_least_cached() -> None:
    """e1 is free, every queued request waits for busy e0: the one with the fewest
    tokens cached on e0 goes (it loses least), not the head with a whole document."""
    q: AdmissionQueue[str] = AdmissionQueue(CFG)
    for rid in ("doc0", "doc1", "cold0", "cold1"):
        _offer(q, rid, "standard", 0.0)
    cached = {"doc0": 3000, "doc1": 3000, "cold0": 0, "cold1": 0}

    def run(now: float, stake: bool = True) -> list[tuple[str, str, str]]:
        actions = drain(
            q, now, config=CFG, thresholds=T, views_for=lambda item: _views(2, 1),
            pick=_first, in_flight=(), prefer=lambda item: frozenset({"e0"}),
            stake=(lambda item: cached[item.request_id]) if stake else None,
        )  # fmt: skip
        return [(a.item.request_id, a.endpoint, a.how) for a in actions if isinstance(a, Dispatch)]

    assert run(0.1) == [("cold0", "e1", "cheapest-elsewhere")]
    assert q.passed_over_for(q.peek_next(0.2, lambda item: True), 0.2) > 0, "head passed over"
    assert run(0.2) == [("cold1", "e1", "cheapest-elsewhere")]
    # only document holders left, equal stakes: queue order, the head
    assert run(0.3) == [("doc0", "e1", "head-elsewhere")]
    _offer(q, "cold2", "standard", 0.4)
    assert run(0.4, stake=False) == [("doc1", "e1", "head-elsewhere")], "no stake: the head"


def test_one_drain_counts_the_kv_each_dispatch_takes() -> None:
    """A drain's views come from the last scrape; without the KV each dispatch takes,
    one drain filled a freed engine up to its slot count (64 on the emulator) although
    its KV cache held ~20 long prompts: measured, 16 running + 46 waiting."""
    q: AdmissionQueue[str] = AdmissionQueue(CFG)
    for i in range(10):
        _offer(q, f"r{i}", "standard", 0.0)
    views = [SaturationView("e0", 0.70, 0, 10, 10, 0.0, 64)]

    def run(kv_share: object) -> list[str]:
        actions = drain(
            q, 0.0, config=CFG, thresholds=T, views_for=lambda item: views, pick=_first,
            in_flight=(), kv_share=kv_share,  # type: ignore[arg-type]
        )  # fmt: skip
        return [a.item.request_id for a in actions if isinstance(a, Dispatch)]

    # 0.70 + 0.06 per request: after four the estimate is 0.94, over kv_usage_max 0.9
    assert run(lambda item, endpoint: 0.06) == ["r0", "r1", "r2", "r3"]
    assert len(run(None)) == 6, "without it the queue empties into the engine"


def test_a_queued_request_goes_to_its_holder_whose_only_bound_is_a_short_queue() -> None:
    q: AdmissionQueue[str] = AdmissionQueue(CFG)
    for rid in ("cold", "a0", "b0"):
        _offer(q, rid, "standard", 0.0)
    # both engines have a free slot and one request waiting inside (a long prefill ran):
    # the pool is saturated for a request without a holder, not for a holder's own
    views = [SaturationView(f"e{i}", 0.1, 1, 1, 1, 0.0, 4) for i in range(2)]
    held = {"a0": "e0", "b0": "e1"}

    def holds(item: QueueItem[str]) -> frozenset[str]:
        want = held.get(item.request_id)
        return frozenset() if want is None else frozenset({want})

    got = _holds_run(q, views, holds)
    assert got == [("a0", "e0", "ahead"), ("b0", "e1", "ahead")]
    assert [i.request_id for i in q.ordered()] == ["cold"]
    # without the holders' relief nothing leaves the queue
    q2: AdmissionQueue[str] = AdmissionQueue(CFG)
    for rid in ("cold", "a0", "b0"):
        _offer(q2, rid, "standard", 0.0)
    assert _affinity_run(q2, 0.1, views, {"a0": "e0", "b0": "e1"}) == []


def test_a_drain_looks_up_holders_only_where_a_short_queue_could_open() -> None:
    # the holders lookup is a prefix match per queued request: under real overload
    # (KV use over its bound everywhere) no holder can take a request, so a drain that
    # cannot dispatch does not pay for the window's lookups
    q: AdmissionQueue[str] = AdmissionQueue(CFG)
    for i in range(5):
        _offer(q, f"r{i}", "standard", 0.0)
    looked_up: list[str] = []

    def holds(item: QueueItem[str]) -> frozenset[str]:
        looked_up.append(item.request_id)
        return frozenset({"e0"})

    def run(views: list[SaturationView]) -> list[str]:
        return [rid for rid, _, _ in _holds_run(q, views, holds)]

    kv_full = [SaturationView(f"e{i}", 0.95, 1, 1, 1, 0.0, 4) for i in range(2)]
    assert run(kv_full) == []
    assert looked_up == []
    # one engine over only by its queue: the holders are looked up and r0 goes there
    short_queue = [SaturationView("e0", 0.1, 1, 1, 1, 0.0, 4), kv_full[1]]
    assert run(short_queue)[:1] == ["r0"]
    assert "r0" in looked_up


def test_a_drain_reads_each_queued_request_once_between_dispatches() -> None:
    # can_dispatch, choose and the dispatch itself all ask for the head's and its
    # window's verdicts; between two dispatches nothing they depend on changes
    q: AdmissionQueue[str] = AdmissionQueue(CFG)
    for i in range(6):
        _offer(q, f"r{i}", "standard", 0.0)
    asked: dict[str, int] = {}
    views = [SaturationView("e0", 0.1, 0, 1, 1, 0.0, 2), SaturationView("e1", 0.1, 0, 2, 2, 0.0, 2)]

    def views_for(item: QueueItem[str]) -> Sequence[SaturationView]:
        asked[item.request_id] = asked.get(item.request_id, 0) + 1
        return views

    def holds(item: QueueItem[str]) -> frozenset[str]:
        return frozenset({"e1"}) if item.request_id == "r1" else frozenset()

    actions = drain(
        q, 0.1, config=CFG, thresholds=T, views_for=views_for, pick=_first, in_flight=(),
        prefer=holds, holds=holds,
    )  # fmt: skip
    sent = [(a.item.request_id, a.endpoint) for a in actions if isinstance(a, Dispatch)]
    assert sent == [("r0", "e0")]  # e0's one free slot; e1 full, r1 waits for it
    # one read before the dispatch and one after it (which finds nothing free)
    assert asked["r0"] == 1
    assert max(asked.values()) <= 2
    assert set(asked) == {f"r{i}" for i in range(6)}


def _holds_run(
    q: AdmissionQueue[str],
    views: Sequence[SaturationView],
    holds: Callable[[QueueItem[str]], frozenset[str]],
) -> list[tuple[str, str, str]]:
    """A drain at t=0.1 with affinity dispatch whose holders are also ``holds``."""
    actions = drain(
        q,
        0.1,
        config=CFG,
        thresholds=T,
        views_for=lambda item: views,
        pick=_first,
        in_flight=(),
        prefer=holds,
        holds=holds,
    )
    return [(a.item.request_id, a.endpoint, a.how) for a in actions if isinstance(a, Dispatch)]
