"""Scheduling plugins and pipeline, tested on plain snapshots (no servers).

We test these aspects:
* load estimate: router traffic since the scrape counts at once; staleness is pessimistic;
* prefix rendering covers every chat message and role; chain hashes are stable;
* the prefix index is bounded and LRU; rendezvous order is replica-independent;
* filters, scorers in [0, 1], picker tie-break seeded; the decision names its plugin;
* bounded-load spill spreads a hot prefix; a saturated engine is avoided;
* prefill cost: a warm engine keeps affinity unless its prefill backlog exceeds recomputing
  the prompt elsewhere (plus slack); a cold prefix skips a rendezvous target with a backlog.
"""

from __future__ import annotations

import math
import random

import pytest

from fleetgate.engines.base import LoadSnapshot
from fleetgate.router.scheduling.load import (
    LoadParams,
    RouterCounts,
    estimate_load,
    kv_tokens_needed,
)
from fleetgate.router.scheduling.pipeline import NoEndpointError, default_pipeline
from fleetgate.router.scheduling.plugins import (
    KvHeadroomScorer,
    LoadScorer,
    MaxScorePicker,
    PrefixAffinityScorer,
    prefill_cost,
    uncached_tokens,
)
from fleetgate.router.scheduling.prefix import (
    PrefixIndex,
    chunk_chain,
    first_chunk_key,
    render_prompt,
    rendezvous_order,
)
from fleetgate.router.scheduling.types import (
    EndpointId,
    EndpointView,
    LoadEstimate,
    RequestView,
    ScoredEndpoint,
)

P = LoadParams()


def snap(now: float = 100.0, **kw: object) -> LoadSnapshot:
    base: dict[str, object] = dict(
        scraped_at=now,
        kv_usage=0.1,
        running=1,
        waiting=0,
        block_size=16,
        blocks_total=1000,
        blocks_free=900,
        max_running=8,
    )
    base.update(kw)
    return LoadSnapshot(**base)  # type: ignore[arg-type]


def load(
    work: float = 0.0,
    kv: float = 0.0,
    capacity: int = 8,
    free: int | None = None,
    total: int | None = None,
    block: int = 16,
) -> LoadEstimate:
    return LoadEstimate(
        requests=work * capacity,
        capacity=capacity,
        work=work,
        kv_fraction=kv,
        free_kv_tokens=free,
        total_kv_tokens=total,
        block_size=block,
        confidence=1.0,
        age=0.0,
    )


def view(
    name: str,
    *,
    work: float = 0.0,
    kv: float = 0.0,
    match: int = 0,
    rank: int = 0,
    healthy: bool = True,
    ejected: bool = False,
    models: frozenset[str] = frozenset({"m"}),
    max_len: int | None = None,
    free: int | None = None,
    total: int | None = None,
    engine: str = "vllm",
    backlog: int = 0,
) -> EndpointView:
    return EndpointView(
        id=EndpointId(name),
        engine=engine,
        models=models,
        healthy=healthy,
        ejected=ejected,
        load=load(work, kv, free=free, total=total),
        max_model_len=max_len,
        prefix_match=match,
        rendezvous_rank=rank,
        pending_prefill_tokens=backlog,
    )


def req(chunks: int = 4, prompt_tokens: int = 256, max_tokens: int = 16) -> RequestView:
    return RequestView(model="m", chunks=chunks, prompt_tokens=prompt_tokens, max_tokens=max_tokens)


# ------------------------------------------------------------------ load estimate


def test_burst_between_scrapes_is_seen_at_once() -> None:
    s = snap(running=1, waiting=0)
    idle = estimate_load(s, RouterCounts(), 100.1, P)
    burst = estimate_load(s, RouterCounts(in_flight=6, dispatched_since_scrape=6), 100.1, P)
    assert idle.requests == 1 and burst.requests == 7
    assert burst.work > idle.work
    assert burst.work == pytest.approx(7 / 8)


