"""TensorRT-LLM's streaming KV events end to end: the emulated engine publishes its
ZeroMQ wire (line main, ``kv_events_config``), the router's subscriber decodes it through
the TensorRT-LLM adapter and the exact index shows the engine's blocks.

In-process engines (``run_fleet``, real ZeroMQ sockets, real HTTP), so a test can read
the engine's true cached set and compare it with the index. The wire is TensorRT-LLM's as
read from its source (fleetgate.engines.trtllm.kv_zmq), not recorded from a real engine.
"""

from __future__ import annotations

from typing import Any

import httpx

from fleetgate.engines.trtllm.kv_zmq import signed_hash
from fleetgate.router.app import build_router
from fleetgate.router.scheduling.kvindex import block_keys
from fleetgate.router.state import Fleet
from fleetgate.sim.fleet import EngineSpec, RunningEngine, run_fleet

from .test_kvfeed import BS, complete, config, feeds_for, metric, prompt, truth, until, zmq_backend


def trt_spec(**overrides: Any) -> EngineSpec:
    return EngineSpec(
        kind="trtllm", kv_events=True, overrides={"tokens_per_block": BS, **overrides}
    )


def trt_truth(e: RunningEngine) -> frozenset[int]:
    """The engine's cached blocks as TensorRT-LLM publishes their hashes (signed)."""
    return frozenset(signed_hash(h) for h in truth(e))


async def test_trtllm_stream_feeds_the_exact_index() -> None:
    async with run_fleet([trt_spec()], time_scale=0) as sim:
        (eng,) = sim.engines
        assert eng.kv_events is not None, "main publishes over ZeroMQ"
        before = prompt(2, 3)
        await complete(eng.url, eng.model, before)  # published before anyone subscribed
        async with feeds_for(config([zmq_backend(eng)])) as (fleet, _feeds, metrics):
            (ep,) = fleet
            assert ep.kv_events is not None and ep.kv_events.transport == "zmq"
            await until(lambda: ep.kv_feed.state == "live", "feed live")
            # the start replay (from seq 0) brought what was published before
            assert fleet.kv_index.match(ep.id, block_keys(before, BS)) == 3
            ids = prompt(3, 4)
            await complete(eng.url, eng.model, ids)
            await until(lambda: fleet.kv_index.match(ep.id, block_keys(ids, BS)) == 4,
                        "4 blocks matched")  # fmt: skip
            assert fleet.kv_index.engine_hashes(ep.id) == trt_truth(eng)
            # hashes with the high bit set travel negative, as TensorRT-LLM's
            assert min(trt_truth(eng)) < 0
            assert metric(metrics, "fleetgate_kv_events_total", endpoint=ep.id,
                          engine="trtllm", kind="stored") >= 2  # fmt: skip
            assert metric(metrics, "fleetgate_kv_decode_errors_total") == 0
            assert metric(metrics, "fleetgate_kv_replays_total", endpoint=ep.id,
                          cause="start") == 1  # fmt: skip


async def test_trtllm_evictions_keep_the_index_equal_to_the_engine() -> None:
    async with run_fleet([trt_spec(num_gpu_blocks=12, max_model_len=128)], time_scale=0) as sim:
        (eng,) = sim.engines
        async with feeds_for(config([zmq_backend(eng)])) as (fleet, _feeds, metrics):
            (ep,) = fleet
            await until(lambda: ep.kv_feed.state == "live", "feed live")
            first = prompt(1, 4)
            await complete(eng.url, eng.model, first)
            await until(lambda: fleet.kv_index.match(ep.id, block_keys(first, BS)) == 4,
                        "first prompt indexed")  # fmt: skip
            for seed in range(2, 6):  # more prompts than the small pool holds: it evicts
                await complete(eng.url, eng.model, prompt(seed, 4))
            await until(lambda: fleet.kv_index.engine_hashes(ep.id) == trt_truth(eng),
                        "index == engine")  # fmt: skip
            assert fleet.kv_index.match(ep.id, block_keys(first, BS)) == 0, "evicted"
            assert metric(metrics, "fleetgate_kv_events_total", endpoint=ep.id,
                          engine="trtllm", kind="removed") > 0  # fmt: skip


async def test_router_app_routes_on_a_trtllm_stream() -> None:
    """Through the router app (lifespan starts the feeds): a request it routed shows up
    in its index from the engine's own events."""
    async with run_fleet([trt_spec()], time_scale=0) as sim:
        (eng,) = sim.engines
        app = build_router(config([zmq_backend(eng)]))
        fleet: Fleet = app.state.router.fleet
        (ep,) = fleet
        async with app.router.lifespan_context(app):
            await until(lambda: ep.kv_feed.state == "live", "feed live")
            ids = prompt(5, 4)
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://router") as c:
                r = await c.post(
                    "/v1/completions", json={"model": eng.model, "prompt": ids, "max_tokens": 2}
                )
                assert r.status_code == 200, r.text
            await until(lambda: fleet.kv_index.match(ep.id, block_keys(ids, BS)) == 4,
                        "4 blocks matched")  # fmt: skip
            assert ep.kv_feed.exact
