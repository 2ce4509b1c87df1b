"""The router against emulated fleets (``fleetgate.sim.run_fleet``), all on 127.0.0.1.

We test these aspects:
* passthrough: completions and chat, streaming and not, content identical to a direct call;
* /v1/models, /health, /ready, /metrics;
* a mixed vLLM + TensorRT-LLM pool serves both engines and scrapes both without errors;
* shared long prefixes stick to one engine and its own prefix-cache counters show hits;
* distinct prefixes spread over the pool (rendezvous);
* a hot prefix spills to other engines under a flood;
* a client disconnect aborts the upstream request in the engine;
* a backend 4xx passes through byte for byte.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import json
import re
import socket
from collections.abc import AsyncIterator, Sequence
from typing import Any

import httpx
import pytest
from routerkit import router_config, serve

from fleetgate.engines.base import LoadSnapshot
from fleetgate.router.app import build_router
from fleetgate.router.rawhttp import RawUpstream
from fleetgate.router.upstream import NonLoopbackUpstream, UpstreamConnectError
from fleetgate.sim import EngineSpec, run_fleet

MODEL = "m"
#: Every scenario here runs twice: the serve loop with immediate admission (no
#: ``priority:`` section) and with the class queue (``priority: {}``).
ADMISSIONS = {"immediate": {}, "class-queue": {"priority": {}}}
_admission: dict[str, Any] = {}


@pytest.fixture(autouse=True, params=list(ADMISSIONS))
def admission(request: pytest.FixtureRequest) -> str:
    _admission.clear()
    _admission.update(ADMISSIONS[request.param])
    return str(request.param)


def config(backends: Sequence[tuple[str, str]], **cfg: Any) -> Any:
    """The test router config of this module's current admission."""
    return router_config(backends, **{**_admission, **cfg})


PREFIX = " ".join(f"alpha{i} beta" for i in range(36))  # ~450 chars, ~130 tokens


def sse_texts(body: bytes) -> list[str]:
    """The generated text pieces of an SSE body, in order."""
    out = []
    for line in body.split(b"\n"):
        if line.startswith(b"data: ") and line != b"data: [DONE]":
            doc = json.loads(line[6:])
            for choice in doc.get("choices", []):
                piece = choice.get("text")
                if piece is None:
                    piece = (choice.get("delta") or {}).get("content")
                out.append(piece or "")
    return out


@dataclasses.dataclass
class Rig:
    router: str
    engines: list[str]
    app: Any


@contextlib.asynccontextmanager
async def rig(
    specs: Sequence[EngineSpec], time_scale: float = 1.0, **cfg: Any
) -> AsyncIterator[Rig]:
    async with run_fleet(specs, "127.0.0.1", 0, model=MODEL, time_scale=time_scale) as fleet:
        backends = [(e.kind, e.url) for e in fleet.engines]
        app = build_router(config(backends, **cfg))
        async with serve(app) as url:
            yield Rig(url, [e.url for e in fleet.engines], app)


def scrape_sum(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name) or line[len(name)] not in " {":
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def metric(c: httpx.AsyncClient, url: str, name: str, **labels: str) -> float:
    return scrape_sum((await c.get(url + "/metrics")).text, name, **labels)


async def test_passthrough_nonstream_and_stream_match_direct() -> None:
    async with rig([EngineSpec(kind="vllm")]) as r, httpx.AsyncClient(timeout=30) as c:
        for path, body in [
            ("/v1/completions", {"prompt": "Hello there, router", "max_tokens": 12}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                      "max_tokens": 12}),
        ]:  # fmt: skip
            req = {"model": MODEL, "temperature": 0, "ignore_eos": True, **body}
            direct = (await c.post(r.engines[0] + path, json=req)).json()
            via = await c.post(r.router + path, json=req)
            assert via.status_code == 200, via.text
            assert via.headers["x-fleetgate-endpoint"].startswith("127.0.0.1:")
            assert via.json()["choices"] == direct["choices"]
            assert via.json()["usage"]["completion_tokens"] == 12
            sreq = {**req, "stream": True, "stream_options": {"include_usage": True}}
            d = await c.post(r.engines[0] + path, json=sreq)
            v = await c.post(r.router + path, json=sreq)
            assert v.headers["content-type"].startswith("text/event-stream")
            assert sse_texts(v.content) == sse_texts(d.content)
            assert len(sse_texts(v.content)) >= 12
            assert v.content.endswith(b"data: [DONE]\n\n")
            # Same framing: identical bytes apart from ids and timestamps.
            norm = re.compile(rb'"(id|created)":\s*("[^"]*"|\d+)')
            assert norm.sub(b"", v.content) == norm.sub(b"", d.content)
        # Sequential requests reused one keep-alive upstream connection.
        assert r.app.state.router.upstream.idle_connections() == 1


