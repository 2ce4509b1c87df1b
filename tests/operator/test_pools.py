"""Mixed engines in one pool: the split of demand by role and the pool GPU budget,
with plain numbers (fleetgate/operator/pools.py and ``demand_for(classes=...)``)."""

from __future__ import annotations

import dataclasses

import pytest
from routerdemand import RouterDemand

from fleetgate.operator.autoscale import Demand, RouterSnapshot, demand_for, parse_router_metrics
from fleetgate.operator.pools import (
    DEFAULT_CLASS_ROLES,
    LATENCY,
    THROUGHPUT,
    ClassRoles,
    Member,
    PoolOptionError,
    Share,
    Sharer,
    consolidate,
    demand_roles,
    demand_shares,
    parse_class_roles,
    parse_pool_budgets,
    share_budget,
    spare_room,
)
from fleetgate.router.priority.config import PriorityConfig

MODEL = "llama"

# -- the class mapping ----------------------------------------------------------------


def test_the_defaults_name_every_default_router_class() -> None:
    """The operator names the router's classes itself; a class added or renamed on the
    router side fails here. Interactive classes (level >= 0) go to the latency role,
    batch and sheddable ones to the throughput role."""
    classes = PriorityConfig().classes
    assert {c.name for c in classes} == set(DEFAULT_CLASS_ROLES)
    for c in classes:
        want = THROUGHPUT if c.level < 0 or c.sheddable else LATENCY
        assert DEFAULT_CLASS_ROLES[c.name] == want, c.name


def test_class_roles_merge_over_the_defaults_and_star_sets_unlisted() -> None:
    roles = parse_class_roles(["premium=latency,standard=throughput", "*=throughput"])
    assert roles.role_of("premium") == LATENCY
    assert roles.role_of("standard") == THROUGHPUT  # remapped
    assert roles.role_of("critical") == LATENCY  # default kept
    assert roles.role_of("nightly") == THROUGHPUT  # unlisted -> '*'
    assert ClassRoles().role_of("nightly") == LATENCY  # the documented default
    assert roles.describe(LATENCY) == "critical, premium"
    assert ClassRoles().describe(LATENCY) == "critical, standard, any other class"


@pytest.mark.parametrize(
    ("item", "match"),
    [
        ("critical", "want CLASS=latency"),
        ("critical=fast", "want CLASS=latency"),
        ("Crit ical=latency", "not a priority class name"),
    ],
)
def test_bad_class_roles_say_what_is_wrong(item: str, match: str) -> None:
    with pytest.raises(PoolOptionError, match=match):
        parse_class_roles([item])


def test_pool_budgets_parse() -> None:
    assert parse_pool_budgets(["chat=8", "batch=16,edge=0"]) == {"chat": 8, "batch": 16, "edge": 0}
    assert parse_pool_budgets([]) == {}


@pytest.mark.parametrize(
    ("item", "match"),
    [
        ("chat", "want POOL=N"),
        ("Chat=8", "want POOL=N"),
        ("chat=-1", ">= 0"),
        ("chat=eight", ">= 0"),
        ("chat=8,chat=4", "given twice"),
    ],
)
def test_bad_pool_budgets_say_what_is_wrong(item: str, match: str) -> None:
    with pytest.raises(PoolOptionError, match=match):
        parse_pool_budgets([item])


# -- who takes which demand -----------------------------------------------------------


def test_only_a_model_with_both_roles_in_its_pool_is_split() -> None:
    roles = demand_roles(
        [
            (("ns", "trt"), "chat", MODEL, LATENCY),
            (("ns", "vllm"), "chat", MODEL, THROUGHPUT),
            (("ns", "qwen"), "chat", "qwen", THROUGHPUT),  # alone with its model
            (("ns", "edge"), "edge", MODEL, THROUGHPUT),  # same model, other pool
            (("other", "trt2"), "edge", MODEL, THROUGHPUT),  # same role twice: not split
        ]
    )
    assert roles == {
        ("ns", "trt"): LATENCY,
        ("ns", "vllm"): THROUGHPUT,
        ("ns", "qwen"): None,
        ("ns", "edge"): None,
        ("other", "trt2"): None,
    }


