"""The ASGI edge of the request path: read, parse, serve, count.

:class:`RequestHandler` is a raw ASGI app on ``POST /v1/completions`` and
``POST /v1/chat/completions`` (raw, so the router decides exactly when the
first byte goes to the client). It refuses oversized headers (431) and bodies
that are not ``application/json`` (415), reads the body within
``limits.max_body_bytes``, ``limits.max_bytes_in_flight`` (all bodies held at
once) and ``timeouts.client_body_s``, turns it into one
:class:`~fleetgate.router.request.Request` (a bad one is answered here, with
the OpenAI error envelope), and runs the :class:`~fleetgate.router.serve.ServeLoop`
in a child task that a client disconnect cancels: the attempt's ``finally``
closes the upstream response, which closes the connection, so the engine
aborts the request and frees its KV.

HTTP/1.0 clients get every answer, streams included, as one Content-Length
response (:class:`~fleetgate.router.errors.BufferedSend`): they cannot read the
chunked framing uvicorn uses for a stream.

Every request ends in exactly one answer, one ``fleetgate_requests_total``
count labelled with the status actually sent (499 when the client left first)
and one log line; no exception escapes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from starlette.types import Receive, Scope, Send

from fleetgate.router.errors import BufferedSend, ClientSend, error_body, send_bytes, send_error
from fleetgate.router.identity import OPEN, Gatekeeper, IdentityError, TenantLimiter
from fleetgate.router.request import ParseSettings, Request, RequestError, parse_request
from fleetgate.router.scheduling.kvindex import chain_salt
from fleetgate.router.scheduling.tokenize import prompt_token_ids
from fleetgate.router.serve import ServeLoop
from fleetgate.router.services import Services

log = logging.getLogger("fleetgate.router")

#: Request bodies above this size (about 1k tokens of English) are tokenized off the
#: event loop when the tokenizer releases the GIL (``kind: hf``, the emulator's too).
#: Measured (bench/results/tokenize-prefix-cache.md): the loop's longest stall per
#: request, inline vs in a thread, 0.7 vs 0.2 ms (hf) and 5.6 vs 0.2 ms (emulator) at
#: 1k tokens, 4.6 vs 0.4 and 25.6 vs 0.4 ms at 4k. A cache hit of the prefix token
#: cache is under 1 ms either way; a miss is the whole encode.
OFF_LOOP_BYTES = 4096


class RequestHandler:
    def __init__(
        self,
        services: Services,
        loop: ServeLoop,
        path: str,
        gate: Gatekeeper | None = None,
        limiter: TenantLimiter | None = None,
    ) -> None:
        self.s = services
        self.loop = loop
        self.path = path
        self.gate = gate if gate is not None and gate.active else None
        self.limiter = limiter if limiter is not None and limiter.active else None
        sched = services.config.scheduling
        self.settings = ParseSettings(
            priority=services.config.classes,
            chunk_tokens=sched.chunk_tokens,
            default_max_tokens=sched.default_max_tokens,
            drop_headers=gate.dropped_headers() if gate is not None else frozenset(),
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        s = self.s
        arrival = s.clock()
        if scope.get("http_version") == "1.0":  # no chunked framing: one whole answer
            send = BufferedSend(send, s.config.limits.max_body_bytes)
        sent = ClientSend(send)
        model, engine, endpoint = "none", "none", "none"
        status = 0
        held = [0]
        tenant: str | None = None
        try:
            refused = self._check_head(scope)
            if refused is not None:
                await send_error(sent, refused[0], refused[1])
                return
            grant = OPEN
            if self.gate is not None:  # before the body: no budget for a stranger
                try:
                    grant = self.gate.grant(scope["headers"], scope.get("client"))
                except IdentityError as e:
                    await _send_identity_error(sent, e)
                    return
            body = await self._read_body(scope, receive, sent, held)
            if body is None:
                status = 499  # unless an answer was sent (413, 408, 503): that status
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
                    grant=grant,
                )
            except RequestError as e:
                model = "unknown" if e.status == 404 else "none"
                await send_error(
                    sent, e.status, e.message, param=e.param, retry_after=e.retry_after
                )
                return
            model = req.model
            # The demand signal: every parsed request, once, before any admission.
            s.metrics.child(s.classes.arrivals, model, req.cls.name).inc()
            if self.limiter is not None:
                try:
                    self.limiter.acquire(req.tenant, now)
                except IdentityError as e:
                    await _send_identity_error(sent, e)
                    return
                tenant = req.tenant
            await self._tokenize(req)  # after the limits: a refused request costs no CPU
            try:
                status = await self._watched(req, receive, sent)
            finally:
                engine, endpoint = req.engine, req.endpoint
        except Exception as e:  # a router bug: answer once, log with traceback
            log.exception("%s: internal error", self.path)
            await sent.fail(False, 500, f"internal router error: {type(e).__name__}")
        finally:
            s.body_bytes.give(held[0])
            if tenant is not None and self.limiter is not None:
                self.limiter.release(tenant, s.clock())
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

    async def _tokenize(self, req: Request) -> None:
        """The prompt as the engine's token ids, for the exact KV view (only when the
        fleet has one). A large prompt for a tokenizer that releases the GIL
        (``kind: hf``) is tokenized off the event loop (docs/router.md has the CPU
        figures); a prompt that cannot be tokenized keeps the approximate view only."""
        if self.s.fleet.kv_index is None:
            return
        tok = self.s.tokenizers.get(req.model)
        if tok is None:  # a LoRA adapter: its base model's tokenizer
            base = self.s.fleet.base_model(req.model)
            tok = self.s.tokenizers.get(base) if base is not None else None
        try:
            if tok is not None and tok.off_loop and len(req.body) > OFF_LOOP_BYTES:
                ids = await asyncio.to_thread(prompt_token_ids, req.doc, tok)
            else:
                ids = prompt_token_ids(req.doc, tok)
        except Exception as e:  # a tokenizer library failure never fails the request
            log.warning("%s: tokenizing failed (%s): approximate view", req.label, e)
            return
        if ids:
            fleet = self.s.fleet
            lora = fleet.kv_salt(req.model) or fleet.request_lora_salt(req.doc)
            salt = chain_salt(lora, req.cache_salt)
            req.set_tokens(ids, salt=salt)

    def _check_head(self, scope: Scope) -> tuple[int, str] | None:
        """Refuse before reading the body: too many / too large headers (431), a body
        that is not JSON (415: a browser may POST text/plain cross-site without asking)."""
        limits = self.s.config.limits
        headers = scope["headers"]
        if len(headers) > limits.max_headers:
            return 431, f"more than {limits.max_headers} request header fields"
        size = len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"")
        ctype: bytes | None = None
        for k, v in headers:
            size += len(k) + len(v) + 4
            if k == b"content-type":
                ctype = v
        if size > limits.max_header_bytes:
            return 431, f"request headers over {limits.max_header_bytes} bytes"
        media = (ctype or b"").split(b";", 1)[0].strip().lower()
        if media != b"application/json":
            got = ctype.decode("latin-1")[:100] if ctype is not None else "none"
            return 415, f"the request body must be application/json (content-type: {got})"
        return None

    async def _read_body(
        self, scope: Scope, receive: Receive, send: ClientSend, held: list[int]
    ) -> bytes | None:
        """The whole body, or None when it was answered (413, 408, 503) or the client
        left. Its bytes are taken from the router's body budget as they arrive
        (``held[0]``, given back by the caller when the request ends)."""
        s = self.s
        limit = s.config.limits.max_body_bytes
        budget = s.body_bytes
        declared = 0
        for k, v in scope["headers"]:
            if k == b"content-length" and v.isdigit():
                declared = int(v)
                if declared > limit:
                    await _refuse_body(send, 413, f"request body over {limit} bytes")
                    return None
        if declared and not budget.take(declared):  # reserve what it says it will send
            await self._busy(send)
            return None
        held[0] = declared
        chunks: list[bytes] = []
        size = 0
        msg = await receive()
        try:
            async with asyncio.timeout(
                s.config.timeouts.client_body_s if msg.get("more_body", False) else None
            ):
                while True:
                    if msg["type"] == "http.disconnect":
                        return None
                    part = msg.get("body", b"")
                    size += len(part)
                    if size > limit:
                        await _refuse_body(send, 413, f"request body over {limit} bytes")
                        return None
                    if size > held[0]:
                        if not budget.take(size - held[0]):
                            await self._busy(send)
                            return None
                        held[0] = size
                    chunks.append(part)
                    if not msg.get("more_body", False):
                        return b"".join(chunks)
                    msg = await receive()
        except TimeoutError:
            await _refuse_body(
                send, 408, f"request body not received within {s.config.timeouts.client_body_s}s"
            )
            return None

    async def _busy(self, send: ClientSend) -> None:
        await send_error(
            send,
            503,
            "the router holds too many request bodies at once; retry shortly",
            retry_after=self.s.config.limits.retry_after_s,
        )

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


async def _send_identity_error(send: ClientSend, e: IdentityError) -> None:
    headers = list(e.headers)
    if e.retry_after is not None:
        headers.append((b"retry-after", str(max(0, round(e.retry_after))).encode()))
    await send_bytes(send, e.status, error_body(e.status, e.message, e.param), headers=headers)


async def _refuse_body(send: ClientSend, status: int, message: str) -> None:
    """An answer before the body was read whole: the connection closes after it (what
    is left of the body must not be parsed as the next request)."""
    await send_bytes(send, status, error_body(status, message), headers=_CLOSE)


_CLOSE = [(b"connection", b"close")]


async def _wait_disconnect(receive: Receive) -> None:
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return