def test_finished_since_scrape_subtracts_but_never_below_own_in_flight() -> None:
    s = snap(running=4)
    est = estimate_load(s, RouterCounts(in_flight=2, finished_since_scrape=5), 100.0, P)
    assert est.requests == 2


@pytest.mark.parametrize(
    ("age", "conf"),
    [
        pytest.param(0.1, 1.0, id="fresh"),
        pytest.param(1.75, 0.5, id="half"),
        pytest.param(10.0, 0.0, id="stale"),
    ],
)
def test_confidence_falls_with_age(age: float, conf: float) -> None:
    est = estimate_load(snap(running=0, kv_usage=0.0), RouterCounts(), 100.0 + age, P)
    assert est.confidence == pytest.approx(conf)


def test_stale_or_failing_scrape_never_reads_idle() -> None:
    idle = snap(running=0, waiting=0, kv_usage=0.0, blocks_free=1000)
    fresh = estimate_load(idle, RouterCounts(), 100.0, P)
    stale = estimate_load(idle, RouterCounts(), 200.0, P)
    failing = estimate_load(idle, RouterCounts(), 100.0, P, scrape_failing=True)
    never = estimate_load(None, RouterCounts(), 100.0, P)
    assert fresh.work == 0.0
    for est in (stale, failing, never):
        assert est.work >= P.stale_work
        assert est.kv_fraction >= P.stale_kv
        assert est.confidence == 0.0
    assert math.isinf(never.age)


def test_mixed_engines_normalised_by_their_own_capacity() -> None:
    vllm = estimate_load(snap(running=64, max_running=256), RouterCounts(), 100.0, P)
    trt = estimate_load(snap(running=16, max_running=64, block_size=32), RouterCounts(), 100.0, P)
    assert vllm.work == pytest.approx(trt.work) == pytest.approx(0.25)


def test_kv_estimate_counts_tokens_dispatched_since_scrape() -> None:
    s = snap(kv_usage=0.1, blocks_total=100, blocks_free=90, block_size=16)
    est = estimate_load(s, RouterCounts(dispatched_tokens_since_scrape=800), 100.0, P)
    assert est.free_kv_tokens == 90 * 16 - 800
    assert est.kv_fraction == pytest.approx(1 - (1440 - 800) / 1600)


def test_kv_tokens_needed_rounds_to_block_size() -> None:
    assert kv_tokens_needed(100, 30, 16) == 144
    assert kv_tokens_needed(100, 30, 128) == 256


# ------------------------------------------------------------------ prefix


def chat(*msgs: tuple[str, str]) -> dict[str, object]:
    return {"model": "m", "messages": [{"role": r, "content": c} for r, c in msgs]}


def test_render_covers_every_message_and_role() -> None:
    a = render_prompt(chat(("system", "S"), ("user", "hi"), ("assistant", "yo"), ("user", "A")))
    b = render_prompt(chat(("system", "S"), ("user", "hi"), ("assistant", "yo"), ("user", "B")))
    c = render_prompt(
        chat(("system", "S"), ("assistant", "hi"), ("assistant", "yo"), ("user", "A"))
    )
    assert a != b and a != c
    assert a.startswith(b[:-3])  # shared history is a shared prefix
    assert render_prompt(chat(("user", "x"))) == render_prompt(chat(("user", "x")))


def test_render_completions_strings_tokens_and_parts() -> None:
    assert render_prompt({"model": "m", "prompt": "abc"}).endswith(b"abc")
    assert render_prompt({"model": "m", "prompt": [1, 2, 3]}).endswith(b"1 2 3")
    parts = {
        "model": "m",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}],
    }
    assert b'"text":"x"' in render_prompt(parts)
    assert render_prompt({"model": "a", "prompt": "p"}) != render_prompt(
        {"model": "b", "prompt": "p"}
    )


