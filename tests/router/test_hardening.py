"""Issue 14, router side: no client can hurt another, and faults end fast and cleanly.

The engines are ``httpx.MockTransport`` handlers (fast, deterministic). We test:
* with classes on and no endpoint able to serve the model, a request gets 503 with
  Retry-After at once, and queued requests are answered the moment the last
  endpoint goes (no hold for the class's queue time);
* POST routes require ``application/json`` (415, JSON error);
* HTTP/1.0 clients get a Content-Length answer (no chunked framing), streams included;
* the status label of ``fleetgate_requests_total`` is the status sent (499 for a
  client gone while its body was being read); unknown routes and methods get JSON;
* every client text echoed in an error is bounded.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from routerkit import router_config, serve

from fleetgate.router.app import build_router
from fleetgate.router.services import Services

A, B = "127.0.0.1:18001", "127.0.0.1:18002"
OK_BODY = {"id": "cmpl-1", "object": "text_completion", "model": "m",
           "choices": [{"index": 0, "text": "hi", "finish_reason": "length"}],
           "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}  # fmt: skip
SSE = (
    b'data: {"id":"c","object":"text_completion","created":1,"model":"m","choices":'
    b'[{"index":0,"text":"a","logprobs":null,"finish_reason":null}]}\n\n'
    b'data: {"id":"c","object":"text_completion","created":1,"model":"m","choices":'
    b'[{"index":0,"text":"b","logprobs":null,"finish_reason":"length"}]}\n\n'
    b"data: [DONE]\n\n"
)

Handler = Callable[[httpx.Request], Any]


def ok(request: httpx.Request) -> httpx.Response:
    if json.loads(request.content).get("stream"):
        return httpx.Response(200, content=SSE, headers={"content-type": "text/event-stream"})
    return httpx.Response(200, json=OK_BODY)


class Rig:
    def __init__(self, handlers: dict[str, Handler], **cfg: Any) -> None:
        self.handlers = handlers
        self.calls: Counter[str] = Counter()

        async def route(request: httpx.Request) -> httpx.Response:
            host = f"{request.url.host}:{request.url.port}"
            self.calls[host] += 1
            result = self.handlers[host](request)
            if asyncio.iscoroutine(result):
                result = await result
            assert isinstance(result, httpx.Response)
            return result

        backends = [("vllm", f"http://{h}") for h in handlers]
        self.app = build_router(
            router_config(backends, **cfg),
            transport=httpx.MockTransport(route),
            start_background=False,
        )
        self.services: Services = self.app.state.router
        for e in self.services.fleet:
            e.healthy = True
            e.models = frozenset({"m"})

    def endpoint(self, host: str) -> Any:
        return self.services.fleet.endpoints[host]  # type: ignore[index]


def error_of(resp: httpx.Response) -> dict[str, Any]:
    doc = resp.json()
    assert set(doc) == {"error"}
    assert doc["error"]["code"] == resp.status_code
    assert isinstance(doc["error"]["message"], str) and doc["error"]["message"]
    return dict(doc["error"])


def requests_total(app: Any, status: str) -> float:
    from prometheus_client import generate_latest

    total = 0.0
    for line in generate_latest(app.state.router.metrics.registry).decode().splitlines():
        if line.startswith("fleetgate_requests_total{") and f'status="{status}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


BODY = {"model": "m", "prompt": "x", "max_tokens": 2}


# -- all engines down, classes on ------------------------------------------------------


@pytest.mark.parametrize("cls", ["standard", "batch"])
async def test_all_down_with_classes_is_503_at_once(cls: str) -> None:
    rig = Rig({A: ok, B: ok}, priority={})
    for e in rig.services.fleet:
        e.healthy = False
    async with serve(rig.app) as url, httpx.AsyncClient(timeout=20) as c:
        t0 = time.monotonic()
        resp = await c.post(
            url + "/v1/completions", json=BODY, headers={"x-fleetgate-priority": cls}
        )
        assert time.monotonic() - t0 < 2.0
        assert resp.status_code == 503, resp.text
        assert int(resp.headers["retry-after"]) >= 1
        assert "healthy" in error_of(resp)["message"]
    assert sum(rig.calls.values()) == 0


async def test_queued_requests_get_503_when_the_last_endpoint_goes() -> None:
    gate = asyncio.Event()

    async def slow(request: httpx.Request) -> httpx.Response:
        await gate.wait()
        return ok(request)

    rig = Rig({A: slow}, capacity=1, priority={})
    async with serve(rig.app) as url, httpx.AsyncClient(timeout=20) as c:
        first = asyncio.ensure_future(c.post(url + "/v1/completions", json=BODY))
        for _ in range(200):
            if rig.calls[A]:
                break
            await asyncio.sleep(0.01)
        second = asyncio.ensure_future(
            c.post(url + "/v1/completions", json=BODY, headers={"x-fleetgate-priority": "batch"})
        )
        for _ in range(200):
            if len(rig.app.state.admission.queue):
                break
            await asyncio.sleep(0.01)
        assert len(rig.app.state.admission.queue) == 1
        t0 = time.monotonic()
        rig.endpoint(A).healthy = False
        rig.app.state.admission.on_fleet_change()
        resp = await asyncio.wait_for(second, 5)
        assert time.monotonic() - t0 < 2.0
        assert resp.status_code == 503 and "retry-after" in resp.headers, resp.text
        error_of(resp)
        gate.set()
        assert (await first).status_code == 200
        assert len(rig.app.state.admission.queue) == 0


# -- content type, HTTP/1.0, metrics status, JSON everywhere -----------------------------


@pytest.mark.parametrize(
    "ctype",
    [None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; b=x",
     "application/jsonx", "text/json"],
)  # fmt: skip
async def test_post_routes_require_application_json(ctype: str | None) -> None:
    rig = Rig({A: ok})
    headers = {} if ctype is None else {"content-type": ctype}
    async with serve(rig.app) as url, httpx.AsyncClient() as c:
        for path in ("/v1/completions", "/v1/chat/completions"):
            resp = await c.post(url + path, content=json.dumps(BODY).encode(), headers=headers)
            assert resp.status_code == 415, resp.text
            assert "application/json" in error_of(resp)["message"]
        for ok_type in ("application/json", "Application/JSON; charset=utf-8"):
            resp = await c.post(
                url + "/v1/completions",
                content=json.dumps(BODY).encode(),
                headers={"content-type": ok_type},
            )
            assert resp.status_code == 200, resp.text
    assert rig.calls[A] == 2
    assert requests_total(rig.app, "415") == 2


async def raw_http(url: str, request: bytes, *, read_for: float = 5.0) -> bytes:
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(request)
        await writer.drain()
        out = b""
        async with asyncio.timeout(read_for):
            while chunk := await reader.read(65536):
                out += chunk
        return out
    finally:
        writer.close()


@pytest.mark.parametrize("admission", [{}, {"priority": {}}], ids=["immediate", "class-queue"])
@pytest.mark.parametrize("stream", [False, True])
async def test_http10_clients_get_content_length_answers(
    stream: bool, admission: dict[str, Any]
) -> None:
    rig = Rig({A: ok}, **admission)
    body = json.dumps({**BODY, "stream": stream}).encode()
    async with serve(rig.app) as url:
        raw = await raw_http(
            url,
            b"POST /v1/completions HTTP/1.0\r\nHost: x\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(body), body),
        )
    head, _, payload = raw.partition(b"\r\n\r\n")
    lines = head.lower().split(b"\r\n")
    assert lines[0].startswith(b"http/1.1 200"), raw[:300]
    assert not any(ln.startswith(b"transfer-encoding") for ln in lines), head
    length = next(int(ln.split(b":")[1]) for ln in lines if ln.startswith(b"content-length"))
    assert length == len(payload) > 0
    if stream:
        assert payload.endswith(b"data: [DONE]\n\n")
        assert b'"text":"a"' in payload.replace(b" ", b"")
    else:
        assert json.loads(payload)["choices"][0]["text"] in ("hi", "ab")  # JSON or spliced SSE


async def test_status_label_is_the_status_sent_and_unknown_routes_get_json() -> None:
    rig = Rig({A: ok})
    async with serve(rig.app) as url, httpx.AsyncClient() as c:
        resp = await c.get(url + "/v1/completions")
        assert resp.status_code == 405 and error_of(resp)
        resp = await c.post(url + "/v1/nothing", json=BODY)
        assert resp.status_code == 404 and error_of(resp)
        # a client that leaves while its body is being read: 499, never "0"
        host, port = url.removeprefix("http://").split(":")
        _, writer = await asyncio.open_connection(host, int(port))
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
            b'content-length: 100\r\n\r\n{"model"'
        )
        await writer.drain()
        await asyncio.sleep(0.2)
        writer.close()
        for _ in range(100):
            if requests_total(rig.app, "499"):
                break
            await asyncio.sleep(0.02)
    assert requests_total(rig.app, "499") == 1
    assert requests_total(rig.app, "0") == 0


async def test_client_text_echoed_in_errors_is_bounded() -> None:
    rig = Rig({A: ok})
    huge = "z" * 60_000
    async with serve(rig.app) as url, httpx.AsyncClient() as c:
        for headers, body in [
            ({"x-fleetgate-priority": huge}, BODY),
            ({"x-fleetgate-tenant": huge}, BODY),
            ({}, {**BODY, "model": huge}),
            ({}, {**BODY, "priority": huge}),
        ]:
            resp = await c.post(url + "/v1/completions", json=body, headers=headers)
            assert 400 <= resp.status_code < 500, resp.text
            assert len(resp.content) < 1000, len(resp.content)
            error_of(resp)
        resp = await c.post(
            url + "/v1/completions",
            content=b"{" + huge.encode(),
            headers={"content-type": "application/json"},
        )
        assert resp.status_code == 400 and len(resp.content) < 1000


# -- section 2: limits ---------------------------------------------------------------------


def guarded(rig: Rig) -> Any:
    from fleetgate.router.http_server import guarded_protocol

    cfg = rig.services.config
    return serve(
        rig.app, http=guarded_protocol(cfg), timeout_keep_alive=cfg.timeouts.client_keep_alive_s
    )


async def open_raw(url: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = url.removeprefix("http://").split(":")
    return await asyncio.open_connection(host, int(port))


async def read_all(reader: asyncio.StreamReader, within: float) -> bytes:
    out = b""
    async with asyncio.timeout(within):
        while chunk := await reader.read(65536):
            out += chunk
    return out


async def test_slow_loris_connections_are_closed_with_408() -> None:
    rig = Rig({A: ok}, timeouts={"client_header_s": 0.5})
    async with guarded(rig) as url, httpx.AsyncClient() as c:
        idle = [await open_raw(url) for _ in range(20)]  # connect, send nothing
        slow = [await open_raw(url) for _ in range(20)]  # send headers one byte at a time
        for _, w in slow:
            w.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nx-a: ")
        t0 = time.monotonic()
        for _ in range(3):
            await asyncio.sleep(0.2)
            for _, w in slow:
                w.write(b"a")
        for r, w in idle + slow:
            raw = await read_all(r, 3.0)  # the server closes it
            assert raw == b"" or raw.startswith(b"HTTP/1.1 408"), raw[:100]
            w.close()
        assert time.monotonic() - t0 < 3.0
        # a well-formed client is unaffected
        resp = await c.post(url + "/v1/completions", json=BODY)
        assert resp.status_code == 200


async def test_keep_alive_connection_gets_a_fresh_header_window() -> None:
    rig = Rig({A: ok}, timeouts={"client_header_s": 0.5, "client_keep_alive_s": 5})
    async with guarded(rig) as url, httpx.AsyncClient() as c:
        for _ in range(3):  # one keep-alive connection, idle longer than the header window
            resp = await c.post(url + "/v1/completions", json=BODY)
            assert resp.status_code == 200
            await asyncio.sleep(0.7)


@pytest.mark.parametrize("how", ["count", "one-huge", "many-large"])
@pytest.mark.parametrize("server", ["guarded", "plain"])
async def test_too_many_or_too_large_headers_get_431(how: str, server: str) -> None:
    rig = Rig({A: ok})
    if how == "count":
        headers = [(f"x-h{i}", "v") for i in range(20_000 if server == "guarded" else 200)]
    elif how == "one-huge":
        headers = [("x-big", "v" * (1 << 20 if server == "guarded" else 70_000))]
    else:
        headers = [(f"x-h{i}", "v" * 8000) for i in range(9)]
    head = b"".join(f"{k}: {v}\r\n".encode() for k, v in headers)
    body = json.dumps(BODY).encode()
    ctx = guarded(rig) if server == "guarded" else serve(rig.app)
    async with ctx as url, httpx.AsyncClient() as c:
        r, w = await open_raw(url)
        try:
            w.write(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
                b"connection: close\r\n"
                + head
                + b"content-length: %d\r\n\r\n%s" % (len(body), body)
            )
            await w.drain()
        except ConnectionError:
            pass
        raw = await read_all(r, 5.0)
        w.close()
        assert raw.startswith(b"HTTP/1.1 431"), raw[:200]
        payload = raw.partition(b"\r\n\r\n")[2]
        assert json.loads(payload)["error"]["code"] == 431
        assert (await c.post(url + "/v1/completions", json=BODY)).status_code == 200
    assert rig.calls[A] == 1  # nothing was forwarded


async def test_body_read_timeout_is_408() -> None:
    rig = Rig({A: ok}, timeouts={"client_body_s": 0.5})
    async with serve(rig.app) as url:
        r, w = await open_raw(url)
        w.write(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
            b'content-length: 1000\r\n\r\n{"model": '
        )
        await w.drain()
        t0 = time.monotonic()
        raw = await read_all(r, 5.0)
        w.close()
        assert raw.startswith(b"HTTP/1.1 408"), raw[:200]
        assert time.monotonic() - t0 < 2.0
    assert requests_total(rig.app, "408") == 1
    assert rig.services.body_bytes.used == 0


async def test_bytes_in_flight_are_bounded() -> None:
    """Bodies being read or held count against one budget: beyond it 503, and the
    budget is given back when each request ends."""
    gate = asyncio.Event()

    async def slow(request: httpx.Request) -> httpx.Response:
        await gate.wait()
        return ok(request)

    rig = Rig({A: slow}, limits={"max_body_bytes": 64 * 1024, "max_bytes_in_flight": 200_000})
    big = {**BODY, "prompt": "p" * 60_000}
    async with serve(rig.app) as url, httpx.AsyncClient(timeout=20) as c:
        held = [asyncio.ensure_future(c.post(url + "/v1/completions", json=big)) for _ in range(3)]
        for _ in range(200):
            if rig.calls[A] == 3:
                break
            await asyncio.sleep(0.01)
        assert rig.services.body_bytes.used >= 180_000
        resp = await c.post(url + "/v1/completions", json=big)
        assert resp.status_code == 503 and "retry-after" in resp.headers, resp.text
        error_of(resp)
        gate.set()
        assert [(await h).status_code for h in held] == [200, 200, 200]
        assert (await c.post(url + "/v1/completions", json=big)).status_code == 200
    assert rig.services.body_bytes.used == 0


@pytest.mark.parametrize(
    "extra",
    [
        {"stream_options": [1, 2]},
        {"stream_options": "yes", "stream": True},
        {"n": "two"},
        {"n": 1e308},
        {"best_of": [1]},
    ],
)
@pytest.mark.parametrize("admission", [{}, {"priority": {}}], ids=["immediate", "class-queue"])
async def test_wrongly_typed_fields_the_router_reads_are_400(
    extra: dict[str, Any], admission: dict[str, Any]
) -> None:
    """Found by the property suite: a non-object stream_options was a 500."""
    rig = Rig({A: ok}, **admission)
    async with serve(rig.app) as url, httpx.AsyncClient() as c:
        resp = await c.post(url + "/v1/completions", json={**BODY, **extra})
        assert resp.status_code == 400, resp.text
        assert error_of(resp)["param"] == next(iter(extra))
    assert requests_total(rig.app, "500") == 0
