"""The ``prefix-affinity`` scorer, alone and in the default pipeline.

We test these aspects:
* the load bound zeroes affinity; a cold prefix goes to its rendezvous target(s);
* prefill cost: a warm engine keeps affinity unless its prefill backlog exceeds
  recomputing the prompt elsewhere (plus slack); a cold prefix skips a rendezvous
  target with a backlog;
* the hit-weighted load bound: a long cached document keeps a loaded engine, a few
  hundred tokens of history do not.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import pytest

from fleetgate.router.scheduling.pipeline import default_pipeline
from fleetgate.router.scheduling.plugins.prefix_affinity import (
    PrefixAffinityScorer,
    approximate_cached,
    prefill_cost,
    uncached_tokens,
)
from fleetgate.router.scheduling.types import EndpointId, EndpointView

from .views import DOC, req, view


def test_affinity_zero_when_over_bound() -> None:
    eps = [view("hot", work=3.0, match=4), view("b", work=0.1, match=0), view("c", work=0.1)]
    got = PrefixAffinityScorer(load_bound=0.25, slack_requests=1).score(req(), eps)
    assert got[EndpointId("hot")] == 0.0


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


def test_uncached_tokens_and_prefill_cost() -> None:
    r = req(**DOC)
    # cached tokens in, uncached tokens out; 97 of 100 approximate chunks ~ 2910 tokens
    assert uncached_tokens(r, 0) == 3000 and uncached_tokens(r, 2910) == 90
    assert uncached_tokens(r, 3000) == 0 and uncached_tokens(r, 5000) == 0
    assert approximate_cached(r, 97) == 2910 and approximate_cached(r, 500) == 3000
    assert uncached_tokens(req(chunks=0, prompt_tokens=7), 0) == 7
    assert prefill_cost(r, view("w", match=97, backlog=1000)) == 1090


@pytest.mark.parametrize(
    ("backlog", "pick", "reason"),
    [
        (0, "warm", "affinity-hit"),
        # 3090 tokens ahead vs recomputing 3000 on an idle engine: within the slack
        (3000, "warm", "affinity-hit"),
        # the cold engine's cost counts its 2910 extra prompt tokens twice (its own
        # wait, and the work a second copy adds): limit = 1.25 x (3000 + 2910) + 512
        # = 7899.5 tokens: just under keeps it, just over spills
        (4173, "warm", "affinity-hit"),
        (7809, "warm", "affinity-hit"),
        (7810, "cold", "spill"),
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


def test_without_the_spill_work_the_limit_is_the_cold_engine_own_cost() -> None:
    # spill_prefill_weight 0 (the rule before): limit = 1.25 x 3000 + 512 = 4262
    for backlog, pick in ((4172, "warm"), (4173, "cold")):
        eps = [view("warm", match=97, backlog=backlog, rank=0), view("cold", rank=1)]
        d = default_pipeline(spill_prefill_weight=0.0).schedule(req(**DOC), eps, random.Random(0))
        assert d.pick == EndpointId(pick)


def test_an_even_overload_keeps_every_cached_document_where_it_is() -> None:
    # four engines, all past a full batch with a deep prefill queue: the holder keeps
    # the request whatever the small differences (a spill only prefills it twice)
    for work, backlog in ((1.0, 20000), (1.1, 24000), (1.3, 21000), (1.2, 26000)):
        eps = [
            view("holder", match=97, work=work, backlog=backlog, rank=3),
            view("a", work=1.0, backlog=20000, rank=0),
            view("b", work=0.95, backlog=18000, rank=1),
            view("c", work=1.1, backlog=22000, rank=2),
        ]
        d = default_pipeline().schedule(req(**DOC), eps, random.Random(0))
        assert d.pick == EndpointId("holder") and d.reason == "affinity-hit", (work, backlog)


def test_a_markedly_less_loaded_engine_still_takes_the_spill() -> None:
    # the holder's prefill queue is three times the others' (plus the copy): spill
    eps = [
        view("holder", match=97, work=1.0, backlog=40000, rank=3),
        view("a", work=0.9, backlog=10000, rank=0),
        view("b", work=0.9, backlog=12000, rank=1),
    ]
    d = default_pipeline().schedule(req(**DOC), eps, random.Random(0))
    assert d.pick == EndpointId("a") and d.reason == "spill"


@pytest.mark.parametrize(
    ("other_work", "keeps"),
    [
        (0.95, True),  # a free slot, but nearly as loaded: stay
        (0.7, True),  # 0.7 x 1.5 = 1.05 > 1.0: not markedly emptier
        (0.66, False),  # at most 1 / 1.5 of the holder's work: queueing is worse
        (0.2, False),
    ],
)
def test_a_full_batch_gives_up_affinity_only_for_a_markedly_emptier_engine(
    other_work: float, keeps: bool
) -> None:
    scorer = PrefixAffinityScorer(prefill_slack=None, queue_work=1.0, queue_ratio=1.5)
    eps = [view("full", match=97, work=1.0), view("other", work=other_work)]
    assert scorer.eligible(req(**DOC), eps)[EndpointId("full")] is keeps
    # queue_ratio None (the rule before): any free slot elsewhere drops affinity
    old = PrefixAffinityScorer(prefill_slack=None, queue_work=1.0, queue_ratio=None)
    assert old.eligible(req(**DOC), eps)[EndpointId("full")] is False


def test_the_copy_a_spill_makes_weighs_more_on_a_busy_target() -> None:
    # the target has 5 documents' worth of prefill queued: its second prefill of the
    # 2910 extra tokens delays what arrives there before that queue drains, so it
    # counts (1 + 5) times: limit = 1.25 x (15000 + 3000 + 6 x 2910) + 512 = 44,837
    # against the holder's backlog + its 90 uncached tokens
    for backlog, pick in ((30000, "holder"), (44747, "holder"), (44748, "busy")):
        eps = [
            view("holder", match=97, backlog=backlog, rank=0),
            view("busy", backlog=15000, rank=1),
        ]
        d = default_pipeline().schedule(req(**DOC), eps, random.Random(0))
        assert d.pick == EndpointId(pick), backlog
    # the rule before (spill_prefill_weight 0) moved it at 30000 already
    eps = [view("holder", match=97, backlog=30000, rank=0), view("busy", backlog=15000, rank=1)]
    d = default_pipeline(spill_prefill_weight=0.0).schedule(req(**DOC), eps, random.Random(0))
    assert d.pick == EndpointId("busy")


def _exact(v: EndpointView, tokens: int | None) -> EndpointView:
    return dataclasses.replace(v, exact_cached_tokens=tokens)


def test_an_endpoint_the_load_bound_excludes_is_no_alternative_for_the_prefill_rule() -> None:
    # measured on shared-prefix with events (decision trace, docs/router.md): the holder
    # lost affinity to an idle engine that was itself past its load bound, and the
    # request then went to a third engine whose own cost would not have justified the
    # spill. Holder: 13.6k prompt tokens queued, the whole document cached.
    def fleet(idle_work: float) -> list[EndpointView]:
        return [
            _exact(view("holder", work=0.45, backlog=13600, rank=0), 2992),
            _exact(view("idle", work=idle_work, backlog=0, rank=1), 0),
            _exact(view("third", work=0.44, backlog=3700, rank=2), 0),
        ]

    r = req(chunks=100, prompt_tokens=3100)
    pipeline = default_pipeline(load_bound=1.0, cold_choices=None, bound_tokens=1640)
    # the idle engine is within its bound (a new prefix may go there): the spill pays
    d = pipeline.schedule(r, fleet(idle_work=0.30), random.Random(0))
    assert d.pick == EndpointId("idle") and d.reason == "spill"
    # past its bound (0.9 against a mean of 0.6 + 2 requests of 8 slack; it holds none
    # of the prompt, so its bound is 0): it cannot take the request, so the holder is
    # compared with the third engine only, and keeps it
    d = pipeline.schedule(r, fleet(idle_work=0.90), random.Random(0))
    assert d.pick == EndpointId("holder") and d.reason == "affinity-hit"


def test_replicas_agree_on_a_new_document_one_of_them_just_placed() -> None:
    # Replica A sent the document to "first" a moment ago (still queued: no block
    # stored yet), so A's view holds it there; replica B's view holds it nowhere.
    # The replicas' settings (bound 0.25, no prefill rule); "first" is at 1.2x the
    # mean: past the cold bound (the mean), within a holder's (1.25x).
    settings: dict[str, Any] = dict(
        load_bound=0.25, slack_requests=0, prefill_slack=None, bound_tokens=1640
    )
    loads = {"first": 0.48, "second": 0.42, "third": 0.3}
    a = [view(n, work=w, rank=i, match=100 if n == "first" else 0) for i, (n, w) in
         enumerate(loads.items())]  # fmt: skip
    b = [view(n, work=w, rank=i) for i, (n, w) in enumerate(loads.items())]
    for views in (a, b):
        d = default_pipeline(**settings).schedule(req(**DOC), views, random.Random(0))
        assert d.pick == EndpointId("first")
    scorer = PrefixAffinityScorer(**settings)
    assert scorer.bounds(req(**DOC), b)[EndpointId("first")] == 0.25
    assert scorer.bounds(req(**DOC), b)[EndpointId("second")] == 0.0
    # one router places a new document on the least loaded (cold_choices None): the
    # cold bound stays, and the busy rendezvous target gets no extra load
    alone = dataclasses.replace(scorer, cold_choices=None)
    assert set(alone.bounds(req(**DOC), b).values()) == {0.0}


def test_the_rendezvous_target_bound_covers_spills_but_not_a_shared_system_prompt() -> None:
    scorer = PrefixAffinityScorer(load_bound=0.25, slack_requests=0, bound_tokens=1640)
    # the document is held by "holder" only: "first" (the rendezvous target, holding
    # none of it) is where a spill goes, so it gets a holder's bound too
    held = [view("first", rank=0), view("holder", rank=1, match=100), view("c", rank=2)]
    b = scorer.bounds(req(**DOC), held)
    assert b[EndpointId("first")] == 0.25 and b[EndpointId("c")] == 0.0
    # every endpoint holds the first 10 chunks (a system prompt): no extra bound
    shared = [view(n, rank=i, match=10) for i, n in enumerate(("first", "b", "c"))]
    assert set(scorer.bounds(req(**DOC), shared).values()) == {0.0}
