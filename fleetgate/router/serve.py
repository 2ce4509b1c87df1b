"""The serve loop: one path for every request, whatever the router config.

::

    admit --> exchange --> COMPLETE / ANSWERED ............... done
      ^          |
      |          +--> FAILED before the first byte .......... park (retry)
      |          +--> FAILED mid-answer, resumable ........... park (resume)
      |          +--> PREEMPTED (class queue only) ........... park (resume)
      +----------+
    Refusal (queue full/expired, nothing can serve) ........ error answer
    FATAL, attempts/resumes used up, raw stream broken .... error answer

A retry before the first byte, an engine that dies mid-stream and a
preemption are all the same thing here: park the request and admit it again,
on another endpoint where there is one. What was already delivered is kept
by the request's splicer, so the client sees one unbroken answer. Bounds:
``limits.max_attempts`` failures before anything reached the client,
``priority.max_resumes_per_request`` failures after (the default classes'
value without a ``priority:`` section); preemptions are bounded per class.

Exactly one answer per request: a started stream that cannot be finished ends
with an in-band error event and ``[DONE]``. The upstream failure -> client
status mapping is :meth:`ServeLoop._give_up` (the engine's own 5xx body when
one came back, 504 for a timeout, else 503 with ``Retry-After``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from fleetgate.router.admission import Admission, Refusal
from fleetgate.router.errors import ClientSend, send_bytes, send_error
from fleetgate.router.exchange import Exchange, Outcome, Result
from fleetgate.router.priority.splice import StreamSplicer
from fleetgate.router.priority.wire import encode_json
from fleetgate.router.request import Request
from fleetgate.router.services import Services

log = logging.getLogger("fleetgate.router")


class ServeLoop:
    def __init__(self, services: Services, admission: Admission, exchange: Exchange) -> None:
        self.s = services
        self.admission = admission
        self.exchange = exchange
        self.max_resumes = services.config.classes.max_resumes_per_request

    def splicer_for(self, req: Request) -> StreamSplicer | None:
        """Resumable answers that can be cut short go through a splicer: every stream
        (an engine may die mid-stream) unless ``resume_streams`` is off, and every
        answer when admission preempts."""
        if not req.resumable:
            return None
        if not self.admission.preempts and not (req.stream and self.s.config.resume_streams):
            return None
        opts = req.doc.get("stream_options")
        return StreamSplicer(
            req.kind,
            include_usage=bool(req.stream and isinstance(opts, dict) and opts.get("include_usage")),
            return_token_ids=bool(req.doc.get("return_token_ids")),
        )

    async def serve(self, req: Request, send: ClientSend) -> None:
        req.splicer = self.splicer_for(req)
        try:
            async with asyncio.timeout(self.s.config.timeouts.total_s):
                await self._loop(req, send)
        except TimeoutError:
            self.exchange.objective(req, met=False)
            await send.fail(req.stream, 504, "request timed out in the router")
        except Exception as e:  # a router bug: answer once, log with traceback
            log.exception("request %s: internal error", req.label)
            await send.fail(req.stream, 500, f"internal router error: {type(e).__name__}")
        finally:
            self.admission.forget(req)

    async def _loop(self, req: Request, send: ClientSend) -> None:
        s = self.s
        while True:
            placed = await self.admission.admit(req)
            if isinstance(placed, Refusal):
                self.exchange.objective(req, met=False)
                if req.failures and not placed.shed:
                    await self._give_up(req, send)
                elif placed.shed and send.started:
                    await send.fail(True, placed.status, placed.message)
                else:
                    await send_error(
                        send, placed.status, placed.message, retry_after=placed.retry_after
                    )
                return
            e = placed
            if req.dispatched_once:
                self._count_again(req)
            s.metrics.child(s.classes.dispatches, req.model, req.cls.name).inc()
            req.dispatched_once = True
            req.started_at = s.clock()
            attempt = asyncio.get_running_loop().create_task(self.exchange.run(req, e, send))
            req.segment = attempt
            try:
                await asyncio.wait((attempt,))
            except asyncio.CancelledError:
                attempt.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await attempt
                raise
            finally:
                req.segment = None
                self.admission.release(req)
            result = Result(Outcome.PREEMPTED) if attempt.cancelled() else attempt.result()
            sp = req.splicer
            if result.outcome is Outcome.PREEMPTED and sp is not None and sp.finished:
                result = Result(Outcome.COMPLETE)  # the cancel landed after the finish
            if result.outcome is Outcome.COMPLETE:
                await self._complete(req, send)
                return
            if result.outcome is Outcome.ANSWERED:
                return
            if result.outcome is Outcome.FATAL:
                self.exchange.objective(req, met=False)
                await send.fail(req.stream, 502, f"cannot resume the answer ({result.cause})")
                return
            cause = "preempted"
            if result.outcome is Outcome.FAILED:
                cause = "engine_failure"
                req.failed.add(e.id)
                req.failures += 1
                req.last_cause = result.cause
                delivered = send.started or (sp is not None and sp.tokens > 0)
                if delivered and sp is None:  # a raw stream broke: nothing can mend it
                    self.exchange.objective(req, met=False)
                    await send.fail(req.stream, 502, f"upstream stream broke ({result.cause})")
                    return
                if not delivered and req.failures >= s.config.limits.max_attempts:
                    await self._give_up(req, send)
                    return
                if delivered:
                    if req.resumes >= self.max_resumes:
                        self.exchange.objective(req, met=False)
                        await send.fail(req.stream, 502, f"upstream failure ({result.cause})")
                        return
                    req.resumes += 1
            req.tokens_at_park = sp.tokens if sp is not None else 0
            if req.tokens_at_park:
                s.metrics.child(s.classes.refed, req.model, req.cls.name).inc(req.tokens_at_park)
            req.needs_final_message = _needs_final_message(req)
            self.admission.park(req, cause)

    def _count_again(self, req: Request) -> None:
        """A parked request placed again: a retry if nothing reached the client yet,
        else a resume (``fleetgate_retries`` / ``fleetgate_resumes``)."""
        s = self.s
        if req.park_cause == "engine_failure" and req.tokens_at_park == 0 and not req.resumes:
            s.metrics.child(s.metrics.retries, req.model, req.last_cause or "unknown").inc()
        else:
            s.metrics.child(s.classes.resumes, req.model, req.cls.name, req.park_cause).inc()

    async def _give_up(self, req: Request, send: ClientSend) -> None:
        """Nothing reached the client and no endpoint is left to try: say why."""
        self.exchange.objective(req, met=False)
        if send.started:
            await send.fail(req.stream, 502, f"upstream failure ({req.last_cause})")
        elif req.last_response is not None:
            status, ctype, headers, body = req.last_response
            await send_bytes(send, status, body, content_type=ctype, headers=headers)
        elif req.last_cause == "timeout":
            await send_error(send, 504, "the engine did not answer in time")
        else:
            await send_error(
                send,
                503,
                f"no endpoint could serve the request ({req.last_cause or 'none'})",
                retry_after=self.s.config.limits.retry_after_s,
            )

    async def _complete(self, req: Request, send: ClientSend) -> None:
        sp = req.splicer
        assert sp is not None
        if req.stream:
            tail = sp.finish()
            if not send.started:
                headers = self.exchange.answer_headers(req, req.endpoint)
                await send({"type": "http.response.start", "status": 200, "headers": headers})
            await send({"type": "http.response.body", "body": tail, "more_body": False})
        else:
            body = encode_json(sp.assemble_response()).encode()
            headers = self.exchange.answer_headers(req, req.endpoint, sse=False)
            await send_bytes(send, 200, body, headers=headers)
        self.exchange.e2e(req)


def _needs_final_message(req: Request) -> bool:
    """A chat answer that can only resume from text (no token ids to continue from).

    Its continuation is ``chat-assistant-prefix``, which only an engine that
    continues a partial assistant message resumes exactly
    (``EngineAdapter.continues_final_message``).
    """
    sp = req.splicer
    if req.kind != "chat" or sp is None or sp.tokens == 0:
        return False
    d = sp.delivered()
    return d.token_ids is None or d.prompt_token_ids is None
