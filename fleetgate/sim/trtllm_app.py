"""The emulated ``trtllm-serve`` (engines.md §4, TRT ``serve/openai_server.py``,
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

import collections
import dataclasses
import json
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from fleetgate.sim.asgi import (
    Receive,
    Scope,
    Send,
    SseWriter,
    dumps,
    race_disconnect,
    read_body,
    send_bytes,
    send_json,
)
from fleetgate.sim.core.api import EngineModel, FinishReason, StepResult
from fleetgate.sim.driver import EngineDriver
from fleetgate.sim.generation import (
    EngineOptions,
    Generation,
    GenRequest,
    SimEngine,
    Tokenizer,
    generate,
)
from fleetgate.sim.metrics_common import HistogramState, counter, gauge, histogram

__all__ = ["TrtllmApp", "TrtllmMetrics", "build_trtllm"]

ErrorBody = Callable[[int, str, str, str | None], dict[str, Any]]
DEFAULT_PRIORITY = 0.5
STATS_QUEUE = 1000
LATENCY_BUCKETS = [0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 240.0, 480.0]


class _Req(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    priority: float | None = Field(default=None, ge=0.0, le=1.0)

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> _Req:
        if self.stream_options is not None and not self.stream:
            raise ValueError("Stream options can only be defined when `stream=True`.")
        return self


class CompletionRequest(_Req):
    prompt: str | list[int]


class ChatCompletionRequest(_Req):
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = Field(default=None, ge=1)


@dataclasses.dataclass(slots=True)
class _Live:
    arrival: float
    first: float | None = None
    scheduled: float | None = None


class TrtllmMetrics(Collector):
    """Request observer, drained iteration-stats queue and ``trtllm_*`` collector."""

    def __init__(self, options: EngineOptions, model: EngineModel, created: float) -> None:
        self.options = options
        self.model = model
        self.created = created
        self.iterations: collections.deque[dict[str, Any]] = collections.deque(maxlen=STATS_QUEUE)
        self.success: dict[str, int] = {"stop": 0, "length": 0, "abort": 0}
        self.hist = {
            "e2e_request_latency_seconds": HistogramState(LATENCY_BUCKETS),
            "time_to_first_token_seconds": HistogramState(LATENCY_BUCKETS),
            "time_per_output_token_seconds": HistogramState(LATENCY_BUCKETS),
            "request_queue_time_seconds": HistogramState(LATENCY_BUCKETS),
        }
        self._live: dict[str, _Live] = {}
        self._iter = 0
        self._prev_alloc = 0
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    def on_admit(self, request: GenRequest, now: float) -> None:
        self._live[request.request_id] = _Live(now)

    def on_tokens(
        self,
        request: GenRequest,
        count: int,
        now: float,
        first: bool,
        cached: int,
        scheduled_at: float | None = None,
    ) -> None:
        live = self._live.get(request.request_id)
        if live is not None and live.first is None:
            live.first = now
            self.hist["time_to_first_token_seconds"].observe(now - live.arrival)
            if scheduled_at is not None:
                live.scheduled = min(max(scheduled_at, live.arrival), now)

    def on_finish(
        self, request: GenRequest, reason: FinishReason, completion_tokens: int, now: float
    ) -> None:
        live = self._live.pop(request.request_id, None)
        if live is None:
            return
        self.success[reason] = self.success.get(reason, 0) + 1
        self.hist["e2e_request_latency_seconds"].observe(now - live.arrival)
        if live.scheduled is not None:
            # queue time = arrival until first scheduled (the model's scheduling instant)
            self.hist["request_queue_time_seconds"].observe(live.scheduled - live.arrival)
        if live.first is not None and completion_tokens > 1:
            self.hist["time_per_output_token_seconds"].observe(
                (now - live.first) / (completion_tokens - 1)
            )

    def on_abort(self, request: GenRequest, completion_tokens: int, now: float) -> None:
        if self._live.pop(request.request_id, None) is not None:
            self.success["abort"] += 1

    def on_step(self, now: float, result: StepResult) -> None:
        s = self.model.stats()
        self._iter += 1
        new = sum(1 for e in result.events if e.first)
        done = sum(1 for e in result.events if e.finish_reason is not None)
        alloc_total = s.reused_blocks + s.missed_blocks
        alloc_new, self._prev_alloc = alloc_total - self._prev_alloc, alloc_total
        queried = s.reused_blocks + s.missed_blocks
        self.iterations.append(
            {
                "timestamp": time.strftime("%m-%d-%Y %H:%M:%S", time.gmtime()),
                "iter": self._iter,
                "iterLatencyMS": result.duration * 1000.0,
                "newActiveRequestsQueueLatencyMS": 0.0,
                "numNewActiveRequests": new,
                "numActiveRequests": s.running,
                "numQueuedRequests": s.waiting,
                "numCompletedRequests": done,
                "maxNumActiveRequests": s.max_running,
                "maxBatchSizeStatic": s.max_running,
                "maxBatchSizeTunerRecommended": s.max_running,
                "maxBatchSizeRuntime": s.max_running,
                "maxNumTokensStatic": 8192,
                "maxNumTokensTunerRecommended": 8192,
                "maxNumTokensRuntime": 8192,
                "gpuMemUsage": s.blocks_used * s.block_size * 131072,
                "cpuMemUsage": 0,
                "pinnedMemUsage": 0,
                "kvCacheStats": {
                    "maxNumBlocks": s.blocks_total,
                    "freeNumBlocks": s.blocks_free,
                    "usedNumBlocks": s.blocks_used,
                    "tokensPerBlock": s.block_size,
                    "allocTotalBlocks": alloc_total,
                    "allocNewBlocks": max(0, alloc_new),
                    "reusedBlocks": s.reused_blocks,
                    "missedBlocks": s.missed_blocks,
                    "cacheHitRate": (s.reused_blocks / queried) if queried else 0.0,
                },
                "staticBatchingStats": None,
                "inflightBatchingStats": {
                    "numScheduledRequests": s.running,
                    "numContextRequests": new,
                    "numGenRequests": max(0, s.running - new),
                    "numPausedRequests": s.paused,
                    "numCtxTokens": 0,
                    "microBatchId": 0,
                    "avgNumDecodedTokensPerIter": 1.0,
                },
                "specDecodingStats": None,
            }
        )

    def drain(self) -> list[dict[str, Any]]:
        out = list(self.iterations)
        self.iterations.clear()
        return out

    def collect(self) -> Iterator[Metric]:
        s = self.model.stats()
        base = {"model_name": self.options.model_name, "engine_type": "undefined"}
        c = self.created

        def one(v: float) -> list[tuple[dict[str, str], float]]:
            return [(base, float(v))]

        queried = s.reused_blocks + s.missed_blocks
        yield gauge("trtllm_num_requests_running", "Number of running requests.", one(s.running))
        yield gauge("trtllm_num_requests_waiting", "Number of waiting requests.", one(s.waiting))
        yield gauge(
            "trtllm_kv_cache_utilization",
            "KV cache utilization.",
            one(s.blocks_used / s.blocks_total if s.blocks_total else 0.0),
        )
        yield gauge(
            "trtllm_kv_cache_hit_rate",
            "KV cache hit rate.",
            one(s.reused_blocks / queried if queried else 0.0),
        )
        yield gauge("trtllm_kv_cache_max_blocks", "Max KV cache blocks.", one(s.blocks_total))
        yield gauge("trtllm_kv_cache_free_blocks", "Free KV cache blocks.", one(s.blocks_free))
        yield gauge("trtllm_kv_cache_used_blocks", "Used KV cache blocks.", one(s.blocks_used))
        yield gauge(
            "trtllm_kv_cache_tokens_per_block", "Tokens per KV cache block.", one(s.block_size)
        )
        yield counter(
            "trtllm_kv_cache_reused_blocks", "Reused KV cache blocks.", one(s.reused_blocks), c
        )
        yield counter(
            "trtllm_kv_cache_missed_blocks", "Missed KV cache blocks.", one(s.missed_blocks), c
        )
        yield gauge("trtllm_num_scheduled_requests", "Scheduled requests.", one(s.running))
        yield gauge("trtllm_num_paused_requests", "Paused requests.", one(s.paused))
        yield counter("trtllm_prompt_tokens", "Prompt tokens processed.", one(s.prompt_tokens), c)
        yield counter(
            "trtllm_generation_tokens", "Generation tokens processed.", one(s.generation_tokens), c
        )
        yield counter(
            "trtllm_prompt_cached_tokens",
            "Prompt tokens served from the KV cache.",
            one(s.prefix_hit_tokens),
            c,
        )
        yield counter(
            "trtllm_request_success",
            "Count of successfully processed requests.",
            [({**base, "finished_reason": k}, float(v)) for k, v in self.success.items()],
            c,
        )
        for name, state in self.hist.items():
            yield histogram(
                "trtllm_" + name, f"Histogram of {name.replace('_', ' ')}.", [(base, state)], c
            )

    def render(self) -> bytes:
        return generate_latest(self.registry)


def build_trtllm(
    options: EngineOptions,
    model: EngineModel,
    tokenizer: Tokenizer,
    time_scale: float,
    error_body: ErrorBody,
) -> tuple[SimEngine, TrtllmApp]:
    metrics = TrtllmMetrics(options, model, time.time())
    driver = EngineDriver(model, time_scale=time_scale, on_step=metrics.on_step)
    engine = SimEngine(options, tokenizer, driver, metrics)
    return engine, TrtllmApp(engine, metrics, error_body)


class _Flat(Exception):
    def __init__(self, status: int, message: str, err_type: str = "BadRequestError") -> None:
        super().__init__(message)
        self.status, self.message, self.err_type = status, message, err_type


class TrtllmApp:
    """ASGI app of one emulated trtllm-serve."""

    def __init__(self, engine: SimEngine, metrics: TrtllmMetrics, error_body: ErrorBody) -> None:
        self.engine = engine
        self.metrics = metrics
        self.error_body = error_body
        self.created = int(time.time())

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
        if path in ("/v1/completions", "/v1/chat/completions"):
            if method != "POST":
                await send_json(
                    send, 405, {"detail": "Method Not Allowed"}, extra=((b"allow", b"POST"),)
                )
                return
            body = await read_body(receive)
            if body is None:
                return
            try:
                await self._generate(path == "/v1/chat/completions", body, receive, send)
            except _Flat as e:
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
        model_cls: type[_Req] = ChatCompletionRequest if chat else CompletionRequest
        try:
            data = json.loads(body)
            req = model_cls.model_validate(data)
        except (ValidationError, ValueError) as e:
            await send_json(send, 400, {"error": str(e)})
            return
        o = self.engine.options
        if isinstance(req, ChatCompletionRequest):
            try:
                prompt = self.engine.tokenizer.render_chat(req.messages)
            except ValueError as e:
                raise _Flat(400, str(e)) from None
            max_tokens = req.max_completion_tokens or req.max_tokens
        else:
            assert isinstance(req, CompletionRequest)
            p = req.prompt
            prompt = self.engine.tokenizer.encode(p) if isinstance(p, str) else list(p)
            if any(not 0 <= t < self.engine.tokenizer.vocab_size for t in prompt):
                raise _Flat(400, "Token id out of vocabulary range.")
            max_tokens = req.max_tokens
        if not prompt:
            raise _Flat(400, "The prompt must not be empty.")
        if len(prompt) >= o.max_model_len:
            raise _Flat(
                400,
                f"The sum of prompt length ({len(prompt)}) and query length (1) "
                f"should not exceed max_num_tokens ({o.max_model_len})",
            )
        room = o.max_model_len - len(prompt)
        stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
        gen = GenRequest(
            request_id=self.engine.internal_id(uuid.uuid4().hex[:16]),
            prompt_token_ids=tuple(prompt),
            max_tokens=min(max_tokens, room) if max_tokens else min(room, 2048),
            priority=req.priority if req.priority is not None else DEFAULT_PRIORITY,
            ignore_eos=req.ignore_eos,
            stop=stop,
            seed=req.seed or 0,
        )
        rid = ("chatcmpl-" if chat else "cmpl-") + gen.request_id.rsplit("#", 1)[0]
        model_name = req.model or o.model_name
        try:
            run = generate(self.engine, gen)
        except ValueError as e:
            raise _Flat(400, str(e)) from None
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
            raise _Flat(500, "Request aborted.", "InternalServerError")
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
