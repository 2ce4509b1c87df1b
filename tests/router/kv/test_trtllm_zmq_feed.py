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
import msgpack

from fleetgate.engines.base import BlockStored, KvEventBatch
from fleetgate.engines.trtllm.kv_zmq import decode_trtllm_zmq, encode_trtllm_kv_batch, signed_hash
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


async def test_a_lora_request_is_published_and_keyed_under_its_task_id() -> None:
    """trtllm-serve takes ``lora_request`` and runs the adapter as LoRA task
    ``lora_int_id``; the streaming publisher sends its blocks with that ``lora_id`` and
    no name. The emulator does the same, the decoder salts them ``lora-id:N`` and the
    TensorRT-LLM adapter salts a request naming the adapter alike, so the adapter's
    request matches only the adapter's blocks and a base request only the base's."""
    ids = prompt(4, 3)
    lora = {"lora_name": "sql", "lora_int_id": 7, "lora_path": "/adapters/sql"}
    async with run_fleet([trt_spec()], time_scale=0) as sim:
        (eng,) = sim.engines
        async with feeds_for(config([zmq_backend(eng)])) as (fleet, _feeds, _metrics):
            (ep,) = fleet
            await until(lambda: ep.kv_feed.state == "live", "feed live")
            async with httpx.AsyncClient(base_url=eng.url, trust_env=False, timeout=30) as c:
                body: dict[str, Any] = {"model": eng.model, "prompt": ids, "max_tokens": 2,
                                        "lora_request": lora}  # fmt: skip
                r = await c.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
                bad = await c.post("/v1/completions", json={**body, "lora_request": {"x": 1}})
                assert bad.status_code == 400, bad.text
            salt = ep.adapter.request_lora_salt(body)
            assert salt == "lora-id:7"
            await until(
                lambda: fleet.kv_index.match(ep.id, block_keys(ids, BS, salt=salt)) == 3,
                "the adapter's blocks indexed under its task id",
            )
            assert fleet.kv_index.match(ep.id, block_keys(ids, BS)) == 0  # not the base's
            await complete(eng.url, eng.model, ids)  # the same prompt for the base model
            await until(lambda: fleet.kv_index.match(ep.id, block_keys(ids, BS)) == 3,
                        "the base model's blocks indexed apart")  # fmt: skip
            assert fleet.kv_index.engine_hashes(ep.id) == trt_truth(eng)


def test_the_encoder_sends_a_task_id_not_a_name() -> None:
    event = BlockStored((1,), None, tuple(range(BS)), BS, medium="GPU", lora_name="lora-id:7")
    frames = encode_trtllm_kv_batch(0, KvEventBatch(seq=0, events=(event,), ts=1.0))
    raw = msgpack.unpackb(frames[2], raw=False)[1][0]
    assert (raw["lora_id"], raw["lora_name"]) == (7, None)
    (batch,) = decode_trtllm_zmq(frames)
    assert batch.events[0].lora_name == "lora-id:7"  # type: ignore[union-attr]
