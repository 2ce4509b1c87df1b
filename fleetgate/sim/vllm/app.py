"""The emulated vLLM OpenAI-compatible server (vLLM 0.32's wire format).

Routes: ``GET /health`` (200, empty body), ``GET /v1/models``, ``GET /version``,
``GET /metrics``, ``POST /v1/completions``, ``POST /v1/chat/completions``,
``POST /tokenize``, ``POST /detokenize``. Shapes follow recordings of a real
vLLM 0.32 server key for key (including the null fields), and error bodies
come from the vLLM engine adapter's ``error_body``.

Request handling order: content type / JSON / pydantic validation (400
``Bad Request``) -> model name (404) -> ``max_tokens`` >= 1 (400) -> prompt
length (400) -> ``max_tokens`` <= ``max_model_len`` (400; a smaller value that
only overflows the context with the prompt is clamped, not refused) -> submit.
All errors before the first byte are ordinary JSON responses, also with
``stream: true`` (as real vLLM 0.32 does); errors after the 200 went out are
sent in-band as ``data: {"error": {...}}`` then ``data: [DONE]``.

Streaming framing: one event per HTTP chunk; ``system_fingerprint`` only on the
final event (the finish event, or the usage event with ``include_usage``); the
first chat event carries ``delta: {"role": "assistant", "content": ""}`` and
top-level ``prompt_token_ids``/``prompt_text``.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

from pydantic import BaseModel

from fleetgate.engines.base import KvEvent
from fleetgate.sim.asgi import (
    Receive,
    Scope,
    Send,
    SseWriter,
    dumps,
    header,
    race_disconnect,
    read_body,
    send_bytes,
    send_json,
)
from fleetgate.sim.core.api import EngineModel, StepResult
from fleetgate.sim.driver import EngineDriver
from fleetgate.sim.generation import (
    Delta,
    EngineOptions,
    Generation,
    GenRequest,
    SimEngine,
    Tokenizer,
    generate,
    merge,
)
from fleetgate.sim.vllm.metrics import CONTENT_TYPE, VllmMetrics
from fleetgate.sim.vllm.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    RequestParseError,
    TokenizeRequest,
    parse_body,
)
from fleetgate.sim.vllm.requests import (
    HttpError,
    check_model,
    choice_requests,
    gen_request,
    prompt_ids,
    render,
)
from fleetgate.sim.vllm.shapes import (
    StreamOptions,
    chat_logprobs,
    completion_logprobs,
    created_cache_tokens,
    usage,
)

__all__ = ["VllmApp", "build_vllm", "default_fingerprint"]

M = TypeVar("M", bound=BaseModel)

ErrorBody = Callable[[int, str, str, str | None], dict[str, Any]]


def build_vllm(
    options: EngineOptions,
    model: EngineModel,
    tokenizer: Tokenizer,
    time_scale: float,
    error_body: ErrorBody,
    created: float,
    kv_events: KvEventSink | None = None,
) -> tuple[SimEngine, VllmApp]:
    """One emulated vLLM: metrics observer, driver, engine and ASGI app.

    With ``kv_events`` the model's block pool records KV-cache events and each
    step's events go to the sink (``fleetgate.sim.vllm.kv_events.KvEventPublisher``).
    """
    metrics = VllmMetrics(options, model, created)
    on_step = metrics.on_step
    pool = getattr(model, "pool", None)
    if kv_events is not None and pool is not None:
        pool.enable_kv_events()
        sink = kv_events

        def on_step(now: float, result: StepResult) -> None:
            metrics.on_step(now, result)
            sink.publish(pool.take_kv_events())

    driver = EngineDriver(model, time_scale=time_scale, on_step=on_step)
    engine = SimEngine(options, tokenizer, driver, metrics)
    return engine, VllmApp(engine, metrics, error_body, int(created))


class KvEventSink(Protocol):
    def publish(self, events: Sequence[KvEvent]) -> None: ...


def default_fingerprint(version: str, model_name: str) -> str:
    digest = hashlib.sha256(f"{version}/{model_name}".encode()).hexdigest()[:8]
    return f"vllm-{version}-{digest}"


class VllmApp:
    """ASGI app of one emulated vLLM engine."""

    def __init__(
        self,
        engine: SimEngine,
        metrics: VllmMetrics,
        error_body: ErrorBody,
        created: int,
    ) -> None:
        self.engine = engine
        self.metrics = metrics
        self.error_body = error_body
        self.created = created
        o = engine.options
        self.fingerprint = o.system_fingerprint or default_fingerprint(o.version, o.model_name)
        self._get: dict[str, Callable[[Send], Any]] = {
            "/health": self._health,
            "/v1/models": self._models,
            "/version": self._version,
            "/metrics": self._metrics,
        }
        self._post: dict[str, Callable[[Scope, bytes, Receive, Send], Any]] = {
            "/v1/completions": self._completions,
            "/v1/chat/completions": self._chat,
            "/tokenize": self._tokenize,
            "/detokenize": self._detokenize,
            "/reset_prefix_cache": self._reset_prefix_cache,
        }

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        if path in self._get:
            if method in ("GET", "HEAD"):
                await self._get[path](send)
            else:
                await _method_not_allowed(send, b"GET")
            return
        if path in self._post:
            if method != "POST":
                await _method_not_allowed(send, b"POST")
                return
            body = await read_body(receive)
            if body is None:
                return
            try:
                await self._post[path](scope, body, receive, send)
            except HttpError as e:
                await self._send_error(send, e)
            return
        await send_json(send, 404, {"detail": "Not Found"})

    # -- simple GETs --------------------------------------------------------

    async def _health(self, send: Send) -> None:
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-length", b"0"), (b"vary", b"Origin")],
            }
        )
        await send({"type": "http.response.body", "body": b""})

    async def _models(self, send: Send) -> None:
        """The base model's card, then one per LoRA adapter (``parent``: the base
        model, ``root``: its path, no ``max_model_len``), as vLLM lists them."""
        o = self.engine.options
        now = int(time.time())

        def card(model: str, root: str, parent: str | None, max_len: int | None) -> dict[str, Any]:
            return {
                "id": model,
                "object": "model",
                "created": now,
                "owned_by": "vllm",
                "root": root,
                "parent": parent,
                "max_model_len": max_len,
                "permission": [
                    {
                        "id": f"modelperm-{uuid.uuid4().hex[:16]}",
                        "object": "model_permission",
                        "created": now,
                        "allow_create_engine": False,
                        "allow_sampling": True,
                        "allow_logprobs": True,
                        "allow_search_indices": False,
                        "allow_view": True,
                        "allow_fine_tuning": False,
                        "organization": "*",
                        "group": None,
                        "is_blocking": False,
                    }
                ],
            }

        cards = [card(o.model_name, o.model_root, None, o.max_model_len)]
        cards += [card(a, f"/adapters/{a}", o.model_name, None) for a in o.lora_modules]
        await send_json(send, 200, {"object": "list", "data": cards})

    async def _version(self, send: Send) -> None:
        await send_json(send, 200, {"version": self.engine.options.version})

    async def _metrics(self, send: Send) -> None:
        await send_bytes(send, 200, self.metrics.render(), CONTENT_TYPE.encode())

    # -- errors -------------------------------------------------------------

    def _body(self, e: HttpError) -> dict[str, Any]:
        return self.error_body(e.status, e.message, e.err_type, e.param)

    async def _send_error(self, send: Send, e: HttpError) -> None:
        await send_json(send, e.status, self._body(e))

    def _parse(self, scope: Scope, body: bytes, model: type[M]) -> M:
        try:
            return parse_body(body, header(scope, b"content-type"), model)
        except RequestParseError as e:
            raise HttpError(400, e.message, "Bad Request", e.param) from None

    def _usage(
        self, prompt: int, completion: int, cached: int, full: bool, chat: bool = False
    ) -> dict[str, Any]:
        o = self.engine.options
        created = created_cache_tokens(prompt, cached, o.block_size) if chat else None
        return usage(prompt, completion, cached, o.enable_prompt_tokens_details, full, created)

    async def _completions(self, scope: Scope, body: bytes, receive: Receive, send: Send) -> None:
        req = self._parse(scope, body, CompletionRequest)
        lora = check_model(self.engine, req.model)
        prompt = prompt_ids(self.engine, req.prompt)
        gen = gen_request(self.engine, _headers(scope), req, prompt, req.max_tokens, lora)
        rid = "cmpl-" + gen.request_id.rsplit("#", 1)[0]
        opts = _options(req, req.logprobs)
        gens = choice_requests(self.engine, gen, req.n, req.temperature)
        runs: list[Generation] = []
        try:
            for g in gens:
                runs.append(self._start(g))
            handler = self._stream_completion if req.stream else self._complete_completion
            await race_disconnect(receive, handler(send, gen, runs, rid, opts))
        finally:
            for run in runs:
                run.close()

    def _start(self, gen: GenRequest) -> Generation:
        limit = self.engine.options.max_num_queued_reqs
        if limit is not None and self.engine.driver.model.stats().waiting >= limit:
            self.metrics.rejections["max_num_queued_reqs"] += 1
            raise HttpError(
                503,
                "The engine is currently busy and cannot accept new requests. "
                "Please try again later or on a different instance.",
                "Service Unavailable",
                None,
            )
        try:
            return generate(self.engine, gen)
        except ValueError as e:
            raise HttpError(400, str(e), "BadRequestError", getattr(e, "param", None)) from None

    async def _collect(self, runs: list[Generation]) -> list[list[Delta]] | None:
        """Every choice's deltas, or None when the engine aborted one of them."""
        out: list[list[Delta]] = [[] for _ in runs]
        async with contextlib.aclosing(merge(runs)) as stream:
            async for i, d in stream:
                out[i].append(d)
        return None if any(ds[-1].finish_reason == "abort" for ds in out) else out

    async def _complete_completion(
        self, send: Send, gen: GenRequest, runs: list[Generation], rid: str, opts: StreamOptions
    ) -> None:
        results = await self._collect(runs)
        if results is None:
            await self._send_error(send, _aborted())
            return
        return_ids = opts.return_token_ids
        tok = self.engine.tokenizer
        choices = []
        produced = 0
        for index, deltas in enumerate(results):
            ids = [t for d in deltas for t in d.token_ids]
            produced += len(ids)
            logprobs = None
            if opts.logprobs is not None:
                logprobs = completion_logprobs(ids, tok.decode, opts.logprobs, tok.vocab_size)
            choices.append(
                {
                    "index": index,
                    "text": "".join(d.text for d in deltas),
                    "logprobs": logprobs,
                    "finish_reason": deltas[-1].finish_reason,
                    "stop_reason": deltas[-1].stop_reason,
                    "token_ids": ids if return_ids else None,
                    "prompt_logprobs": None,
                    "prompt_token_ids": list(gen.prompt_token_ids) if return_ids else None,
                    "routed_experts": None,
                }
            )
        cached = results[0][0].cached_prompt_tokens
        out = {
            "id": rid,
            "object": "text_completion",
            "created": int(time.time()),
            "model": gen.lora_name or self.engine.options.model_name,
            "choices": choices,
            "service_tier": None,
            "system_fingerprint": self.fingerprint,
            "usage": self._usage(len(gen.prompt_token_ids), produced, cached, full=True),
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "metrics": None,
        }
        await send_json(send, 200, out)

    async def _stream_completion(
        self, send: Send, gen: GenRequest, runs: list[Generation], rid: str, opts: StreamOptions
    ) -> None:
        sse = SseWriter(send)
        await sse.start()
        created = int(time.time())
        model = gen.lora_name or self.engine.options.model_name
        tok = self.engine.tokenizer
        n_prompt = len(gen.prompt_token_ids)
        n = len(runs)
        produced = [0] * n
        offsets = [0] * n
        started = [False] * n
        finished = 0
        cached = 0
        # Fast path for the common middle-of-stream event: only the text varies, so the
        # bytes around it are built once per choice (same bytes json.dumps would give).
        head = dumps({"id": rid, "object": "text_completion", "created": created, "model": model})
        pre = [b"data: " + head[:-1] + b',"choices":[{"index":%d,"text":' % i for i in range(n)]
        post = (
            b',"logprobs":null,"finish_reason":null,"stop_reason":null,'
            b'"prompt_token_ids":null,"token_ids":null}]}\n\n'
        )
        async with contextlib.aclosing(merge(runs)) as stream:
            async for i, d in stream:
                if d.finish_reason == "abort":
                    await sse.event(self._body(_aborted()))
                    break
                position = produced[i]
                produced[i] += len(d.token_ids)
                first = not started[i]
                started[i] = True
                if first and i == 0:
                    cached = d.cached_prompt_tokens
                elif not first and d.finish_reason is None and opts.fast_path:
                    await sse.raw(pre[i] + dumps(d.text) + post)
                    continue
                logprobs = None
                if opts.logprobs is not None:
                    logprobs = completion_logprobs(
                        d.token_ids, tok.decode, opts.logprobs, tok.vocab_size, position, offsets[i]
                    )
                offsets[i] += len(d.text)
                ids = opts.return_token_ids
                choice = {
                    "index": i,
                    "text": d.text,
                    "logprobs": logprobs,
                    "finish_reason": d.finish_reason,
                    "stop_reason": d.stop_reason,
                    "prompt_token_ids": list(gen.prompt_token_ids) if ids and first else None,
                    "token_ids": list(d.token_ids) if ids else None,
                }
                chunk: dict[str, Any] = {
                    "id": rid,
                    "object": "text_completion",
                    "created": created,
                    "model": model,
                    "choices": [choice],
                }
                if opts.continuous_usage:
                    chunk["usage"] = self._usage(n_prompt, sum(produced), cached, full=False)
                finished += d.finish_reason is not None
                last = finished == n
                if last and not opts.include_usage:
                    chunk["system_fingerprint"] = self.fingerprint
                await sse.event(chunk)
                if last and opts.include_usage:
                    await sse.event(
                        {
                            "id": rid,
                            "object": "text_completion",
                            "created": created,
                            "model": model,
                            "choices": [],
                            "usage": self._usage(n_prompt, sum(produced), cached, full=False),
                            "system_fingerprint": self.fingerprint,
                        }
                    )
        await sse.done()

    async def _chat(self, scope: Scope, body: bytes, receive: Receive, send: Send) -> None:
        req = self._parse(scope, body, ChatCompletionRequest)
        lora = check_model(self.engine, req.model)
        prompt = render(self.engine, req.messages, req.add_generation_prompt)
        max_tokens = (
            req.max_completion_tokens if req.max_completion_tokens is not None else (req.max_tokens)
        )
        gen = gen_request(self.engine, _headers(scope), req, prompt, max_tokens, lora)
        rid = "chatcmpl-" + gen.request_id.rsplit("#", 1)[0]
        opts = _options(req, (req.top_logprobs or 0) if req.logprobs else None)
        gens = choice_requests(self.engine, gen, req.n, req.temperature)
        runs: list[Generation] = []
        try:
            for g in gens:
                runs.append(self._start(g))
            handler = self._stream_chat if req.stream else self._complete_chat
            await race_disconnect(receive, handler(send, gen, runs, rid, opts))
        finally:
            for run in runs:
                run.close()

    async def _complete_chat(
        self, send: Send, gen: GenRequest, runs: list[Generation], rid: str, opts: StreamOptions
    ) -> None:
        results = await self._collect(runs)
        if results is None:
            await self._send_error(send, _aborted())
            return
        return_ids = opts.return_token_ids
        tok = self.engine.tokenizer
        choices = []
        produced = 0
        for index, deltas in enumerate(results):
            ids = [t for d in deltas for t in d.token_ids]
            produced += len(ids)
            logprobs = None
            if opts.logprobs is not None:
                logprobs = chat_logprobs(ids, tok.decode, opts.logprobs, tok.vocab_size)
            choices.append(
                {
                    "index": index,
                    "message": {
                        "role": "assistant",
                        "content": "".join(d.text for d in deltas),
                        "refusal": None,
                        "annotations": None,
                        "audio": None,
                        "function_call": None,
                        "reasoning": None,
                    },
                    "logprobs": logprobs,
                    "finish_reason": deltas[-1].finish_reason,
                    "stop_reason": deltas[-1].stop_reason,
                    "token_ids": ids if return_ids else None,
                    "routed_experts": None,
                }
            )
        cached = results[0][0].cached_prompt_tokens
        out = {
            "id": rid,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": gen.lora_name or self.engine.options.model_name,
            "choices": choices,
            "service_tier": None,
            "system_fingerprint": self.fingerprint,
            "usage": self._usage(len(gen.prompt_token_ids), produced, cached, full=True, chat=True),
            "prompt_logprobs": None,
            "prompt_token_ids": list(gen.prompt_token_ids) if return_ids else None,
            "prompt_text": None,
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "metrics": None,
        }
        await send_json(send, 200, out)

    async def _stream_chat(
        self, send: Send, gen: GenRequest, runs: list[Generation], rid: str, opts: StreamOptions
    ) -> None:
        sse = SseWriter(send)
        await sse.start()
        created = int(time.time())
        model = gen.lora_name or self.engine.options.model_name
        tok = self.engine.tokenizer
        n_prompt = len(gen.prompt_token_ids)
        n = len(runs)
        return_ids = opts.return_token_ids
        head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}
        for i in range(n):
            await sse.event(
                {
                    **head,
                    "choices": [
                        {
                            "index": i,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ],
                    "prompt_token_ids": list(gen.prompt_token_ids) if return_ids else None,
                    "prompt_text": None,
                }
            )
        produced = [0] * n
        finished = 0
        cached = 0
        pre = [
            b"data: " + dumps(head)[:-1] + b',"choices":[{"index":%d,"delta":{"content":' % i
            for i in range(n)
        ]
        post = b'},"logprobs":null,"finish_reason":null,"token_ids":null}]}\n\n'
        async with contextlib.aclosing(merge(runs)) as stream:
            async for i, d in stream:
                if d.finish_reason == "abort":
                    await sse.event(self._body(_aborted()))
                    break
                if d.first and i == 0:
                    cached = d.cached_prompt_tokens
                position = produced[i]
                produced[i] += len(d.token_ids)
                if d.finish_reason is None and opts.fast_path:
                    await sse.raw(pre[i] + dumps(d.text) + post)
                    continue
                logprobs = None
                if opts.logprobs is not None:
                    logprobs = chat_logprobs(
                        d.token_ids, tok.decode, opts.logprobs, tok.vocab_size, position
                    )
                choice: dict[str, Any] = {
                    "index": i,
                    "delta": {"content": d.text},
                    "logprobs": logprobs,
                    "finish_reason": d.finish_reason,
                }
                if d.finish_reason is not None:
                    choice["stop_reason"] = d.stop_reason
                choice["token_ids"] = list(d.token_ids) if return_ids else None
                chunk: dict[str, Any] = {**head, "choices": [choice]}
                if opts.continuous_usage:
                    chunk["usage"] = self._usage(
                        n_prompt, sum(produced), cached, full=False, chat=True
                    )
                finished += d.finish_reason is not None
                last = finished == n
                if last and not opts.include_usage:
                    chunk["system_fingerprint"] = self.fingerprint
                await sse.event(chunk)
                if last and opts.include_usage:
                    await sse.event(
                        {
                            **head,
                            "choices": [],
                            "usage": self._usage(
                                n_prompt, sum(produced), cached, full=False, chat=True
                            ),
                            "system_fingerprint": self.fingerprint,
                        }
                    )
        await sse.done()

    # -- dev endpoints (vLLM: VLLM_SERVER_DEV_MODE=1) ------------------------

    async def _reset_prefix_cache(
        self, scope: Scope, body: bytes, receive: Receive, send: Send
    ) -> None:
        # Its AllBlocksCleared stays with the pool until the next step publishes it, as
        # vLLM publishes a step's events in Scheduler.update_from_output.
        reset = getattr(self.engine.driver.model, "reset_prefix_cache", None)
        success = bool(reset()) if reset is not None else False
        await send_json(send, 200, {"success": success})

    # -- tokenizer endpoints ------------------------------------------------

    async def _tokenize(self, scope: Scope, body: bytes, receive: Receive, send: Send) -> None:
        req = self._parse(scope, body, TokenizeRequest)
        check_model(self.engine, req.model)
        if req.messages is not None:
            tokens = render(self.engine, req.messages, req.add_generation_prompt)
        elif req.prompt is not None:
            tokens = self.engine.tokenizer.encode(req.prompt)
        else:
            raise HttpError(
                400, "Either prompt or messages must be given.", "BadRequestError", None
            )
        strs = (
            [self.engine.tokenizer.decode([t]) for t in tokens] if req.return_token_strs else None
        )
        await send_json(
            send,
            200,
            {
                "count": len(tokens),
                "max_model_len": self.engine.options.max_model_len,
                "tokens": tokens,
                "token_strs": strs,
            },
        )

    async def _detokenize(self, scope: Scope, body: bytes, receive: Receive, send: Send) -> None:
        req = self._parse(scope, body, DetokenizeRequest)
        check_model(self.engine, req.model)
        await send_json(send, 200, {"prompt": self.engine.tokenizer.decode(req.tokens)})


def _headers(scope: Scope) -> dict[str, str]:
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", ())}


def _options(req: CompletionRequest | ChatCompletionRequest, logprobs: int | None) -> StreamOptions:
    so = req.stream_options
    return StreamOptions(
        include_usage=bool(so and so.include_usage),
        continuous_usage=bool(so and so.include_usage and so.continuous_usage_stats),
        return_token_ids=bool(req.return_token_ids),
        logprobs=logprobs,
    )


def _aborted() -> HttpError:
    return HttpError(500, "The engine aborted the request.", "InternalServerError", None)


async def _method_not_allowed(send: Send, allow: bytes) -> None:
    await send_json(send, 405, {"detail": "Method Not Allowed"}, extra=((b"allow", allow),))


async def _lifespan(receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
