"""The request path: parse -> admit -> schedule -> relay, with retries and aborts.

``ProxyEndpoint`` is a raw ASGI app mounted on ``POST /v1/completions`` and
``POST /v1/chat/completions``, so the router controls exactly when the first
byte goes to the client:

* The upstream response is held until its first body chunk arrives. Until
  then nothing has reached the client, so a connect error, a 5xx or a body
  that breaks before its first chunk is retried on the next endpoint of the
  decision's ranking (bounded by ``limits.max_attempts``; each endpoint is
  tried at most once).
* A backend 4xx (``classify_error`` kind ``client``) passes through unchanged,
  byte for byte, status and body.
* Streams are relayed chunk by chunk as they arrive (``aiter_raw``: no
  re-framing, no buffering), each sent at once.
* Request bodies go upstream byte for byte unless an engine-specific field
  must be added (``x-fleetgate-priority`` -> ``adapter.priority_fields``).
* A client disconnect cancels the relay task; its ``finally`` closes the
  upstream response, which closes the connection, so the engine aborts the
  request and frees its KV. The same path serves :meth:`InFlight.cancel`.

Every accepted request ends in exactly one response and one log line, and
``Endpoint.dispatch``/``finish`` always pair up (``finally``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import logging
import random
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from starlette.types import Message, Receive, Scope, Send

from fleetgate.engines.base import LEVEL_MAX, LEVEL_MIN
from fleetgate.router.config import RouterConfig
from fleetgate.router.dispatch import Admission, AdmissionRejected, InFlight, InFlightTable, Ticket
from fleetgate.router.errors import send_bytes, send_error
from fleetgate.router.metrics import RouterMetrics
from fleetgate.router.scheduling.load import kv_tokens_needed
from fleetgate.router.scheduling.pipeline import NoEndpointError, Pipeline
from fleetgate.router.scheduling.plugins import uncached_tokens
from fleetgate.router.scheduling.prefix import (
    chunk_chain,
    first_chunk_key,
    render_prompt,
    rendezvous_order,
)
from fleetgate.router.scheduling.types import Decision, EndpointId, RequestView
from fleetgate.router.state import EjectionPolicy, Endpoint, Fleet
from fleetgate.router.upstream import Headers, Upstream, UpstreamError, UpstreamResponse

if TYPE_CHECKING:
    from fleetgate.router.resume import PriorityPath

log = logging.getLogger("fleetgate.router")

_HOP = {
    b"connection",
    b"keep-alive",
    b"proxy-authenticate",
    b"proxy-authorization",
    b"te",
    b"trailer",
    b"transfer-encoding",
    b"upgrade",
    b"host",
    b"content-length",
}
_SKIP_RESPONSE = _HOP | {b"date", b"server"}
_PRIORITY_HEADER = b"x-fleetgate-priority"
_ERROR_BODY_LIMIT = 1 << 20
_NO_VIEW = RequestView(model="", chunks=0, prompt_tokens=0, max_tokens=0)
_NO_CLASS = "none"  # metrics ``class`` label without a priority section


class Services:
    """Everything the request path needs; built once per app by ``app.build_router``."""

    def __init__(
        self,
        *,
        config: RouterConfig,
        fleet: Fleet,
        pipeline: Pipeline,
        upstream: Upstream,
        metrics: RouterMetrics,
        admission: Admission,
        inflight: InFlightTable,
        clock: Callable[[], float],
        rng: random.Random,
    ) -> None:
        self.config = config
        self.fleet = fleet
        self.pipeline = pipeline
        self.upstream = upstream
        self.metrics = metrics
        self.admission = admission
        self.inflight = inflight
        self.clock = clock
        self.rng = rng
        self.ejection = EjectionPolicy(
            after_failures=config.health.eject_after_failures,
            base_s=config.health.eject_base_s,
            max_s=config.health.eject_max_s,
        )
        self.ids = itertools.count(1)
        self.priority: PriorityPath | None = None
        """Set by ``app.build_router`` when the config has a ``priority:`` section."""


class _Fail(Exception):
    """One attempt failed before any byte reached the client."""

    def __init__(
        self, cause: str, retry: bool, response: tuple[int, bytes, Headers, bytes] | None = None
    ):
        super().__init__(cause)
        self.cause = cause
        self.retry = retry
        self.response = response


@dataclasses.dataclass(slots=True, eq=False)
class _Req:
    """Per-request facts, filled in as the request path learns them."""

    arrival: float = 0.0
    path: str = ""
    body: bytes = b""
    doc: dict[str, Any] = dataclasses.field(default_factory=dict)
    headers: list[tuple[bytes, bytes]] = dataclasses.field(default_factory=list)
    model: str = "none"
    stream: bool = False
    priority: int = 0
    chain: tuple[int, ...] = ()
    view: RequestView = _NO_VIEW
    kv_tokens: int = 0
    prefill: int = 0
    """Uncached prompt tokens of the current attempt still counted as its engine's
    prefill backlog (``Endpoint.prefilling``); 0 once the first chunk arrived."""
    request_id: str = ""
    endpoint: str = "none"
    engine: str = "none"
    status: int = 0


class ProxyEndpoint:
    def __init__(self, services: Services, path: str) -> None:
        self.s = services
        self.path = path

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        s = self.s
        r = _Req()
        r.arrival = s.clock()
        r.path = self.path
        r.model = "none"
        sent = _Tracked(send)
        try:
            await self._accept(scope, receive, sent, r)
        finally:
            if sent.status:
                r.status = sent.status
            s.metrics.child(s.metrics.requests, r.model, r.engine, r.endpoint, str(r.status)).inc()
            log.info(
                "%s model=%s status=%s endpoint=%s dur_ms=%.1f",
                self.path,
                r.model,
                r.status or "aborted",
                r.endpoint,
                (s.clock() - r.arrival) * 1000,
            )

    async def _accept(self, scope: Scope, receive: Receive, send: _Tracked, r: _Req) -> None:
        s = self.s
        limit = s.config.limits.max_body_bytes
        r.headers = [(k, v) for k, v in scope["headers"] if k.lower() not in _HOP]
        hdr = dict(scope["headers"])
        declared = hdr.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await send_error(send, 413, f"request body over {limit} bytes")
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            part = msg.get("body", b"")
            size += len(part)
            if size > limit:
                await send_error(send, 413, f"request body over {limit} bytes")
                return
            chunks.append(part)
            if not msg.get("more_body", False):
                break
        r.body = b"".join(chunks)
        try:
            doc = json.loads(r.body)
        except (ValueError, UnicodeDecodeError) as e:
            await send_error(send, 400, f"malformed JSON body: {e}")
            return
        if not isinstance(doc, dict):
            await send_error(send, 400, "the request body must be a JSON object")
            return
        r.doc = doc
        now = s.clock()
        known = s.fleet.models(healthy_only=False, now=now)
        model = doc.get("model")
        if model is None and len(known) == 1:
            model = known[0]
        if not isinstance(model, str) or not model:
            await send_error(send, 400, "'model' is required (a string)", param="model")
            return
        r.model = model if model in known else "unknown"
        if model not in known:
            if not known:
                await send_error(send, 503, "no backend has reported its models yet", retry_after=1)
            else:
                await send_error(send, 404, f"The model `{model}` does not exist.", param="model")
            return
        r.model = model
        r.stream = bool(doc.get("stream", False))
        r.priority = 0
        raw_level = hdr.get(_PRIORITY_HEADER)
        if raw_level is not None and s.priority is None:
            try:
                level = int(raw_level)
            except ValueError:
                level = LEVEL_MAX + 1
            if not LEVEL_MIN <= level <= LEVEL_MAX:
                await send_error(
                    send,
                    400,
                    f"x-fleetgate-priority must be an integer in [{LEVEL_MIN}, {LEVEL_MAX}]",
                )
                return
            r.priority = level
        cfg = s.config.scheduling
        rendered = render_prompt(doc)
        r.chain = chunk_chain(rendered, cfg.chunk_bytes)
        max_tokens = doc.get("max_tokens", doc.get("max_completion_tokens"))
        if not isinstance(max_tokens, int) or max_tokens <= 0:
            max_tokens = cfg.default_max_tokens
        prompt_tokens = int(len(rendered) / cfg.bytes_per_token)
        r.view = RequestView(
            model=model,
            chunks=len(r.chain),
            prompt_tokens=prompt_tokens,
            max_tokens=max_tokens,
            priority=r.priority,
        )
        r.kv_tokens = kv_tokens_needed(prompt_tokens, max_tokens, 1)
        rid = hdr.get(b"x-request-id")
        r.request_id = rid.decode("latin-1") if rid else f"fg-{next(s.ids)}"
        key = first_chunk_key(rendered, cfg.chunk_bytes)
        order = rendezvous_order(key, list(s.fleet.endpoints)) if r.chain else []
        if s.priority is not None:  # classes, admission queue, preemption: resume.py
            await s.priority.serve(r, hdr, receive, send, order)
            return
        await self._run_watched(r, receive, send, order)

    async def _run_watched(
        self, r: _Req, receive: Receive, send: _Tracked, order: list[EndpointId]
    ) -> None:
        """Serve in a child task; a client disconnect (or InFlight.cancel) cancels it."""
        s = self.s
        ticket = Ticket(
            request_id=r.request_id,
            model=r.model,
            priority=r.priority,
            arrival=r.arrival,
            stream=r.stream,
            request=r.view,
        )
        item = InFlight(ticket=ticket, endpoint="", started=r.arrival)
        task = asyncio.get_running_loop().create_task(self._serve(r, send, order, ticket, item))
        item.task = task
        watcher = asyncio.get_running_loop().create_task(_wait_disconnect(receive))
        s.inflight.add(item)
        try:
            await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
            if not task.done():
                item.cancel("client-disconnect")
                if r.endpoint != "none":
                    s.metrics.child(s.metrics.client_disconnects, r.endpoint, r.engine).inc()
                r.status = r.status or 499
            with contextlib.suppress(asyncio.CancelledError):
                await task
            if task.cancelled() and item.cancel_reason != "client-disconnect":
                # Cancelled by the router (InFlight.cancel): finish the response cleanly.
                why = f"request cancelled by the router: {item.cancel_reason}"
                if not send.started:
                    await send_error(send, 503, why, retry_after=s.config.limits.retry_after_s)
                elif not send.ended:
                    await send.end_with_error(r.stream, why)
        finally:
            s.inflight.remove(item)
            for t in (task, watcher):
                t.cancel()
            for t in (task, watcher):
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t

    async def _serve(
        self, r: _Req, send: _Tracked, order: list[EndpointId], ticket: Ticket, item: InFlight
    ) -> None:
        s = self.s
        try:
            await s.admission.admit(ticket)
        except AdmissionRejected as e:
            await send_error(send, e.status, e.message, retry_after=e.retry_after)
            return
        try:
            views = s.fleet.views(r.chain, order, s.clock())
            try:
                decision = s.pipeline.schedule(r.view, views, s.rng)
            except NoEndpointError as e:
                msg = f"no healthy endpoint serves model `{r.model}` ({e.filter_name})"
                await send_error(send, 503, msg, retry_after=s.config.limits.retry_after_s)
                return
            s.metrics.child(
                s.metrics.decisions, r.model, decision.reason, decision.decided_by
            ).inc()
            try:
                async with asyncio.timeout(s.config.timeouts.total_s):
                    await self._attempts(r, send, decision, item)
            except TimeoutError:
                if not send.started:
                    await send_error(send, 504, "request timed out in the router")
                elif not send.ended:
                    await send.end_with_error(r.stream, "request timed out in the router")
            except (UpstreamError, OSError) as e:
                log.warning("request %s: upstream failure: %r", r.request_id, e)
                if not send.started:
                    await send_error(send, 502, f"upstream failure: {type(e).__name__}")
                elif not send.ended:
                    await send.end_with_error(r.stream, f"upstream failure: {type(e).__name__}")
            except Exception as e:  # a router bug: answer once, log with traceback
                log.exception("request %s: internal error", r.request_id)
                if not send.started:
                    await send_error(send, 500, f"internal router error: {type(e).__name__}")
                elif not send.ended:
                    await send.end_with_error(r.stream, "internal router error")
        finally:
            s.admission.release(ticket)

    async def _attempts(self, r: _Req, send: _Tracked, decision: Decision, item: InFlight) -> None:
        s = self.s
        last: _Fail | None = None
        attempts = 0
        for eid in decision.ranking:
            if attempts >= s.config.limits.max_attempts:
                break
            e = s.fleet.endpoints[eid]
            if attempts:
                s.metrics.child(s.metrics.retries, r.model, last.cause if last else "unknown").inc()
            attempts += 1
            r.endpoint, r.engine = e.id, e.engine
            item.endpoint = e.id
            predicted = s.fleet.index.match(e.id, r.chain) if r.chain else 0
            r.prefill = uncached_tokens(r.view, predicted)
            e.dispatch(r.kv_tokens, r.prefill)
            gauge = s.metrics.child(s.metrics.in_flight, e.id, e.engine)
            gauge.inc()
            try:
                await self._relay(r, send, e, predicted)
                return
            except _Fail as f:
                last = f
                s.metrics.child(s.metrics.upstream_errors, e.id, e.engine, f.cause).inc()
                if e.record_failure(s.clock(), s.ejection):
                    s.metrics.child(s.metrics.ejections, e.id, e.engine).inc()
                    log.warning("endpoint %s ejected after repeated failures", e.id)
                if not f.retry:
                    break
            finally:
                gauge.dec()
                self._prefilled(r, e)
                e.finish(r.kv_tokens)
        if last is not None and last.response is not None:
            status, ctype, headers, body = last.response
            await send_bytes(send, status, body, content_type=ctype, headers=headers)
        elif last is not None and last.cause == "timeout":
            await send_error(send, 504, "the engine did not answer in time")
        else:
            cause = last.cause if last else "none"
            await send_error(
                send,
                503,
                f"no endpoint could serve the request ({cause})",
                retry_after=s.config.limits.retry_after_s,
            )

    @staticmethod
    def _prefilled(r: _Req, e: Endpoint) -> None:
        """The attempt's prefill is over (first chunk sent, or the attempt ended): once."""
        if r.prefill:
            e.prefilled(r.prefill)
            r.prefill = 0

    def _body_for(self, r: _Req, e: Endpoint) -> bytes:
        if r.priority == 0 and _PRIORITY_HEADER not in dict(r.headers):
            return r.body
        doc = dict(r.doc)
        doc.update(e.adapter.priority_fields(r.priority))
        return json.dumps(doc).encode()

    async def _relay(self, r: _Req, send: _Tracked, e: Endpoint, predicted: int) -> None:
        s = self.s
        headers_out = [(k, v) for k, v in r.headers if k.lower() != _PRIORITY_HEADER]
        try:
            resp = await s.upstream.send(e.url, r.path, self._body_for(r, e), headers_out)
        except UpstreamError as err:
            raise _Fail(err.cause, retry=err.cause != "timeout") from None
        try:
            headers = [(k, v) for k, v in resp.headers if k.lower() not in _SKIP_RESPONSE]
            headers.append((b"x-fleetgate-endpoint", e.id.encode()))
            if resp.status >= 400:
                await self._upstream_error(send, e, resp, headers)
                return
            e.record_success()
            if r.chain:
                s.fleet.index.record(e.id, r.chain)
            if r.stream and resp.content_type().startswith(b"text/event-stream"):
                await self._relay_stream(r, send, e, resp, headers, predicted)
            else:
                try:
                    data = await resp.read()
                except UpstreamError as err:
                    raise _Fail(err.cause, retry=True) from None
                ctype = resp.content_type() or b"application/json"
                rest = [h for h in headers if h[0].lower() != b"content-type"]
                await send_bytes(send, resp.status, data, content_type=ctype, headers=rest)
                self._usage(e, data, predicted)
                s.metrics.child(s.metrics.e2e, r.model, e.engine, "false", _NO_CLASS).observe(
                    s.clock() - r.arrival
                )
        finally:
            await resp.aclose()

    async def _upstream_error(
        self, send: _Tracked, e: Endpoint, resp: UpstreamResponse, headers: Headers
    ) -> None:
        try:
            data = await resp.read()
        except UpstreamError:
            raise _Fail("stream_broken", retry=True) from None
        status = resp.status
        try:
            kind = e.adapter.classify_error(status, data[:_ERROR_BODY_LIMIT]).kind
        except Exception:  # an adapter must never turn a backend error into a router 500
            kind = "server" if status >= 500 else "client"
        ctype = resp.content_type() or b"application/json"
        rest = [h for h in headers if h[0].lower() != b"content-type"]
        if kind == "client":
            e.record_success()
            await send_bytes(send, status, data, content_type=ctype, headers=rest)
            return
        cause = "overload" if kind == "overload" else "status_5xx"
        raise _Fail(cause, retry=True, response=(status, ctype, rest, data))

    async def _relay_stream(
        self,
        r: _Req,
        send: _Tracked,
        e: Endpoint,
        resp: UpstreamResponse,
        headers: Headers,
        predicted: int,
    ) -> None:
        s = self.s
        chunks = resp.chunks()
        try:
            first = await chunks.__anext__()
        except StopAsyncIteration:
            first = b""
        except UpstreamError:
            raise _Fail("stream_broken", retry=True) from None
        await send({"type": "http.response.start", "status": resp.status, "headers": headers})
        await send({"type": "http.response.body", "body": first, "more_body": True})
        self._prefilled(r, e)
        t = s.clock()
        s.metrics.child(s.metrics.ttft, r.model, e.engine, _NO_CLASS).observe(t - r.arrival)
        itl = s.metrics.child(s.metrics.itl, r.model, e.engine, _NO_CLASS)
        usage_chunk = first if b'"usage"' in first else b""
        try:
            async for chunk in chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                now = s.clock()
                itl.observe(now - t)
                t = now
                if b'"usage"' in chunk:
                    usage_chunk = chunk
        except UpstreamError as err:
            s.metrics.child(s.metrics.upstream_errors, e.id, e.engine, "stream_broken").inc()
            await send.end_with_error(True, f"upstream stream broke: {err}")
            return
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        send.ended = True
        s.metrics.child(s.metrics.e2e, r.model, e.engine, "true", _NO_CLASS).observe(
            s.clock() - r.arrival
        )
        if usage_chunk:
            for line in usage_chunk.split(b"\n"):
                if line.startswith(b"data:") and b'"usage"' in line:
                    self._usage(e, line[5:], predicted)

    def _usage(self, e: Endpoint, data: bytes, predicted_chunks: int) -> None:
        """Closed loop: predicted versus actual cached prompt tokens, per endpoint."""
        if b'"usage"' not in data:
            return
        try:
            usage = json.loads(data).get("usage")
        except (ValueError, AttributeError):
            return
        if isinstance(usage, dict):
            self.s.metrics.record_usage(
                e.id, e.engine, usage, self.s.config.scheduling, predicted_chunks
            )


class _Tracked:
    """``send`` that remembers whether the response started / ended, and its status."""

    __slots__ = ("ended", "send", "started", "status")

    def __init__(self, send: Send) -> None:
        self.send = send
        self.started = False
        self.ended = False
        self.status = 0

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.started = True
            self.status = int(message["status"])
        elif message["type"] == "http.response.body" and not message.get("more_body", False):
            self.ended = True
        await self.send(message)

    async def end_with_error(self, sse: bool, message: str) -> None:
        """The response has started: finish it as cleanly as the format allows."""
        if sse:
            event = json.dumps({"error": {"message": message, "type": "BadGatewayError"}})
            body = f"data: {event}\n\ndata: [DONE]\n\n".encode()
        else:
            body = b""
        self.ended = True
        await self.send({"type": "http.response.body", "body": body, "more_body": False})


async def _wait_disconnect(receive: Receive) -> None:
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return