def test_chain_hash_is_a_prefix_chain_and_stable() -> None:
    x = b"a" * 100 + b"b" * 100
    y = b"a" * 100 + b"c" * 100
    cx, cy = chunk_chain(x, 50), chunk_chain(y, 50)
    assert len(cx) == 4 and cx[:2] == cy[:2] and cx[2] != cy[2]
    assert chunk_chain(b"short", 50) == ()
    # Fixed value: must not depend on PYTHONHASHSEED or the process.
    assert chunk_chain(b"0123456789", 10) == chunk_chain(b"0123456789", 10)
    assert first_chunk_key(x, 50) == first_chunk_key(y, 50)


def test_prefix_index_longest_match_bounded_lru() -> None:
    idx = PrefixIndex(capacity=5)
    e = EndpointId("e")
    idx.record(e, [1, 2, 3])
    assert idx.match(e, [1, 2, 3, 4]) == 3
    assert idx.match(e, [1, 9]) == 1
    assert idx.match(EndpointId("other"), [1]) == 0
    idx.record(e, [7, 8, 9])  # 6 entries -> oldest (1) evicted
    assert idx.size(e) == 5
    assert idx.match(e, [1, 2, 3]) == 3  # the longer hash still names the prefix
    idx.forget(e)
    assert idx.match(e, [1, 2, 3]) == 0


def test_rendezvous_is_replica_independent_and_stable_under_removal() -> None:
    eps = [EndpointId(f"e{i}") for i in range(5)]
    key = first_chunk_key(b"some prompt prefix", 16)
    order = rendezvous_order(key, eps)
    assert order == rendezvous_order(key, list(reversed(eps)))
    fewer = rendezvous_order(key, [e for e in eps if e != order[-1]])
    assert fewer[0] == order[0]
    firsts = {rendezvous_order(first_chunk_key(str(i).encode(), 16), eps)[0] for i in range(200)}
    assert len(firsts) == 5  # keys spread over all endpoints


# ------------------------------------------------------------------ plugins


def test_scorers_stay_in_unit_range() -> None:
    eps = [view("a", work=0.0, kv=0.0), view("b", work=5.0, kv=1.0, free=0, total=1000)]
    for scorer in (LoadScorer(), KvHeadroomScorer(), PrefixAffinityScorer()):
        for s in scorer.score(req(), eps).values():
            assert 0.0 <= s <= 1.0


def test_kv_headroom_counts_request_blocks() -> None:
    r = req(prompt_tokens=100, max_tokens=30)  # 144 tokens at block 16
    eps = [view("fits", free=200, total=1000), view("tight", free=140, total=1000)]
    got = KvHeadroomScorer().score(r, eps)
    assert got[EndpointId("fits")] == pytest.approx(56 / 1000)
    assert got[EndpointId("tight")] == 0.0


def test_affinity_zero_when_over_bound() -> None:
    eps = [view("hot", work=3.0, match=4), view("b", work=0.1, match=0), view("c", work=0.1)]
    got = PrefixAffinityScorer(load_bound=0.25, slack_requests=1).score(req(), eps)
    assert got[EndpointId("hot")] == 0.0


def test_picker_seeded_tie_break() -> None:
    tied = [ScoredEndpoint(EndpointId(n), 1.0, ()) for n in "abcd"]
    picks = {MaxScorePicker().order(tied, random.Random(s))[0][0].id for s in range(40)}
    assert len(picks) > 1
    a = MaxScorePicker().order(tied, random.Random(7))
    b = MaxScorePicker().order(tied, random.Random(7))
    assert a == b and a[1] is True


# ------------------------------------------------------------------ pipeline


def test_filters_and_no_endpoint() -> None:
    pipe = default_pipeline()
    eps = [
        view("sick", healthy=False),
        view("out", ejected=True),
        view("other", models=frozenset({"x"})),
        view("ok"),
    ]
    d = pipe.schedule(req(), eps, random.Random(0))
    assert d.ranking == (EndpointId("ok"),)
    assert d.decided_by == "filter:serves-model" and d.reason == "single"
    assert {n for n, _ in d.filtered_out} == {"healthy", "not-ejected", "serves-model"}
    with pytest.raises(NoEndpointError) as err:
        pipe.schedule(req(), [view("sick", healthy=False)], random.Random(0))
    assert err.value.filter_name == "healthy"


