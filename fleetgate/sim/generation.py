"""One emulated engine as the HTTP layers see it, and the per-request token stream.

:class:`SimEngine` bundles what an engine's HTTP app needs: its options, the
shared tokenizer, the :class:`~fleetgate.sim.driver.EngineDriver` running its
model, and a :class:`RequestObserver` (the engine's metrics) that is told about
each request's life: admitted, first token, tokens, finished or aborted.

:func:`generate` turns the driver's :class:`~fleetgate.sim.core.api.TokenEvent`
queue into :class:`Delta` items (token ids, their text, finish info), applying
``stop`` strings on the text like vLLM (text that may begin a stop string is
held back; the matched stop string is cut from the output,
``finish_reason="stop"``, ``stop_reason=<the string>``) and aborting the request
in the model the moment the consumer goes away (client disconnect -> the handler
is cancelled -> :meth:`Generation.close` -> ``driver.abort`` frees its KV).

A request with ``n`` choices is ``n`` independent generations (vLLM fans ``n``
out into child requests the same way); :func:`merge` interleaves their deltas
in arrival order, tagged with the choice index, for one response stream.

Invariant: a request is reported to the observer exactly once as finished
(``stop``/``length``) or as aborted, never both; an abort by the client is not a
``finished_reason="abort"`` success (vLLM does not count it, fixture README
quirk 5), the observer decides what to do with it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from collections.abc import AsyncGenerator, Sequence
from typing import Literal, Protocol

from fleetgate.sim.core.api import FinishReason, SimRequest
from fleetgate.sim.driver import EngineDriver

__all__ = [
    "Delta",
    "Generation",
    "EngineOptions",
    "GenRequest",
    "RequestObserver",
    "SimEngine",
    "Tokenizer",
    "generate",
    "merge",
]

EngineKind = Literal["vllm", "trtllm"]


class Tokenizer(Protocol):
    """The part of the shared emulator tokenizer the HTTP layer uses."""

    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: Sequence[int]) -> str: ...

    def render_chat(
        self, messages: Sequence[dict[str, object]], add_generation_prompt: bool = True
    ) -> list[int]: ...


@dataclasses.dataclass(frozen=True, slots=True)
class EngineOptions:
    """Per-engine, engine-neutral server options."""

    kind: EngineKind
    model_name: str
    model_root: str
    max_model_len: int
    block_size: int
    num_gpu_blocks: int
    max_num_seqs: int
    enable_prompt_tokens_details: bool = True
    max_num_queued_reqs: int | None = None
    """vLLM ``--max-num-queued-reqs``: beyond it new requests get 503 (off by default)."""
    """vLLM ``--enable-prompt-tokens-details`` (the operator turns it on); off gives the
    fixtures' ``prompt_tokens_details: null``."""
    version: str = ""
    system_fingerprint: str = ""
    engine_index: str = "0"
    num_gpu_blocks_override: int | None = None
    """vLLM ``--num-gpu-blocks-override``: set when the KV block count was given
    explicitly (not derived from the profile); shown in ``vllm:cache_config_info``."""
    prefix_caching: bool = True
    user_specified_block_size: bool = False
    lora_modules: tuple[str, ...] = ()
    """vLLM ``--lora-modules``: adapter model names served beside ``model_name``."""


@dataclasses.dataclass(frozen=True, slots=True)
class GenRequest:
    """A validated generation request, in the engine's own priority convention."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    priority: float = 0.0
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    seed: int = 0
    lora_name: str | None = None
    """The LoRA adapter the request names (vLLM: its ``model``), None for the base model."""
    cache_salt: str | None = None
    """vLLM's ``cache_salt``: the request's blocks hash apart from unsalted ones."""


@dataclasses.dataclass(frozen=True, slots=True)
class Delta:
    token_ids: tuple[int, ...]
    text: str
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    cached_prompt_tokens: int = 0
    first: bool = False


class RequestObserver(Protocol):
    """Per-request lifecycle hooks (times are model time, seconds)."""

    def on_admit(self, request: GenRequest, now: float) -> None: ...

    def on_tokens(
        self,
        request: GenRequest,
        count: int,
        now: float,
        first: bool,
        cached: int,
        scheduled_at: float | None = None,
    ) -> None:
        """``scheduled_at``: model time the request was first scheduled (first event)."""
        ...

    def on_finish(
        self, request: GenRequest, reason: FinishReason, completion_tokens: int, now: float
    ) -> None: ...

    def on_abort(self, request: GenRequest, completion_tokens: int, now: float) -> None: ...


class SimEngine:
    """Everything one emulated engine's HTTP app needs."""

    def __init__(
        self,
        options: EngineOptions,
        tokenizer: Tokenizer,
        driver: EngineDriver,
        observer: RequestObserver,
    ) -> None:
        self.options = options
        self.tokenizer = tokenizer
        self.driver = driver
        self.observer = observer
        self._ids = itertools.count()

    def internal_id(self, external: str) -> str:
        """A unique engine-side id (external ids such as X-Request-Id may repeat)."""
        return f"{external}#{next(self._ids)}"


