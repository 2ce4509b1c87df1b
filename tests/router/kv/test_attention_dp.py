"""Attention data parallelism: one engine replica, several ranks, each with its own KV cache
and its own event stream (TensorRT-LLM ``enable_attention_dp``).

* the index keeps one view per (endpoint, rank) and answers per endpoint as the engine
  will serve it: ``load`` (TensorRT-LLM's default rank choice, by load alone) the mean of
  the ranks' chains, ``cache`` (``enable_kv_cache_aware_routing``) the longest (pure);
* the HTTP drain (1.3): rank 0 gathers every rank's events, each rank numbering its own
  from 0. Before per-rank feeds, rank 1's event 0 after rank 0's event 1 read as an engine
  restart and cleared the endpoint on every drain;
* the ZeroMQ stream (main): rank r publishes on the base ports + r; one subscriber per
  rank (real sockets, the emulator's publisher with TensorRT-LLM's wire); a rank's
  restart clears that rank only, and the endpoint is ``live`` only when every rank is.

The multi-rank publishers here are the emulator's publisher class run once per rank with
events written by the test: the emulated engine itself is one rank (docs/router.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from fleetgate.engines.base import AllBlocksCleared, BlockRemoved, BlockStored, KvEventBatch
from fleetgate.engines.trtllm.kv_events import trtllm_event_items
from fleetgate.engines.trtllm.kv_zmq import encode_trtllm_kv_batch, signed_hash
from fleetgate.router.scheduling.kvindex import KvIndex, block_keys
from fleetgate.router.scheduling.types import EndpointId
from fleetgate.sim.core.kv_vllm import external_hash
from fleetgate.sim.fleet import EngineSpec, RunningEngine, free_port_run, run_fleet
from fleetgate.sim.vllm.kv_events import KvEventPublisher, KvEventsConfig

from .test_kvfeed import BS, complete, config, feeds_for, metric, until, zmq_backend

A, B = EndpointId("a"), EndpointId("b")


def toks(seed: int, blocks: int) -> tuple[int, ...]:
    return tuple((seed * 7919 + i * 31) % 30000 + 100 for i in range(blocks * BS))


def stored(first_hash: int, tokens: tuple[int, ...], parent: int | None = None) -> BlockStored:
    n = len(tokens) // BS
    return BlockStored(tuple(range(first_hash, first_hash + n)), parent, tokens, BS)


def batch(*events: Any) -> KvEventBatch:
    return KvEventBatch(seq=None, events=tuple(events))


# ------------------------------------------------------------------ the index (pure)


@pytest.mark.parametrize(("choice", "want"), [("load", (4 + 1) // 2), ("cache", 4)])
def test_ranks_are_separate_caches_matched_as_the_engine_picks_a_rank(
    choice: str, want: int
) -> None:
    doc = toks(1, 4)
    keys = block_keys(doc, BS)
    idx = KvIndex()
    idx.set_ranks(A, 2, choice)  # type: ignore[arg-type]
    idx.apply(A, batch(stored(100, doc)), rank=0)
    # rank 1 holds the first block only, under the SAME engine hash (every rank hashes
    # alike): its entry is its own, rank 0's stay
    idx.apply(A, batch(stored(100, doc[:BS])), rank=1)
    assert idx.match(A, keys) == want
    assert idx.blocks(A) == 5 and len(idx) == 5
    assert idx.engine_hashes(A, rank=1) == frozenset({100})
    # a removal on one rank leaves the other's copy
    idx.apply(A, batch(BlockRemoved((100,))), rank=1)
    assert idx.engine_hashes(A, rank=0) == frozenset({100, 101, 102, 103})
    assert idx.match(A, keys) == (4 if choice == "cache" else 4 // 2)
    idx.apply(A, batch(BlockRemoved((101,))), rank=0)
    assert idx.match(A, keys) == (1 if choice == "cache" else 1 // 2)


def test_a_rank_restart_forgets_that_rank_and_set_ranks_drops_ranks_gone() -> None:
    doc = toks(2, 3)
    keys = block_keys(doc, BS)
    idx = KvIndex()
    idx.set_ranks(A, 3, "cache")
    for r in range(3):
        idx.apply(A, batch(stored(10 * r, doc)), rank=r)
    idx.apply(B, batch(stored(7, doc)))
    idx.clear(A, rank=1)
    assert idx.engine_hashes(A) == frozenset({0, 1, 2, 20, 21, 22})
    idx.apply(A, batch(AllBlocksCleared()), rank=0)  # rank 0's own "cleared"
    assert idx.engine_hashes(A) == frozenset({20, 21, 22}) and idx.match(A, keys) == 3
    idx.set_ranks(A, 2, "cache")  # rank 2 is gone (a smaller replica)
    assert idx.blocks(A) == 0 and idx.match(A, keys) == 0
    assert idx.match(B, keys) == 3 and idx.ranks(B) == 1 and idx.ranks(A) == 2
    idx.clear(A)  # it left: no entries, and no rank count kept for it
    assert idx.endpoints() == [B] and idx.ranks(A) == 1


# ------------------------------------------------------------------ the HTTP drain (1.3)


class DrainEngine:
    """``POST /kv_cache_events`` of an attention-DP engine: rank 0 returns every rank's
    buffered events (TensorRT-LLM's ``KVCacheEventManager``: each rank counts its own
    ``event_id`` from 0; rank 0 gathers the others' and tags each ``attention_dp_rank``)."""

    def __init__(self, ranks: int) -> None:
        self.next_id = [0] * ranks
        self.buffer: list[dict[str, Any]] = []
        for r in range(ranks):
            self.add(r, AllBlocksCleared())  # each rank's cache starts: "created"

    def add(self, rank: int, *events: Any) -> None:
        items = trtllm_event_items(self.next_id[rank], events, 4096, 1000)
        self.next_id[rank] += len(items)
        self.buffer += [{**item, "attention_dp_rank": rank} for item in items]

    def handler(self, request: httpx.Request) -> httpx.Response:
        assert request.method == "POST" and request.url.path == "/kv_cache_events"
        body, self.buffer = self.buffer, []
        return httpx.Response(200, content=json.dumps(body).encode())


def drain_config(ranks: int) -> Any:
    return config([{"engine": "trtllm", "url": "http://127.0.0.1:9",
                    "kv_events": {"transport": "http-drain", "path": "/kv_cache_events",
                                  "ranks": ranks}}])  # fmt: skip


async def test_one_drain_of_every_rank_feeds_each_rank_and_restarts_nothing() -> None:
    engine = DrainEngine(ranks=2)
    doc = toks(3, 4)
    engine.add(0, stored(100, doc[: 2 * BS]))
    engine.add(1, stored(100, doc))  # rank 1's ids 1.. interleave with rank 0's
    engine.add(0, stored(102, doc[2 * BS :], parent=101))
    drain = httpx.MockTransport(engine.handler)
    async with feeds_for(drain_config(2), drain) as (fleet, _feeds, metrics):
        (ep,) = fleet
        await until(lambda: ep.kv_feed.state == "live", "both ranks live")
        keys = block_keys(doc, BS)
        assert fleet.kv_index.match(ep.id, keys) == 4, "load: (4 + 4) // 2"
        assert fleet.kv_index.engine_hashes(ep.id, rank=0) == frozenset({100, 101, 102, 103})
        assert metric(metrics, "fleetgate_kv_feed_restarts_total") == 0
        # only rank 1 keeps a new prefix: the engine may send it to either rank
        other = toks(4, 2)
        engine.add(1, stored(500, other))
        await until(lambda: fleet.kv_index.blocks(ep.id) == 10, "rank 1's new blocks")
        assert fleet.kv_index.match(ep.id, block_keys(other, BS)) == 1, "(0 + 2) // 2"
        # a rank's own restart ("created" again, its ids from 0) clears that rank only
        engine.next_id[1] = 0
        engine.add(1, AllBlocksCleared())
        await until(lambda: fleet.kv_index.blocks(ep.id) == 4, "rank 1 cleared")
        assert fleet.kv_index.engine_hashes(ep.id) == frozenset({100, 101, 102, 103})
        assert metric(metrics, "fleetgate_kv_feed_restarts_total") == 1
        assert ep.kv_feed.state == "live"


async def test_a_drain_with_a_rank_beyond_the_configured_ones_is_counted_not_applied() -> None:
    engine = DrainEngine(ranks=3)
    engine.add(2, stored(100, toks(5, 2)))
    drain = httpx.MockTransport(engine.handler)
    async with feeds_for(drain_config(2), drain) as (fleet, _feeds, metrics):
        (ep,) = fleet
        await until(lambda: ep.kv_feed.state == "live", "ranks 0 and 1 live")
        await until(lambda: metric(metrics, "fleetgate_kv_decode_errors_total") == 2,
                    "rank 2's two events counted")  # fmt: skip
        assert fleet.kv_index.blocks(ep.id) == 0


# ------------------------------------------------------------------ ZeroMQ (main)


def rank_publisher(port: int, replay: int) -> KvEventPublisher:
    cfg = KvEventsConfig(
        enable_kv_cache_events=True,
        endpoint=f"tcp://127.0.0.1:{port}",
        replay_endpoint=f"tcp://127.0.0.1:{replay}",
        topic="kv-events",
    )
    return KvEventPublisher(cfg, {}, encode=encode_trtllm_kv_batch, always_bind=True)


@contextlib.contextmanager
def ranks_up(base: int, replay: int, ranks: list[int]) -> Iterator[dict[int, KvEventPublisher]]:
    pubs = {r: rank_publisher(base + r, replay + r) for r in ranks}
    try:
        yield pubs
    finally:
        for p in pubs.values():
            p.close()


def zmq_config(base: int, replay: int, ranks: int, choice: str) -> Any:
    return config([{"engine": "trtllm", "url": "http://127.0.0.1:9",
                    "kv_events": {"port": base, "replay_port": replay, "topic": "kv-events",
                                  "ranks": ranks, "rank_choice": choice}}])  # fmt: skip


@pytest.mark.parametrize("choice", ["load", "cache"])
async def test_every_rank_stream_is_followed_and_scored_as_the_engine_picks(choice: str) -> None:
    base = free_port_run("127.0.0.1", 4)
    replay = base + 2
    doc = toks(6, 4)
    keys = block_keys(doc, BS)
    with ranks_up(base, replay, [0]) as pubs:
        pubs[0].publish([stored(100, doc)])
        async with feeds_for(zmq_config(base, replay, 2, choice)) as (fleet, feeds, metrics):
            metrics.watch_fleet(fleet, time.monotonic)
            (ep,) = fleet
            assert len(feeds.feeds[ep.id]) == 2, "a subscriber per rank"
            await until(lambda: fleet.kv_index.blocks(ep.id) == 4, "rank 0 replayed")
            # rank 1 has no publisher yet: the endpoint is not exact, whatever rank 0 is
            await until(lambda: ep.kv_rank_feeds[0].state == "live", "rank 0 live")
            assert ep.kv_feed.state != "live" and ep.kv_rank_feeds[1].state != "live"
            assert "rank 1" in (ep.kv_feed.reason or "")
            rank_state = "fleetgate_kv_feed_rank_state"
            assert metric(metrics, rank_state, endpoint=ep.id, rank="0", state="live") == 1
            assert metric(metrics, rank_state, endpoint=ep.id, rank="1", state="live") == 0
            assert metric(metrics, "fleetgate_kv_feed_state", endpoint=ep.id, state="live") == 0
            with ranks_up(base, replay, [1]) as more:
                await until(lambda: ep.kv_feed.state == "live", "both ranks live")
                assert metric(metrics, rank_state, endpoint=ep.id, state="live") == 2
                more[1].publish([stored(100, doc[: 2 * BS])])
                await until(lambda: fleet.kv_index.blocks(ep.id) == 6, "rank 1's blocks")
                want = 4 if choice == "cache" else (4 + 2) // 2
                assert fleet.kv_index.match(ep.id, keys) == want
                assert fleet.kv_index.engine_hashes(ep.id, rank=1) == frozenset({100, 101})
            assert metric(metrics, "fleetgate_kv_decode_errors_total") == 0


async def test_a_rank_that_restarts_is_cleared_alone() -> None:
    base = free_port_run("127.0.0.1", 4)
    replay = base + 2
    doc = toks(7, 3)
    async with feeds_for(zmq_config(base, replay, 2, "cache")) as (fleet, _feeds, metrics):
        (ep,) = fleet
        with ranks_up(base, replay, [0]) as pubs:
            pubs[0].publish([stored(100, doc)])
            with ranks_up(base, replay, [1]) as old:
                old[1].publish([stored(200, doc)])
                await until(lambda: fleet.kv_index.blocks(ep.id) == 6, "both ranks indexed")
            # rank 1's process restarts on the same ports: a new stream from seq 0
            with ranks_up(base, replay, [1]) as new:
                new[1].publish([stored(300, doc[:BS])])
                await until(
                    lambda: fleet.kv_index.engine_hashes(ep.id, rank=1) == frozenset({300}),
                    "rank 1 relearned from its new stream",
                    within=20,
                )
                assert fleet.kv_index.engine_hashes(ep.id, rank=0) == frozenset({100, 101, 102})
                assert metric(metrics, "fleetgate_kv_feed_restarts_total") >= 1
                await until(lambda: ep.kv_feed.state == "live", "live again")


# ------------------------------------------------------------------ the emulated engine


def rank_truth(e: RunningEngine, rank: int, *, stream: bool = True) -> frozenset[int]:
    """Rank ``rank``'s cached blocks as the engine publishes their hashes (the stream:
    signed; the drain: as they are)."""
    model: Any = e.engine.driver.model
    hashes = (external_hash(h) for h in model.ranks[rank].pool._cached)
    return frozenset(signed_hash(h) if stream else h for h in hashes)


def adp_spec(version: str, cache_aware: bool) -> EngineSpec:
    overrides = {"tokens_per_block": BS, "attention_dp_ranks": 2, "adp_cache_routing": cache_aware}
    return EngineSpec(kind="trtllm", kv_events=True, version=version, overrides=overrides)


@pytest.mark.parametrize("cache_aware", [False, True])
async def test_an_emulated_two_rank_engine_streams_each_rank_and_the_index_follows(
    cache_aware: bool,
) -> None:
    doc = list(toks(8, 4)) + [7, 7, 7]
    async with run_fleet([adp_spec("main", cache_aware)], time_scale=0) as sim:
        (eng,) = sim.engines
        choice = "cache" if cache_aware else "load"
        async with feeds_for(config([zmq_backend(eng, ranks=2, rank_choice=choice)])) as (
            fleet,
            _feeds,
            _metrics,
        ):
            (ep,) = fleet
            await until(lambda: ep.kv_feed.state == "live", "both ranks live")
            for _ in range(3):  # one after another: each lands on an idle engine
                await complete(eng.url, eng.model, doc)
            model: Any = eng.engine.driver.model
            for r in (0, 1):
                await until(lambda r=r: fleet.kv_index.engine_hashes(ep.id, rank=r)  # type: ignore[misc]
                            == rank_truth(eng, r), f"rank {r}: index == engine")  # fmt: skip
            keys = block_keys(doc, BS)
            held = [bool(rank_truth(eng, r)) for r in (0, 1)]
            if cache_aware:
                # the engine sent the repeats where the document was: one rank holds it
                assert model.placements in ([3, 0], [0, 3]) and held.count(True) == 1
                assert fleet.kv_index.match(ep.id, keys) == 4
            else:
                # by load: both idle, the lower rank, then the same again (0 active tokens)
                assert model.placements == [3, 0] and held == [True, False]
                assert fleet.kv_index.match(ep.id, keys) == 4 // 2


async def test_an_emulated_two_rank_engine_drains_every_rank_with_its_own_ids() -> None:
    async with run_fleet([adp_spec("1.3.0", False)], time_scale=0) as sim:
        (eng,) = sim.engines
        backend = {"engine": "trtllm", "url": eng.url,
                   "kv_events": {"transport": "http-drain", "path": "/kv_cache_events",
                                 "ranks": 2}}  # fmt: skip
        async with feeds_for(config([backend])) as (fleet, _feeds, metrics):
            (ep,) = fleet
            await until(lambda: ep.kv_feed.state == "live", "both ranks live")
            # two long prompts at once: by load the second goes to the other rank
            a, b = list(toks(9, 3)) + [1], list(toks(10, 3)) + [1]
            await asyncio.gather(complete(eng.url, eng.model, a, max_tokens=8),
                                 complete(eng.url, eng.model, b, max_tokens=8))  # fmt: skip
            model: Any = eng.engine.driver.model
            assert model.placements == [1, 1]
            for r in (0, 1):
                await until(lambda r=r: fleet.kv_index.engine_hashes(ep.id, rank=r)  # type: ignore[misc]
                            == rank_truth(eng, r, stream=False),
                            f"rank {r}: index == engine")  # fmt: skip
            assert all(rank_truth(eng, r, stream=False) for r in (0, 1)), "both ranks hold blocks"
            assert metric(metrics, "fleetgate_kv_feed_restarts_total") == 0