def _older_router(snaps: dict[str, RouterSnapshot]) -> dict[str, RouterSnapshot]:
    """The same snapshots as a router whose held gauge has no ``class`` label."""
    return {k: dataclasses.replace(v, held_by_class={}) for k, v in snaps.items()}


def _split_scene() -> tuple[dict[str, RouterSnapshot], dict[str, RouterSnapshot]]:
    r = RouterDemand()
    before = {"r": parse_router_metrics(r.text())}
    r.set_queue(MODEL, 5, "critical")
    r.set_queue(MODEL, 1, "standard")
    r.set_queue(MODEL, 4, "batch")
    r.set_queue(MODEL, 2, "sheddable")
    r.arrive(MODEL, 30, "critical")
    r.arrive(MODEL, 10, "batch")
    r.set_held(MODEL, 3, "critical")
    r.set_held(MODEL, 1, "batch")
    r.set_in_flight({"ns/trt-0": 3, "ns/vllm-0": 7})
    return before, {"r": parse_router_metrics(r.text())}


def test_demand_splits_by_class_queue_arrivals_and_held() -> None:
    before, now = _split_scene()
    roles = ClassRoles()
    lat = demand_for(
        now, before, 10.0, model=MODEL, endpoints=["ns/trt-0"], classes=roles.accepts(LATENCY)
    )
    thr = demand_for(
        now, before, 10.0, model=MODEL, endpoints=["ns/vllm-0"], classes=roles.accepts(THROUGHPUT)
    )
    whole = demand_for(now, before, 10.0, model=MODEL, endpoints=["ns/trt-0"])
    # held requests are counted by class, and they sit in their class's queue too
    # (critical 5 + standard 1 with 3 held; batch 4 + sheddable 2 with 1 held)
    assert (lat.held, thr.held, whole.held) == (3, 1, 4)
    assert (lat.queued, thr.queued, whole.queued) == (3, 5, 8)
    assert lat.arrival_rate == pytest.approx(3.0)
    assert thr.arrival_rate == pytest.approx(1.0)
    assert whole.arrival_rate == pytest.approx(4.0)
    # in flight is per endpoint: each service's own pods, split or not
    assert (lat.in_flight, thr.in_flight) == (3, 7)


def test_an_older_routers_held_requests_split_as_the_ticks_arrivals() -> None:
    before, labelled = _split_scene()
    now = _older_router(labelled)
    roles = ClassRoles()
    lat = demand_for(now, before, 10.0, model=MODEL, endpoints=[], classes=roles.accepts(LATENCY))
    thr = demand_for(
        now, before, 10.0, model=MODEL, endpoints=[], classes=roles.accepts(THROUGHPUT)
    )
    whole = demand_for(now, before, 10.0, model=MODEL, endpoints=[])
    # no class on held: shared as this tick's arrivals were (30:10) ...
    assert (lat.held, thr.held, whole.held) == (pytest.approx(3.0), pytest.approx(1.0), 4)
    # ... and each side's queue loses its depth's share of the 4 held (12 deep)
    assert (lat.queued, thr.queued, whole.queued) == (4, 4, 8)


def test_held_requests_wake_only_their_classes_role_when_nothing_arrived_this_tick() -> None:
    """A held request waits through a cold start, ticks after its arrival: a standard
    request held at zero wakes the latency role alone, not the throughput role too
    (the mixed bench's cold request woke both at d09db11)."""
    r = RouterDemand()
    r.arrive(MODEL, 1, "standard")
    r.set_held(MODEL, 1, "standard")
    before = {"r": parse_router_metrics(r.text())}
    now = {"r": parse_router_metrics(r.text())}
    roles = ClassRoles()
    lat = demand_for(now, before, 5.0, model=MODEL, endpoints=[], classes=roles.accepts(LATENCY))
    thr = demand_for(now, before, 5.0, model=MODEL, endpoints=[], classes=roles.accepts(THROUGHPUT))
    assert lat.held == 1 and not lat.idle
    assert thr.held == 0 and thr.idle


