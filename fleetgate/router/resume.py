"""The request path under priority control: admit, relay in segments, resume.

``ProxyEndpoint`` (proxy.py) parses and validates a request, then hands it to
:meth:`PriorityPath.serve` when the router has a ``priority:`` section. From
there (steps of ``fleetgate/router/priority/__init__.py``):

1. class + tenant resolution (``x-fleetgate-priority`` class name, or the body's
   ``priority`` through ``body_priority_map``); an unknown class or a bad tenant
   is a 400 with the OpenAI error envelope, before anything else;
2. :meth:`PriorityRuntime.admit <fleetgate.router.admission.PriorityRuntime.admit>`
   places the request at once or queues it; a shed is answered with 429 (sheddable
   classes) or 503, both with ``Retry-After``;
3. the answer is relayed as one or more *segments*. A resumable request
   (``continuation.resumability`` is None) is always sent upstream as a stream
   with usage and, where the engine returns them, token ids; every upstream byte
   goes through one ``StreamSplicer``, which renders the client's stream (or,
   for a non-streaming client, the assembled JSON body at the end). The engine
   body carries ``adapter.priority_fields(level)`` when the endpoint runs a
   priority scheduler (``priority.engine_priority``), never the client's
   ``priority`` value;
4. a segment ends ``done`` (the splicer saw the finish), ``preempted`` (the
   runtime cancelled it: closing the upstream response makes the engine abort
   and free its KV), or ``failed`` (connect error, 5xx, broken stream, error
   event: the engine died). Preempted and failed answers are parked with
   everything delivered so far and resumed as a continuation
   (``build_continuation``: token ids where the engine takes them) on any
   suitable endpoint; engine failures at most ``max_resumes_per_request`` times,
   preemptions as the victim's class allows;
5. exactly one response per request: a started stream that cannot be finished
   ends with an in-band error event and ``[DONE]``.

Client bytes are never cut by a preemption: the runtime cancels a segment only
while it awaits the engine, never while it is writing to the client
(``Job.sending``), so what the splicer counts as delivered was delivered.
Non-resumable requests (n > 1, tools, ...) are relayed unchanged and never
preempted; a failure before their first byte is retried like a resume.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import TYPE_CHECKING, Any

from starlette.types import Receive

from fleetgate.router.admission import Job, PriorityRuntime
from fleetgate.router.errors import send_bytes, send_error
from fleetgate.router.priority.config import (
    PRIORITY_HEADER,
    TENANT_HEADER,
    PriorityError,
    engine_priority_body,
    resolve_class,
    resolve_tenant,
)
from fleetgate.router.priority.continuation import (
    ContinuationError,
    Kind,
    build_continuation,
    request_kind,
    resumability,
    upstream_body,
)
from fleetgate.router.priority.queue import Shed
from fleetgate.router.priority.splice import StreamSplicer, encode_json
from fleetgate.router.scheduling.types import EndpointId
from fleetgate.router.state import Endpoint
from fleetgate.router.upstream import UpstreamError

if TYPE_CHECKING:
    from fleetgate.router.proxy import Services, _Req, _Tracked

log = logging.getLogger("fleetgate.router.priority")

_STRIP = {PRIORITY_HEADER.encode(), TENANT_HEADER.encode(), b"x-request-id"}
_SSE = b"text/event-stream; charset=utf-8"
_FATAL = ("continuation_error", "continuation_rejected")


class _Preempted(Exception):
    pass


class _Answer:
    """One request's answer state across segments."""

    def __init__(self, r: _Req, job: Job, kind: Kind, splicer: StreamSplicer | None) -> None:
        self.r = r
        self.job = job
        self.kind = kind
        self.splicer = splicer
        self.segments = 0
        self.first_token_at: float | None = None
        self.tokens_at_park = 0
        self.last_send = 0.0
        self.objective_counted = False
        self.answered = False


