"""The scheduling cycle (``scheduling.pipeline``) on plain views: scores stay in [0, 1],
the decision names its plugin and reason, bounded-load spill spreads a hot prefix,
a saturated engine is avoided.
"""

from __future__ import annotations

import random

from fleetgate.router.scheduling.pipeline import default_pipeline
from fleetgate.router.scheduling.plugins.kv_headroom import KvHeadroomScorer
from fleetgate.router.scheduling.plugins.load_scorer import LoadScorer
from fleetgate.router.scheduling.plugins.prefix_affinity import PrefixAffinityScorer
from fleetgate.router.scheduling.prefix import (
    PrefixIndex,
    chunk_chain,
    first_chunk_key,
    rendezvous_order,
)
from fleetgate.router.scheduling.types import EndpointId

from .views import req, view


def test_scorers_stay_in_unit_range() -> None:
    eps = [view("a", work=0.0, kv=0.0), view("b", work=5.0, kv=1.0, free=0, total=1000)]
    for scorer in (LoadScorer(), KvHeadroomScorer(), PrefixAffinityScorer()):
        for s in scorer.score(req(), eps).values():
            assert 0.0 <= s <= 1.0


def test_affinity_hit_beats_mild_load_difference() -> None:
    eps = [view("warm", work=0.3, match=4), view("cold", work=0.0)]
    d = default_pipeline().schedule(req(), eps, random.Random(0))
    assert d.pick == EndpointId("warm") and d.reason == "affinity-hit"
    assert d.decided_by == "scorer:prefix-affinity" and d.predicted_cached_chunks == 4


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
    chain = chunk_chain(b"x " * 1024, 256)
    order = rendezvous_order(first_chunk_key(b"x " * 1024, 256), [EndpointId(n) for n in names])
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