def test_an_older_routers_held_requests_wake_every_role_when_nothing_arrived() -> None:
    r = RouterDemand()
    r.arrive(MODEL, 3, "batch")
    r.set_held(MODEL, 3, "batch")
    before = {"r": parse_router_metrics(r.text())}
    now = _older_router({"r": parse_router_metrics(r.text())})
    roles = ClassRoles()
    for role in (LATENCY, THROUGHPUT):
        d = demand_for(now, before, 5.0, model=MODEL, endpoints=[], classes=roles.accepts(role))
        assert d.held == 3 and not d.idle


def test_a_role_whose_classes_saw_nothing_gets_no_held_share() -> None:
    r = RouterDemand()
    before = {"r": parse_router_metrics(r.text())}
    r.arrive(MODEL, 2, "batch")
    r.set_held(MODEL, 2, "batch")
    labelled = {"r": parse_router_metrics(r.text())}
    for now in (labelled, _older_router(labelled)):
        lat = demand_for(
            now, before, 5.0, model=MODEL, endpoints=[], classes=ClassRoles().accepts(LATENCY)
        )
        assert lat.held == 0 and lat.idle  # batch alone does not wake the latency engines


def test_the_split_falls_back_to_dispatches_per_class() -> None:
    r = RouterDemand()
    before = {"r": parse_router_metrics(r.text())}
    r.classes.dispatches.labels(MODEL, "critical").inc(8)
    r.classes.dispatches.labels(MODEL, "batch").inc(2)
    now = {"r": parse_router_metrics(r.text())}
    # a router without fleetgate_arrivals_total for the model: drop it from the parse
    stripped = {"r": dataclasses.replace(now["r"], arrivals={}, arrivals_by_class={})}
    lat = demand_for(
        stripped, before, 2.0, model=MODEL, endpoints=[], classes=ClassRoles().accepts(LATENCY)
    )
    assert lat.arrival_rate == pytest.approx(4.0)


# -- the budget -----------------------------------------------------------------------


def m(
    name: str, role: str, gpus: int, wanted: int, current: int = 1, min_replicas: int = 1
) -> Member:
    return Member(
        key=("ns", name),
        role=LATENCY if role == "l" else THROUGHPUT,
        gpus=gpus,
        min_replicas=min_replicas,
        current=current,
        wanted=wanted,
    )


def replicas(grants: dict[tuple[str, str], object]) -> dict[str, tuple[int, int]]:
    return {k[1]: (g.replicas, g.target) for k, g in grants.items()}  # type: ignore[attr-defined]


def test_within_the_budget_nothing_is_limited() -> None:
    g = share_budget("chat", 8, [m("trt", "l", 2, 2), m("vllm", "t", 1, 4)])
    assert replicas(g) == {"trt": (2, 2), "vllm": (4, 4)}
    assert all(x.note is None for x in g.values())


def test_latency_first_then_throughput() -> None:
    g = share_budget("chat", 8, [m("vllm", "t", 1, 5), m("trt", "l", 2, 3)])
    assert replicas(g) == {"trt": (3, 3), "vllm": (2, 2)}  # 3 x 2 + 2 x 1 = 8
    assert g[("ns", "trt")].note is None
    assert g[("ns", "vllm")].note == "pool chat gpu budget 8 reached (5 wanted, 2 granted)"


def test_growth_waits_for_gpus_another_service_still_holds() -> None:
    # throughput holds 6 GPUs of 8; the latency role wants 3 x 2
    g = share_budget("chat", 8, [m("trt", "l", 2, 3, current=1), m("vllm", "t", 1, 6, current=6)])
    assert g[("ns", "trt")].target == 3
    assert g[("ns", "trt")].replicas == 1  # 0 GPUs free now
    assert g[("ns", "trt")].note == (
        "pool chat gpu budget 8 reached (2 more once GPUs drain elsewhere in the pool)"
    )
    assert g[("ns", "vllm")].replicas == 2  # shrinks (drained one replica per tick)
    # two ticks later throughput is down to 4: 2 GPUs free, one more latency replica
    g = share_budget("chat", 8, [m("trt", "l", 2, 3, current=1), m("vllm", "t", 1, 6, current=4)])
    assert replicas(g) == {"trt": (2, 3), "vllm": (2, 2)}
    # the sum of spec.replicas x GPUs never passed the budget on the way: 2 + 6, 4 + 4


