"""The poller over RawUpstream's keep-alive GET reads the same state as over httpx.

Emulated vLLM and TensorRT-LLM engines on 127.0.0.1: probes, model lists and
load scrapes through ``Poller(getter=RawUpstream)`` give the endpoints the
same health, models and load snapshot as the default httpx getter; a dead
endpoint and one answering 503 (with bodies that would parse) fail as before
(unhealthy, no models, scrape failing and counted).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator

import httpx
import pytest
from recordings import VLLM_032
from routerkit import router_config

from fleetgate.router.app import build_fleet
from fleetgate.router.client import make_client
from fleetgate.router.metrics import RouterMetrics
from fleetgate.router.poller import Getter, Poller
from fleetgate.router.rawhttp import RawUpstream
from fleetgate.router.state import Fleet
from fleetgate.router.upstream import UpstreamBroken, UpstreamTimeout
from fleetgate.sim import EngineSpec, run_fleet

MODEL = "m"


def _raw() -> RawUpstream:
    return RawUpstream(test_mode=True, connect_timeout=1, first_byte_timeout=1, idle_timeout=1)


async def _poll(backends: list[tuple[str, str]], getter: Getter | None) -> tuple[Fleet, float]:
    config = router_config(backends)
    fleet = build_fleet(config)
    metrics = RouterMetrics()
    client = make_client(test_mode=True, max_connections=4, connect_timeout=1, read_timeout=1)
    try:
        poller = Poller(fleet, client, config, metrics, time.monotonic, getter=getter)
        for e in fleet:
            await poller.refresh(e)
        errors = sum(metrics.scrape_errors.labels(e.id, e.engine)._value.get() for e in fleet)
    finally:
        await client.aclose()
    return fleet, errors


async def test_raw_getter_reads_what_httpx_reads() -> None:
    specs = [EngineSpec(kind="vllm"), EngineSpec(kind="trtllm")]
    async with run_fleet(specs, "127.0.0.1", 0, model=MODEL, time_scale=0) as sim:
        backends = [(e.kind, e.url) for e in sim.engines]
        raw = _raw()
        try:
            via_raw, raw_errors = await _poll(backends, raw)
            assert raw.idle_connections() >= 1  # the GETs went over kept-alive connections
        finally:
            await raw.aclose()
        via_httpx, httpx_errors = await _poll(backends, None)
    assert raw_errors == httpx_errors == 0
    for a, b in zip(via_raw, via_httpx, strict=True):
        assert a.healthy and b.healthy
        assert a.models == b.models == frozenset({MODEL})
        assert a.max_model_len == b.max_model_len
        assert a.snapshot is not None and b.snapshot is not None
        assert not a.scrape_failing
        for field in ("kv_usage", "running", "waiting"):
            assert getattr(a.snapshot, field) == getattr(b.snapshot, field), field


FIX = VLLM_032
_BODIES = {
    b"/metrics": (FIX / "metrics_a_after_start.prom.txt").read_bytes(),
    b"/v1/models": json.dumps({"object": "list", "data": [{"id": MODEL}]}).encode(),
}


async def _answer_503(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Every answer is a 503 whose body would parse: only the status says it failed."""
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            body = _BODIES.get(head.split(b" ")[1], b"")
            writer.write(
                b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: %d\r\n\r\n" % len(body)
            )
            writer.write(body)
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


