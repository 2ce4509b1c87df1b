"""The emulated ``trtllm-serve`` (TensorRT-LLM's ``serve/openai_server.py``,
``postprocess_handlers.py``).

Routes: ``GET /health`` (200, empty), ``GET /health_generate``, ``GET /version``,
``GET /v1/models`` (``owned_by: tensorrt_llm``), ``POST /v1/completions``,
``POST /v1/chat/completions``, ``GET /metrics`` (JSON list of IterationStats,
**drained** on read: each iteration is returned once, queue bounded at 1000
like ``iter_stats_max_iterations``) and ``GET /prometheus/metrics``
(``trtllm_*`` families of TRT main's ``metrics/collector.py``).

Quirks reproduced: the first, role-only chat chunk is ``data: {...} \\n\\n``
(a space before the newlines) and chat chunks are dumped with
``exclude_none``; ``stream_options.include_usage`` defaults to True once
``stream_options`` is present, and ``stream_options`` without ``stream: true``
fails validation; request-validation errors are ``400 {"error": "<str(exc)>"}``
and other errors the flat ``{"object": "error", ...}`` body from the TensorRT-LLM
adapter; ``priority`` is a float in [0, 1], higher first, default 0.5.
The model name in requests is not checked (trtllm-serve serves one model).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from typing import Any

from pydantic import ValidationError

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
    EngineOptions,
    Generation,
    GenRequest,
    SimEngine,
    Tokenizer,
    generate,
)
from fleetgate.sim.trtllm.kv_events import TrtllmKvEventBuffer
from fleetgate.sim.trtllm.metrics import TrtllmMetrics
from fleetgate.sim.trtllm.protocol import request_model
from fleetgate.sim.trtllm.requests import DEFAULT_PRIORITY, HttpError, gen_request
from fleetgate.sim.vllm.app import KvEventSink

__all__ = ["TrtllmApp", "build_trtllm"]

ErrorBody = Callable[[int, str, str, str | None], dict[str, Any]]


def build_trtllm(
    options: EngineOptions,
    model: EngineModel,
    tokenizer: Tokenizer,
    time_scale: float,
    error_body: ErrorBody,
    kv_event_buffer: int | None = None,
    kv_publishers: Sequence[KvEventSink] = (),
) -> tuple[SimEngine, TrtllmApp]:
    """One emulated trtllm-serve. ``kv_publishers`` receive each step's KV-cache events
    (the streaming ``kv_events_config`` publisher; one per attention-DP rank, rank
    order); otherwise ``kv_event_buffer`` > 0 keeps that many for ``POST
    /kv_cache_events`` (``event_buffer_max_size``), every rank's in one buffer."""
    metrics = TrtllmMetrics(options, model, time.time())
    on_step = metrics.on_step
    pools = list(getattr(model, "pools", None) or [getattr(model, "pool", None)])
    pools = [p for p in pools if p is not None]
    events: TrtllmKvEventBuffer | None = None
    if kv_publishers and pools:
        if len(kv_publishers) != len(pools):
            raise ValueError(f"{len(pools)} attention-DP rank(s), {len(kv_publishers)} publishers")
        for pool in pools:
            pool.enable_kv_events()
        sinks = list(zip(kv_publishers, pools, strict=True))

        def on_step(now: float, result: StepResult) -> None:
            metrics.on_step(now, result)
            for sink, pool in sinks:
                sink.publish(pool.take_kv_events())

    elif kv_event_buffer and pools:
        for pool in pools:
            pool.enable_kv_events()
        buffer = events = TrtllmKvEventBuffer(
            kv_event_buffer, options.max_model_len, options.num_gpu_blocks // len(pools),
            ranks=len(pools),
        )  # fmt: skip

        def on_step(now: float, result: StepResult) -> None:
            metrics.on_step(now, result)
            for rank, pool in enumerate(pools):
                buffer.add(pool.take_kv_events(), rank)

    driver = EngineDriver(model, time_scale=time_scale, on_step=on_step)
    engine = SimEngine(options, tokenizer, driver, metrics)
    return engine, TrtllmApp(engine, metrics, error_body, events)