def test_never_below_min_replicas_even_past_the_budget() -> None:
    g = share_budget(
        "chat",
        3,
        [
            m("trt", "l", 2, 4, current=1, min_replicas=1),
            m("vllm", "t", 2, 3, current=0, min_replicas=1),
        ],
    )
    assert replicas(g) == {"trt": (1, 1), "vllm": (1, 1)}  # 4 GPUs > 3: the floors win
    assert g[("ns", "trt")].note == "pool chat gpu budget 3 reached (4 wanted, 1 granted)"


def test_services_of_one_role_take_turns() -> None:
    g = share_budget(
        "chat",
        5,
        [
            m("b", "l", 1, 4, current=0, min_replicas=0),
            m("a", "l", 1, 4, current=0, min_replicas=0),
        ],
    )
    assert replicas(g) == {"a": (3, 3), "b": (2, 2)}  # a, b, a, b, a


def test_a_smaller_replica_uses_gpus_a_larger_one_cannot() -> None:
    g = share_budget("chat", 7, [m("big", "l", 4, 2, current=1), m("small", "t", 1, 4, current=1)])
    assert replicas(g) == {"big": (1, 1), "small": (3, 3)}  # 4 + 3: a second big needs 8


def test_cpu_services_cost_nothing() -> None:
    g = share_budget("chat", 0, [m("cpu", "t", 0, 5, current=1, min_replicas=0)])
    assert replicas(g) == {"cpu": (5, 5)} and g[("ns", "cpu")].note is None


def test_the_split_sums_over_routers_and_shares_held_by_all_their_arrivals() -> None:
    a, b = RouterDemand(), RouterDemand()
    before = {"a": parse_router_metrics(a.text()), "b": parse_router_metrics(b.text())}
    a.set_queue(MODEL, 3, "critical")
    b.set_queue(MODEL, 2, "critical")
    b.set_queue(MODEL, 7, "batch")
    a.arrive(MODEL, 10, "standard")  # router a saw only latency classes ...
    b.arrive(MODEL, 30, "batch")  # ... router b only batch: 1:3 overall
    a.set_held(MODEL, 2, "critical")
    b.set_held(MODEL, 6, "batch")
    labelled = {"a": parse_router_metrics(a.text()), "b": parse_router_metrics(b.text())}
    roles = ClassRoles()

    def split(now: dict[str, RouterSnapshot]) -> tuple[Demand, Demand]:
        lat, thr = (
            demand_for(now, before, 10.0, model=MODEL, endpoints=[], classes=roles.accepts(r))
            for r in (LATENCY, THROUGHPUT)
        )
        return lat, thr

    lat, thr = split(labelled)
    assert (lat.arrival_rate, thr.arrival_rate) == (pytest.approx(1.0), pytest.approx(3.0))
    assert (lat.held, thr.held) == (2, 6)  # by class, router by router
    assert (lat.queued, thr.queued) == (3, 1)  # a: 3 - 2, b: 2 and 7 - 6
    lat, thr = split(_older_router(labelled))
    # held requests sit in their router's queue: a 3 - 2; b 2 - 6 x 2/9 and 7 - 6 x 7/9
    assert (lat.queued, thr.queued) == (pytest.approx(5 / 3), pytest.approx(7 / 3))
    assert (lat.held, thr.held) == (pytest.approx(2.0), pytest.approx(6.0))  # 8 x 1/4, 8 x 3/4


# -- services of one role share its demand ----------------------------------------------


def _shares(*members: tuple[str, int, int], role: str | None = THROUGHPUT) -> dict[str, Share]:
    """``(name, spec.replicas, maxReplicas)`` of services of one (pool, model, role)."""
    got = demand_shares((("ns", n), ("chat", MODEL, role), c, most) for n, c, most in members)
    return {k[1]: v for k, v in got.items()}


def test_services_of_one_demand_share_it_by_replicas() -> None:
    got = _shares(("b", 3, 8), ("a", 1, 8))
    assert (got["a"].weight, got["b"].weight) == (0.25, 0.75)
    assert (got["a"].objective, got["b"].objective) == (False, True)  # the larger reads it
    assert got["a"].of == got["b"].of == 2
    tie = _shares(("b", 2, 8), ("a", 2, 8))
    assert tie["a"].objective and not tie["b"].objective


