"""The router's own placements as pending blocks in the exact view (kvpending.py).

Pure: a Fleet of four emulated-vLLM endpoint records with live feeds (no sockets),
the router's default pipeline, a fake clock. An engine publishes BlockStored only
after prefilling, so without the overlay a burst for a new prefix sees nothing
resident and spreads; with it the burst stays on the endpoint of its first request.
"""

from __future__ import annotations

import random

from fleetgate.engines.base import BlockRemoved, BlockStored, KvEventBatch, LoadSnapshot
from fleetgate.router.app import pipeline_for
from fleetgate.router.config_sections import Scheduling
from fleetgate.router.scheduling.exact import PromptKeys
from fleetgate.router.scheduling.kvindex import KvIndex
from fleetgate.router.scheduling.kvpending import PendingBlocks
from fleetgate.router.scheduling.load import LoadParams
from fleetgate.router.scheduling.prefix import PrefixIndex, rendezvous_order
from fleetgate.router.scheduling.types import EndpointId, RequestView
from fleetgate.router.served import adapter_for
from fleetgate.router.state import Endpoint, Fleet

BS = 16
MODEL = "m"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make_fleet(clock: Clock, *, overlay: bool) -> Fleet:
    adapter = adapter_for("vllm", None)
    eps = []
    for i in range(4):
        e = Endpoint(
            id=EndpointId(f"e{i}"),
            pool="default",
            engine=adapter.name,
            url=f"http://127.0.0.1:{18300 + i}",
            adapter=adapter,
            metrics_source=adapter.metrics_sources[0],
        )
        e.healthy, e.models = True, frozenset({MODEL})
        e.kv_feed.set("live", clock.now)
        # every engine equally busy: 16 of 64 slots, a quarter of its KV
        e.scraped(
            LoadSnapshot(
                scraped_at=clock.now,
                kv_usage=0.25,
                running=16,
                waiting=0,
                block_size=BS,
                blocks_total=4096,
                blocks_free=3072,
                max_running=64,
            )
        )
        eps.append(e)
    pending = PendingBlocks(clock, ttl_s=2.0) if overlay else None
    return Fleet(
        eps,
        index=PrefixIndex(1024),
        load_params=LoadParams(),
        kv_index=KvIndex(pending=pending),
    )


DOC = [1000 + (i * 7919) % 30000 for i in range(3000)]


def prompt(q: int) -> list[int]:
    return DOC + [50000 + q * 100 + j for j in range(60)]


def place(fleet: Fleet, tokens: list[int], clock: Clock, rng: random.Random) -> tuple[str, str]:
    """One scheduling cycle as the router runs it: views, pipeline, reserve
    (dispatch accounting + the pending placement). Returns (endpoint, reason)."""
    keys = PromptKeys(tokens)
    request = RequestView(
        model=MODEL, chunks=len(tokens) // 32, prompt_tokens=len(tokens), max_tokens=124
    )
    order = rendezvous_order(7, list(fleet.endpoints))
    views = fleet.views((), order, clock.now, keys)
    decision = pipeline_for(Scheduling()).schedule(request, views, rng)
    e = fleet.endpoints[decision.pick]
    cached = fleet.exact_cached(e, keys) or 0
    e.dispatch(request.prompt_tokens + request.max_tokens, max(0, len(tokens) - cached))
    fleet.kv_index.place(e.id, keys.keys(e.block_size))
    return e.id, decision.reason


def burst(overlay: bool) -> list[tuple[str, str]]:
    clock, rng = Clock(), random.Random(0)
    fleet = make_fleet(clock, overlay=overlay)
    out = []
    for q in range(6):
        clock.now += 0.01  # 10 ms apart: far less than a 3000-token prefill
        out.append(place(fleet, prompt(q), clock, rng))
    return out


def test_a_burst_for_a_new_prefix_goes_to_one_endpoint_with_the_overlay() -> None:
    got = burst(overlay=True)
    assert len({eid for eid, _ in got}) == 1, got
    assert [reason for _, reason in got] == ["cold"] + ["affinity-hit"] * 5


def test_without_the_overlay_the_same_burst_spreads() -> None:
    # the control: nothing is resident until the engine's events arrive, so every
    # request is a cold placement and the load scorer spreads them
    got = burst(overlay=False)
    assert len({eid for eid, _ in got}) > 1, got
    assert all(reason == "cold" for _, reason in got)


def stored(tokens: list[int], first_hash: int) -> KvEventBatch:
    n = len(tokens) // BS
    event = BlockStored(
        block_hashes=tuple(range(first_hash, first_hash + n)),
        parent_hash=None,
        token_ids=tuple(tokens[: n * BS]),
        block_size=BS,
    )
    return KvEventBatch(seq=None, events=(event,))