class PriorityPath:
    def __init__(self, services: Services, runtime: PriorityRuntime) -> None:
        self.s = services
        self.rt = runtime

    async def serve(
        self,
        r: _Req,
        hdr: dict[bytes, bytes],
        receive: Receive,
        send: _Tracked,
        order: list[EndpointId],
    ) -> None:
        s = self.s
        cfg = self.rt.cfg
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in hdr.items()}
        try:
            cls = resolve_class(cfg, headers, r.doc)
            tenant = resolve_tenant(headers)
        except PriorityError as e:
            await send_bytes(send, e.status, json.dumps(e.openai_body()).encode())
            return
        kind = request_kind(r.path)
        resumable = resumability(r.doc, kind) is None
        job = Job(
            request_id=r.request_id,
            cls=cls,
            tenant=tenant,
            model=r.model,
            arrival=r.arrival,
            view=r.view,
            chain=r.chain,
            order=order,
            kv_tokens=r.kv_tokens,
            resumable=resumable,
            chat=kind == "chat",
        )
        splicer = None
        if resumable:
            opts = r.doc.get("stream_options")
            splicer = StreamSplicer(
                kind,
                include_usage=bool(
                    r.stream and isinstance(opts, dict) and opts.get("include_usage")
                ),
                return_token_ids=bool(r.doc.get("return_token_ids")),
            )
        ans = _Answer(r, job, kind, splicer)
        loop = asyncio.get_running_loop()
        task = loop.create_task(self._run(ans, send))
        watcher = loop.create_task(_wait_disconnect(receive))
        try:
            await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
            if not task.done():
                task.cancel()
                if r.endpoint != "none":
                    s.metrics.child(s.metrics.client_disconnects, r.endpoint, r.engine).inc()
                r.status = r.status or 499
        finally:
            for t in (task, watcher):
                t.cancel()
            for t in (task, watcher):
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t
            self.rt.forget(job)

    # -- the segment loop ------------------------------------------------------

    async def _run(self, ans: _Answer, send: _Tracked) -> None:
        s, rt, job = self.s, self.rt, ans.job
        try:
            async with asyncio.timeout(s.config.timeouts.total_s):
                await self._loop(ans, send)
        except TimeoutError:
            self._objective(ans, met=False)
            await self._fail(ans, send, 504, "request timed out in the router")
        except Exception as e:  # a router bug: answer once, log with traceback
            log.exception("request %s: internal error", job.request_id)
            await self._fail(ans, send, 500, f"internal router error: {type(e).__name__}")
        finally:
            rt.running.pop(job.request_id, None)

    async def _loop(self, ans: _Answer, send: _Tracked) -> None:
        s, rt, job = self.s, self.rt, ans.job
        while True:
            # The waiter exists before the job can be queued: a drain resolves it.
            job.waiter = asyncio.get_running_loop().create_future()
            got = None if job.queued else rt.admit(job)
            if got is None:
                got = await job.waiter
            job.waiter = None
            if isinstance(got, Shed):
                self._objective(ans, met=False)
                await self._shed(ans, send, got)
                return
            e = got
            if job.parked_at is not None:
                cause = job.park_cause
                s.metrics.child(rt.metrics.resumes, job.model, job.cls.name, cause).inc()
            s.metrics.child(rt.metrics.dispatches, job.model, job.cls.name).inc()
            job.dispatched_once = True
            job.started_at = s.clock()
            rt.running[job.request_id] = job
            seg = asyncio.get_running_loop().create_task(self._segment(ans, send, e))
            job.segment = seg
            try:
                await asyncio.wait((seg,))
            except asyncio.CancelledError:
                seg.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await seg
                raise
            finally:
                job.segment = None
                rt.running.pop(job.request_id, None)
            outcome = "preempted" if seg.cancelled() else seg.result()
            if outcome == "preempted" and ans.splicer is not None and ans.splicer.finished:
                outcome = "done"  # the cancel landed after the finish: nothing to resume
            if outcome == "done":
                await self._complete(ans, send)
                return
            if outcome == "answered":
                return
            if outcome in _FATAL:
                self._objective(ans, met=False)
                await self._fail(ans, send, 502, f"cannot resume the answer ({outcome})")
                return
            if outcome == "preempted":
                cause = "preempted"
            else:
                cause = "engine_failure"
                job.failed.add(e.id)
                if job.resumes >= rt.cfg.max_resumes_per_request:
                    self._objective(ans, met=False)
                    await self._fail(ans, send, 502, f"upstream failure ({outcome})")
                    return
                job.resumes += 1
            if ans.splicer is None and send.started:
                await self._fail(ans, send, 502, f"upstream failure ({outcome})")
                return
            ans.tokens_at_park = ans.splicer.tokens if ans.splicer else 0
            s.metrics.child(rt.metrics.refed, job.model, job.cls.name).inc(ans.tokens_at_park)
            job.needs_final_message = _needs_final_message(ans)
            rt.park(job, cause)

    async def _segment(self, ans: _Answer, send: _Tracked, e: Endpoint) -> str:
        """One upstream exchange; returns done | answered | preempted | <failure cause>."""
        s, rt, job, r = self.s, self.rt, ans.job, ans.r
        r.endpoint, r.engine = e.id, e.engine
        gauge = s.metrics.child(s.metrics.in_flight, e.id, e.engine)
        gauge.inc()
        try:
            try:
                path, body = self._body(ans, e)
            except ContinuationError as err:
                log.warning("request %s: cannot continue: %s", job.request_id, err)
                return "continuation_error"
            ans.segments += 1
            rid = job.request_id if ans.segments == 1 else f"{job.request_id}-{ans.segments}"
            headers = [(k, v) for k, v in r.headers if k.lower() not in _STRIP]
            headers.append((b"x-request-id", rid.encode()))
            predicted = s.fleet.index.match(e.id, job.chain) if job.chain else 0
            try:
                resp = await s.upstream.send(e.url, path, body, headers)
            except UpstreamError as err:
                return self._failed(e, err.cause)
            try:
                if resp.status >= 400:
                    return await self._upstream_error(ans, send, e, resp.status, resp)
                e.record_success()
                if job.chain:
                    s.fleet.index.record(e.id, job.chain)
                if ans.splicer is not None:
                    ans.splicer.upstream_usage = None
                try:
                    if ans.splicer is None:
                        return await self._relay_raw(ans, send, e, resp)
                    splicer = ans.splicer
                    itl = s.metrics.child(s.metrics.itl, job.model, e.engine, job.cls.name)
                    async for chunk in resp.chunks():
                        out = splicer.feed(chunk)
                        job.generated = splicer.tokens
                        if (
                            ans.first_token_at is None or job.parked_at is not None
                        ) and splicer.tokens > ans.tokens_at_park:
                            self._first_token(ans)  # TTFT / resume latency: once per segment
                        if out and r.stream:
                            await self._client(ans, send, out, e, itl)
                except UpstreamError as err:
                    return self._failed(e, err.cause)
                except _Preempted:
                    return "preempted"
                if ans.splicer.upstream_usage is not None:
                    s.metrics.record_usage(
                        e.id, e.engine, ans.splicer.upstream_usage, s.config.scheduling, predicted
                    )
                if ans.splicer.finished:
                    return "done"
                return self._failed(e, "stream_broken")
            finally:
                await resp.aclose()
        finally:
            gauge.dec()
            rt.release(job)
            rt.kick()  # capacity freed: an event for the drain

    def _body(self, ans: _Answer, e: Endpoint) -> tuple[str, bytes]:
        job, r, sp = ans.job, ans.r, ans.splicer
        doc: dict[str, Any]
        path = r.path
        if sp is None:
            doc = dict(r.doc)
        elif ans.segments == 0:
            doc = upstream_body(r.doc, return_token_ids=e.adapter.returns_token_ids)
        else:
            plan = build_continuation(
                r.doc,
                ans.kind,
                sp.delivered(),
                accepts_token_ids=e.adapter.accepts_token_ids_prompt,
                return_token_ids=e.adapter.returns_token_ids,
            )
            sp.begin_continuation(plan.mode, seam_prefix=plan.seam_prefix)
            doc, path = plan.body, plan.path
        fields: dict[str, Any] = {}
        if self.rt.engine_priority.enabled(e.pool, e.id):
            fields = e.adapter.priority_fields(job.cls.level)
        return path, json.dumps(engine_priority_body(doc, fields)).encode()

    def _failed(self, e: Endpoint, cause: str) -> str:
        s = self.s
        s.metrics.child(s.metrics.upstream_errors, e.id, e.engine, cause).inc()
        if e.record_failure(s.clock(), s.ejection):
            s.metrics.child(s.metrics.ejections, e.id, e.engine).inc()
            log.warning("endpoint %s ejected after repeated failures", e.id)
        return cause

    async def _upstream_error(
        self, ans: _Answer, send: _Tracked, e: Endpoint, status: int, resp: Any
    ) -> str:
        try:
            data = await resp.read()
        except UpstreamError:
            return self._failed(e, "stream_broken")
        try:
            kind = e.adapter.classify_error(status, data[: 1 << 20]).kind
        except Exception:  # an adapter must never turn a backend error into a router 500
            kind = "server" if status >= 500 else "client"
        if kind == "client":
            e.record_success()
            if not send.started and ans.segments == 1:
                ctype = resp.content_type() or b"application/json"
                await send_bytes(send, status, data, content_type=ctype)
                return "answered"
            return "continuation_rejected"
        return self._failed(e, "overload" if kind == "overload" else "status_5xx")

    async def _relay_raw(self, ans: _Answer, send: _Tracked, e: Endpoint, resp: Any) -> str:
        """A non-resumable request: the engine's answer unchanged."""
        r = ans.r
        eh = [(b"x-fleetgate-endpoint", e.id.encode())]
        if r.stream and resp.content_type().startswith(b"text/event-stream"):
            async for chunk in resp.chunks():
                self._first_token(ans)
                if not send.started:
                    h = [(b"content-type", resp.content_type()), *eh]
                    await send({"type": "http.response.start", "status": 200, "headers": h})
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        else:
            data = await resp.read()
            self._first_token(ans)
            ctype = resp.content_type() or b"application/json"
            await send_bytes(send, resp.status, data, content_type=ctype, headers=eh)
        self._e2e(ans, e.engine)
        return "answered"

    # -- client side -------------------------------------------------------------

    async def _client(
        self, ans: _Answer, send: _Tracked, data: bytes, e: Endpoint, itl: Any
    ) -> None:
        """Write stream bytes; a preemption requested meanwhile takes effect after.
        ``itl`` is the segment's inter-token-latency histogram child."""
        job, s = ans.job, self.s
        job.sending = True
        try:
            if not send.started:
                h = [(b"content-type", _SSE), (b"x-fleetgate-endpoint", e.id.encode())]
                await send({"type": "http.response.start", "status": 200, "headers": h})
            await send({"type": "http.response.body", "body": data, "more_body": True})
            now = s.clock()
            if ans.last_send:
                itl.observe(now - ans.last_send)
            ans.last_send = now
        finally:
            job.sending = False
        if job.preempt_pending:
            raise _Preempted

    def _first_token(self, ans: _Answer) -> None:
        job, s = ans.job, self.s
        if job.prefill:
            self.rt.prefilled(job)
        now = s.clock()
        if job.parked_at is not None:
            s.metrics.child(self.rt.metrics.resume_latency, job.model, job.cls.name).observe(
                now - job.parked_at
            )
            job.parked_at = None
        if ans.first_token_at is None:
            ans.first_token_at = now
            if ans.r.stream:
                s.metrics.child(s.metrics.ttft, job.model, ans.r.engine, job.cls.name).observe(
                    now - job.arrival
                )
            self._objective(ans, met=now - job.arrival <= job.cls.ttft_objective_s)

    def _objective(self, ans: _Answer, *, met: bool) -> None:
        if ans.objective_counted:
            return
        ans.objective_counted = True
        job = ans.job
        self.s.metrics.child(
            self.rt.metrics.ttft_objective, job.model, job.cls.name, "true" if met else "false"
        ).inc()

    def _e2e(self, ans: _Answer, engine: str) -> None:
        s, job = self.s, ans.job
        s.metrics.child(
            s.metrics.e2e, job.model, engine, "true" if ans.r.stream else "false", job.cls.name
        ).observe(s.clock() - job.arrival)

    async def _complete(self, ans: _Answer, send: _Tracked) -> None:
        sp, r = ans.splicer, ans.r
        assert sp is not None
        if r.stream:
            tail = sp.finish()
            if not send.started:
                h = [(b"content-type", _SSE), (b"x-fleetgate-endpoint", r.endpoint.encode())]
                await send({"type": "http.response.start", "status": 200, "headers": h})
            await send({"type": "http.response.body", "body": tail, "more_body": False})
        else:
            body = encode_json(sp.assemble_response()).encode()
            eh = [(b"x-fleetgate-endpoint", r.endpoint.encode())]
            await send_bytes(send, 200, body, headers=eh)
        self._e2e(ans, r.engine)

    async def _shed(self, ans: _Answer, send: _Tracked, shed: Shed[Job]) -> None:
        if send.started:
            if not send.ended:
                await send.end_with_error(True, shed.message)
            return
        body = json.dumps(shed.openai_body()).encode()
        extra = [(k.encode(), v.encode()) for k, v in shed.headers().items()]
        await send_bytes(send, shed.status, body, headers=extra)

    async def _fail(self, ans: _Answer, send: _Tracked, status: int, message: str) -> None:
        if send.started:
            if not send.ended:
                await send.end_with_error(ans.r.stream, message)
            return
        retry = self.s.config.limits.retry_after_s if status in (502, 503) else None
        await send_error(send, status, message, retry_after=retry)


async def _wait_disconnect(receive: Receive) -> None:
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return


def _needs_final_message(ans: _Answer) -> bool:
    """A chat answer that can only resume from text (no token ids to continue from).

    Its continuation is ``chat-assistant-prefix``, which only an engine that
    continues a partial assistant message resumes exactly
    (``EngineAdapter.continues_final_message``).
    """
    sp = ans.splicer
    if ans.kind != "chat" or sp is None or sp.tokens == 0:
        return False
    d = sp.delivered()
    return d.token_ids is None or d.prompt_token_ids is None
