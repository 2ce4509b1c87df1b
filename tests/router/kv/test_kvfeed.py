"""KV-event subscribers against emulated engines (real ZeroMQ sockets, real HTTP drains).

In-process engines (``run_fleet``) let a test read the engine's true cached set
(its block pool) and compare it with the router's index; the restart test runs the
emulator as a process and starts it again on the same ports.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from fleetgate.engines import get_adapter
from fleetgate.engines.base import KvEventsEndpoint
from fleetgate.router.app import build_fleet, build_router
from fleetgate.router.config import RouterConfig, parse_config
from fleetgate.router.kvfeed import KvFeeds
from fleetgate.router.metrics import RouterMetrics
from fleetgate.router.scheduling.kvindex import block_keys
from fleetgate.router.scheduling.types import EndpointId
from fleetgate.router.state import Endpoint, Fleet
from fleetgate.sim import fleet as sim_fleet
from fleetgate.sim.core.kv_vllm import external_hash
from fleetgate.sim.fleet import EngineSpec, RunningEngine, run_fleet

BS = 16


def _port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def zmq_backend(e: RunningEngine, **kv: Any) -> dict[str, Any]:
    assert e.kv_events is not None and e.kv_replay is not None
    return {
        "engine": e.kind,  # vLLM, or TensorRT-LLM's streaming publisher (same framing)
        "url": e.url,
        "kv_events": {
            "port": _port_of(e.kv_events),
            "replay_port": _port_of(e.kv_replay),
            "topic": "kv-events",
            **kv,
        },
    }


def config(backends: list[dict[str, Any]], **kv: Any) -> RouterConfig:
    return parse_config(
        {
            "test_mode": True,
            "pools": [{"name": "default", "backends": backends}],
            "kv_events": {"replay_timeout_s": 2.0, "retry_max_s": 0.5, "drain_interval_s": 0.05,
                          **kv},
        }
    )  # fmt: skip


def truth(e: RunningEngine) -> frozenset[int]:
    """The engine's cached block hashes as it publishes them (its block pool's index)."""
    pool: Any = getattr(e.engine.driver.model, "pool")  # noqa: B009 (the vLLM model's)
    return frozenset(external_hash(h) for h in pool._cached)


async def until(pred: Callable[[], bool], what: str, within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def feeds_for(
    cfg: RouterConfig, transport: httpx.AsyncBaseTransport | None = None
) -> AsyncIterator[tuple[Fleet, KvFeeds, RouterMetrics]]:
    """The feeds of ``cfg``'s fleet; ``transport`` answers the HTTP drains in-process."""
    fleet = build_fleet(cfg)
    metrics = RouterMetrics()
    async with httpx.AsyncClient(trust_env=False, transport=transport) as client:
        feeds = KvFeeds(fleet, client, cfg.kv_events, metrics, time.monotonic)
        feeds.start()
        try:
            yield fleet, feeds, metrics
        finally:
            await feeds.stop()


async def complete(base: str, model: str, prompt: list[int], max_tokens: int = 2) -> None:
    async with httpx.AsyncClient(base_url=base, trust_env=False, timeout=30) as c:
        r = await c.post(
            "/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": max_tokens}
        )
        assert r.status_code == 200, r.text


def prompt(seed: int, blocks: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 30000 + 100 for i in range(blocks * BS + 3)]


def vllm_spec(**overrides: Any) -> EngineSpec:
    return EngineSpec(kind="vllm", kv_events=True, overrides={"block_size": BS, **overrides})