async def test_models_health_ready_metrics_mixed_pool() -> None:
    specs = [EngineSpec(kind="vllm"), EngineSpec(kind="trtllm")]
    # Rendezvous placement of new prefixes (as with replicas): a sequential trickle would
    # otherwise all go to the engine with the most free KV, and both kinds must serve here.
    sched = {"router_replicas": 2}
    async with rig(specs, scheduling=sched) as r, httpx.AsyncClient(timeout=30) as c:
        models = (await c.get(r.router + "/v1/models")).json()
        assert [m["id"] for m in models["data"]] == [MODEL]
        assert (await c.get(r.router + "/health")).status_code == 200
        assert (await c.get(r.router + "/ready")).json() == {"status": "ready"}
        for i in range(12):
            path = "/v1/completions" if i % 2 else "/v1/chat/completions"
            body: dict[str, Any] = {"model": MODEL, "max_tokens": 4}
            text = f"conversation {i}: {PREFIX}"  # distinct long prompts: rendezvous spreads them
            if i % 2:
                body["prompt"] = text
            else:
                body["messages"] = [{"role": "user", "content": text}]
            resp = await c.post(r.router + path, json=body)
            assert resp.status_code == 200, resp.text
        await asyncio.sleep(0.3)
        text = (await c.get(r.router + "/metrics")).text
        for name in (
            "fleetgate_requests_total",
            "fleetgate_decisions_total",
            "fleetgate_e2e_request_latency_seconds_bucket",
            "fleetgate_scrape_duration_seconds_bucket",
            "fleetgate_endpoint_healthy",
            "fleetgate_scrape_age_seconds",
            "fleetgate_endpoint_kv_usage",
        ):
            assert name in text, name
        assert scrape_sum(text, "fleetgate_scrape_errors_total") == 0
        assert scrape_sum(text, "fleetgate_endpoint_healthy") == 2
        for engine in ("vllm", "trtllm"):
            assert scrape_sum(text, "fleetgate_requests_total", engine=engine, status="200") > 0
            assert scrape_sum(text, "fleetgate_scrape_duration_seconds_count", engine=engine) > 0


async def test_shared_prefix_sticks_and_engine_counts_hits() -> None:
    specs = [EngineSpec(kind="vllm") for _ in range(3)]
    async with rig(specs) as r, httpx.AsyncClient(timeout=30) as c:
        used = []
        for q in range(6):
            body = {"model": MODEL, "prompt": f"{PREFIX} question {q}?", "max_tokens": 4}
            resp = await c.post(r.router + "/v1/completions", json=body)
            assert resp.status_code == 200, resp.text
            used.append(resp.headers["x-fleetgate-endpoint"])
        assert len(set(used)) == 1, used
        engine_url = next(u for u in r.engines if u.endswith(used[0].split(":")[1]))
        hits = await metric(c, engine_url, "vllm:prefix_cache_hits_total")
        assert hits >= 5 * 16  # every repeat hit whole blocks of the prefix
        assert await metric(c, r.router, "fleetgate_decisions_total", reason="affinity-hit") == 5
        assert await metric(c, r.router, "fleetgate_decisions_total", reason="cold") == 1
        predicted = await metric(c, r.router, "fleetgate_predicted_cached_tokens_total")
        actual = await metric(c, r.router, "fleetgate_actual_cached_tokens_total")
        assert predicted > 0 and actual > 0
        # Chunk-granular prediction vs block-granular engine hits: same order of size.
        assert 0.5 <= actual / predicted <= 3.0, (actual, predicted)
        # Distinct prefixes spread over the pool. Placement of a new prefix hashes it
        # with the endpoint ids (random ports), so 12 prefixes left one of 3 engines
        # empty about 2% of the time; with 30 it is 3 x (2/3)^30, about 2e-5.
        spread = collections.Counter()
        for k in range(30):
            body = {"model": MODEL, "prompt": f"topic {k}: " + PREFIX, "max_tokens": 2}
            resp = await c.post(r.router + "/v1/completions", json=body)
            spread[resp.headers["x-fleetgate-endpoint"]] += 1
        assert len(spread) == 3, spread


