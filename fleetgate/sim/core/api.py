"""The contract between the emulator's pure engine models and its HTTP layer.

An :class:`EngineModel` is a deterministic state machine with no clock of its
own: the HTTP layer's driver calls :meth:`EngineModel.step` with the current
(injected) time, sleeps for the returned ``duration`` (scaled by the time-scale
option), then delivers the tokens the step produced. Between steps it may add
or abort requests. Nothing here does I/O.

Tokens are integers from the shared emulator tokenizer
(``fleetgate.sim.core.tokenizer``), so equal text prefixes give equal block
hashes on every emulated engine and ``/tokenize`` agrees with the KV model.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, Protocol

FinishReason = Literal["stop", "length", "abort"]


@dataclasses.dataclass(slots=True)
class SimRequest:
    """One generation request as the engine model sees it."""

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    arrival_time: float
    priority: float = 0.0
    """In the ENGINE's own convention (vLLM: int, lower first; TRT: float, higher first)."""
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    seed: int = 0
    """Output is a pure function of (prompt_token_ids, seed); see ``textgen``."""
    lora_name: str | None = None
    """A LoRA adapter (vLLM): its blocks hash apart from the base model's and are
    published with this ``lora_name``."""
    cache_salt: str | None = None
    """vLLM's per-request ``cache_salt``: its first block (and so its whole chain)
    hashes apart from an unsalted request's."""


@dataclasses.dataclass(frozen=True, slots=True)
class TokenEvent:
    """Tokens a request produced in one step (usually one), or its end."""

    request_id: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason | None = None
    cached_prompt_tokens: int = 0
    """Prompt tokens served from the prefix cache (set on the first event)."""
    first: bool = False
    """True on the request's first event (time to first token ends here)."""
    scheduled_at: float | None = None
    """On the first event: the model time (the ``now`` given to :meth:`EngineModel.step`)
    of the step that first scheduled the request, i.e. where its queueing ended and
    its prefill began (vLLM's ``scheduled_ts``). ``None`` on later events and from
    models that do not track it."""


@dataclasses.dataclass(frozen=True, slots=True)
class StepResult:
    duration: float
    """Modelled wall time of this step in seconds (before time scaling)."""
    events: tuple[TokenEvent, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class EngineStats:
    """Everything the emulator's /metrics endpoints need, engine-neutral."""

    running: int
    waiting: int
    paused: int
    kv_usage: float
    block_size: int
    blocks_total: int
    blocks_free: int
    blocks_used: int
    prefix_query_tokens: int
    prefix_hit_tokens: int
    reused_blocks: int
    missed_blocks: int
    preemptions: int
    prompt_tokens: int
    generation_tokens: int
    iterations: int
    max_running: int
    last_step_duration: float


class EngineModel(Protocol):
    """A scheduler + KV cache + timing model of one engine."""

    block_size: int
    max_model_len: int

    def add_request(self, request: SimRequest) -> None: ...

    def abort(self, request_id: str) -> bool:
        """Drop a waiting or running request and free its blocks; False if unknown."""
        ...

    def has_work(self) -> bool: ...

    def step(self, now: float) -> StepResult:
        """Run one scheduler iteration starting at ``now``."""
        ...

    def stats(self) -> EngineStats: ...