def test_soft_context_filter_never_empties_the_pool() -> None:
    pipe = default_pipeline()
    short, long_ = view("short", max_len=512), view("long", max_len=8192)
    d = pipe.schedule(req(prompt_tokens=4000), [short, long_], random.Random(0))
    assert d.ranking == (EndpointId("long"),)
    d = pipe.schedule(req(prompt_tokens=40000), [short, long_], random.Random(0))
    assert len(d.ranking) == 2  # clearly too long for all: the engine answers


def test_affinity_hit_beats_mild_load_difference() -> None:
    eps = [view("warm", work=0.3, match=4), view("cold", work=0.0)]
    d = default_pipeline().schedule(req(), eps, random.Random(0))
    assert d.pick == EndpointId("warm") and d.reason == "affinity-hit"
    assert d.decided_by == "scorer:prefix-affinity" and d.predicted_cached_chunks == 4


def test_cold_prefix_goes_to_rendezvous_target() -> None:
    eps = [view("a", rank=1), view("b", rank=0), view("c", rank=2)]
    for seed in range(20):  # level loads: rendezvous order decides, never the dice
        d = default_pipeline().schedule(req(), eps, random.Random(seed))
        assert d.pick == EndpointId("b") and d.reason == "cold"


def test_cold_prefix_takes_the_less_loaded_of_two_rendezvous_candidates() -> None:
    # b is the rendezvous target but busier than a, the second candidate; c (third) is idle
    eps = [view("a", rank=1, work=0.1), view("b", rank=0, work=0.3), view("c", rank=2)]
    d = default_pipeline(cold_choices=2).schedule(req(), eps, random.Random(0))
    assert d.pick == EndpointId("a") and d.reason == "cold"
    assert d.decided_by == "scorer:load"
    # d = 1 (the default) is plain rendezvous: b, though busier (within the load bound)
    d = default_pipeline().schedule(req(), eps, random.Random(0))
    assert d.pick == EndpointId("b") and d.reason == "cold"
    # d = 3 lets the idle third candidate win
    d = default_pipeline(cold_choices=3).schedule(req(), eps, random.Random(0))
    assert d.pick == EndpointId("c") and d.reason == "cold"


def test_cold_prefix_one_request_of_load_difference_overrides_rendezvous_order() -> None:
    cap = 64  # one request on a 64-sequence engine (the default capacity)
    eps = [view("first", rank=0, work=1 / cap), view("second", rank=1, work=0.0)]
    d = default_pipeline(cold_choices=2).schedule(req(), eps, random.Random(0))
    assert d.pick == EndpointId("second")
    for seed in range(10):  # level loads with d = 2: still the rendezvous target
        eps = [view("first", rank=0), view("second", rank=1)]
        d = default_pipeline(cold_choices=2).schedule(req(), eps, random.Random(seed))
        assert d.pick == EndpointId("first")


def test_hot_prefix_spills_to_next_best() -> None:
    eps = [view("hot", work=2.0, match=4), view("b", work=0.2), view("c", work=0.25)]
    d = default_pipeline().schedule(req(), eps, random.Random(0))
    assert d.pick == EndpointId("b") and d.reason == "spill"


def test_saturated_engine_avoided() -> None:
    eps = [view("full", work=1.5, kv=0.99, free=10, total=10000), view("free", work=0.1, kv=0.1)]
    d = default_pipeline().schedule(req(chunks=0), eps, random.Random(0))
    assert d.pick == EndpointId("free") and d.reason == "fallback"
    assert d.ranking[-1] == EndpointId("full")


