"""Faults and bad input, with the engines replaced by ``httpx.MockTransport``.

We test these aspects:
* connect errors and 5xx before the first byte retry on another endpoint; repeated
  failures eject the endpoint, a good /health probe after the ejection time restores it;
* a stream that breaks before its first chunk is retried; all endpoints failing gives the
  last engine error (5xx) or 503 with Retry-After;
* bad input: malformed JSON, non-object, unknown model, missing model, oversized body,
  bad priority header, wrong method, no healthy endpoint, nothing discovered yet;
* a saturated engine is avoided; a stale scrape never reads idle;
* request bodies pass upstream byte for byte; the priority header is translated;
* the total timeout answers 504; InFlight.cancel stops a stream and closes upstream;
* test mode refuses non-loopback backends in config and in the client.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest
from routerkit import router_config, serve

from fleetgate.engines import get_adapter
from fleetgate.engines.base import LoadSnapshot
from fleetgate.router.app import build_router
from fleetgate.router.client import NonLoopbackBackendError, make_client
from fleetgate.router.config import ConfigError
from fleetgate.router.poller import metrics_url
from fleetgate.router.scheduling.prefix import estimate_tokens, render_prompt
from fleetgate.router.services import Services

A, B = "127.0.0.1:18001", "127.0.0.1:18002"
OK_BODY = {"id": "cmpl-1", "object": "text_completion", "model": "m",
           "choices": [{"index": 0, "text": "hi", "finish_reason": "length"}],
           "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4,
                     "prompt_tokens_details": {"cached_tokens": 0}}}  # fmt: skip


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


Handler = Callable[[httpx.Request], Any]
JSON = {"content-type": "application/json"}


def ok(request: httpx.Request) -> httpx.Response:
    return httpx.Response(200, json=OK_BODY)


class Rig:
    def __init__(self, handlers: dict[str, Handler], **cfg: Any) -> None:
        self.handlers = handlers
        self.calls: Counter[str] = Counter()
        self.bodies: list[bytes] = []
        self.clock = Clock()

        async def route(request: httpx.Request) -> httpx.Response:
            host = f"{request.url.host}:{request.url.port}"
            self.calls[host] += 1
            self.bodies.append(request.content)
            result = self.handlers[host](request)
            if asyncio.iscoroutine(result):
                result = await result
            assert isinstance(result, httpx.Response)
            return result

        backends = [("vllm", f"http://{h}") for h in handlers]
        self.app = build_router(
            router_config(backends, **cfg),
            clock=self.clock,
            transport=httpx.MockTransport(route),
            start_background=False,
        )
        self.services: Services = self.app.state.router
        for e in self.services.fleet:
            e.healthy = True
            e.models = frozenset({"m"})

    def endpoint(self, host: str) -> Any:
        return self.services.fleet.endpoints[host]  # type: ignore[index]


async def post(
    c: httpx.AsyncClient, url: str, body: Any, path: str = "/v1/completions"
) -> httpx.Response:
    return await c.post(url + path, json=body)


def error_of(resp: httpx.Response) -> dict[str, Any]:
    doc = resp.json()
    assert set(doc) == {"error"}
    assert doc["error"]["code"] == resp.status_code
    assert isinstance(doc["error"]["message"], str) and doc["error"]["message"]
    return dict(doc["error"])


def refuse(request: httpx.Request) -> httpx.Response:
    raise httpx.ConnectError("connection refused", request=request)


async def test_connect_errors_retry_eject_and_recover() -> None:
    rig = Rig({A: refuse, B: ok})
    async with serve(rig.app) as url, httpx.AsyncClient(timeout=10) as c:
        for _ in range(12):
            resp = await post(c, url, {"model": "m", "prompt": "x", "max_tokens": 1})
            assert resp.status_code == 200 and resp.headers["x-fleetgate-endpoint"] == B
        assert rig.calls[A] == 3  # ejected after the third consecutive failure
        a = rig.endpoint(A)
        assert a.is_ejected(rig.clock.t)
        text = (await c.get(url + "/metrics")).text
        assert (
            'fleetgate_endpoint_ejections_total{endpoint="127.0.0.1:18001",engine="vllm"} 1.0'
            in text
        )
        assert 'fleetgate_retries_total{cause="connect",model="m"} 3.0' in text
        # Recovery: the engine is back, but only a probe after the ejection time restores it.
        rig.handlers[A] = ok
        poller = rig.app.state.poller
        await poller.probe(a)
        assert a.is_ejected(rig.clock.t)
        rig.clock.t += 10
        await poller.probe(a)
        assert not a.is_ejected(rig.clock.t)
        seen = Counter()
        for _ in range(12):
            resp = await post(c, url, {"model": "m", "prompt": "x", "max_tokens": 1})
            seen[resp.headers["x-fleetgate-endpoint"]] += 1
        assert seen[A] > 0


async def test_5xx_and_overload_before_first_byte_retry() -> None:
    body = {"error": {"message": "boom", "type": "InternalServerError", "param": None, "code": 500}}
    rig = Rig({A: lambda r: httpx.Response(500, json=body), B: ok})
    async with serve(rig.app) as url, httpx.AsyncClient(timeout=10) as c:
        for _ in range(6):
            resp = await post(c, url, {"model": "m", "prompt": "x"})
            assert resp.status_code == 200
    rig = Rig({A: lambda r: httpx.Response(429, json=body), B: ok})
    async with serve(rig.app) as url, httpx.AsyncClient(timeout=10) as c:
        for _ in range(6):
            resp = await post(c, url, {"model": "m", "prompt": "x"})
            assert resp.status_code == 200


async def test_all_endpoints_failing() -> None:
    engine_body = (
        b'{"error":{"message":"dead","type":"InternalServerError","param":null,"code":500}}'
    )

    def dead(request: httpx.Request) -> httpx.Response:
        return httpx.Response(500, content=engine_body)

    fail = {A: dead, B: dead}
    async with serve(Rig(fail).app) as url, httpx.AsyncClient(timeout=10) as c:
        resp = await post(c, url, {"model": "m", "prompt": "x"})
        assert resp.status_code == 500 and resp.content == engine_body
    async with serve(Rig({A: refuse, B: refuse}).app) as url, httpx.AsyncClient(timeout=10) as c:
        resp = await post(c, url, {"model": "m", "prompt": "x"})
        assert resp.status_code == 503 and resp.headers["retry-after"] == "1"
        assert "connect" in error_of(resp)["message"]


class Chunks(httpx.AsyncByteStream):
    """A real (not pre-read) response stream, as the network transport gives."""

    def __init__(self, *chunks: bytes) -> None:
        self.chunks = chunks

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for chunk in self.chunks:
            yield chunk


class BrokenStream(httpx.AsyncByteStream):
    async def __aiter__(self) -> AsyncIterator[bytes]:
        raise httpx.ReadError("reset by peer")
        yield b""  # pragma: no cover

    async def aclose(self) -> None:
        return None


async def test_stream_broken_before_first_chunk_is_retried() -> None:
    sse = b'data: {"choices":[{"index":0,"text":"a","finish_reason":"length"}]}\n\ndata: [DONE]\n\n'
    broken = lambda r: httpx.Response(  # noqa: E731
        200, headers={"content-type": "text/event-stream"}, stream=BrokenStream()
    )

    def good(request: httpx.Request) -> httpx.Response:
        sse_type = {"content-type": "text/event-stream"}
        return httpx.Response(200, headers=sse_type, stream=Chunks(sse[:20], sse[20:]))

    rig = Rig({A: broken, B: good})
    async with serve(rig.app) as url, httpx.AsyncClient(timeout=10) as c:
        for _ in range(4):
            resp = await post(c, url, {"model": "m", "prompt": "x", "stream": True})
            assert resp.status_code == 200, resp.text
            # the stream goes through the splicer (resumable): same answer, one [DONE]
            events = [ln[6:] for ln in resp.text.split("\n") if ln.startswith("data: ")]
            assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
            assert "error" not in resp.text, resp.text
            docs = [json.loads(ev) for ev in events[:-1]]
            assert "".join(d["choices"][0]["text"] for d in docs if d.get("choices")) == "a"


@pytest.mark.parametrize(
    ("raw", "status", "param"),
    [
        pytest.param(b"{not json", 400, None, id="malformed-json"),
        pytest.param(b"[1, 2]", 400, None, id="not-an-object"),
        pytest.param(b'{"model": "nope", "prompt": "x"}', 404, "model", id="unknown-model"),
        pytest.param(b'{"model": 5, "prompt": "x"}', 400, "model", id="model-not-string"),
        pytest.param(b'{"model": "m", "prompt": "' + b"x" * 3000 + b'"}', 413, None, id="too-big"),
    ],
)
async def test_bad_input(raw: bytes, status: int, param: str | None) -> None:
    rig = Rig({A: ok}, limits={"max_body_bytes": 2048})
    async with serve(rig.app) as url, httpx.AsyncClient() as c:
        resp = await c.post(url + "/v1/completions", content=raw, headers=JSON)
        assert resp.status_code == status, resp.text
        assert error_of(resp)["param"] == param
    assert rig.calls[A] == 0


async def test_more_bad_input_and_unavailable() -> None:
    rig = Rig({A: ok, B: ok})
    rig.endpoint(B).models = frozenset({"other"})
    async with serve(rig.app) as url, httpx.AsyncClient() as c:
        resp = await c.post(url + "/v1/completions", json={"prompt": "x"})
        assert resp.status_code == 400 and error_of(resp)["param"] == "model"
        resp = await c.post(
            url + "/v1/completions", json={"model": "m"}, headers={"x-fleetgate-priority": "hi"}
        )
        assert resp.status_code == 400
        resp = await c.get(url + "/v1/completions")
        assert resp.status_code == 405
        rig.endpoint(A).healthy = False
        resp = await c.post(url + "/v1/completions", json={"model": "m", "prompt": "x"})
        assert resp.status_code == 503 and resp.headers["retry-after"] == "1"
        assert "healthy" in error_of(resp)["message"]
        assert (await c.get(url + "/ready")).status_code == 200  # "other" is still served
        for e in rig.services.fleet:
            e.models = frozenset()
        resp = await c.post(url + "/v1/completions", json={"model": "m", "prompt": "x"})
        assert resp.status_code == 503 and "retry-after" in resp.headers
        assert (await c.get(url + "/ready")).status_code == 503
    assert rig.calls[A] == 0


def snapshot(now: float, **kw: Any) -> LoadSnapshot:
    base: dict[str, Any] = dict(scraped_at=now, kv_usage=0.05, running=0, waiting=0,
                                block_size=16, blocks_total=1000, blocks_free=950)  # fmt: skip
    base.update(kw)
    return LoadSnapshot(**base)


async def test_saturated_engine_avoided_and_stale_is_not_idle() -> None:
    rig = Rig({A: ok, B: ok})
    t = rig.clock.t
    rig.endpoint(A).scraped(snapshot(t, kv_usage=0.99, running=8, waiting=30, blocks_free=5))
    rig.endpoint(B).scraped(snapshot(t))
    async with serve(rig.app) as url, httpx.AsyncClient(timeout=10) as c:
        for i in range(20):
            resp = await post(c, url, {"model": "m", "prompt": f"p{i}", "max_tokens": 8})
            assert resp.headers["x-fleetgate-endpoint"] == B
        # B's scrape goes stale while A reports idle: B no longer looks idle.
        rig.clock.t += 30
        rig.endpoint(A).scraped(snapshot(rig.clock.t))
        for i in range(10):
            resp = await post(c, url, {"model": "m", "prompt": f"q{i}", "max_tokens": 8})
            assert resp.headers["x-fleetgate-endpoint"] == A


async def test_body_passthrough_and_priority_translation() -> None:
    rig = Rig({A: ok})
    raw = b'{"model":"m","prompt":"x","unknown_field":{"keep":[1,2]},  "max_tokens":3}'
    async with serve(rig.app) as url, httpx.AsyncClient() as c:
        await c.post(url + "/v1/completions", content=raw, headers=JSON)
        assert rig.bodies[-1] == raw
        hdr = {"x-fleetgate-priority": "critical", **JSON}
        await c.post(url + "/v1/completions", content=raw, headers=hdr)
        sent = json.loads(rig.bodies[-1])
        assert sent["unknown_field"] == {"keep": [1, 2]}
        for key, value in get_adapter("vllm").priority_fields(8).items():
            assert sent[key] == value


async def test_total_timeout_gives_504() -> None:
    async def slow(request: httpx.Request) -> httpx.Response:
        await asyncio.sleep(5)
        return ok(request)

    rig = Rig({A: slow}, timeouts={"total_s": 0.2})
    async with serve(rig.app) as url, httpx.AsyncClient(timeout=10) as c:
        resp = await post(c, url, {"model": "m", "prompt": "x"})
        assert resp.status_code == 504
        assert error_of(resp)["type"] == "GatewayTimeoutError"


async def test_test_mode_refuses_non_loopback() -> None:
    with pytest.raises(ConfigError, match="not a loopback"):
        build_router(router_config([("vllm", "http://10.0.0.1:8000")]))
    called = []
    client = make_client(
        test_mode=True,
        max_connections=4,
        connect_timeout=1,
        read_timeout=1,
        transport=httpx.MockTransport(lambda r: called.append(r) or ok(r)),
    )
    async with client:
        with pytest.raises(NonLoopbackBackendError):
            await client.get("http://10.1.2.3:8000/health")
        assert (await client.get("http://127.0.0.2:8000/health")).status_code == 200
    assert len(called) == 1


def test_metrics_source_with_its_own_port() -> None:
    assert metrics_url("http://127.0.0.1:8000", None) == "http://127.0.0.1:8000"
    assert metrics_url("http://127.0.0.1:8000", 8002) == "http://127.0.0.1:8002"
    assert metrics_url("http://[::1]:8000", 8002) == "http://[::1]:8002"


class GatedStream(httpx.AsyncByteStream):
    """An SSE answer whose first token and the rest wait for the test's go-ahead."""

    def __init__(self) -> None:
        self.first, self.rest = asyncio.Event(), asyncio.Event()

    async def __aiter__(self) -> AsyncIterator[bytes]:
        await self.first.wait()
        for i, text in enumerate(("a", "b")):
            if i:
                await self.rest.wait()
            choice = {"index": 0, "text": text, "finish_reason": "length" if i else None}
            doc = {"id": "cmpl-1", "object": "text_completion", "model": "m", "choices": [choice]}
            yield b"data: " + json.dumps(doc).encode() + b"\n\n"
        yield b"data: [DONE]\n\n"


