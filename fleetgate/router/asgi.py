"""The ASGI edge of the request path: read, parse, serve, count.

:class:`RequestHandler` is a raw ASGI app on ``POST /v1/completions`` and
``POST /v1/chat/completions`` (raw, so the router decides exactly when the
first byte goes to the client). It reads the body within
``limits.max_body_bytes``, turns it into one
:class:`~fleetgate.router.request.Request` (a bad one is answered here, with
the OpenAI error envelope), and runs the :class:`~fleetgate.router.serve.ServeLoop`
in a child task that a client disconnect cancels: the attempt's ``finally``
closes the upstream response, which closes the connection, so the engine
aborts the request and frees its KV.

Every request ends in exactly one answer, one ``fleetgate_requests_total``
count labelled with the status actually sent (499 when the client left first)
and one log line; no exception escapes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from starlette.types import Receive, Scope, Send

from fleetgate.router.errors import ClientSend, send_error
from fleetgate.router.request import ParseSettings, Request, RequestError, parse_request
from fleetgate.router.serve import ServeLoop
from fleetgate.router.services import Services

log = logging.getLogger("fleetgate.router")


class RequestHandler:
    def __init__(self, services: Services, loop: ServeLoop, path: str) -> None:
        self.s = services
        self.loop = loop
        self.path = path
        sched = services.config.scheduling
        self.settings = ParseSettings(
            priority=services.config.classes,
            chunk_bytes=sched.chunk_bytes,
            bytes_per_token=sched.bytes_per_token,
            default_max_tokens=sched.default_max_tokens,
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        s = self.s
        arrival = s.clock()
        sent = ClientSend(send)
        model, engine, endpoint = "none", "none", "none"
        status = 0
        try:
            body = await self._read_body(scope, receive, sent)
            if body is None:
                return
            now = s.clock()
            try:
                req = parse_request(
                    self.path,
                    body,
                    scope["headers"],
                    settings=self.settings,
                    known_models=s.fleet.models(healthy_only=False, now=now),
                    endpoints=list(s.fleet.endpoints),
                    new_id=s.new_id,
                    now=arrival,
                )
            except RequestError as e:
                model = "unknown" if e.status == 404 else "none"
                await send_error(
                    sent, e.status, e.message, param=e.param, retry_after=e.retry_after
                )
                return
            model = req.model
            try:
                status = await self._watched(req, receive, sent)
            finally:
                engine, endpoint = req.engine, req.endpoint
        except Exception as e:  # a router bug: answer once, log with traceback
            log.exception("%s: internal error", self.path)
            await sent.fail(False, 500, f"internal router error: {type(e).__name__}")
        finally:
            status = sent.status or status
            s.metrics.child(s.metrics.requests, model, engine, endpoint, str(status)).inc()
            log.info(
                "%s model=%s status=%s endpoint=%s dur_ms=%.1f",
                self.path,
                model,
                status or "aborted",
                endpoint,
                (s.clock() - arrival) * 1000,
            )

    async def _read_body(self, scope: Scope, receive: Receive, send: ClientSend) -> bytes | None:
        """The whole body, or None when it was answered (413) or the client left."""
        limit = self.s.config.limits.max_body_bytes
        for k, v in scope["headers"]:
            if k == b"content-length" and v.isdigit() and int(v) > limit:
                await send_error(send, 413, f"request body over {limit} bytes")
                return None
        chunks: list[bytes] = []
        size = 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return None
            part = msg.get("body", b"")
            size += len(part)
            if size > limit:
                await send_error(send, 413, f"request body over {limit} bytes")
                return None
            chunks.append(part)
            if not msg.get("more_body", False):
                return b"".join(chunks)

    async def _watched(self, req: Request, receive: Receive, send: ClientSend) -> int:
        """Serve in a child task; a client disconnect cancels it. Returns 499 then."""
        s = self.s
        loop = asyncio.get_running_loop()
        task = loop.create_task(self.loop.serve(req, send))
        watcher = loop.create_task(_wait_disconnect(receive))
        try:
            await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
            if not task.done():
                task.cancel()
                if req.endpoint != "none":
                    s.metrics.child(s.metrics.client_disconnects, req.endpoint, req.engine).inc()
                return 499
            return 0
        finally:
            for t in (task, watcher):
                t.cancel()
            for t in (task, watcher):
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t


async def _wait_disconnect(receive: Receive) -> None:
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return