def test_flooding_one_hot_prefix_spreads_load() -> None:
    """Simulated flood: each pick adds work to the pick and records the prefix there."""
    pipe = default_pipeline()
    names = [f"e{i}" for i in range(4)]
    work = dict.fromkeys(names, 0.0)
    idx = PrefixIndex(capacity=100)
    chain = chunk_chain(b"x" * 1024, 256)
    order = rendezvous_order(first_chunk_key(b"x" * 1024, 256), [EndpointId(n) for n in names])
    rng = random.Random(1)
    reasons: list[str] = []
    for _ in range(40):
        eps = [
            view(
                n,
                work=work[n],
                match=idx.match(EndpointId(n), chain),
                rank=order.index(EndpointId(n)),
            )
            for n in names
        ]
        d = pipe.schedule(req(chunks=len(chain)), eps, rng)
        work[d.pick] += 1 / 8
        idx.record(d.pick, chain)
        reasons.append(d.reason)
    assert reasons[0] == "cold"
    assert "spill" in reasons and "affinity-hit" in reasons
    assert max(work.values()) - min(work.values()) <= 3 / 8  # spread, not one hot engine
    assert all(idx.match(EndpointId(n), chain) == len(chain) for n in names)


# ------------------------------------------------------------------ prefill cost


DOC = dict(chunks=100, prompt_tokens=3000)  # a 3000-token document prompt


def test_uncached_tokens_and_prefill_cost() -> None:
    r = req(**DOC)
    assert uncached_tokens(r, 0) == 3000 and uncached_tokens(r, 97) == 90
    assert uncached_tokens(r, 100) == 0 and uncached_tokens(r, 500) == 0
    assert uncached_tokens(req(chunks=0, prompt_tokens=7), 0) == 7
    assert prefill_cost(r, view("w", match=97, backlog=1000)) == 1090


@pytest.mark.parametrize(
    ("backlog", "pick", "reason"),
    [
        (0, "warm", "affinity-hit"),
        # 3090 tokens ahead vs recomputing 3000 on an idle engine: within the slack
        (3000, "warm", "affinity-hit"),
        # limit = 1.25 x 3000 + 512 = 4262 tokens: just under keeps it, just over spills
        (4172, "warm", "affinity-hit"),
        (4173, "cold", "spill"),
        (12000, "cold", "spill"),
    ],
)
def test_warm_engine_keeps_affinity_until_its_backlog_outweighs_the_prompt(
    backlog: int, pick: str, reason: str
) -> None:
    eps = [view("warm", match=97, backlog=backlog, rank=0), view("cold", rank=1)]
    d = default_pipeline().schedule(req(**DOC), eps, random.Random(0))
    assert d.pick == EndpointId(pick) and d.reason == reason


def test_spill_for_prefill_cost_goes_to_the_cheapest_rendezvous_candidate() -> None:
    # rendezvous order: warm, busy, idle; busy has a backlog over the limit as well
    eps = [
        view("warm", match=97, backlog=9000, rank=0),
        view("busy", backlog=6000, rank=1),
        view("idle", rank=2),
    ]
    d = default_pipeline().schedule(req(**DOC), eps, random.Random(0))
    assert d.pick == EndpointId("idle") and d.reason == "spill"


def test_cold_prefix_skips_a_rendezvous_target_with_a_prefill_backlog() -> None:
    eps = [view("target", rank=0, backlog=6000), view("second", rank=1, backlog=200)]
    d = default_pipeline().schedule(req(**DOC), eps, random.Random(0))
    assert d.pick == EndpointId("second") and d.reason == "spill"
    # a backlog within the slack leaves rendezvous alone (replicas keep agreeing)
    eps = [view("target", rank=0, backlog=300), view("second", rank=1, backlog=0)]
    d = default_pipeline().schedule(req(**DOC), eps, random.Random(0))
    assert d.pick == EndpointId("target") and d.reason == "cold"


