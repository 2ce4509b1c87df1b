"""Admission queue: class order, deadline/arrival order, WFQ fairness, limits, parking."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from fleetgate.router.priority.class_queue import QueueItem
from fleetgate.router.priority.config import PriorityClass, PriorityConfig
from fleetgate.router.priority.queue import AdmissionQueue, Shed

CFG = PriorityConfig()
CRIT, STD, BATCH, SHED = (CFG.get(n) for n in ("critical", "standard", "batch", "sheddable"))


def _always(_: QueueItem[str]) -> bool:
    return True


def _drain(q: AdmissionQueue[str], now: float, n: int | None = None) -> list[str]:
    out: list[str] = []
    while n is None or len(out) < n:
        item = q.pop_next(now, _always)
        if item is None:
            break
        out.append(item.request_id)
    return out


def _offer(q: AdmissionQueue[str], rid: str, cls: PriorityClass, now: float, tenant: str = "t"):
    got = q.offer(rid, cls, tenant, now, payload=rid)
    assert isinstance(got, QueueItem), got
    return got


@pytest.mark.parametrize(
    ("arrivals", "expected"),
    [
        pytest.param(
            [("b1", BATCH, 0.0, "t"), ("s1", STD, 1.0, "t"), ("c1", CRIT, 2.0, "t")],
            ["c1", "s1", "b1"],
            id="class-beats-arrival",
        ),
        pytest.param(
            [("s2", STD, 2.0, "b"), ("s1", STD, 1.0, "a"), ("s3", STD, 3.0, "c")],
            ["s1", "s2", "s3"],
            id="equal-wfq-tags-tie-break-on-deadline",
        ),
        pytest.param(
            [
                ("x1", SHED, 0.0, "t"),
                ("b1", BATCH, 5.0, "t"),
                ("x2", SHED, 1.0, "u"),
                ("c1", CRIT, 9.0, "t"),
            ],
            ["c1", "b1", "x1", "x2"],
            id="four-classes",
        ),
    ],
)
def test_order(arrivals: list[tuple[str, PriorityClass, float, str]], expected: list[str]) -> None:
    q: AdmissionQueue[str] = AdmissionQueue(CFG)
    for rid, cls, t, tenant in arrivals:
        _offer(q, rid, cls, t, tenant)
    assert [i.request_id for i in q.ordered()] == expected
    assert _drain(q, 10.0) == expected
    assert len(q) == 0


def test_single_tenant_is_fifo_by_arrival() -> None:
    q: AdmissionQueue[str] = AdmissionQueue(CFG)
    for i in range(20):
        _offer(q, f"s{i}", STD, float(i))
    assert _drain(q, 30.0) == [f"s{i}" for i in range(20)]


def test_item_carries_deadline_from_class_objective() -> None:
    q: AdmissionQueue[str] = AdmissionQueue(CFG)
    item = _offer(q, "c", CRIT, 10.0)
    assert item.deadline == pytest.approx(10.0 + CRIT.ttft_objective_s)
    assert item.arrival == item.enqueued_at == 10.0
    assert not item.parked


def test_parked_resume_first_in_class_but_not_above_higher_class() -> None:
    q: AdmissionQueue[str] = AdmissionQueue(CFG)
    _offer(q, "b-fresh-old", BATCH, 1.0)
    _offer(q, "c1", CRIT, 5.0)
    q.park("b-parked-late", BATCH, "t", arrival=3.0, now=6.0, payload="p")
    q.park("b-parked-early", BATCH, "t", arrival=2.0, now=7.0, payload="p")
    order = _drain(q, 8.0)
    assert order == ["c1", "b-parked-early", "b-parked-late", "b-fresh-old"]


def test_park_keeps_original_arrival_and_bypasses_max_queued() -> None:
    tiny = PriorityClass(
        name="tiny", level=1, ttft_objective_s=1.0, max_queue_time_s=5.0, max_queued=1
    )
    q: AdmissionQueue[str] = AdmissionQueue(PriorityConfig(classes=(tiny,), default_class="tiny"))
    _offer(q, "a", tiny, 0.0)
    assert isinstance(q.offer("b", tiny, "t", 0.0, payload="b"), Shed)
    parked = q.park("p", tiny, "t", arrival=-100.0, now=0.0, payload="p")
    assert parked.arrival == -100.0 and parked.enqueued_at == 0.0 and parked.parked
    assert parked.deadline == pytest.approx(-99.0)
    assert len(q) == 2
    # queue time of a parked item counts from parking, not from its arrival
    assert q.expire(4.0) == []


def test_wfq_flood_cannot_starve_a_late_tenant() -> None:
    q: AdmissionQueue[str] = AdmissionQueue(CFG)
    for i in range(200):
        _offer(q, f"flood-{i}", BATCH, 0.0 + i * 1e-3, tenant="flood")
    first = _drain(q, 1.0, 5)  # service starts before the small tenant arrives
    assert first == [f"flood-{i}" for i in range(5)]
    for i in range(10):
        _offer(q, f"small-{i}", BATCH, 1.0 + i * 1e-3, tenant="small")
    order = _drain(q, 2.0)
    small_positions = [n for n, rid in enumerate(order) if rid.startswith("small")]
    assert len(small_positions) == 10
    # equal weights: the late tenant alternates with the flood, all served in 20 pops
    assert small_positions[-1] < 20, small_positions
    # without WFQ (FIFO) the first small request would sit behind 195 flood requests
    assert small_positions[0] <= 1
    # FIFO inside one tenant
    assert [r for r in order if r.startswith("small")] == [f"small-{i}" for i in range(10)]
    assert [r for r in order if r.startswith("flood")] == [f"flood-{i}" for i in range(5, 200)]


@pytest.mark.parametrize(
    ("weights", "expected_share"),
    [
        pytest.param({}, {"a": 30, "b": 30, "c": 30}, id="equal"),
        pytest.param({"a": 3.0}, {"a": 54, "b": 18, "c": 18}, id="a-weight-3"),
        pytest.param({"a": 4.0, "b": 2.0}, {"a": 51, "b": 26, "c": 13}, id="4-2-1"),
    ],
)
def test_wfq_shares_follow_weights(
    weights: dict[str, float], expected_share: dict[str, int]
) -> None:
    cfg = PriorityConfig(tenant_weights=weights)
    q: AdmissionQueue[str] = AdmissionQueue(cfg)
    rng = random.Random(7)
    ids = [(t, i) for t in "abc" for i in range(200)]
    rng.shuffle(ids)  # interleaved arrival order must not matter
    for n, (t, i) in enumerate(ids):
        _offer(q, f"{t}-{i}", BATCH, n * 1e-3, tenant=t)
    served = Counter(rid.split("-")[0] for rid in _drain(q, 5.0, 90))
    for tenant, share in expected_share.items():
        assert abs(served[tenant] - share) <= 1, served


def test_wfq_token_cost_gives_equal_tokens_not_equal_requests() -> None:
    q: AdmissionQueue[str] = AdmissionQueue(CFG)
    for i in range(50):
        assert isinstance(q.offer(f"big-{i}", STD, "big", 0.0, "x", cost=1000.0), QueueItem)
        assert isinstance(q.offer(f"tiny-{i}", STD, "tiny", 0.0, "x", cost=100.0), QueueItem)
    served = Counter(rid.split("-")[0] for rid in _drain(q, 1.0, 22))
    assert served == {"tiny": 20, "big": 2}
    with pytest.raises(ValueError, match="cost"):
        q.offer("zero", STD, "t", 0.0, "x", cost=0.0)


@pytest.mark.parametrize(
    ("cls", "status"),
    [pytest.param(SHED, 429, id="sheddable-429"), pytest.param(BATCH, 503, id="batch-503")],
)
def test_queue_full_rejects_at_once(cls: PriorityClass, status: int) -> None:
    small = cls.model_copy(update={"max_queued": 2})
    cfg = PriorityConfig(classes=tuple(small if c.name == cls.name else c for c in CFG.classes))
    q: AdmissionQueue[str] = AdmissionQueue(cfg)
    _offer(q, "1", small, 0.0)
    _offer(q, "2", small, 0.0)
    shed = q.offer("3", small, "t", 0.0, payload="3")
    assert isinstance(shed, Shed)
    assert shed.status == status and shed.reason == "queue_full"
    assert shed.headers() == {"retry-after": str(small.retry_after_s)}
    assert shed.openai_body()["error"]["code"] == status
    assert "full" in shed.openai_body()["error"]["message"]
    assert "3" not in q and len(q) == 2
    _drain(q, 0.0, 1)
    assert isinstance(q.offer("3", small, "t", 0.0, payload="3"), QueueItem)


def test_expire_sheds_past_queue_time_with_class_codes() -> None:
    q: AdmissionQueue[str] = AdmissionQueue(CFG)
    _offer(q, "x", SHED, 0.0)  # limit 10 s
    _offer(q, "c", CRIT, 0.0)  # limit 10 s
    _offer(q, "b", BATCH, 0.0)  # limit 600 s
    assert q.next_expiry() == pytest.approx(10.0)
    assert q.expire(10.0) == []  # exactly at the limit is still allowed
    shed = q.expire(10.5)
    assert [(s.item.request_id, s.status, s.reason) for s in shed] == [
        ("c", 503, "queue_timeout"),
        ("x", 429, "queue_timeout"),
    ]
    assert shed[1].headers() == {"retry-after": str(SHED.retry_after_s)}
    assert "over its limit" in shed[1].message
    assert list(map(lambda i: i.request_id, q.ordered())) == ["b"]
    assert q.next_expiry() == pytest.approx(600.0)


def test_pop_next_never_returns_expired_items() -> None:
    q: AdmissionQueue[str] = AdmissionQueue(CFG)
    _offer(q, "c", CRIT, 0.0)
    _offer(q, "s", STD, 0.0)
    assert _drain(q, 11.0, 1) == ["s"]  # critical expired (10 s); still there for expire()
    assert [s.item.request_id for s in q.expire(11.0)] == ["c"]


def test_pools_drain_independently_with_head_of_line_blocking_inside_one() -> None:
    q: AdmissionQueue[str] = AdmissionQueue(CFG)
    for rid, cls, pool in [
        ("c-a", CRIT, "A"),
        ("s-b", STD, "B"),
        ("s-a", STD, "A"),
        ("b-b", BATCH, "B"),
    ]:
        assert isinstance(q.offer(rid, cls, "t", 0.0, payload=pool, pool=pool), QueueItem)
    asked: list[str] = []

    def only_b(item: QueueItem[str]) -> bool:
        asked.append(item.request_id)
        return item.pool == "B"

    got = q.pop_next(1.0, only_b)
    assert got is not None and got.request_id == "s-b"
    assert sorted(asked) == ["c-a", "s-b"]  # one head per pool, never "s-a" behind "c-a"
    got = q.pop_next(1.0, only_b)
    assert got is not None and got.request_id == "b-b"
    assert q.pop_next(1.0, only_b) is None
    assert [i.request_id for i in q.ordered()] == ["c-a", "s-a"]

    def not_critical(item: QueueItem[str]) -> bool:
        return item.class_name != "critical"

    assert q.pop_next(1.0, not_critical) is None  # "s-a" may not overtake "c-a"
    assert _drain(q, 1.0) == ["c-a", "s-a"]


def test_most_urgent_head_across_pools_first() -> None:
    q: AdmissionQueue[str] = AdmissionQueue(CFG)
    assert isinstance(q.offer("b", BATCH, "t", 0.0, "x", pool="P1"), QueueItem)
    assert isinstance(q.offer("c", CRIT, "t", 1.0, "x", pool="P2"), QueueItem)
    assert isinstance(q.offer("s", STD, "t", 0.5, "x", pool="P3"), QueueItem)
    assert _drain(q, 2.0) == ["c", "s", "b"]


def test_max_queued_counts_a_class_over_all_pools() -> None:
    small = BATCH.model_copy(update={"max_queued": 2})
    cfg = PriorityConfig(classes=tuple(small if c.name == "batch" else c for c in CFG.classes))
    q: AdmissionQueue[str] = AdmissionQueue(cfg)
    assert isinstance(q.offer("1", small, "t", 0.0, "x", pool="A"), QueueItem)
    assert isinstance(q.offer("2", small, "t", 0.0, "x", pool="B"), QueueItem)
    assert isinstance(q.offer("3", small, "t", 0.0, "x", pool="C"), Shed)
    q.remove("1")
    assert isinstance(q.offer("3", small, "t", 0.0, "x", pool="C"), QueueItem)


def test_remove_and_duplicates() -> None:
    q: AdmissionQueue[str] = AdmissionQueue(CFG)
    _offer(q, "a", STD, 0.0)
    _offer(q, "b", STD, 0.0)
    with pytest.raises(ValueError, match="already queued"):
        q.offer("a", STD, "t", 0.0, payload="a")
    removed = q.remove("a")
    assert removed is not None and removed.request_id == "a"
    assert q.remove("a") is None
    assert "a" not in q
    q.park("a", STD, "t", arrival=0.0, now=1.0, payload="a")  # same id may come back
    assert _drain(q, 1.0) == ["a", "b"]


def test_unknown_class_rejected() -> None:
    q: AdmissionQueue[str] = AdmissionQueue(CFG)
    alien = PriorityClass(
        name="alien", level=3, ttft_objective_s=1.0, max_queue_time_s=1.0, max_queued=1
    )
    with pytest.raises(KeyError, match="alien"):
        q.offer("a", alien, "t", 0.0, payload="a")


def test_heads_and_stats() -> None:
    q: AdmissionQueue[str] = AdmissionQueue(CFG)
    _offer(q, "b1", BATCH, 0.0, tenant="x")
    _offer(q, "b2", BATCH, 1.0, tenant="y")
    _offer(q, "c1", CRIT, 2.0)
    q.park("b0", BATCH, "x", arrival=-5.0, now=3.0, payload="p")
    assert [h.request_id for h in q.heads()] == ["c1", "b0"]
    stats = {s.class_name: s for s in q.stats(4.0)}
    assert stats["batch"].depth == 3 and stats["batch"].parked == 1
    assert stats["batch"].tenants == 2
    assert stats["batch"].oldest_wait_s == pytest.approx(4.0)
    assert stats["critical"].depth == 1 and stats["standard"].depth == 0
    assert stats["standard"].oldest_wait_s == 0.0


def test_an_item_may_carry_a_tighter_queue_time_than_its_class() -> None:
    """A request held for a cold start expires at min(its own limit, its class's)."""
    q: AdmissionQueue[str] = AdmissionQueue(CFG)
    held = q.offer("held", STD, "t", 0.0, payload="held", max_wait_s=2.5)
    assert isinstance(held, QueueItem) and held.max_wait_s == 2.5
    q.offer("loose", STD, "t", 0.0, payload="loose", max_wait_s=1e9)  # the class caps it
    q.offer("plain", STD, "t", 0.0, payload="plain")
    assert q.next_expiry() == 2.5
    assert q.expire(2.5) == []
    shed = q.expire(2.6)
    assert [s.item.request_id for s in shed] == ["held"]
    assert shed[0].reason == "queue_timeout" and "limit of 2.5s" in shed[0].message
    assert q.next_expiry() == STD.max_queue_time_s
    assert sorted(s.item.request_id for s in q.expire(STD.max_queue_time_s + 0.1)) == [
        "loose",
        "plain",
    ]


def test_followers_are_the_heads_own_class_in_order_and_take_serves_one_of_them() -> None:
    cfg = PriorityConfig()
    q: AdmissionQueue[str] = AdmissionQueue(cfg)
    for rid, cls in (("s0", "standard"), ("b0", "batch"), ("s1", "standard"), ("s2", "standard")):
        assert isinstance(q.offer(rid, cfg.get(cls), "t", 0.0, rid), QueueItem)
    head = q.peek_next(0.0, lambda item: True)
    assert head is not None and head.request_id == "s0"
    assert len(q) == 4  # peeking removes nothing
    assert [i.request_id for i in q.followers(head, 0.0, 8)] == ["s1", "s2"]
    assert [i.request_id for i in q.followers(head, 0.0, 1)] == ["s1"]
    s2 = q.followers(head, 0.0, 8)[1]
    q.take(s2)
    assert "s2" not in q and len(q) == 3
    assert [i.request_id for i in q.ordered()] == ["s0", "s1", "b0"]
    # expired followers are left out (standard: 30 s)
    assert q.followers(head, 31.0, 8) == []


def test_passed_over_counts_from_the_first_time_and_is_forgotten_when_the_item_leaves() -> None:
    cfg = PriorityConfig()
    q: AdmissionQueue[str] = AdmissionQueue(cfg)
    for rid in ("x", "y"):
        assert isinstance(q.offer(rid, cfg.get("standard"), "t", 0.0, rid), QueueItem)
    x, y = q.ordered()
    assert q.passed_over_for(x, 5.0) == 0.0, "never passed over"
    q.pass_over(x, 1.0)
    q.pass_over(x, 2.0)  # the first time counts
    assert q.passed_over_for(x, 3.0) == 2.0
    q.take(x)
    q.pass_over(y, 1.0)
    q.remove("y")
    assert q._passed_over == {}  # nothing kept for items that left