def test_an_unconfirmed_pending_placement_expires_after_its_prefill() -> None:
    clock = Clock()
    fleet = make_fleet(clock, overlay=True)
    e = fleet.endpoints[EndpointId("e2")]
    keys = PromptKeys(prompt(0))
    counted = fleet.kv_index.place(e.id, keys.keys(BS))
    assert len(counted) == len(prompt(0)) // BS
    assert fleet.exact_cached(e, keys) == len(counted) * BS
    clock.now += 300.0  # the engine queues it for minutes: still pending while it prefills
    assert fleet.exact_cached(e, keys) == len(counted) * BS
    fleet.kv_index.settle(e.id, counted)  # first token; the engine never confirms
    clock.now += 1.9
    assert fleet.exact_cached(e, keys) == len(counted) * BS
    clock.now += 0.2
    assert fleet.exact_cached(e, keys) == 0
    other = fleet.endpoints[EndpointId("e0")]
    assert fleet.exact_cached(other, keys) == 0


def test_a_placement_is_never_pending_longer_than_max_age() -> None:
    clock = Clock()
    pending = PendingBlocks(clock, ttl_s=2.0, max_age_s=30.0)
    pending.place(EndpointId("a"), (1, 2, 3), lambda k: False)
    clock.now += 29.0
    assert pending.holds(EndpointId("a"), 3)
    clock.now += 1.0  # its end was never seen (no settle): gone anyway
    assert not pending.holds(EndpointId("a"), 3)


def test_events_confirm_pending_blocks_and_a_removal_still_removes() -> None:
    clock = Clock()
    fleet = make_fleet(clock, overlay=True)
    index = fleet.kv_index
    e = fleet.endpoints[EndpointId("e1")]
    tokens = prompt(0)
    keys = PromptKeys(tokens)
    full = len(tokens) // BS * BS
    counted = index.place(e.id, keys.keys(BS))
    index.apply(e.id, stored(tokens, 1))  # the engine prefilled and published them
    assert index.pending is not None and index.pending.blocks(e.id) == 0  # confirmed
    assert fleet.exact_cached(e, keys) == full
    # a second placement of the same prompt adds nothing: all of it is resident
    assert index.place(e.id, keys.keys(BS)) == ()
    # the engine evicts the tail while the first request is still in its prefill
    # accounting: the removal wins, nothing pending brings the blocks back
    n = len(tokens) // BS
    index.apply(e.id, KvEventBatch(seq=None, events=(BlockRemoved(tuple(range(101, n + 1))),)))
    assert fleet.exact_cached(e, keys) == 100 * BS
    index.settle(e.id, counted)
    clock.now += 10.0
    assert fleet.exact_cached(e, keys) == 100 * BS


def test_pending_chain_extends_a_resident_prefix_and_stops_at_a_gap() -> None:
    clock = Clock()
    index = KvIndex(pending=PendingBlocks(clock))
    a = EndpointId("a")
    tokens = prompt(0)
    keys = PromptKeys(tokens).keys(BS)
    index.apply(a, stored(tokens[: 10 * BS], 1))  # 10 blocks resident
    counted = index.place(a, keys[:20])  # the next 10 are pending
    assert len(counted) == 10
    assert index.match(a, keys) == 10  # the plain exact view: confirmed blocks only
    assert index.match_believed(a, keys) == 20
    index.clear(a)  # AllBlocksCleared / restart: pending goes too
    assert index.match_believed(a, keys) == 0


def test_pending_memory_is_bounded_per_endpoint() -> None:
    clock = Clock()
    pending = PendingBlocks(clock, max_blocks=100)
    a = EndpointId("a")
    for start in range(0, 1000, 50):
        pending.place(a, tuple(range(start, start + 50)), lambda k: False)
    assert pending.blocks(a) == 100
    assert pending.holds(a, 999) and not pending.holds(a, 0)  # the oldest went first


def test_settled_entries_are_purged_on_later_placements() -> None:
    clock = Clock()
    pending = PendingBlocks(clock, ttl_s=1.0)
    a = EndpointId("a")
    for start in range(0, 500, 50):
        keys = tuple(range(start, start + 50))
        pending.settle(a, pending.place(a, keys, lambda k: False))
        clock.now += 2.0
    pending.place(a, (10_000,), lambda k: False)
    assert pending.blocks(a) == 1


def test_a_second_placement_keeps_blocks_pending_after_the_first_prefill_ends() -> None:
    clock = Clock()
    pending = PendingBlocks(clock, ttl_s=1.0)
    a = EndpointId("a")
    first = pending.place(a, (1, 2), lambda k: False)
    second = pending.place(a, (1, 2), lambda k: False)
    pending.settle(a, first)
    clock.now += 5.0
    assert pending.holds(a, 2)  # the second request still prefills them
    pending.settle(a, second)
    clock.now += 1.0
    assert not pending.holds(a, 2)