def test_prefill_rule_off_is_the_load_bound_alone() -> None:
    eps = [view("warm", match=97, backlog=50000, rank=0), view("cold", rank=1)]
    d = default_pipeline(prefill_slack=None).schedule(req(**DOC), eps, random.Random(0))
    assert d.pick == EndpointId("warm") and d.reason == "affinity-hit"
    scorer = PrefixAffinityScorer(prefill_slack=None)
    assert scorer.eligible(req(**DOC), eps) == {EndpointId("warm"): True, EndpointId("cold"): True}


def test_cold_prefix_goes_where_the_fewest_prompt_tokens_are_queued() -> None:
    # rendezvous: a, b, c; backlogs 2000 / 900 / 0: only c is within 512 tokens of the least
    eps = [
        view("a", rank=0, backlog=2000),
        view("b", rank=1, backlog=900),
        view("c", rank=2, backlog=0, work=0.2),  # busier in requests, within the load bound
    ]
    d = default_pipeline().schedule(req(**DOC), eps, random.Random(0))
    assert d.pick == EndpointId("c") and d.reason == "spill"  # passed over a and b
    # within the slack of each other, rendezvous order decides again (replicas agree)
    eps = [view("a", rank=0, backlog=400), view("b", rank=1, backlog=0)]
    d = default_pipeline().schedule(req(**DOC), eps, random.Random(0))
    assert d.pick == EndpointId("a") and d.reason == "cold"


def test_cold_choices_none_lets_the_least_loaded_near_cheapest_endpoint_win() -> None:
    eps = [
        view("target", rank=0, work=0.25),
        view("idle", rank=2, work=0.0),
        view("queued", rank=1, work=0.0, backlog=3000),  # idle slots, but prefill queued
    ]
    d = default_pipeline(cold_choices=None).schedule(req(**DOC), eps, random.Random(0))
    assert d.pick == EndpointId("idle") and d.reason == "cold"
    d = default_pipeline(cold_choices=1).schedule(req(**DOC), eps, random.Random(0))
    assert d.pick == EndpointId("target") and d.reason == "cold"


# ------------------------------------------------------------ hit-weighted load bound


def test_bound_scales_with_the_prompt_tokens_a_spill_would_prefill_again() -> None:
    scorer = PrefixAffinityScorer(load_bound=1.0, bound_tokens=2048)
    r = req(**DOC)  # 3000 tokens in 100 chunks
    eps = [
        view("doc", match=100),  # saves all 3000 tokens against "none": the full bound
        view("half", match=34),  # saves 1020 tokens: about half of it
        view("none"),  # holds nothing: bound 0
    ]
    b = scorer.bounds(r, eps)
    assert b[EndpointId("doc")] == 1.0 and b[EndpointId("none")] == 0.0
    assert b[EndpointId("half")] == pytest.approx(1020 / 2048)
    # a prefix every endpoint holds (a shared system prompt) saves nothing anywhere
    shared = [view("a", match=10), view("b", match=10)]
    assert set(scorer.bounds(r, shared).values()) == {0.0}
    # unset: the flat bound for every endpoint
    flat = PrefixAffinityScorer(load_bound=1.0).bounds(r, eps)
    assert set(flat.values()) == {1.0}


@pytest.mark.parametrize(
    ("match", "keeps"),
    [
        (100, True),  # a 3000-token document: staying at 1.75x the mean beats a re-prefill
        (10, False),  # 300 tokens of history: spill to the idle engines
    ],
)
def test_a_loaded_engine_keeps_a_long_prefix_but_not_a_short_one(match: int, keeps: bool) -> None:
    # mean work 0.4: "warm" at 1.75x the mean, over a flat bound of 0.25, under 1.0
    eps = [view("warm", match=match, work=0.7, rank=1), view("a", work=0.3), view("b", work=0.2)]
    scorer = PrefixAffinityScorer(load_bound=1.0, slack_requests=0, bound_tokens=2048)
    assert scorer.eligible(req(**DOC), eps)[EndpointId("warm")] is keeps
    d = default_pipeline(load_bound=1.0, bound_tokens=2048).schedule(
        req(**DOC), eps, random.Random(0)
    )
    assert (d.pick == EndpointId("warm")) is keeps