@pytest.mark.parametrize("replicas", [1, 2])
async def test_hot_prefix_spills_under_flood(replicas: int) -> None:
    """One router places the concurrent copies of a new prefix on the least loaded
    engines (cold placement over all); replicas place it by rendezvous, and the
    bounded-load / prefill-cost rules spill it once its engine is loaded."""
    specs = [EngineSpec(kind="vllm") for _ in range(3)]
    sched = {"router_replicas": replicas}
    async with rig(specs, scheduling=sched) as r, httpx.AsyncClient(timeout=60) as c:
        body = {"model": MODEL, "prompt": PREFIX + " go", "max_tokens": 48, "ignore_eos": True}

        async def one() -> str:
            resp = await c.post(r.router + "/v1/completions", json=body)
            assert resp.status_code == 200, resp.text
            return resp.headers["x-fleetgate-endpoint"]

        used = collections.Counter(await asyncio.gather(*(one() for _ in range(24))))
        assert len(used) == 3, used
        assert max(used.values()) <= 12, used  # no engine takes the whole flood
        reason = "spill" if replicas > 1 else "cold"  # a new prefix placed more than once
        assert await metric(c, r.router, "fleetgate_decisions_total", reason=reason) > 1


async def test_client_disconnect_aborts_upstream() -> None:
    async with (
        rig([EngineSpec(kind="vllm")], time_scale=5.0) as r,
        httpx.AsyncClient(timeout=30) as c,
    ):
        body = {"model": MODEL, "prompt": "tell a long story", "max_tokens": 400,
                "ignore_eos": True, "stream": True}  # fmt: skip
        async with c.stream("POST", r.router + "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            async for _ in resp.aiter_raw():
                break
            running = await metric(c, r.engines[0], "vllm:num_requests_running")
            assert running == 1
        # The client closed: the engine must drop the request quickly.
        for _ in range(100):
            if await metric(c, r.engines[0], "vllm:num_requests_running") == 0:
                break
            await asyncio.sleep(0.02)
        assert await metric(c, r.engines[0], "vllm:num_requests_running") == 0
        generated = await metric(c, r.engines[0], "vllm:generation_tokens_total")
        assert generated < 200
        await asyncio.sleep(0.1)
        assert await metric(c, r.router, "fleetgate_client_disconnects_total") == 1
        assert await metric(c, r.router, "fleetgate_endpoint_in_flight") == 0


async def test_backend_4xx_passes_through_unchanged() -> None:
    async with rig([EngineSpec(kind="vllm")]) as r, httpx.AsyncClient(timeout=30) as c:
        for body in (
            {"model": MODEL, "prompt": "x", "max_tokens": 0},
            {"model": MODEL, "prompt": "hello world " * 400, "max_tokens": 8},
            {"model": MODEL, "prompt": "x", "temperature": "hot"},
        ):
            direct = await c.post(r.engines[0] + "/v1/completions", json=body)
            via = await c.post(r.router + "/v1/completions", json=body)
            assert direct.status_code == 400
            assert via.status_code == direct.status_code
            assert via.content == direct.content


async def test_dead_backend_is_retried_and_ejected_raw_client() -> None:
    """A backend port with nothing listening: connect errors retry elsewhere, then ejection."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"  # bound, never listening: refused
        async with run_fleet([EngineSpec(kind="vllm")], "127.0.0.1", 0, model=MODEL) as fleet:
            cfg = config([("vllm", dead), ("vllm", fleet.engines[0].url)])
            app = build_router(cfg, start_background=False)
            services = app.state.router
            now = services.clock()
            for e in services.fleet:  # the dead one looks best: it just died after a good scrape
                e.healthy, e.models = True, frozenset({MODEL})
                busy = 0 if e.url == dead else 4
                e.scraped(LoadSnapshot(scraped_at=now, running=busy, waiting=0, kv_usage=0.0))
            dead_ep = next(e for e in services.fleet if e.url == dead)
            async with serve(app) as url, httpx.AsyncClient(timeout=30) as c:
                for i in range(10):
                    body = {"model": MODEL, "prompt": f"p{i}", "max_tokens": 2}
                    resp = await c.post(url + "/v1/completions", json=body)
                    assert resp.status_code == 200, resp.text
                text = (await c.get(url + "/metrics")).text
                assert scrape_sum(text, "fleetgate_upstream_errors_total", cause="connect") >= 1
                assert scrape_sum(text, "fleetgate_endpoint_ejected", endpoint=dead_ep.id) == 1


async def test_raw_upstream_refuses_non_loopback_in_test_mode() -> None:
    up = RawUpstream(test_mode=True, connect_timeout=1, first_byte_timeout=1, idle_timeout=1)
    with pytest.raises(NonLoopbackUpstream):
        await up.send("http://10.1.2.3:8000", "/v1/completions", b"{}", [])
    with pytest.raises(UpstreamConnectError):
        await up.send("https://127.0.0.1:8000", "/v1/completions", b"{}", [])
    await up.aclose()


async def test_two_router_replicas_place_new_prefixes_alike() -> None:
    """Replicas share no state, yet rendezvous hashing puts each new prefix on one engine."""
    specs = [EngineSpec(kind="vllm") for _ in range(3)]
    async with run_fleet(specs, "127.0.0.1", 0, model=MODEL) as fleet:
        backends = [(e.kind, e.url) for e in fleet.engines]
        # as the Helm chart configures its replicas
        replicas = {"scheduling": {"router_replicas": 2}}
        one = build_router(config(backends, **replicas))
        two = build_router(config(backends, **replicas))
        async with serve(one) as a, serve(two) as b, httpx.AsyncClient(timeout=30) as c:
            placed: dict[int, set[str]] = collections.defaultdict(set)
            for k in range(8):
                body = {"model": MODEL, "prompt": f"tenant {k} says: {PREFIX}", "max_tokens": 2}
                for url in (a, b):
                    resp = await c.post(url + "/v1/completions", json=body)
                    placed[k].add(resp.headers["x-fleetgate-endpoint"])
                    # Replicas agree while engines have free slots. Let a scrape interval
                    # (0.05 s) pass, or the other replica's class queue may see the
                    # request just answered still waiting in its engine and pass it by.
                    await asyncio.sleep(0.15)
            assert all(len(v) == 1 for v in placed.values()), placed
            assert len({next(iter(v)) for v in placed.values()}) > 1  # and they spread


async def test_non_streaming_client_disconnect_aborts_upstream() -> None:
    async with (
        rig([EngineSpec(kind="vllm")], time_scale=5.0) as r,
        httpx.AsyncClient(timeout=30) as c,
    ):
        body = {"model": MODEL, "prompt": "a long answer", "max_tokens": 400, "ignore_eos": True}
        async with httpx.AsyncClient(timeout=30) as doomed:
            task = asyncio.get_running_loop().create_task(
                doomed.post(r.router + "/v1/completions", json=body)
            )
            for _ in range(100):
                if await metric(c, r.engines[0], "vllm:num_requests_running") == 1:
                    break
                await asyncio.sleep(0.02)
            task.cancel()  # closes the client's connection mid-request
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for _ in range(100):
            if await metric(c, r.engines[0], "vllm:num_requests_running") == 0:
                break
            await asyncio.sleep(0.02)
        assert await metric(c, r.engines[0], "vllm:num_requests_running") == 0
        assert await metric(c, r.engines[0], "vllm:generation_tokens_total") < 200
        await asyncio.sleep(0.1)
        assert await metric(c, r.router, "fleetgate_client_disconnects_total") == 1


async def test_saturated_engine_is_avoided_from_its_own_metrics() -> None:
    """Load sent straight to one engine (not via the router) shows up in its scrape."""
    specs = [EngineSpec(kind="vllm"), EngineSpec(kind="vllm")]
    async with rig(specs, time_scale=5.0) as r, httpx.AsyncClient(timeout=60) as c:
        busy, idle = r.engines
        body = {"model": MODEL, "prompt": "fill", "max_tokens": 300, "ignore_eos": True}
        flood = [
            asyncio.get_running_loop().create_task(c.post(busy + "/v1/completions", json=body))
            for _ in range(16)
        ]
        try:
            for _ in range(100):
                if await metric(c, busy, "vllm:num_requests_waiting") >= 4:
                    break
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.3)  # a few router scrapes
            used = collections.Counter()
            for i in range(10):
                short = {"model": MODEL, "prompt": f"q{i}", "max_tokens": 2}
                resp = await c.post(r.router + "/v1/completions", json=short)
                assert resp.status_code == 200
                used[resp.headers["x-fleetgate-endpoint"]] += 1
            assert used == {idle.removeprefix("http://"): 10}, used
        finally:
            for task in flood:
                task.cancel()
            await asyncio.gather(*flood, return_exceptions=True)


async def test_killed_engine_is_ejected_and_requests_retry() -> None:
    async with (
        run_fleet([EngineSpec(kind="vllm")], "127.0.0.1", 0, model=MODEL) as stays,
        httpx.AsyncClient(timeout=30) as c,
    ):
        async with contextlib.AsyncExitStack() as stack:
            doomed = await stack.enter_async_context(
                run_fleet([EngineSpec(kind="vllm")], "127.0.0.1", 0, model=MODEL)
            )
            victim = doomed.engines[0].url
            # Slow scrapes and probes: only the request path can notice the death here.
            # A long ejection, so a slow (shared CI) machine cannot outlive it before the check.
            health = {"interval_s": 60.0, "eject_base_s": 60.0}
            slow = {"scrape": {"interval_s": 60.0}, "health": health}
            backends = [("vllm", victim), ("vllm", stays.engines[0].url)]
            app = build_router(config(backends, **slow))
            url = await stack.enter_async_context(serve(app))
            # Distinct prefixes until the victim holds at least 3 (where each was served
            # is random: endpoint ids carry ephemeral ports, rendezvous hashes them).
            served: dict[str, list[int]] = collections.defaultdict(list)
            for i in range(64):
                body = {"model": MODEL, "prompt": f"tenant {i}: {PREFIX}", "max_tokens": 2}
                resp = await c.post(url + "/v1/completions", json=body)
                assert resp.status_code == 200
                served["http://" + resp.headers["x-fleetgate-endpoint"]].append(i)
                if len(served[victim]) >= 3 and served.keys() == {victim, stays.engines[0].url}:
                    break
            assert len(served[victim]) >= 3 and served[stays.engines[0].url], dict(served)
            # Kill the victim engine (its server stops; the port refuses connections).
            await doomed_close(stack, doomed)
            for i in served[victim] + served[stays.engines[0].url]:
                body = {"model": MODEL, "prompt": f"tenant {i}: {PREFIX}", "max_tokens": 2}
                resp = await c.post(url + "/v1/completions", json=body)
                assert resp.status_code == 200, resp.text
                assert resp.headers["x-fleetgate-endpoint"] == stays.engines[0].url[7:]
            text = (await c.get(url + "/metrics")).text
            victim_id = victim.removeprefix("http://")
            failures = [
                line
                for line in text.splitlines()
                if line.startswith(("fleetgate_retries_total", "fleetgate_upstream_errors_total"))
            ]
            # the victim's three prefixes each failed there once, then it was ejected
            assert scrape_sum(text, "fleetgate_retries_total") == 3, failures
            ejected = scrape_sum(text, "fleetgate_endpoint_ejected", endpoint=victim_id)
            healthy = scrape_sum(text, "fleetgate_endpoint_healthy", endpoint=victim_id)
            assert ejected == 1 and healthy == 1, failures  # passive; no probe has run yet


async def doomed_close(stack: contextlib.AsyncExitStack, fleet: Any) -> None:
    """Stop one emulated engine while the router keeps running."""
    engine = fleet.engines[0]
    await engine.engine.driver.stop()
    engine.server.should_exit = True
    await engine.server.shutdown()


class _ClosingEngine(asyncio.Protocol):
    """Answers one request per connection, then closes it shortly after (idle timeout)."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.buf = b""

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if b"\r\n\r\n" in self.buf:
            body = b'{"ok":true}'
            head = (
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 11\r\n\r\n"
            )
            self.transport.write(head + body)  # type: ignore[attr-defined]
            asyncio.get_running_loop().call_later(0.05, self.transport.close)


async def test_raw_upstream_survives_keepalive_closed_by_the_engine() -> None:
    server = await asyncio.get_running_loop().create_server(_ClosingEngine, "127.0.0.1", 0)
    base = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    up = RawUpstream(test_mode=True, connect_timeout=1, first_byte_timeout=1, idle_timeout=1)
    try:
        for _ in range(3):
            resp = await up.send(base, "/v1/completions", b"{}", [])
            assert resp.status == 200 and await resp.read() == b'{"ok":true}'
            await resp.aclose()
            assert up.idle_connections() == 1  # kept: the engine said nothing about closing
            await asyncio.sleep(0.2)  # the engine closes it meanwhile
    finally:
        await up.aclose()
        server.close()
        await server.wait_closed()
