"""One upstream attempt: send the request to an endpoint and classify what happened.

:meth:`Exchange.run` sends the request (or its continuation) to the endpoint
admission placed it on and returns a typed :class:`Result`; nothing outside
this module looks at upstream status codes or error bodies. The answer goes to
the client in one of two ways:

* **raw relay** (the splicer is off for this request): the engine's bytes
  unchanged, chunk by chunk as they arrive (no re-framing, no buffering). The
  response is held until the first body chunk, so an attempt that fails
  before it can still be placed elsewhere;
* **splicer** (a resumable answer: every stream, and with a preempting
  admission every answer): every upstream byte goes through the request's
  :class:`~fleetgate.router.priority.splice.StreamSplicer`, which renders the
  client's one seamless stream (or, for a non-streaming client, the JSON body
  the serve loop sends at the end) out of all attempts. A preemption takes
  effect only between two client writes (``Request.sending``).

Outcomes: ``COMPLETE`` (the splicer saw the end; the serve loop finishes the
answer), ``ANSWERED`` (the client has the whole answer: a raw relay, or the
engine's own 4xx passed through byte for byte), ``PREEMPTED``, ``FAILED``
(connect error, timeout, 5xx, overload, broken stream: the endpoint's failure
count and ejection are updated here) and ``FATAL`` (the answer cannot be
continued anywhere).
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import json
import logging
from typing import Any

from fleetgate.router.config import EnginePriority
from fleetgate.router.errors import ClientSend, send_bytes
from fleetgate.router.priority.config import engine_priority_body
from fleetgate.router.priority.continuation import (
    ContinuationError,
    build_continuation,
    upstream_body,
)
from fleetgate.router.request import HOP_HEADERS, Headers, Request
from fleetgate.router.scheduling.types import CacheSource
from fleetgate.router.services import Services
from fleetgate.router.state import Endpoint
from fleetgate.router.upstream import UpstreamError, UpstreamResponse

log = logging.getLogger("fleetgate.router")

_SKIP_RESPONSE = HOP_HEADERS | {b"date", b"server", b"x-request-id"}
_SSE = b"text/event-stream; charset=utf-8"
_ERROR_BODY_LIMIT = 1 << 20


class Outcome(enum.Enum):
    COMPLETE = "complete"
    ANSWERED = "answered"
    PREEMPTED = "preempted"
    FAILED = "failed"
    FATAL = "fatal"


@dataclasses.dataclass(frozen=True, slots=True)
class Result:
    outcome: Outcome
    cause: str = ""
    """FAILED: connect | timeout | status_5xx | overload | stream_broken;
    FATAL: continuation_error | continuation_rejected."""


class _Preempted(Exception):
    pass


class _SilenceWatch:
    """Silent-stream failover: ends an attempt whose stream has gone quiet.

    Armed by the first chunk of a streamed answer; fires when the attempt has
    waited ``idle_s`` for the next upstream chunk (time spent writing to the client
    does not count). Firing cancels the attempt's task while it awaits the engine;
    the exchange turns that into ``FAILED`` (``stream_idle``), so a resumable answer
    resumes on another endpoint and a raw stream ends with an in-band error. One
    self-re-arming timer per stream, no timer set-up per chunk (as
    ``RawUpstream.chunks``). ``timeouts.stream_idle_s`` per engine kind.
    """

    __slots__ = ("fired", "handle", "idle_s", "loop", "task", "waiting_since")

    def __init__(self, idle_s: float) -> None:
        self.loop = asyncio.get_running_loop()
        self.task = asyncio.current_task()
        self.idle_s = idle_s
        self.handle: asyncio.TimerHandle | None = None
        self.waiting_since: float | None = None
        self.fired = False

    def got(self) -> None:
        """A chunk arrived (the attempt is busy with it, not waiting)."""
        self.waiting_since = None

    def wait(self) -> None:
        """The attempt goes back to awaiting the engine's next chunk."""
        self.waiting_since = now = self.loop.time()
        if self.handle is None:
            self.handle = self.loop.call_at(now + self.idle_s, self._check)

    def _check(self) -> None:
        self.handle = None
        since = self.waiting_since
        now = self.loop.time()
        if since is None:  # busy: any later wait ends after now + idle_s at the earliest
            self.handle = self.loop.call_at(now + self.idle_s, self._check)
        elif now < since + self.idle_s:
            self.handle = self.loop.call_at(since + self.idle_s, self._check)
        elif self.task is not None and not self.task.done():
            self.fired = True
            self.task.cancel()

    def caught(self) -> bool:
        """In ``except CancelledError``: True (and the cancel absorbed) if it was ours."""
        if not self.fired or self.task is None:
            return False
        self.task.uncancel()
        return True

    def stop(self) -> None:
        if self.handle is not None:
            self.handle.cancel()
            self.handle = None


