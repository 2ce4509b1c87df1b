"""The emulated vLLM OpenAI-compatible server (engines.md §2-3, vLLM 0.32 fixtures).

Routes: ``GET /health`` (200, empty body), ``GET /v1/models``, ``GET /version``,
``GET /metrics``, ``POST /v1/completions``, ``POST /v1/chat/completions``,
``POST /tokenize``, ``POST /detokenize``. Shapes follow the real recordings in
``/work/shared/fixtures/vllm-0.32-cpu/`` key for key (including the null
fields), and error bodies come from the vLLM engine adapter's ``error_body``.

Request handling order: content type / JSON / pydantic validation (400
``Bad Request``) -> model name (404) -> ``max_tokens`` >= 1 (400) -> prompt
length (400; ``max_tokens`` beyond the context is clamped, not refused) ->
submit. All errors before the first byte are ordinary JSON responses, also with
``stream: true`` (fixture README quirk 3); errors after the 200 went out are
sent in-band as ``data: {"error": {...}}`` then ``data: [DONE]``.

Streaming framing: one event per HTTP chunk; ``system_fingerprint`` only on the
final event (the finish event, or the usage event with ``include_usage``); the
first chat event carries ``delta: {"role": "assistant", "content": ""}`` and
top-level ``prompt_token_ids``/``prompt_text``.
"""

from __future__ import annotations

import hashlib
import time
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

from pydantic import BaseModel

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
from fleetgate.sim.generation import Delta, Generation, GenRequest, SimEngine, generate
from fleetgate.sim.vllm_metrics import CONTENT_TYPE, VllmMetrics
from fleetgate.sim.vllm_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    RequestParseError,
    TokenizeRequest,
    parse_body,
)

__all__ = ["VllmApp", "default_fingerprint"]

M = TypeVar("M", bound=BaseModel)

ErrorBody = Callable[[int, str, str, str | None], dict[str, Any]]


class _HttpError(Exception):
    def __init__(self, status: int, message: str, err_type: str, param: str | None) -> None:
        super().__init__(message)
        self.status, self.message, self.err_type, self.param = status, message, err_type, param


def default_fingerprint(version: str, model_name: str) -> str:
    digest = hashlib.sha256(f"{version}/{model_name}".encode()).hexdigest()[:8]
    return f"vllm-{version}-{digest}"


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [p.get("text", "") for p in content if isinstance(p, dict)]
        return "".join(str(p) for p in parts)
    return str(content)