def metric(metrics: RouterMetrics, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    return sum(
        sample.value
        for family in metrics.registry.collect()
        for sample in family.samples
        if sample.name == name and labels.items() <= sample.labels.items()
    )


async def test_router_app_learns_blocks_of_a_request_it_routed() -> None:
    async with run_fleet([vllm_spec()], time_scale=0) as sim:
        (eng,) = sim.engines
        app = build_router(config([zmq_backend(eng)]))
        fleet: Fleet = app.state.router.fleet
        (ep,) = fleet
        async with app.router.lifespan_context(app):
            await until(lambda: ep.kv_feed.state == "live", "feed live")
            ids = prompt(1, 4)
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://router") as c:
                r = await c.post(
                    "/v1/completions",
                    json={"model": eng.model, "prompt": ids, "max_tokens": 2},
                )
                assert r.status_code == 200, r.text
            keys = block_keys(ids, BS)
            await until(lambda: fleet.kv_index.match(ep.id, keys) == 4, "4 blocks matched")
            assert ep.kv_feed.exact and ep.kv_feed.last_seq is not None
            text = (await _metrics(app)).decode()
            live = f'fleetgate_kv_feed_state{{endpoint="{ep.id}",engine="vllm",state="live"}} 1.0'
            assert live in text
            assert "fleetgate_kv_events_total" in text and 'kind="stored"' in text
            assert "fleetgate_kv_index_blocks" in text
        assert ep.kv_feed.state == "off", "the lifespan stopped the feed"
        assert fleet.kv_index.blocks(ep.id) == 0


async def _metrics(app: Any) -> bytes:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://router") as c:
        return (await c.get("/metrics")).content


async def test_eviction_in_a_small_cache_leaves_the_index_equal_to_the_engine() -> None:
    async with run_fleet([vllm_spec(num_gpu_blocks=12, max_model_len=128)], time_scale=0) as sim:
        (eng,) = sim.engines
        async with feeds_for(config([zmq_backend(eng)])) as (fleet, _feeds, metrics):
            (ep,) = fleet
            await until(lambda: ep.kv_feed.state == "live", "feed live")
            first = prompt(1, 4)
            await complete(eng.url, eng.model, first)
            await until(lambda: fleet.kv_index.match(ep.id, block_keys(first, BS)) == 4,
                        "first prompt indexed")  # fmt: skip
            for seed in range(2, 6):  # 4 more prompts of 4 blocks: the 11-block pool evicts
                await complete(eng.url, eng.model, prompt(seed, 4))
            await until(lambda: fleet.kv_index.engine_hashes(ep.id) == truth(eng),
                        "index == engine")  # fmt: skip
            assert fleet.kv_index.match(ep.id, block_keys(first, BS)) == 0, "evicted"
            assert metric(metrics, "fleetgate_kv_events_total", endpoint=ep.id, engine="vllm",
                          kind="removed") > 0  # fmt: skip


class DropOrGarble:
    """The emulator's PUB socket, losing or garbling chosen batches on the way out
    (the replay buffer keeps the true frames)."""

    def __init__(self, sock: Any, drop: set[int], garble: set[int]) -> None:
        self.sock, self.drop, self.garble = sock, drop, garble

    def send_multipart(self, frames: Any) -> None:
        seq = int.from_bytes(frames[1], "big")
        if seq in self.drop:
            return
        if seq in self.garble:
            frames = (frames[0], frames[1], b"\xc1 not msgpack")
        self.sock.send_multipart(frames)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sock, name)


@pytest.mark.parametrize("fault", ["drop", "garble"])
async def test_lost_or_undecodable_batch_is_replayed(fault: str, publishers: list[Any]) -> None:
    async with run_fleet([vllm_spec()], time_scale=0) as sim:
        (eng,) = sim.engines
        (pub,) = publishers
        async with feeds_for(config([zmq_backend(eng)])) as (fleet, _feeds, metrics):
            (ep,) = fleet
            await until(lambda: ep.kv_feed.state == "live", "feed live")
            await complete(eng.url, eng.model, prompt(1, 2))
            await until(lambda: ep.kv_feed.last_seq is not None, "first batch")
            assert ep.kv_feed.last_seq is not None
            bad = ep.kv_feed.last_seq + 1
            pub._pub = DropOrGarble(pub._pub, {bad} if fault == "drop" else set(),
                                    {bad} if fault == "garble" else set())  # fmt: skip
            replays = metric(metrics, "fleetgate_kv_replays_total", endpoint=ep.id, engine="vllm")
            for seed in range(2, 5):
                await complete(eng.url, eng.model, prompt(seed, 3))
            await until(lambda: (ep.kv_feed.last_seq or 0) > bad, "past the fault")
            await until(lambda: fleet.kv_index.engine_hashes(ep.id) == truth(eng),
                        "index == engine")  # fmt: skip
            for seed in range(2, 5):
                assert fleet.kv_index.match(ep.id, block_keys(prompt(seed, 3), BS)) == 3
            assert metric(metrics, "fleetgate_kv_replays_total", endpoint=ep.id,
                          engine="vllm") > replays  # fmt: skip
            if fault == "garble":
                assert metric(metrics, "fleetgate_kv_decode_errors_total", endpoint=ep.id,
                              engine="vllm") == 1  # fmt: skip
            assert ep.kv_feed.state == "live"