class Exchange:
    def __init__(
        self,
        services: Services,
        engine_priority: EnginePriority,
        *,
        held_prefix_sooner: bool = False,
        held_prefix_guard_s: float | None = None,
    ) -> None:
        self.s = services
        self.engine_priority = engine_priority
        self.held_prefix_sooner = held_prefix_sooner
        self.held_prefix_guard_s = held_prefix_guard_s

    async def run(self, req: Request, e: Endpoint, send: ClientSend) -> Result:
        s = self.s
        gauge = s.metrics.child(s.metrics.in_flight, e.id, e.engine)
        gauge.inc()
        try:
            predicted = req.believed_on(e.id)
            if predicted is None:
                predicted = s.fleet.believed_cached(e, req.chain, req.prompt, req.view)
            raised = self._raises(req, e, predicted[0])
            if (
                not raised
                and self.held_prefix_guard_s is not None
                and self.held_prefix_sooner
                and self.engine_priority.enabled(e.pool, e.id)
            ):  # an engine without the priority field gets no raise to pause
                e.plain_waiting.setdefault(id(req), s.clock())
            try:
                path, body = self._body(req, e, raised)
            except ContinuationError as err:
                log.warning("request %s: cannot continue: %s", req.label, err)
                return Result(Outcome.FATAL, "continuation_error")
            req.segments += 1
            rid = req.id if req.segments == 1 else f"{req.id}-{req.segments}"
            headers = [*req.headers, (b"x-request-id", rid.encode())]
            try:
                resp = await s.upstream.send(e.url, path, body, headers)
            except UpstreamError as err:
                return self._failed(e, err.cause)
            try:
                if resp.status >= 400:
                    return await self._engine_error(req, send, e, resp)
                e.record_success()
                if req.chain:
                    s.fleet.index.record(e.id, req.chain)
                if req.splicer is not None:
                    return await self._splice(req, send, e, resp, predicted)
                return await self._relay(req, send, e, resp, predicted)
            finally:
                await resp.aclose()
        finally:
            e.plain_waiting.pop(id(req), None)
            gauge.dec()

    # -- the body sent upstream --------------------------------------------------

    def _raises(self, req: Request, e: Endpoint, cached_tokens: int) -> bool:
        """Whether ``req`` goes to ``e`` one level above its class
        (``scheduling.held_prefix_sooner``): ``e`` holds at least half its prompt and, with
        ``held_prefix_guard_s``, no request sent there at its own level has waited that
        long for its first token (else the raise stops until it starts: in an overload a
        stream of held requests would starve the ones that hold little)."""
        if not self.held_prefix_sooner or not 0 < req.view.prompt_tokens <= 2 * cached_tokens:
            return False
        guard = self.held_prefix_guard_s
        if guard is not None and e.plain_waiting:
            oldest = next(iter(e.plain_waiting.values()))
            if self.s.clock() - oldest > guard:
                return False
        return True

    def _body(self, req: Request, e: Endpoint, raised: bool = False) -> tuple[str, bytes]:
        sp = req.splicer
        fields: dict[str, Any] = {}
        level = req.cls.level
        if raised:
            level += 1  # its history is cached there: admitted before those holding less
        if level != 0 and self.engine_priority.enabled(e.pool, e.id):
            fields = e.adapter.priority_fields(level)
        path = req.path
        # The engine's own name where it lists another and may refuse the served one
        # (served.py): sent upstream in its place.
        own = e.engine_model if e.engine_model and not e.echoes_any_model else None
        if own is not None:
            fields = {**fields, "model": own}
        if sp is None:
            if not fields and "priority" not in req.doc:
                return path, req.body  # byte for byte
            doc = req.doc
        elif req.segments == 0:
            doc = upstream_body(req.doc, return_token_ids=e.adapter.returns_token_ids)
        else:
            plan = build_continuation(
                req.doc,
                req.kind,
                sp.delivered(),
                accepts_token_ids=e.adapter.accepts_token_ids_prompt,
                return_token_ids=e.adapter.returns_token_ids,
            )
            sp.begin_continuation(plan.mode, seam_prefix=plan.seam_prefix)
            doc, path = plan.body, plan.path
        return path, json.dumps(engine_priority_body(doc, fields)).encode()

    # -- outcomes ------------------------------------------------------------------

    def _failed(self, e: Endpoint, cause: str) -> Result:
        s = self.s
        s.metrics.child(s.metrics.upstream_errors, e.id, e.engine, cause).inc()
        if e.record_failure(s.clock(), s.ejection):
            s.metrics.child(s.metrics.ejections, e.id, e.engine).inc()
            log.warning("endpoint %s ejected after repeated failures", e.id)
        return Result(Outcome.FAILED, cause)

    async def _engine_error(
        self, req: Request, send: ClientSend, e: Endpoint, resp: UpstreamResponse
    ) -> Result:
        """The one place an engine's error status becomes an outcome."""
        try:
            data = await resp.read()
        except UpstreamError:
            return self._failed(e, "stream_broken")
        status = resp.status
        try:
            kind = e.adapter.classify_error(status, data[:_ERROR_BODY_LIMIT]).kind
        except Exception:  # an adapter must never turn a backend error into a router 500
            kind = "server" if status >= 500 else "client"
        ctype = resp.content_type() or b"application/json"
        headers = self._headers(req, e, resp, ctype=False)
        if kind == "client":
            e.record_success()
            if not send.started and req.segments == 1:
                await send_bytes(send, status, data, content_type=ctype, headers=headers)
                return Result(Outcome.ANSWERED)
            return Result(Outcome.FATAL, "continuation_rejected")
        req.last_response = (status, ctype, headers, data)
        return self._failed(e, "overload" if kind == "overload" else "status_5xx")

    # -- raw relay ------------------------------------------------------------------

    async def _relay(
        self,
        req: Request,
        send: ClientSend,
        e: Endpoint,
        resp: UpstreamResponse,
        predicted: tuple[int, CacheSource],
    ) -> Result:
        s = self.s
        rename = e.model_rename()  # None unless the engine lists another name (served.py)
        if not (req.stream and resp.content_type().startswith(b"text/event-stream")):
            try:
                data = await resp.read()
            except UpstreamError as err:
                return self._failed(e, err.cause)
            if rename is not None:
                data = rename.whole(data)
            ctype = resp.content_type() or b"application/json"
            headers = self._headers(req, e, resp, ctype=False)
            await send_bytes(send, resp.status, data, content_type=ctype, headers=headers)
            self.first_token(req, e)
            self._e2e(req, e)
            self._usage(e, data, predicted, req.id)
            return Result(Outcome.ANSWERED)
        chunks = resp.chunks()
        try:
            first = await chunks.__anext__()
        except StopAsyncIteration:
            first = b""
        except UpstreamError:
            return self._failed(e, "stream_broken")
        if rename is not None:
            first = rename.feed(first)
        headers = self._headers(req, e, resp, ctype=True)
        await send({"type": "http.response.start", "status": resp.status, "headers": headers})
        await send({"type": "http.response.body", "body": first, "more_body": True})
        self.first_token(req, e)
        t = s.clock()
        itl = s.metrics.child(s.metrics.itl, req.model, e.engine, req.cls.name)
        usage_chunk = first if b'"usage"' in first else b""
        watch = _SilenceWatch(s.config.timeouts.stream_idle_for(e.engine))
        try:
            watch.wait()
            async for chunk in chunks:
                watch.got()
                if rename is not None:
                    chunk = rename.feed(chunk)
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                now = s.clock()
                itl.observe(now - t)
                t = now
                if b'"usage"' in chunk:
                    usage_chunk = chunk
                watch.wait()
        except UpstreamError as err:
            return self._failed(e, err.cause)
        except asyncio.CancelledError:
            if watch.caught():
                return self._failed(e, "stream_idle")
            raise
        finally:
            watch.stop()
        tail = rename.flush() if rename is not None else b""
        await send({"type": "http.response.body", "body": tail, "more_body": False})
        self._e2e(req, e)
        for line in usage_chunk.split(b"\n"):
            if line.startswith(b"data:") and b'"usage"' in line:
                self._usage(e, line[5:], predicted, req.id)
        return Result(Outcome.ANSWERED)

    def _headers(
        self, req: Request, e: Endpoint, resp: UpstreamResponse, *, ctype: bool
    ) -> Headers:
        out = [
            (k, v)
            for k, v in resp.headers
            if k.lower() not in _SKIP_RESPONSE and (ctype or k.lower() != b"content-type")
        ]
        out.append((b"x-fleetgate-endpoint", e.id.encode()))
        out.append((b"x-request-id", req.label.encode("latin-1", "replace")))
        return out

    # -- splicer ----------------------------------------------------------------------

    async def _splice(
        self,
        req: Request,
        send: ClientSend,
        e: Endpoint,
        resp: UpstreamResponse,
        predicted: tuple[int, CacheSource],
    ) -> Result:
        s, sp = self.s, req.splicer
        assert sp is not None
        sp.use_token_events(e.adapter.token_events)
        sp.rename_model(e.engine_model, e.served_model)
        sp.upstream_usage = None
        itl = s.metrics.child(s.metrics.itl, req.model, e.engine, req.cls.name)
        watch = _SilenceWatch(s.config.timeouts.stream_idle_for(e.engine))
        try:
            async for chunk in resp.chunks():
                watch.got()
                out = sp.feed(chunk)
                req.generated = sp.tokens
                if (
                    req.first_token_at is None or req.parked_at is not None
                ) and sp.tokens > req.tokens_at_park:
                    self.first_token(req, e)  # TTFT / resume latency: once per attempt
                if out and req.stream:
                    await self._write(req, send, out, e, itl)
                watch.wait()
        except UpstreamError as err:
            return self._failed(e, err.cause)
        except _Preempted:
            return Result(Outcome.PREEMPTED)
        except asyncio.CancelledError:
            if watch.caught() and not req.preempt_pending:
                return self._failed(e, "stream_idle")
            raise
        finally:
            watch.stop()
        if sp.upstream_usage is not None:
            s.metrics.record_usage(e.id, e.engine, sp.upstream_usage, *predicted, rid=req.id)
        if sp.finished:
            return Result(Outcome.COMPLETE)
        return self._failed(e, "stream_broken")

    async def _write(
        self, req: Request, send: ClientSend, data: bytes, e: Endpoint, itl: Any
    ) -> None:
        """Write stream bytes; a preemption requested meanwhile takes effect after."""
        req.sending = True
        try:
            if not send.started:
                await send({"type": "http.response.start", "status": 200,
                            "headers": self.answer_headers(req, e.id)})  # fmt: skip
            await send({"type": "http.response.body", "body": data, "more_body": True})
            now = self.s.clock()
            if req.last_send:
                itl.observe(now - req.last_send)
            req.last_send = now
        finally:
            req.sending = False
        if req.preempt_pending:
            raise _Preempted

    @staticmethod
    def answer_headers(req: Request, endpoint: str, *, sse: bool = True) -> Headers:
        """Headers of an answer the router renders itself (the splicer's)."""
        h = [(b"x-fleetgate-endpoint", endpoint.encode()),
             (b"x-request-id", req.label.encode("latin-1", "replace"))]  # fmt: skip
        return [(b"content-type", _SSE), *h] if sse else h

    # -- per-request metrics ------------------------------------------------------------

    def first_token(self, req: Request, e: Endpoint) -> None:
        s = self.s
        req.prefilled()
        e.plain_waiting.pop(id(req), None)
        now = s.clock()
        if req.parked_at is not None:
            s.metrics.child(s.classes.resume_latency, req.model, req.cls.name).observe(
                now - req.parked_at
            )
            req.parked_at = None
        if req.first_token_at is None:
            req.first_token_at = now
            if req.stream:
                s.metrics.child(s.metrics.ttft, req.model, e.engine, req.cls.name).observe(
                    now - req.arrival
                )
            self.objective(req, met=now - req.arrival <= req.cls.ttft_objective_s)

    def objective(self, req: Request, *, met: bool) -> None:
        if req.objective_counted:
            return
        req.objective_counted = True
        s = self.s
        s.metrics.child(
            s.classes.ttft_objective, req.model, req.cls.name, "true" if met else "false"
        ).inc()

    def _e2e(self, req: Request, e: Endpoint) -> None:
        s = self.s
        stream = "true" if req.stream else "false"
        s.metrics.child(s.metrics.e2e, req.model, e.engine, stream, req.cls.name).observe(
            s.clock() - req.arrival
        )

    def e2e(self, req: Request) -> None:
        e = self.s.fleet.endpoints.get(req.endpoint)  # type: ignore[call-overload]
        if e is not None:
            self._e2e(req, e)

    def _usage(
        self, e: Endpoint, data: bytes, predicted: tuple[int, CacheSource], rid: str
    ) -> None:
        """Closed loop: predicted versus actual cached prompt tokens, per endpoint."""
        if b'"usage"' not in data:
            return
        try:
            usage = json.loads(data).get("usage")
        except (ValueError, AttributeError):
            return
        if isinstance(usage, dict):
            self.s.metrics.record_usage(e.id, e.engine, usage, *predicted, rid=rid)