class VllmApp:
    """ASGI app of one emulated vLLM engine."""

    def __init__(
        self, engine: SimEngine, metrics: VllmMetrics, error_body: ErrorBody, created: int
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
            except _HttpError as e:
                await self._send_error(send, e)
            return
        await send_json(send, 404, {"detail": "Not Found"})

    # -- simple GETs --------------------------------------------------------

    async def _health(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", b"0"), (b"vary", b"Origin")]})  # fmt: skip
        await send({"type": "http.response.body", "body": b""})

    async def _models(self, send: Send) -> None:
        o = self.engine.options
        now = int(time.time())
        card = {
            "id": o.model_name,
            "object": "model",
            "created": now,
            "owned_by": "vllm",
            "root": o.model_root,
            "parent": None,
            "max_model_len": o.max_model_len,
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
        await send_json(send, 200, {"object": "list", "data": [card]})

    async def _version(self, send: Send) -> None:
        await send_json(send, 200, {"version": self.engine.options.version})

    async def _metrics(self, send: Send) -> None:
        await send_bytes(send, 200, self.metrics.render(), CONTENT_TYPE.encode())

    # -- errors -------------------------------------------------------------

    def _body(self, e: _HttpError) -> dict[str, Any]:
        return self.error_body(e.status, e.message, e.err_type, e.param)

    async def _send_error(self, send: Send, e: _HttpError) -> None:
        await send_json(send, e.status, self._body(e))

    def _parse(self, scope: Scope, body: bytes, model: type[M]) -> M:
        try:
            return parse_body(body, header(scope, b"content-type"), model)
        except RequestParseError as e:
            raise _HttpError(400, e.message, "Bad Request", e.param) from None

    def _check_model(self, name: str | None) -> None:
        served = self.engine.options.model_name
        if name is not None and name != served:
            raise _HttpError(
                404,
                f"The model `{name}` does not exist. Valid aliases: {served}.",
                "NotFoundError",
                "model",
            )

    # -- generation ---------------------------------------------------------

    def _gen_request(
        self, scope: Scope, req: CompletionRequest | ChatCompletionRequest, prompt: list[int],
        max_tokens: int | None,
    ) -> GenRequest:  # fmt: skip
        o = self.engine.options
        if max_tokens is not None and max_tokens < 1:
            raise _HttpError(
                400,
                f"max_tokens must be at least 1, got {max_tokens}. "
                f"(parameter=max_tokens, value={max_tokens})",
                "BadRequestError",
                "max_tokens",
            )
        if req.n != 1:
            raise _HttpError(400, "n must be 1 on the emulator.", "BadRequestError", "n")
        if len(prompt) >= o.max_model_len:
            shown = o.max_model_len + 1 if len(prompt) > o.max_model_len else len(prompt)
            raise _HttpError(
                400,
                f"This model's maximum context length is {o.max_model_len} tokens. However, "
                f"your prompt contains at least {shown} input tokens, which exceeds this limit "
                "even without any output tokens. Please reduce the length of the input prompt. "
                f"(parameter=input_tokens, value={shown})",
                "BadRequestError",
                "input_tokens",
            )
        room = o.max_model_len - len(prompt)
        limit = room if max_tokens is None else min(max_tokens, room)
        priority = req.priority
        hdr = header(scope, b"x-vllm-priority")
        if hdr is not None:
            try:
                priority = int(hdr.strip())
            except ValueError:
                raise _HttpError(
                    400, f"Invalid X-Vllm-Priority header: {hdr!r}", "BadRequestError", "priority"
                ) from None
        stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
        external = header(scope, b"x-request-id") or req.request_id or uuid.uuid4().hex[:16]
        return GenRequest(
            request_id=self.engine.internal_id(external),
            prompt_token_ids=tuple(prompt),
            max_tokens=limit,
            priority=float(priority),
            ignore_eos=req.ignore_eos,
            stop=stop,
            stop_token_ids=tuple(req.stop_token_ids or ()),
            seed=req.seed or 0,
        )

    def _usage(self, prompt: int, completion: int, cached: int, full: bool) -> dict[str, Any]:
        usage: dict[str, Any] = {
            "prompt_tokens": prompt,
            "total_tokens": prompt + completion,
            "completion_tokens": completion,
        }
        details = (
            {"cached_tokens": cached} if self.engine.options.enable_prompt_tokens_details else None
        )
        if full:
            usage["prompt_tokens_details"] = details
            usage["completion_tokens_details"] = None
        elif details is not None:
            usage["prompt_tokens_details"] = details
        return usage

    async def _completions(self, scope: Scope, body: bytes, receive: Receive, send: Send) -> None:
        req = self._parse(scope, body, CompletionRequest)
        self._check_model(req.model)
        prompt = self._prompt_ids(req.prompt)
        gen = self._gen_request(scope, req, prompt, req.max_tokens)
        rid = "cmpl-" + gen.request_id.rsplit("#", 1)[0]
        run = self._start(gen)
        return_ids = bool(req.return_token_ids)
        try:
            if req.stream:
                include_usage = bool(req.stream_options and req.stream_options.include_usage)
                await race_disconnect(
                    receive,
                    self._stream_completion(send, gen, run, rid, include_usage, return_ids),
                )
            else:
                await race_disconnect(
                    receive, self._complete_completion(send, gen, run, rid, return_ids)
                )
        finally:
            run.close()

    def _prompt_ids(self, prompt: Any) -> list[int]:
        if isinstance(prompt, str):
            return self.engine.tokenizer.encode(prompt)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            vocab = self.engine.tokenizer.vocab_size
            bad = [t for t in prompt if not 0 <= t < vocab]
            if bad:
                raise _HttpError(400, f"Token id {bad[0]} is out of vocabulary "
                                 f"(vocab size {vocab}). (parameter=prompt, value={bad[0]})",
                                 "BadRequestError", "prompt")  # fmt: skip
            return list(prompt)
        if isinstance(prompt, list) and len(prompt) == 1:
            return self._prompt_ids(prompt[0])
        if prompt is None or prompt == []:
            raise _HttpError(400, "Prompt must not be empty. (parameter=prompt, value=None)",
                             "BadRequestError", "prompt")  # fmt: skip
        raise _HttpError(
            400, "Batched prompts are not supported by the emulator.", "BadRequestError", "prompt"
        )

    def _start(self, gen: GenRequest) -> Generation:
        limit = self.engine.options.max_num_queued_reqs
        if limit is not None and self.engine.driver.model.stats().waiting >= limit:
            self.metrics.rejections["max_num_queued_reqs"] += 1
            raise _HttpError(
                503,
                "The engine is currently busy and cannot accept new requests. "
                "Please try again later or on a different instance.",
                "Service Unavailable",
                None,
            )
        try:
            return generate(self.engine, gen)
        except ValueError as e:
            raise _HttpError(400, str(e), "BadRequestError", getattr(e, "param", None)) from None

    async def _collect(self, run: Generation) -> tuple[list[Delta], str]:
        deltas: list[Delta] = []
        async for d in run:
            deltas.append(d)
        return deltas, "".join(d.text for d in deltas)

    async def _complete_completion(
        self, send: Send, gen: GenRequest, run: Generation, rid: str, return_ids: bool
    ) -> None:
        deltas, text = await self._collect(run)
        last = deltas[-1]
        if last.finish_reason == "abort":
            await self._send_error(send, _aborted())
            return
        ids = [t for d in deltas for t in d.token_ids]
        cached = deltas[0].cached_prompt_tokens
        out = {
            "id": rid,
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.engine.options.model_name,
            "choices": [
                {
                    "index": 0,
                    "text": text,
                    "logprobs": None,
                    "finish_reason": last.finish_reason,
                    "stop_reason": last.stop_reason,
                    "token_ids": ids if return_ids else None,
                    "prompt_logprobs": None,
                    "prompt_token_ids": list(gen.prompt_token_ids) if return_ids else None,
                    "routed_experts": None,
                }
            ],
            "service_tier": None,
            "system_fingerprint": self.fingerprint,
            "usage": self._usage(len(gen.prompt_token_ids), len(ids), cached, full=True),
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "metrics": None,
        }
        await send_json(send, 200, out)

    async def _stream_completion(
        self,
        send: Send,
        gen: GenRequest,
        run: Generation,
        rid: str,
        include_usage: bool,
        return_ids: bool,
    ) -> None:
        sse = SseWriter(send)
        await sse.start()
        created = int(time.time())
        model = self.engine.options.model_name
        produced = 0
        cached = 0
        first = True
        # Fast path for the common middle-of-stream event: only the text varies, so the
        # bytes around it are built once (same bytes json.dumps would give).
        head = dumps({"id": rid, "object": "text_completion", "created": created, "model": model})
        pre = b"data: " + head[:-1] + b',"choices":[{"index":0,"text":'
        post = (b',"logprobs":null,"finish_reason":null,"stop_reason":null,'
                b'"prompt_token_ids":null,"token_ids":null}]}\n\n')  # fmt: skip
        async for d in run:
            if d.finish_reason == "abort":
                await sse.event(self._body(_aborted()))
                break
            produced += len(d.token_ids)
            if first:
                cached = d.cached_prompt_tokens
            elif d.finish_reason is None and not return_ids:
                await sse.raw(pre + dumps(d.text) + post)
                continue
            choice = {
                "index": 0,
                "text": d.text,
                "logprobs": None,
                "finish_reason": d.finish_reason,
                "stop_reason": d.stop_reason,
                "prompt_token_ids": list(gen.prompt_token_ids) if return_ids and first else None,
                "token_ids": list(d.token_ids) if return_ids else None,
            }
            first = False
            chunk: dict[str, Any] = {"id": rid, "object": "text_completion", "created": created,
                                     "model": model, "choices": [choice]}  # fmt: skip
            if d.finish_reason is not None and not include_usage:
                chunk["system_fingerprint"] = self.fingerprint
            await sse.event(chunk)
            if d.finish_reason is not None and include_usage:
                await sse.event({"id": rid, "object": "text_completion", "created": created,
                                 "model": model, "choices": [],
                                 "usage": self._usage(len(gen.prompt_token_ids), produced,
                                                      cached, full=False),
                                 "system_fingerprint": self.fingerprint})  # fmt: skip
        await sse.done()

    async def _chat(self, scope: Scope, body: bytes, receive: Receive, send: Send) -> None:
        req = self._parse(scope, body, ChatCompletionRequest)
        self._check_model(req.model)
        prompt = self._render(req.messages, req.add_generation_prompt)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else (
            req.max_tokens
        )  # fmt: skip
        gen = self._gen_request(scope, req, prompt, max_tokens)
        rid = "chatcmpl-" + gen.request_id.rsplit("#", 1)[0]
        return_ids = bool(req.return_token_ids)
        run = self._start(gen)
        try:
            if req.stream:
                include_usage = bool(req.stream_options and req.stream_options.include_usage)
                await race_disconnect(
                    receive, self._stream_chat(send, gen, run, rid, include_usage, return_ids)
                )
            else:
                await race_disconnect(receive, self._complete_chat(send, gen, run, rid, return_ids))
        finally:
            run.close()

    def _render(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> list[int]:
        clean: list[dict[str, object]] = []
        for i, m in enumerate(messages):
            role = m.get("role")
            if not isinstance(role, str):
                raise _HttpError(
                    400,
                    f"1 validation error:\n  {{'type': 'missing', 'loc': 'body.messages.{i}.role',"
                    " 'msg': 'Field required'}",
                    "Bad Request",
                    f"body.messages.{i}.role",
                )
            clean.append({"role": role, "content": _content_text(m.get("content"))})
        try:
            return self.engine.tokenizer.render_chat(clean, add_generation_prompt)
        except ValueError as e:
            raise _HttpError(400, str(e), "BadRequestError", "messages") from None

    async def _complete_chat(
        self, send: Send, gen: GenRequest, run: Generation, rid: str, return_ids: bool
    ) -> None:
        deltas, text = await self._collect(run)
        last = deltas[-1]
        if last.finish_reason == "abort":
            await self._send_error(send, _aborted())
            return
        ids = [t for d in deltas for t in d.token_ids]
        out = {
            "id": rid,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.engine.options.model_name,
            "choices": [
                {
                    "index": 0,
                    "message": {
                        "role": "assistant",
                        "content": text,
                        "refusal": None,
                        "annotations": None,
                        "audio": None,
                        "function_call": None,
                        "reasoning": None,
                    },
                    "logprobs": None,
                    "finish_reason": last.finish_reason,
                    "stop_reason": last.stop_reason,
                    "token_ids": ids if return_ids else None,
                    "routed_experts": None,
                }
            ],
            "service_tier": None,
            "system_fingerprint": self.fingerprint,
            "usage": self._usage(
                len(gen.prompt_token_ids), len(ids), deltas[0].cached_prompt_tokens, full=True
            ),
            "prompt_logprobs": None,
            "prompt_token_ids": list(gen.prompt_token_ids) if return_ids else None,
            "prompt_text": None,
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "metrics": None,
        }
        await send_json(send, 200, out)

    async def _stream_chat(
        self,
        send: Send,
        gen: GenRequest,
        run: Generation,
        rid: str,
        include_usage: bool,
        return_ids: bool,
    ) -> None:
        sse = SseWriter(send)
        await sse.start()
        created = int(time.time())
        model = self.engine.options.model_name
        head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}
        await sse.event({**head, "choices": [{"index": 0,
                         "delta": {"role": "assistant", "content": ""},
                         "logprobs": None, "finish_reason": None}],
                         "prompt_token_ids": list(gen.prompt_token_ids) if return_ids else None,
                         "prompt_text": None})  # fmt: skip
        produced = 0
        cached = 0
        pre = b"data: " + dumps(head)[:-1] + b',"choices":[{"index":0,"delta":{"content":'
        post = b'},"logprobs":null,"finish_reason":null,"token_ids":null}]}\n\n'
        async for d in run:
            if d.finish_reason == "abort":
                await sse.event(self._body(_aborted()))
                break
            if d.first:
                cached = d.cached_prompt_tokens
            produced += len(d.token_ids)
            if d.finish_reason is None and not return_ids:
                await sse.raw(pre + dumps(d.text) + post)
                continue
            choice: dict[str, Any] = {"index": 0, "delta": {"content": d.text}, "logprobs": None,
                                      "finish_reason": d.finish_reason}  # fmt: skip
            if d.finish_reason is not None:
                choice["stop_reason"] = d.stop_reason
            choice["token_ids"] = list(d.token_ids) if return_ids else None
            chunk: dict[str, Any] = {**head, "choices": [choice]}
            if d.finish_reason is not None and not include_usage:
                chunk["system_fingerprint"] = self.fingerprint
            await sse.event(chunk)
            if d.finish_reason is not None and include_usage:
                await sse.event({**head, "choices": [],
                                 "usage": self._usage(len(gen.prompt_token_ids), produced,
                                                      cached, full=False),
                                 "system_fingerprint": self.fingerprint})  # fmt: skip
        await sse.done()

    # -- tokenizer endpoints ------------------------------------------------

    async def _tokenize(self, scope: Scope, body: bytes, receive: Receive, send: Send) -> None:
        req = self._parse(scope, body, TokenizeRequest)
        self._check_model(req.model)
        if req.messages is not None:
            tokens = self._render(req.messages, req.add_generation_prompt)
        elif req.prompt is not None:
            tokens = self.engine.tokenizer.encode(req.prompt)
        else:
            raise _HttpError(400, "Either prompt or messages must be given.", "BadRequestError",
                             None)  # fmt: skip
        strs = (
            [self.engine.tokenizer.decode([t]) for t in tokens] if req.return_token_strs else None
        )
        await send_json(send, 200, {"count": len(tokens),
                                    "max_model_len": self.engine.options.max_model_len,
                                    "tokens": tokens, "token_strs": strs})  # fmt: skip

    async def _detokenize(self, scope: Scope, body: bytes, receive: Receive, send: Send) -> None:
        req = self._parse(scope, body, DetokenizeRequest)
        self._check_model(req.model)
        await send_json(send, 200, {"prompt": self.engine.tokenizer.decode(req.tokens)})


def _aborted() -> _HttpError:
    return _HttpError(500, "The engine aborted the request.", "InternalServerError", None)


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