class TrtllmApp:
    """ASGI app of one emulated trtllm-serve."""

    def __init__(
        self,
        engine: SimEngine,
        metrics: TrtllmMetrics,
        error_body: ErrorBody,
        kv_events: TrtllmKvEventBuffer | None = None,
    ) -> None:
        self.engine = engine
        self.kv_events = kv_events
        self.metrics = metrics
        self.error_body = error_body
        self.created = int(time.time())
        self.release = metrics.release

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        gets = {
            "/health": self._health,
            "/health_generate": self._health_generate,
            "/version": self._version,
            "/v1/models": self._models,
            "/metrics": self._metrics,
            "/prometheus/metrics": self._prometheus,
        }
        if path in gets:
            if method != "GET":
                await send_json(
                    send, 405, {"detail": "Method Not Allowed"}, extra=((b"allow", b"GET"),)
                )
                return
            await gets[path](send)
            return
        if path == "/kv_cache_events":
            if method != "POST":
                await send_json(
                    send, 405, {"detail": "Method Not Allowed"}, extra=((b"allow", b"POST"),)
                )
                return
            await send_json(send, 200, self.kv_events.drain() if self.kv_events else [])
            return
        if path in ("/v1/completions", "/v1/chat/completions"):
            if method != "POST":
                await send_json(
                    send, 405, {"detail": "Method Not Allowed"}, extra=((b"allow", b"POST"),)
                )
                return
            body = await read_body(receive)
            if body is None:
                return
            if not _json_media(header(scope, b"content-type")):
                # trtllm-serve is FastAPI: a body that is not JSON is not parsed, so its
                # pydantic request model sees bytes (a text/plain POST, which a browser
                # may send cross-site without a preflight, must not run a generation).
                detail = {
                    "type": "model_attributes_type",
                    "loc": ["body"],
                    "msg": "Input should be a valid dictionary or object to extract fields from",
                    "input": body[:200].decode("utf-8", "replace"),
                }
                await send_json(send, 422, {"detail": [detail]})
                return
            try:
                await self._generate(path == "/v1/chat/completions", body, receive, send)
            except HttpError as e:
                await send_json(
                    send, e.status, self.error_body(e.status, e.message, e.err_type, None)
                )
            return
        await send_json(send, 404, {"detail": "Not Found"})

    async def _health(self, send: Send) -> None:
        await send_bytes(send, 200, b"", None)

    async def _health_generate(self, send: Send) -> None:
        gen = GenRequest(
            self.engine.internal_id("health"),
            tuple(self.engine.tokenizer.render_chat([{"role": "user", "content": "hi"}])),
            max_tokens=1,
            priority=DEFAULT_PRIORITY,
        )
        run = generate(self.engine, gen)
        try:
            deltas = [d async for d in run]
        finally:
            run.close()
        for d in deltas:
            if d.finish_reason == "abort":
                await send_bytes(send, 500, b"Generation health check failed.", b"text/plain")
                return
        await send_bytes(send, 200, b"Generation health check OK", b"text/plain; charset=utf-8")

    async def _version(self, send: Send) -> None:
        await send_json(send, 200, {"version": self.engine.options.version})

    async def _models(self, send: Send) -> None:
        card = {
            "id": self.engine.options.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "tensorrt_llm",
        }
        await send_json(send, 200, {"object": "list", "data": [card]})

    async def _metrics(self, send: Send) -> None:
        await send_json(send, 200, self.metrics.drain())

    async def _prometheus(self, send: Send) -> None:
        await send_bytes(
            send, 200, self.metrics.render(), b"text/plain; version=1.0.0; charset=utf-8"
        )

    async def _generate(self, chat: bool, body: bytes, receive: Receive, send: Send) -> None:
        model_cls = request_model(chat, self.release.request_priority)
        try:
            data = json.loads(body)
            req = model_cls.model_validate(data)
        except (ValidationError, ValueError) as e:
            await send_json(send, 400, {"error": str(e)})
            return
        gen = gen_request(self.engine, req)
        o = self.engine.options
        rid = ("chatcmpl-" if chat else "cmpl-") + gen.request_id.rsplit("#", 1)[0]
        model_name = req.model or o.model_name
        try:
            run = generate(self.engine, gen)
        except ValueError as e:
            raise HttpError(400, str(e)) from None
        try:
            if req.stream:
                usage = req.stream_options is not None and bool(
                    req.stream_options.get("include_usage", True)
                )
                await race_disconnect(
                    receive, self._stream(send, gen, run, rid, chat, model_name, usage)
                )
            else:
                await race_disconnect(receive, self._once(send, gen, run, rid, chat, model_name))
        finally:
            run.close()

    def _usage(self, gen: GenRequest, produced: int, cached: int) -> dict[str, Any]:
        p = len(gen.prompt_token_ids)
        return {
            "prompt_tokens": p,
            "total_tokens": p + produced,
            "completion_tokens": produced,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    async def _once(
        self, send: Send, gen: GenRequest, run: Generation, rid: str, chat: bool, model: str
    ) -> None:
        deltas = [d async for d in run]
        last = deltas[-1]
        if last.finish_reason == "abort":
            raise HttpError(500, "Request aborted.", "InternalServerError")
        text = "".join(d.text for d in deltas)
        produced = sum(len(d.token_ids) for d in deltas)
        choice: dict[str, Any]
        if chat:
            choice = {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": text,
                    "reasoning_content": None,
                    "tool_calls": [],
                },
                "logprobs": None,
                "finish_reason": last.finish_reason,
                "stop_reason": last.stop_reason,
            }
        else:
            choice = {
                "index": 0,
                "text": text,
                "token_ids": None,
                "logprobs": None,
                "finish_reason": last.finish_reason,
                "stop_reason": last.stop_reason,
            }
        out = {
            "id": rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": model,
            "choices": [choice],
            "usage": self._usage(gen, produced, deltas[0].cached_prompt_tokens),
        }
        await send_json(send, 200, out)

    async def _stream(
        self,
        send: Send,
        gen: GenRequest,
        run: Generation,
        rid: str,
        chat: bool,
        model: str,
        usage: bool,
    ) -> None:
        sse = SseWriter(send)
        await sse.start()
        head = {
            "id": rid,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()),
            "model": model,
        }
        if chat:
            first = {**head, "choices": [{"index": 0, "delta": {"role": "assistant"}}]}
            await sse.raw(b"data: " + dumps(first) + b" \n\n")
        produced = 0
        cached = 0
        async for d in run:
            if d.finish_reason == "abort":
                await sse.event(
                    self.error_body(500, "Request aborted.", "InternalServerError", None)
                )
                break
            if d.first:
                cached = d.cached_prompt_tokens
            produced += len(d.token_ids)
            if chat:
                choice: dict[str, Any] = {"index": 0, "delta": {"content": d.text}}
                if d.finish_reason is not None:
                    choice["finish_reason"] = d.finish_reason
                if d.stop_reason is not None:
                    choice["stop_reason"] = d.stop_reason
                await sse.event({**head, "choices": [choice]})
            else:
                await sse.event(
                    {
                        **head,
                        "choices": [
                            {
                                "index": 0,
                                "text": d.text,
                                "token_ids": None,
                                "logprobs": None,
                                "finish_reason": d.finish_reason,
                                "stop_reason": d.stop_reason,
                            }
                        ],
                        "usage": None,
                    }
                )
            if d.finish_reason is not None and usage:
                await sse.event(
                    {**head, "choices": [], "usage": self._usage(gen, produced, cached)}
                )
        await sse.done()


def _json_media(content_type: str | None) -> bool:
    """FastAPI's rule: no content type, ``application/json`` or any ``+json`` type."""
    if content_type is None:
        return True
    media = content_type.split(";", 1)[0].strip().lower()
    main, _, sub = media.partition("/")
    return main == "application" and (sub == "json" or sub.endswith("+json"))