@pytest.mark.parametrize("priority", [None, {}], ids=["plain", "priority-classes"])
async def test_prefill_backlog_counts_until_the_first_token(priority: Any) -> None:
    """``Endpoint.prefilling`` (the prefill-cost rule's backlog) holds a request's uncached
    prompt from dispatch to its first token, on the plain and the priority path."""
    stream = GatedStream()
    sse = {"content-type": "text/event-stream"}
    cfg = {"priority": priority} if priority is not None else {}
    rig = Rig({A: lambda r: httpx.Response(200, headers=sse, stream=stream)}, **cfg)
    prompt = "word " * 400  # ~400 estimated tokens (words), all uncached
    body = {"model": "m", "prompt": prompt, "max_tokens": 2, "stream": True}
    expected = estimate_tokens(render_prompt(body))
    assert 400 <= expected <= 410
    a = rig.endpoint(A)
    async with serve(rig.app) as url, httpx.AsyncClient(timeout=10) as c:
        task = asyncio.create_task(post(c, url, body))
        for _ in range(200):
            if a.prefilling:
                break
            await asyncio.sleep(0.01)
        assert a.prefilling == expected
        text = (await c.get(url + "/metrics")).text
        gauge = "fleetgate_endpoint_prefill_backlog_tokens"
        assert f'{gauge}{{endpoint="{A}",engine="vllm"}} {float(expected)}' in text
        stream.first.set()
        for _ in range(200):  # first token relayed; the answer is still streaming
            if not a.prefilling:
                break
            await asyncio.sleep(0.01)
        assert a.prefilling == 0 and a.counts.in_flight == 1
        stream.rest.set()
        resp = await task
        assert resp.status_code == 200 and resp.text.endswith("data: [DONE]\n\n")
        assert a.prefilling == 0 and a.counts.in_flight == 0
        # A second request of the same prompt is believed cached: no backlog while it waits.
        stream2 = GatedStream()
        rig.handlers[A] = lambda r: httpx.Response(200, headers=sse, stream=stream2)
        task = asyncio.create_task(post(c, url, body))
        for _ in range(200):
            if a.counts.in_flight:
                break
            await asyncio.sleep(0.01)
        assert a.counts.in_flight == 1 and a.prefilling < 10  # only the last partial chunk
        stream2.first.set()
        stream2.rest.set()
        assert (await task).status_code == 200
        assert a.prefilling == 0


async def test_prefill_backlog_is_released_when_the_attempt_fails() -> None:
    rig = Rig({A: lambda r: httpx.Response(500, json={"error": "x"}), B: refuse})
    async with serve(rig.app) as url, httpx.AsyncClient(timeout=10) as c:
        resp = await post(c, url, {"model": "m", "prompt": "word " * 400, "max_tokens": 2})
        assert resp.status_code == 500
    assert rig.endpoint(A).prefilling == 0 and rig.endpoint(B).prefilling == 0