@contextlib.asynccontextmanager
async def _answering_503() -> AsyncIterator[str]:
    server = await asyncio.start_server(_answer_503, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()
        await server.wait_closed()


async def _dead_url() -> str:
    dead = await asyncio.get_running_loop().create_server(asyncio.Protocol, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{dead.sockets[0].getsockname()[1]}"
    dead.close()
    await dead.wait_closed()  # nothing listens there any more
    return url


@pytest.mark.parametrize("use_raw", [True, False])
async def test_dead_and_503_endpoints_fail_alike(use_raw: bool) -> None:
    dead_url = await _dead_url()
    raw = _raw()
    client = make_client(test_mode=True, max_connections=4, connect_timeout=1, read_timeout=1)
    metrics = RouterMetrics()
    try:
        async with _answering_503() as url_503:
            config = router_config([("vllm", url_503), ("vllm", dead_url)])
            fleet = build_fleet(config)
            getter = raw if use_raw else None
            poller = Poller(fleet, client, config, metrics, time.monotonic, getter=getter)
            for e in fleet:
                await poller.probe(e)
                await poller.load_models(e)
                await poller.scrape(e)
    finally:
        await client.aclose()
        await raw.aclose()
    for e in fleet:
        assert not e.healthy
        assert e.models == frozenset()
        assert e.scrape_failing and e.snapshot is None
        assert metrics.scrape_errors.labels(e.id, e.engine)._value.get() == 1


def test_httpx_client_stays_the_default() -> None:
    config = router_config([("vllm", "http://127.0.0.1:9")])
    client = httpx.AsyncClient()
    poller = Poller(build_fleet(config), client, config, RouterMetrics(), time.monotonic)
    assert type(poller.getter).__name__ == "HttpxGetter" and poller.getter.client is client  # type: ignore[attr-defined]


async def test_raw_get_is_bounded_by_its_deadline() -> None:
    """A silent endpoint: ``get`` gives up after ``within_s`` (here below the 1 s
    first-byte timeout), so a probe never waits longer than its configured timeout."""
    stop = asyncio.Event()

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await stop.wait()
        writer.close()

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/health"
    raw = _raw()
    t0 = time.monotonic()
    try:
        with pytest.raises(UpstreamTimeout):
            await raw.get(url, 0.3)
    finally:
        elapsed = time.monotonic() - t0
        stop.set()
        await raw.aclose()
        server.close()
        await server.wait_closed()
    assert 0.3 <= elapsed < 0.9


@pytest.mark.parametrize(
    ("answer", "expected"),
    [
        # HTTP/1.0 style: no Content-Length, the body ends when the server closes
        (b"HTTP/1.0 200 OK\r\ncontent-type: text/plain\r\n\r\nvllm:num_requests_running 1\n", True),
        # chunked framing cut before its last chunk: a broken body, not a short one
        (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n", False),
        # Content-Length promised more than came
        (b"HTTP/1.1 200 OK\r\ncontent-length: 50\r\n\r\nshort", False),
    ],
)
async def test_raw_get_body_ends_as_http_says(answer: bytes, expected: bool) -> None:
    async def once(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(answer)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(once, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/metrics"
    raw = _raw()
    try:
        if expected:
            status, body = await raw.get(url, 2.0)
            assert status == 200 and body == answer.split(b"\r\n\r\n", 1)[1]
            assert raw.idle_connections() == 0  # closed, never reused
        else:
            with pytest.raises(UpstreamBroken):
                await raw.get(url, 2.0)
    finally:
        await raw.aclose()
        server.close()
        await server.wait_closed()


async def test_raw_gets_poller_owns_and_closes_its_connections() -> None:
    """``raw_gets=True``: the poller's own RawUpstream (not the request path's pools),
    at most 2 kept-alive connections per engine while its loops run, none after stop()."""
    specs = [EngineSpec(kind="vllm"), EngineSpec(kind="vllm")]
    async with run_fleet(specs, "127.0.0.1", 0, model=MODEL, time_scale=0) as sim:
        config = router_config([(e.kind, e.url) for e in sim.engines])
        fleet = build_fleet(config)
        metrics = RouterMetrics()
        client = make_client(test_mode=True, max_connections=4, connect_timeout=1, read_timeout=1)
        poller = Poller(fleet, client, config, metrics, time.monotonic, raw_gets=True)
        assert isinstance(poller.getter, RawUpstream)
        try:
            await poller.start()
            scraped_at = {e.id: e.snapshot.scraped_at for e in fleet if e.snapshot is not None}
            assert len(scraped_at) == 2
            await asyncio.sleep(0.3)  # scrape loops (0.05 s) and health loops (0.1 s) run
            for e in fleet:
                assert e.healthy and e.models == frozenset({MODEL})
                assert e.snapshot is not None and e.snapshot.scraped_at > scraped_at[e.id]
            # Sampled: at any one instant every kept connection may be mid-GET (0 idle),
            # which a loaded machine hits; over 100 samples some must be idle, none above 4.
            idle = []
            for _ in range(100):
                idle.append(poller.getter.idle_connections())
                await asyncio.sleep(0.01)
            assert 1 <= max(idle) <= 4, idle
        finally:
            await poller.stop()
            await client.aclose()
        assert poller.getter.idle_connections() == 0


def test_the_router_app_scrapes_with_raw_gets_unless_a_transport_is_injected() -> None:
    """Production scrapes and probes take the cheap raw client; tests that mock httpx keep it."""
    from fleetgate.router.app import build_router
    from fleetgate.router.config import parse_config
    from fleetgate.router.poller import HttpxGetter
    from fleetgate.router.rawhttp import RawUpstream

    raw = {
        "test_mode": True,
        "pools": [{"name": "p", "backends": [{"engine": "vllm", "url": "http://127.0.0.1:1"}]}],
    }
    app = build_router(parse_config(raw), start_background=False)
    assert isinstance(app.state.poller.getter, RawUpstream)
    mocked = build_router(
        parse_config(raw),
        transport=httpx.MockTransport(lambda r: httpx.Response(200)),
        start_background=False,
    )
    assert isinstance(mocked.state.poller.getter, HttpxGetter)


class _ScriptedGetter:
    """/health answers from a script: "ok", "slow" (a timeout) or "refused"."""

    def __init__(self, script: list[str]) -> None:
        self.script = script

    async def get(self, url: str, within_s: float) -> tuple[int, bytes]:
        step = self.script.pop(0)
        if step == "slow":
            raise UpstreamTimeout(f"GET {url}: no complete answer in {within_s}s")
        if step == "refused":
            raise httpx.ConnectError("connection refused")
        return 200, b""


@pytest.mark.parametrize(
    ("script", "healthy_after_each"),
    [
        # a busy engine: two slow probes keep it in the pool, the third takes it out
        (["ok", "slow", "slow", "slow", "ok"], [True, True, True, False, True]),
        # slowness in between resets the count
        (["ok", "slow", "ok", "slow", "slow"], [True, True, True, True, True]),
        # a dead engine (refused) is out at once, whatever came before
        (["ok", "slow", "refused"], [True, True, False]),
        # a slow probe never makes an unhealthy endpoint healthy
        (["slow", "slow", "ok"], [False, False, True]),
    ],
)
async def test_slow_health_probes_take_an_endpoint_out_only_after_three(
    script: list[str], healthy_after_each: list[bool]
) -> None:
    config = router_config([("vllm", "http://127.0.0.1:9")])
    assert config.health.slow_probes_to_unhealthy == 3
    fleet = build_fleet(config)
    (e,) = fleet
    client = make_client(test_mode=True, max_connections=1, connect_timeout=1, read_timeout=1)
    try:
        poller = Poller(
            fleet, client, config, RouterMetrics(), time.monotonic, getter=_ScriptedGetter(script)
        )
        seen = []
        for _ in healthy_after_each:
            await poller.probe(e)
            seen.append(e.healthy)
    finally:
        await client.aclose()
    assert seen == healthy_after_each