def test_a_service_alone_on_its_demand_takes_all_of_it() -> None:
    got = demand_shares(
        [
            (("ns", "trt"), ("chat", MODEL, LATENCY), 1, 4),
            (("ns", "vllm"), ("chat", MODEL, THROUGHPUT), 2, 4),
            (("ns", "other"), ("chat", "other-model", THROUGHPUT), 2, 4),
            (("ns", "elsewhere"), ("batch", MODEL, THROUGHPUT), 2, 4),
        ]
    )
    assert got == {}


def test_with_no_replica_anywhere_the_first_that_may_run_one_takes_it_all() -> None:
    got = _shares(("c", 0, 4), ("a", 0, 0), ("b", 0, 4))
    assert {n: s.weight for n, s in got.items()} == {"a": 0.0, "b": 1.0, "c": 0.0}
    assert got["b"].objective


def test_a_service_at_zero_gets_a_part_only_when_the_running_ones_are_full() -> None:
    growing = _shares(("a", 2, 4), ("b", 0, 4))
    assert (growing["a"].weight, growing["b"].weight) == (1.0, 0.0)
    full = _shares(("a", 4, 4), ("b", 0, 4), ("c", 0, 4))
    assert {n: s.weight for n, s in full.items()} == {"a": 0.8, "b": 0.2, "c": 0.0}


# -- one role serving both at low demand ------------------------------------------------


def _sharer(role: str, **kw: object) -> Sharer:
    name = "trt" if role == LATENCY else "vllm"
    base: dict[str, object] = {"key": ("ns", name), "role": role, "min_replicas": 0,
                               "current": 1, "ready": 1, "wanted": 1, "load": 0.5,
                               "arrivals": 1.0, "target": 4.0}  # fmt: skip
    return Sharer(**(base | kw))  # type: ignore[arg-type]


def test_quiet_hours_run_one_replica_the_role_with_fewer_arrivals_stands_down() -> None:
    # critical 0.6/s on TensorRT-LLM, standard 2.4/s on vLLM; 1.5 in flight of 4 + 4
    trt = _sharer(LATENCY, arrivals=0.6, load=0.5)
    vllm = _sharer(THROUGHPUT, arrivals=2.4, load=1.0)
    got = consolidate([trt, vllm])
    assert list(got) == [("ns", "trt")]
    assert "throughput-role replicas serve its classes (ns/vllm" in got[("ns", "trt")]
    assert "fills 38% of their target" in got[("ns", "trt")]  # 1.5 / (1 x 4)
    # the other way round when batch work is the smaller share
    assert list(consolidate([dataclasses.replace(trt, arrivals=3.0), vllm])) == [("ns", "vllm")]
    # a tie: the throughput role stands down, the faster engine keeps serving
    assert list(consolidate([dataclasses.replace(trt, arrivals=2.4), vllm])) == [("ns", "vllm")]


def test_a_role_with_replicas_drains_below_half_one_at_zero_stays_below_three_quarters() -> None:
    vllm = _sharer(THROUGHPUT, arrivals=5.0, load=2.0)
    # 2.6 of 4: 65%, above ABSORB_FILL: a latency replica that runs keeps running
    assert consolidate([_sharer(LATENCY, load=0.6), vllm]) == {}
    # ... but one at zero stays there (below KEEP_FILL)
    at_zero = _sharer(LATENCY, load=0.6, current=0, ready=0)
    assert list(consolidate([at_zero, vllm])) == [("ns", "trt")]
    # past KEEP_FILL it comes back: 3.2 of 4
    assert consolidate([dataclasses.replace(at_zero, load=1.2), vllm]) == {}


@pytest.mark.parametrize(
    ("mine", "other"),
    [
        ({"min_replicas": 1}, {}),  # a floor is the owner's promise
        ({"wanted": 2}, {}),  # its own demand wants more than one replica
        ({}, {"ready": 0}),  # nothing ready on the other side to serve it
        ({}, {"wanted": 0}),  # the other role is going to zero itself
        ({}, {"wanted": 2}),  # the other role grows: demand is no longer low
        ({"current": 0, "ready": 0}, {"wanted": 2}),  # ... so one at zero comes back
        ({"target": None}, {}),  # a KV target: no load to add up
        ({}, {"current": 0, "ready": 0}),
    ],
)
def test_no_consolidation(mine: dict[str, object], other: dict[str, object]) -> None:
    low = {"arrivals": 0.1, "load": 0.2}
    trt = _sharer(LATENCY, **(low | mine))
    vllm = _sharer(THROUGHPUT, arrivals=3.0, load=0.5, **other)
    assert ("ns", "trt") not in consolidate([trt, vllm])


