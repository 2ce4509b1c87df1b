"""The load estimate (``scheduling.load``): router traffic since the scrape counts at
once, staleness is pessimistic, engines are normalised by their own capacity.
"""

from __future__ import annotations

import math

import pytest

from fleetgate.router.scheduling.load import (
    RouterCounts,
    estimate_load,
    kv_tokens_needed,
    replica_snapshot,
    slot_limit,
)

from .views import P, snap


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


def test_a_replica_of_several_schedulers_holds_the_reported_limit_each() -> None:
    """TensorRT-LLM attention DP: 4 ranks, maxNumActiveRequests 64 is one rank's. The
    router's 128 requests in flight fill half the replica, not two replicas' worth."""
    s = snap(running=32, max_running=64)
    counts = RouterCounts(in_flight=128)
    one = estimate_load(s, counts, 100.0, P)
    adp = estimate_load(replica_snapshot(s, 4), counts, 100.0, P)
    assert (one.work, adp.work) == (pytest.approx(2.0), pytest.approx(0.5))
    assert slot_limit(replica_snapshot(s, 4), 512) == 256, "a reported limit wins"
    assert slot_limit(replica_snapshot(None, 4), 512) == 512
    assert slot_limit(snap(max_running=None), None) is None
    # the rank's pool too: the router's tokens since the scrape spread over 4 ranks' blocks
    kv = snap(kv_usage=0.5, blocks_total=100, blocks_free=50, block_size=16, max_running=64)
    counts = RouterCounts(in_flight=1, dispatched_tokens_since_scrape=1600)
    assert replica_snapshot(kv, 1) is kv
    assert estimate_load(kv, counts, 100.0, P).kv_fraction == pytest.approx(1.0)
    spread = estimate_load(replica_snapshot(kv, 4), counts, 100.0, P)
    assert spread.kv_fraction == pytest.approx(1 - (4 * 50 * 16 - 1600) / (4 * 100 * 16))


def test_kv_estimate_counts_tokens_dispatched_since_scrape() -> None:
    s = snap(kv_usage=0.1, blocks_total=100, blocks_free=90, block_size=16)
    est = estimate_load(s, RouterCounts(dispatched_tokens_since_scrape=800), 100.0, P)
    assert est.free_kv_tokens == 90 * 16 - 800
    assert est.kv_fraction == pytest.approx(1 - (1440 - 800) / 1600)


def test_kv_tokens_needed_rounds_to_block_size() -> None:
    assert kv_tokens_needed(100, 30, 16) == 144
    assert kv_tokens_needed(100, 30, 128) == 256


def test_idle_without_a_kv_figure_reads_as_an_empty_cache_unknown_does_not() -> None:
    """A TensorRT-LLM engine before its first iteration reports idle counts and no KV
    figure: that is an empty cache, not the pessimistic prior (which starved it)."""
    idle_no_kv = estimate_load(
        snap(running=0, waiting=0, kv_usage=None, blocks_total=None, blocks_free=None),
        RouterCounts(),
        100.0,
        P,
    )
    unknown = estimate_load(
        snap(running=None, waiting=None, kv_usage=None, blocks_total=None, blocks_free=None),
        RouterCounts(),
        100.0,
        P,
    )
    assert idle_no_kv.kv_fraction == 0.0 and idle_no_kv.work == 0.0
    assert unknown.kv_fraction == pytest.approx(P.stale_kv)