class Generation:
    """A submitted request's token stream (async iterator of :class:`Delta`).

    Creating it submits the request (the model may raise ``ValueError``, e.g.
    sim-core's ``SimRequestError``, before any response byte is sent).
    :meth:`close` aborts it in the model unless it already finished; handlers
    call it in ``finally`` so a disconnect or cancellation frees KV at once.
    """

    def __init__(self, engine: SimEngine, request: GenRequest) -> None:
        self.engine = engine
        self.request = request
        self._queue = engine.driver.submit(
            SimRequest(
                request_id=request.request_id,
                prompt_token_ids=list(request.prompt_token_ids),
                max_tokens=request.max_tokens,
                arrival_time=0.0,
                priority=request.priority,
                ignore_eos=request.ignore_eos,
                stop_token_ids=request.stop_token_ids,
                seed=request.seed,
                lora_name=request.lora_name,
                cache_salt=request.cache_salt,
            )
        )
        engine.observer.on_admit(request, engine.driver.now())
        self.done = False
        self.produced = 0
        self._text = ""
        self._emitted = 0
        self._max_stop = max((len(s) for s in request.stop), default=0)

    def __aiter__(self) -> Generation:
        return self

    async def __anext__(self) -> Delta:
        if self.done:
            raise StopAsyncIteration
        engine, request = self.engine, self.request
        event = await self._queue.get()
        now = engine.driver.now()
        self.produced += len(event.token_ids)
        if event.token_ids:
            engine.observer.on_tokens(
                request,
                len(event.token_ids),
                now,
                event.first,
                event.cached_prompt_tokens,
                event.scheduled_at,
            )
        text = engine.tokenizer.decode(event.token_ids) if event.token_ids else ""
        finish: FinishReason | None = event.finish_reason
        stop_reason: str | int | None = None
        if request.stop:
            # Text that could still be the start of a stop string is held back until
            # it is known not to be one (vLLM does the same), so a stop string that
            # spans tokens never leaks its beginning to the client.
            window_start = max(0, len(self._text) - self._max_stop + 1)
            self._text += text
            hit = _find_stop(self._text, request.stop, window_start) if text else None
            if hit is not None:
                pos, stop_reason = hit
                finish = "stop"
                engine.driver.abort(request.request_id)
                end = pos
            elif finish is not None:
                end = len(self._text)
            else:
                end = max(self._emitted, len(self._text) - self._max_stop + 1)
            text = self._text[self._emitted : end]
            self._emitted = end
        if finish == "abort":
            self.done = True
            engine.observer.on_abort(request, self.produced, now)
        elif finish is not None:
            self.done = True
            engine.observer.on_finish(request, finish, self.produced, now)
        return Delta(
            event.token_ids, text, finish, stop_reason, event.cached_prompt_tokens, event.first
        )

    def close(self) -> None:
        if not self.done:
            self.done = True
            self.engine.driver.abort(self.request.request_id)
            self.engine.observer.on_abort(self.request, self.produced, self.engine.driver.now())


def generate(engine: SimEngine, request: GenRequest) -> Generation:
    """Submit ``request`` now; iterate the result for its deltas, ``close()`` it at the end."""
    return Generation(engine, request)


async def merge(runs: Sequence[Generation]) -> AsyncGenerator[tuple[int, Delta], None]:
    """``(choice index, delta)`` from all ``runs`` as they arrive, until each ended.

    Deltas of one run keep their order; runs that are ready together come in index
    order. Use under ``contextlib.aclosing``: closing it cancels and awaits the
    pending reads (the runs themselves are closed by their owner).
    """
    if len(runs) == 1:
        async for d in runs[0]:
            yield 0, d
        return

    async def read(run: Generation) -> Delta | None:
        try:
            return await anext(run)
        except StopAsyncIteration:
            return None

    pending = {asyncio.ensure_future(read(run)): i for i, run in enumerate(runs)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for fut in sorted(done, key=lambda f: pending[f]):
                i = pending.pop(fut)
                got = fut.result()
                if got is None:
                    continue
                pending[asyncio.ensure_future(read(runs[i]))] = i
                yield i, got
    finally:
        for fut in pending:
            fut.cancel()
        await asyncio.gather(*pending, return_exceptions=True)


def _find_stop(text: str, stops: tuple[str, ...], start: int) -> tuple[int, str] | None:
    best: tuple[int, str] | None = None
    for stop in stops:
        if not stop:
            continue
        pos = text.find(stop, start)
        if pos >= 0 and (best is None or pos < best[0]):
            best = (pos, stop)
    return best