@pytest.fixture
def publishers(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The KvEventPublishers run_fleet creates (real ones, recorded on the way)."""
    made: list[Any] = []
    real = sim_fleet._kv_publishers

    def record(spec: EngineSpec, host: str) -> list[Any]:
        publishers = real(spec, host)
        made.extend(publishers)
        return publishers

    monkeypatch.setattr(sim_fleet, "_kv_publishers", record)
    return made


async def test_lost_last_batch_is_found_by_the_idle_check(publishers: list[Any]) -> None:
    async with run_fleet([vllm_spec()], time_scale=0) as sim:
        (eng,) = sim.engines
        (pub,) = publishers
        cfg = config([zmq_backend(eng)], idle_check_s=0.3)
        async with feeds_for(cfg) as (fleet, _feeds, metrics):
            (ep,) = fleet
            await until(lambda: ep.kv_feed.state == "live", "feed live")
            pub._pub = DropOrGarble(pub._pub, set(range(1000)), set())  # the SUB gets nothing
            ids = prompt(5, 3)
            await complete(eng.url, eng.model, ids)
            await until(lambda: fleet.kv_index.match(ep.id, block_keys(ids, BS)) == 3,
                        "blocks learned by the idle replay")  # fmt: skip
            assert fleet.kv_index.engine_hashes(ep.id) == truth(eng)
            assert metric(metrics, "fleetgate_kv_replays_total", endpoint=ep.id,
                          cause="idle") >= 1  # fmt: skip
            assert ep.kv_feed.state == "live"


async def test_without_replay_a_late_router_is_partial() -> None:
    async with run_fleet([vllm_spec()], time_scale=0) as sim:
        (eng,) = sim.engines
        await complete(eng.url, eng.model, prompt(6, 2))  # published before anyone listens
        backend = zmq_backend(eng)
        del backend["kv_events"]["replay_port"]
        async with feeds_for(config([backend])) as (fleet, _feeds, _m):
            (ep,) = fleet
            await until(lambda: "first batch" in (ep.kv_feed.reason or ""), "waiting for batch")
            assert ep.kv_feed.state == "syncing"
            await asyncio.sleep(0.3)  # let the subscription reach the publisher
            ids = prompt(7, 2)
            await complete(eng.url, eng.model, ids)
            await until(lambda: ep.kv_feed.state == "partial", "partial (batch 0 was missed)")
            assert fleet.kv_index.match(ep.id, block_keys(ids, BS)) == 2
            assert not ep.kv_feed.exact


async def test_without_replay_an_undecodable_message_clears_and_goes_partial(
    publishers: list[Any],
) -> None:
    async with run_fleet([vllm_spec()], time_scale=0) as sim:
        (eng,) = sim.engines
        (pub,) = publishers
        backend = zmq_backend(eng)
        del backend["kv_events"]["replay_port"]
        async with feeds_for(config([backend])) as (fleet, _feeds, metrics):
            (ep,) = fleet
            await until(lambda: "first batch" in (ep.kv_feed.reason or ""), "waiting for batch")
            await asyncio.sleep(0.3)  # let the subscription reach the publisher
            first = prompt(8, 2)
            await complete(eng.url, eng.model, first)
            await until(lambda: ep.kv_feed.state == "live", "live from batch 0")
            assert fleet.kv_index.match(ep.id, block_keys(first, BS)) == 2
            pub._pub = DropOrGarble(pub._pub, set(), set(range(1000)))
            await complete(eng.url, eng.model, prompt(9, 2))
            await until(lambda: ep.kv_feed.state == "partial", "partial after the garbled batch")
            assert fleet.kv_index.blocks(ep.id) == 0, "entries cleared: they cannot be trusted"
            assert metric(metrics, "fleetgate_kv_decode_errors_total", endpoint=ep.id) >= 1


async def test_router_started_late_replays_what_was_published_before() -> None:
    async with run_fleet([vllm_spec()], time_scale=0) as sim:
        (eng,) = sim.engines
        ids = prompt(9, 5)
        await complete(eng.url, eng.model, ids)
        async with feeds_for(config([zmq_backend(eng)])) as (fleet, _feeds, _m):
            (ep,) = fleet
            await until(lambda: ep.kv_feed.state == "live", "feed live")
            assert fleet.kv_index.match(ep.id, block_keys(ids, BS)) == 5
            assert fleet.kv_index.engine_hashes(ep.id) == truth(eng)


async def test_trtllm_drain_feeds_the_index() -> None:
    spec = EngineSpec(kind="trtllm", kv_events=True, kv_event_buffer=256, version="1.3.0",
                      overrides={"tokens_per_block": BS})  # fmt: skip
    async with run_fleet([spec], time_scale=0) as sim:
        (eng,) = sim.engines
        backend = {
            "engine": "trtllm",
            "url": eng.url,
            "kv_events": {"transport": "http-drain", "path": "/kv_cache_events"},
        }
        async with feeds_for(config([backend])) as (fleet, _feeds, metrics):
            (ep,) = fleet
            await until(lambda: ep.kv_feed.state == "live", "feed live (created seen)")
            ids = prompt(3, 4)
            await complete(eng.url, eng.model, ids)
            await until(lambda: fleet.kv_index.match(ep.id, block_keys(ids, BS)) == 4,
                        "4 blocks matched")  # fmt: skip
            assert fleet.kv_index.engine_hashes(ep.id) == truth(eng)
            assert metric(metrics, "fleetgate_kv_events_total", endpoint=ep.id,
                          engine="trtllm", kind="cleared") == 1  # fmt: skip


async def test_trtllm_started_late_is_partial() -> None:
    spec = EngineSpec(kind="trtllm", kv_events=True, kv_event_buffer=256, version="1.3.0",
                      overrides={"tokens_per_block": BS})  # fmt: skip
    async with run_fleet([spec], time_scale=0) as sim:
        (eng,) = sim.engines
        async with httpx.AsyncClient(trust_env=False) as c:  # another reader took them
            await c.post(eng.url + "/kv_cache_events")
        await complete(eng.url, eng.model, prompt(4, 2))
        backend = {
            "engine": "trtllm",
            "url": eng.url,
            "kv_events": {"transport": "http-drain", "path": "/kv_cache_events"},
        }
        async with feeds_for(config([backend])) as (fleet, _feeds, _m):
            (ep,) = fleet
            await until(lambda: ep.kv_feed.state == "partial", "partial")
            assert not ep.kv_feed.exact


# ------------------------------------------------------------------ a real restart


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.asynccontextmanager
async def emulator_process(
    tmp: Path, http: int, pub: int | None = None, replay: int | None = None, engine: str = "vllm"
) -> AsyncIterator[str]:
    """The emulator on fixed ports, stopped by its PID: ``vllm serve`` (or, ``engine``
    ``trtllm``, ``trtllm-serve`` with ``kv_cache_config.kv_events_config``) with events on
    ``pub``/``replay``, or without them ``trtllm-serve`` keeping events for the drain."""
    log = tmp / f"sim-{time.monotonic_ns()}.log"
    if pub is not None and engine == "trtllm":
        options = tmp / "llm_api_options.yaml"
        events = {"enable_kv_cache_events": True, "publisher": "zmq",
                  "endpoint": f"tcp://*:{pub}", "replay_endpoint": f"tcp://*:{replay}",
                  "topic": "kv-events"}  # fmt: skip
        kv_cache = {"tokens_per_block": BS, "kv_events_config": events,
                    "use_kv_cache_manager_v2": True}  # fmt: skip
        options.write_text(yaml.safe_dump({"kv_cache_config": kv_cache}))
        cmd = [sys.executable, "-m", "fleetgate", "sim", "trtllm-serve", "m", "--host",
               "127.0.0.1", "--port", str(http),
               "--extra_llm_api_options", str(options)]  # fmt: skip
    elif pub is not None:
        kv = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                         "endpoint": f"tcp://*:{pub}", "replay_endpoint": f"tcp://*:{replay}",
                         "topic": "kv-events"})  # fmt: skip
        cmd = [sys.executable, "-m", "fleetgate", "sim", "vllm", "serve", "m", "--host",
               "127.0.0.1", "--port", str(http), "--block-size", str(BS),
               "--enable-prefix-caching", "--kv-events-config", kv]  # fmt: skip
    else:
        options = tmp / "llm_api_options.yaml"
        options.write_text(
            f"kv_cache_config:\n  event_buffer_max_size: 256\n  tokens_per_block: {BS}\n"
        )
        cmd = [sys.executable, "-m", "fleetgate", "sim", "trtllm-serve", "m", "--host",
               "127.0.0.1", "--port", str(http),
               "--extra_llm_api_options", str(options)]  # fmt: skip
    with log.open("wb") as out:
        proc = await asyncio.create_subprocess_exec(*cmd, stdout=out, stderr=out,
                                                    stdin=asyncio.subprocess.DEVNULL)  # fmt: skip
    try:
        url = f"http://127.0.0.1:{http}"
        deadline = time.monotonic() + 60
        async with httpx.AsyncClient(trust_env=False) as c:
            while True:
                with contextlib.suppress(httpx.HTTPError):
                    if (await c.get(url + "/health")).status_code == 200:
                        break
                if proc.returncode is not None or time.monotonic() > deadline:
                    raise AssertionError(f"emulator did not start:\n{log.read_text()[-3000:]}")
                await asyncio.sleep(0.1)
        yield url
    finally:
        if proc.returncode is None:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), 15)
            except TimeoutError:
                proc.kill()
                await proc.wait()


@pytest.mark.parametrize("engine", ["vllm", "trtllm"])
async def test_engine_restart_on_the_same_port_clears_and_relearns(
    tmp_path: Path, engine: str
) -> None:
    """A ZeroMQ stream (vLLM's, or TensorRT-LLM's streaming publisher started from the
    options file the operator writes) whose engine restarts on the same ports."""
    http, pub, replay = _free_port(), _free_port(), _free_port()
    backend = {"engine": engine, "url": f"http://127.0.0.1:{http}",
               "kv_events": {"port": pub, "replay_port": replay, "topic": "kv-events"}}  # fmt: skip
    before, after = prompt(1, 3), prompt(2, 2)
    async with feeds_for(config([backend])) as (fleet, _feeds, metrics):
        (ep,) = fleet
        async with emulator_process(tmp_path, http, pub, replay, engine) as url:
            await until(lambda: ep.kv_feed.state == "live", "feed live", 30)
            await complete(url, "m", before)
            await until(lambda: fleet.kv_index.match(ep.id, block_keys(before, BS)) == 3,
                        "first engine's blocks")  # fmt: skip
        await until(lambda: ep.kv_feed.state != "live", "feed notices the engine left")
        async with emulator_process(tmp_path, http, pub, replay, engine) as url:
            # the new engine publishes seq 0, 1, ... again
            await until(lambda: ep.kv_feed.state == "live", "feed live again", 30)
            await complete(url, "m", after)
            await until(lambda: fleet.kv_index.match(ep.id, block_keys(after, BS)) == 2,
                        "second engine's blocks")  # fmt: skip
            assert fleet.kv_index.match(ep.id, block_keys(before, BS)) == 0, "old entries gone"
            assert fleet.kv_index.blocks(ep.id) == 2
            assert metric(metrics, "fleetgate_kv_feed_restarts_total", endpoint=ep.id,
                          engine=engine) == 1  # fmt: skip
            assert metric(metrics, "fleetgate_kv_decode_errors_total") == 0


async def test_trtllm_restart_on_the_same_port_clears_and_relearns(tmp_path: Path) -> None:
    http = _free_port()
    backend = {"engine": "trtllm", "url": f"http://127.0.0.1:{http}",
               "kv_events": {"transport": "http-drain", "path": "/kv_cache_events"}}  # fmt: skip
    before, after = prompt(1, 3), prompt(2, 2)
    async with feeds_for(config([backend])) as (fleet, _feeds, metrics):
        (ep,) = fleet
        async with emulator_process(tmp_path, http) as url:
            await until(lambda: ep.kv_feed.state == "live", "feed live", 30)
            await complete(url, "m", before)
            await until(lambda: fleet.kv_index.match(ep.id, block_keys(before, BS)) == 3,
                        "first engine's blocks")  # fmt: skip
        await until(lambda: ep.kv_feed.state == "broken", "drains fail while it is down")
        assert fleet.kv_index.blocks(ep.id) == 0, "a failed drain cannot be trusted"
        async with emulator_process(tmp_path, http) as url:
            await until(lambda: ep.kv_feed.state == "live", "live again (created, id 0)", 30)
            await complete(url, "m", after)
            await until(lambda: fleet.kv_index.match(ep.id, block_keys(after, BS)) == 2,
                        "second engine's blocks")  # fmt: skip
            assert fleet.kv_index.match(ep.id, block_keys(before, BS)) == 0
            assert metric(metrics, "fleetgate_kv_feed_restarts_total", endpoint=ep.id) == 1


async def test_endpoint_without_events_stays_off_and_bad_endpoint_breaks() -> None:
    port = _free_port()  # nothing listens there
    cfg = config(
        [{"engine": "vllm", "url": f"http://127.0.0.1:{_free_port()}"},
         {"engine": "vllm", "url": f"http://127.0.0.1:{port}", "name": "dead",
          "kv_events": {"port": port, "replay_port": _free_port()}}],
        connect_timeout_s=0.2,
    )  # fmt: skip
    async with feeds_for(cfg) as (fleet, feeds, _m):
        quiet, dead = list(fleet)
        await until(lambda: dead.kv_feed.state == "broken", "broken")
        assert quiet.kv_feed.state == "off" and not feeds.add(quiet)
        assert "no connection" in (dead.kv_feed.reason or "")
        await feeds.remove(dead.id)
        assert dead.kv_feed.state == "off"


def test_endpoint_kv_events_default() -> None:
    adapter = get_adapter("vllm")
    e = Endpoint(EndpointId("x"), "default", "vllm", "http://127.0.0.1:1", adapter,
                 adapter.metrics_sources[0])  # fmt: skip
    assert e.kv_events is None and e.kv_feed.state == "off"
    kv = KvEventsEndpoint("zmq", "vllm", port=1)
    assert Endpoint(EndpointId("y"), "default", "vllm", "http://127.0.0.1:1", adapter,
                    adapter.metrics_sources[0], kv_events=kv).kv_events == kv  # fmt: skip


@pytest.mark.parametrize(
    ("trtllm_version", "adp"), [(None, False), ("1.3.0", False), (None, True), ("1.3.0", True)]
)
async def test_sim_lines_paste_into_router_backend_flags(
    tmp_path: Path, trtllm_version: str | None, adp: bool
) -> None:
    """``fleetgate sim --vllm 1 --trtllm 1 --kv-events`` prints what ``--backend`` takes:
    TensorRT-LLM main's ZeroMQ stream by default, 1.3's HTTP drain with that version; with
    ``--trtllm-attention-dp 2`` the ranks too, and the router follows both."""
    import argparse

    from fleetgate.router.cli import resolve_config

    log = tmp_path / "sim.log"
    cmd = [sys.executable, "-m", "fleetgate", "sim", "--vllm", "1", "--trtllm", "1",
           "--kv-events", "--host", "127.0.0.1", "--port", "0"]  # fmt: skip
    if trtllm_version is not None:
        cmd += ["--trtllm-version", trtllm_version]
    if adp:
        cmd += ["--trtllm-attention-dp", "2", "--trtllm-adp-routing", "cache"]
    with log.open("wb") as out:
        proc = await asyncio.create_subprocess_exec(*cmd, stdout=out, stderr=out,
                                                    stdin=asyncio.subprocess.DEVNULL)  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while log.read_text().count("engine=") < 2:
            assert proc.returncode is None and time.monotonic() < deadline, log.read_text()
            await asyncio.sleep(0.1)
        flags = []
        for line in log.read_text().splitlines():
            if not line.startswith("engine="):
                continue
            fields = dict(part.split("=", 1) for part in line.split())
            keys = ("kv_events", "kv_replay", "kv_ranks", "kv_rank_choice")
            kv = [f"{k}={fields[k]}" for k in keys if k in fields]
            flags.append(",".join([f"{fields['engine']}={fields['url']}", *kv]))
        (trt,) = [f for f in flags if f.startswith("trtllm=")]
        (vllm,) = [f for f in flags if f.startswith("vllm=")]
        assert "kv_replay=tcp://127.0.0.1:" in vllm, flags
        if trtllm_version is None:
            assert "kv_events=tcp://127.0.0.1:" in trt and "kv_replay=tcp://127.0.0.1:" in trt
        else:
            assert ",kv_events=http-drain:/kv_cache_events" in trt, flags
        assert trt.endswith(",kv_ranks=2,kv_rank_choice=cache") == adp, flags
        args = argparse.Namespace(config=None, backend=flags)
        app = build_router(resolve_config(args))
        async with app.router.lifespan_context(app):
            eps = list(app.state.router.fleet)
            assert all(e.kv_events is not None for e in eps)
            await until(lambda: all(e.kv_feed.state == "live" for e in eps), "both live", 20)
            (t,) = [e for e in eps if e.engine == "trtllm"]
            assert len(t.kv_rank_feeds) == (2 if adp else 0)
            # its ranks are its schedulers: a reported limit counts once per rank
            assert t.schedulers == (2 if adp else 1)
    finally:
        if proc.returncode is None:
            proc.terminate()
            await asyncio.wait_for(proc.wait(), 15)


def test_feed_runs_on_uvloop() -> None:
    """The router CLI serves on uvloop (uvicorn[standard] installs it): zmq.asyncio works there."""
    import uvloop

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(test_router_started_late_replays_what_was_published_before())
