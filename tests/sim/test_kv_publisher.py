"""The emulated vLLM's ZeroMQ KV-event publisher: wire frames, replay, config, loopback."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from pathlib import Path
from typing import Any

import httpx
import msgpack
import pytest
import yaml
import zmq

from fleetgate.cli import CliError
from fleetgate.engines import get_adapter
from fleetgate.engines.base import AllBlocksCleared, BlockRemoved, BlockStored
from fleetgate.engines.vllm import decode_vllm_kv_events
from fleetgate.sim.entrypoints import engine_spec, parse
from fleetgate.sim.fleet import EngineSpec, _kv_publishers, run_fleet
from fleetgate.sim.vllm.kv_events import KvEventPublisher, parse_kv_events_config

TRT = get_adapter("trtllm")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_config_parsing() -> None:
    assert not parse_kv_events_config("{}").active
    assert parse_kv_events_config('{"enable_kv_cache_events": true}').active
    off = parse_kv_events_config('{"enable_kv_cache_events": true, "publisher": "null"}')
    assert not off.active
    with pytest.raises(CliError, match="kv-events-config"):
        parse_kv_events_config('{"enable_kv_cache_events": true, "nope": 1}')
    with pytest.raises(CliError, match="unknown publisher"):
        parse_kv_events_config('{"enable_kv_cache_events": true, "publisher": "kafka"}')
    with pytest.raises(CliError):
        parse_kv_events_config("not json")


def test_wildcard_binds_loopback_in_test_mode_and_replay_answers() -> None:
    pub_port, replay_port = _port(), _port()
    config = parse_kv_events_config(
        json.dumps(
            {
                "enable_kv_cache_events": True,
                "endpoint": f"tcp://*:{pub_port}",
                "replay_endpoint": f"tcp://*:{replay_port}",
                "topic": "t",
            }
        )
    )
    publisher = KvEventPublisher(config, {"FLEETGATE_TEST_MODE": "1"})
    bound = publisher._pub.getsockopt_string(zmq.LAST_ENDPOINT)
    assert bound == f"tcp://127.0.0.1:{pub_port}", "test mode binds loopback, never *"
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    dealer = ctx.socket(zmq.DEALER)
    try:
        sub.setsockopt(zmq.SUBSCRIBE, b"t")
        sub.connect(f"tcp://127.0.0.1:{pub_port}")
        time.sleep(0.3)  # let the subscription reach the publisher
        publisher.publish([])  # an empty step sends nothing
        publisher.publish([BlockRemoved((1,), medium="GPU", group=0)])
        publisher.publish([AllBlocksCleared()])
        got = []
        for _ in range(2):
            assert sub.poll(5000), "no batch published"
            got.append(decode_vllm_kv_events(sub.recv_multipart())[0])
        assert [b.seq for b in got] == [0, 1]
        assert got[1].events == (AllBlocksCleared(),)
        dealer.connect(f"tcp://127.0.0.1:{replay_port}")
        dealer.send_multipart([b"", (1).to_bytes(8, "big")])
        replies = []
        while True:
            assert dealer.poll(5000), "no replay answer"
            frames = dealer.recv_multipart()
            batches = decode_vllm_kv_events(frames)
            if not batches:
                break
            replies += batches
        assert replies == got[1:]
    finally:
        sub.close(linger=0)
        dealer.close(linger=0)
        ctx.term()
        publisher.close()


async def test_fleet_engines_publish_on_their_own_loopback_ports() -> None:
    specs = [
        EngineSpec(kind="vllm", kv_events=True, overrides={"block_size": 16}),
        EngineSpec(kind="vllm", kv_events=True, overrides={"block_size": 16}),
        EngineSpec(kind="trtllm"),
    ]
    async with run_fleet(specs, time_scale=0) as fleet:
        a, b, trt = fleet.engines
        assert trt.kv_events is None
        assert a.kv_events and b.kv_events and a.kv_events != b.kv_events
        assert a.kv_events.startswith("tcp://127.0.0.1:") and a.kv_replay
        ctx = zmq.Context()
        sub = ctx.socket(zmq.SUB)
        try:
            sub.setsockopt(zmq.SUBSCRIBE, b"kv-events")
            sub.connect(a.kv_events)
            await asyncio.sleep(0.3)
            async with httpx.AsyncClient(base_url=a.url) as client:
                r = await client.post(
                    "/v1/completions",
                    json={"model": a.model, "prompt": list(range(10, 60)), "max_tokens": 1},
                )
                assert r.status_code == 200, r.text
            for _ in range(50):
                if sub.poll(0):
                    break
                await asyncio.sleep(0.1)
            (batch,) = decode_vllm_kv_events(sub.recv_multipart(zmq.NOBLOCK))
            (stored,) = batch.events
            assert isinstance(stored, BlockStored) and len(stored.block_hashes) == 3
        finally:
            sub.close(linger=0)
            ctx.term()


async def test_fleet_trtllm_keeps_events_for_the_drain_endpoint() -> None:
    # 1.3 drains; main streams (test_fleet_trtllm_main_streams_its_own_zmq_wire)
    spec = EngineSpec(kind="trtllm", kv_events=True, kv_event_buffer=64, version="1.3.0")
    assert _kv_publishers(spec, "127.0.0.1") == []  # no sockets: HTTP drain
    async with run_fleet([spec], time_scale=0) as fleet:
        (trt,) = fleet.engines
        async with httpx.AsyncClient(base_url=trt.url) as client:
            first = (await client.post("/kv_cache_events")).content
            r = await client.post(
                "/v1/completions",
                json={"model": trt.model, "prompt": list(range(10, 110)), "max_tokens": 1},
            )
            assert r.status_code == 200, r.text
            second = (await client.post("/kv_cache_events")).content
            third = (await client.post("/kv_cache_events")).json()
            assert (await client.get("/kv_cache_events")).status_code == 405
    (created,) = TRT.decode_kv_events([first])
    assert created.seq == 0 and created.events == (AllBlocksCleared(),)
    batches = TRT.decode_kv_events([second])
    assert [b.seq for b in batches] == list(range(1, 1 + len(batches)))
    stored = [e for b in batches for e in b.events if isinstance(e, BlockStored)]
    assert stored and stored[0].parent_hash is None
    assert stored[0].token_ids[:32] == tuple(range(10, 42))
    assert third == [], "a read drains the buffer"


async def test_fleet_trtllm_main_streams_its_own_zmq_wire() -> None:
    spec = EngineSpec(kind="trtllm", kv_events=True, overrides={"tokens_per_block": 16})
    async with run_fleet([spec], time_scale=0) as fleet:
        (trt,) = fleet.engines
        assert trt.kv_events and trt.kv_events.startswith("tcp://127.0.0.1:") and trt.kv_replay
        ctx = zmq.Context()
        sub = ctx.socket(zmq.SUB)
        try:
            sub.setsockopt(zmq.SUBSCRIBE, b"kv-events")
            sub.connect(trt.kv_events)
            await asyncio.sleep(0.3)
            async with httpx.AsyncClient(base_url=trt.url) as client:
                r = await client.post(
                    "/v1/completions",
                    json={"model": trt.model, "prompt": list(range(10, 60)), "max_tokens": 1},
                )
                assert r.status_code == 200, r.text
                # no drained buffer beside the stream (the engine's pull API is empty)
                assert (await client.post("/kv_cache_events")).json() == []
            for _ in range(50):
                if sub.poll(0):
                    break
                await asyncio.sleep(0.1)
            message = sub.recv_multipart(zmq.NOBLOCK)
        finally:
            sub.close(linger=0)
            ctx.term()
    topic, seq, payload = message
    assert topic == b"kv-events" and int.from_bytes(seq, "big") == 0
    raw = msgpack.unpackb(payload)
    # TensorRT-LLM's wire: map-shaped events without vLLM's extra_keys, rank 0, signed hashes
    (event,) = raw[1]
    assert raw[2] == 0 and event["type"] == "BlockStored" and "extra_keys" not in event
    assert all(-(2**63) <= h < 2**63 for h in event["block_hashes"])
    (batch,) = TRT.decode_kv_events(message)
    (stored,) = batch.events
    assert isinstance(stored, BlockStored) and len(stored.block_hashes) == 3
    assert stored.token_ids == tuple(range(10, 58)) and stored.block_size == 16


def test_trtllm_entrypoint_reads_the_streaming_config_from_the_options_file(
    tmp_path: Path,
) -> None:
    """What the operator writes for main (kv_events_config) starts TensorRT-LLM's publisher."""
    from fleetgate.engines.trtllm.launch import llm_api_options_yaml
    from fleetgate.engines.trtllm.settings import TrtllmSettings
    from fleetgate.engines.trtllm.versions import MAIN
    from fleetgate.sim import entrypoints

    written = yaml.safe_load(llm_api_options_yaml(TrtllmSettings(), MAIN))
    events = written["kv_cache_config"]["kv_events_config"]
    assert events["endpoint"] == "tcp://*:5557" and events["replay_endpoint"] == "tcp://*:5567"
    pub_port, replay_port = _port(), _port()  # not the fixed ports: other tests run here
    events.update(endpoint=f"tcp://*:{pub_port}", replay_endpoint=f"tcp://*:{replay_port}")
    options = tmp_path / "o.yaml"
    options.write_text(yaml.safe_dump(written))
    launch = parse(["trtllm-serve", "m", "--extra_llm_api_options", str(options)])
    assert launch.kv_events_config is not None
    assert not any("kv_events_config" in u or "use_kv_cache" in u for u in launch.unknown)
    spec = engine_spec(launch, "test")
    assert not spec.kv_events, "no HTTP-drain buffer beside the stream"
    (publisher,) = entrypoints._kv_publishers(launch, {"FLEETGATE_TEST_MODE": "1"}, "127.0.0.1")
    try:
        assert publisher.endpoint == f"tcp://127.0.0.1:{pub_port}"
        assert publisher.replay_endpoint == f"tcp://127.0.0.1:{replay_port}"
        frames = publisher._encode(0, _one_removal(), "kv-events")
        assert msgpack.unpackb(frames[2])[1][0]["type"] == "BlockRemoved"
    finally:
        publisher.close()


def _one_removal() -> Any:
    from fleetgate.engines.base import KvEventBatch

    return KvEventBatch(seq=0, events=(BlockRemoved((1,), medium="GPU"),), ts=1.0)


def test_trtllm_entrypoint_reads_the_buffer_size_from_the_options_file(tmp_path: Path) -> None:
    options = tmp_path / "o.yaml"
    options.write_text("kv_cache_config:\n  event_buffer_max_size: 128\n")
    launch = parse(["trtllm-serve", "m", "--extra_llm_api_options", str(options)])
    spec = engine_spec(launch, "test")
    assert (spec.kv_events, spec.kv_event_buffer) == (True, 128)
    assert "event_buffer_max_size" not in spec.overrides
    plain = engine_spec(parse(["trtllm-serve", "m"]), "test")
    assert not plain.kv_events


def test_wildcard_binds_the_engines_own_address() -> None:
    port = _port()
    config = parse_kv_events_config(
        json.dumps({"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}"})
    )
    publisher = KvEventPublisher(config, {}, wildcard_host="127.0.0.9")
    try:
        assert publisher.endpoint == f"tcp://127.0.0.9:{port}"
        assert publisher.replay_endpoint is None
    finally:
        publisher.close()