def test_only_the_replicas_the_other_role_keeps_count() -> None:
    # vLLM shrinks from 3 to 2 this tick: 6.5 in flight fill 81% of the 2 it keeps, so
    # a TensorRT-LLM role at zero comes back (of all 3 it would be 54%)
    trt = _sharer(LATENCY, current=0, ready=0, arrivals=3.0, load=0.0)
    vllm = _sharer(THROUGHPUT, current=3, ready=3, wanted=2, arrivals=12.0, load=6.5)
    assert consolidate([trt, vllm]) == {}
    assert list(consolidate([trt, dataclasses.replace(vllm, wanted=3)])) == [("ns", "trt")]


def test_a_role_drains_only_onto_one_replica_and_only_once_its_own_all_serve() -> None:
    trt = _sharer(LATENCY, arrivals=0.6, load=0.2)
    # a peak both roles serve is no quiet hour, however low the fill of 3 replicas
    three = _sharer(THROUGHPUT, current=3, ready=3, wanted=3, arrivals=2.4, load=1.0)
    assert consolidate([trt, three]) == {}
    # the one replica it keeps of them: 1.2 of 4
    assert list(consolidate([trt, dataclasses.replace(three, wanted=1)])) == [("ns", "trt")]
    # a replica still starting came back for the load: it is not drained yet
    vllm = _sharer(THROUGHPUT, arrivals=2.4, load=1.0)
    assert ("ns", "trt") not in consolidate([dataclasses.replace(trt, current=2, ready=1), vllm])
    assert list(consolidate([dataclasses.replace(trt, ready=1), vllm])) == [("ns", "trt")]


def test_the_load_compared_may_be_the_callers_mean() -> None:
    trt, vllm = _sharer(LATENCY, arrivals=0.6, load=0.5), _sharer(THROUGHPUT, load=3.0)
    assert consolidate([trt, vllm]) == {}  # 3.5 of 4 now
    assert list(consolidate([trt, vllm], total=1.5)) == [("ns", "trt")]  # its recent mean


def test_unknown_arrivals_start_no_drain_but_keep_a_role_at_zero() -> None:
    # the first scrape after a restart: no rates yet
    trt, vllm = _sharer(LATENCY, arrivals=None), _sharer(THROUGHPUT, arrivals=None)
    assert consolidate([trt, vllm]) == {}
    at_zero = dataclasses.replace(trt, current=0, ready=0)
    assert list(consolidate([at_zero, vllm])) == [("ns", "trt")]


def test_one_role_alone_is_never_consolidated() -> None:
    assert consolidate([_sharer(THROUGHPUT), _sharer(THROUGHPUT, key=("ns", "b"))]) == {}


def test_every_service_of_the_role_stands_down_together() -> None:
    trt = [_sharer(LATENCY, key=("ns", f"trt-{i}"), wanted=w, arrivals=0.1, load=0.1)
           for i, w in enumerate((1, 0))]  # fmt: skip
    vllm = _sharer(THROUGHPUT, arrivals=4.0, load=1.5)
    assert sorted(consolidate([*trt, vllm])) == [("ns", "trt-0"), ("ns", "trt-1")]


def test_the_latency_roles_room_is_what_its_kept_replicas_hold_beyond_its_need() -> None:
    # 2 replicas of which its decision keeps 1: 1 x 4 - 1.5
    assert spare_room([(2, 1, 4.0, 1.5)]) == 2.5
    # starting replicas count (they serve within a cold start); no negative room
    assert spare_room([(3, 3, 4.0, 10.0), (1, 1, 4.0, 6.0)]) == 2.0
    # no in-flight target, or no need measured: no room claimed
    assert spare_room([(1, 1, None, 1.0), (1, 1, 4.0, None)]) == 0.0
    assert spare_room([]) == 0.0
