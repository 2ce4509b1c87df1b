"""What the vLLM and TensorRT-LLM scheduler models share.

Each engine model (``sched_vllm.VllmEngine``, ``sched_trtllm.TrtllmEngine``)
implements :class:`fleetgate.sim.core.api.EngineModel` by subclassing
:class:`BaseEngine` and writing only its *scheduling policy*
(:meth:`BaseEngine._schedule`): which requests run this iteration and how many
tokens each computes. Everything after that is common and lives here:

* request validation at ``add_request`` (:class:`PromptTooLongError` and
  friends, which the HTTP layer maps to the engine's 400 body);
* the iteration itself (:meth:`BaseEngine.step`): advance each scheduled
  request by its tokens, register newly full KV blocks in the prefix cache,
  sample one token for every request whose context is fully computed
  (``textgen``: a pure function of context + seed), finish requests on EOS,
  stop ids, ``max_tokens`` or ``max_model_len``, free their blocks, and
  charge the step's modelled time to the injected :class:`CostModel`;
* the counters behind :class:`~fleetgate.sim.core.api.EngineStats`.

Invariants: a request's ``tokens`` is ``prompt + generated``; its
``num_computed`` tokens have KV in its ``blocks`` (``len(blocks) ==
ceil(num_computed / block_size)`` after every step); a preempted request keeps
its generated tokens and recomputes them (vLLM "recompute" preemption), so the
client never sees a token twice. No clock, no I/O: ``now`` and the seeded
``random.Random`` are injected.
"""

from __future__ import annotations

import dataclasses
import heapq
import random
from collections import deque
from collections.abc import Callable
from typing import Literal, Protocol

from fleetgate.engines.base import BlockStored
from fleetgate.sim.core import textgen
from fleetgate.sim.core.api import EngineStats, SimRequest, StepResult, TokenEvent
from fleetgate.sim.core.kv_vllm import (
    MEDIUM,
    BlockPool,
    extend_block_hashes,
    external_hash,
    root_hash,
)

QueuePolicy = Literal["fcfs", "priority"]


class SimRequestError(ValueError):
    """A request the engine refuses at admission (HTTP 400 in every engine)."""

    param: str | None = None


class PromptTooLongError(SimRequestError):
    """The prompt leaves no room for even one output token within ``max_model_len``."""

    param = "input_tokens"

    def __init__(self, prompt_tokens: int, max_model_len: int) -> None:
        self.prompt_tokens = prompt_tokens
        self.max_model_len = max_model_len
        shown = min(prompt_tokens, max_model_len + 1)
        super().__init__(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"prompt contains at least {shown} input tokens, which exceeds this limit even "
            f"without any output tokens. Please reduce the length of the input prompt. "
            f"(parameter=input_tokens, value={shown})"
        )


class InvalidRequestError(SimRequestError):
    """Any other malformed request (empty prompt, bad max_tokens, reused id)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class CostModel(Protocol):
    """Modelled wall time of one iteration (see ``fleetgate.sim.core.timing``)."""

    def step_seconds(
        self, prefill_tokens: int, decode_seqs: int, kv_tokens: int, rng: random.Random
    ) -> float: ...


@dataclasses.dataclass(frozen=True, slots=True)
class EngineConfig:
    """Engine-neutral scheduler/KV settings (each engine maps its own flag names).

    vLLM: ``max_running`` = ``--max-num-seqs``, ``max_step_tokens`` =
    ``--max-num-batched-tokens``, ``queue_policy`` = ``--scheduling-policy``.
    TensorRT-LLM: ``max_running`` = ``max_batch_size``, ``max_step_tokens`` =
    ``max_num_tokens``, ``queue_policy`` = ``waiting_queue_policy``,
    ``capacity_policy`` = ``capacity_scheduler_policy``.
    """

    num_blocks: int
    block_size: int
    max_running: int
    max_step_tokens: int
    max_model_len: int
    queue_policy: QueuePolicy = "fcfs"
    prefix_caching: bool = True
    chunked_prefill: bool = True
    mean_output_tokens: float = textgen.DEFAULT_MEAN_OUTPUT_TOKENS
    capacity_policy: Literal["GUARANTEED_NO_EVICT", "MAX_UTILIZATION"] = "GUARANTEED_NO_EVICT"

    def validate(self, usable_blocks: int) -> None:
        if self.max_running < 1 or self.max_step_tokens < 1 or self.max_model_len < 2:
            raise ValueError("max_running, max_step_tokens must be >= 1 and max_model_len >= 2")
        if self.queue_policy not in ("fcfs", "priority"):
            raise ValueError(f"unknown queue policy {self.queue_policy!r}")
        if self.capacity_policy not in ("GUARANTEED_NO_EVICT", "MAX_UTILIZATION"):
            raise ValueError(f"unknown capacity policy {self.capacity_policy!r}")
        if self.max_model_len > usable_blocks * self.block_size:
            raise ValueError(
                f"max_model_len {self.max_model_len} exceeds the KV cache "
                f"({usable_blocks} blocks x {self.block_size} tokens)"
            )
        if not self.chunked_prefill and self.max_model_len > self.max_step_tokens:
            raise ValueError("without chunked prefill max_model_len must fit max_step_tokens")


@dataclasses.dataclass(slots=True, eq=False)
class RequestState:
    """One request inside an engine model (mutable; owned by the engine)."""

    req: SimRequest
    tokens: list[int]
    num_prompt: int
    max_total: int
    """Generation stops at this many tokens (prompt + output)."""
    stream: textgen.Stream
    order: int
    """Arrival order inside this engine (FCFS tie-break)."""
    num_computed: int = 0
    blocks: list[int] = dataclasses.field(default_factory=list)
    hashes: list[int] = dataclasses.field(default_factory=list)
    num_cached_blocks: int = 0
    num_generated: int = 0
    cached_prompt_tokens: int = 0
    admitted: bool = False
    num_preemptions: int = 0
    scheduled_at: float | None = None
    """Model time of the first step that scheduled this request (kept across preemption)."""

    @property
    def request_id(self) -> str:
        return self.req.request_id


class WaitingQueue:
    """FCFS deque or a priority heap ordered by an engine-specific key."""

    def __init__(
        self, policy: QueuePolicy, key: Callable[[RequestState], tuple[float, float, int]]
    ) -> None:
        self.policy = policy
        self._key = key
        self._fifo: deque[RequestState] = deque()
        self._heap: list[tuple[tuple[float, float, int], RequestState]] = []

    def __len__(self) -> int:
        return len(self._fifo) if self.policy == "fcfs" else len(self._heap)

    def add(self, st: RequestState) -> None:
        if self.policy == "fcfs":
            self._fifo.append(st)
        else:
            heapq.heappush(self._heap, (self._key(st), st))

    def prepend(self, st: RequestState) -> None:
        """Put a preempted request back: at the front (FCFS) or by key (priority)."""
        if self.policy == "fcfs":
            self._fifo.appendleft(st)
        else:
            heapq.heappush(self._heap, (self._key(st), st))

    def peek(self) -> RequestState | None:
        if self.policy == "fcfs":
            return self._fifo[0] if self._fifo else None
        return self._heap[0][1] if self._heap else None

    def pop(self) -> RequestState:
        if self.policy == "fcfs":
            return self._fifo.popleft()
        return heapq.heappop(self._heap)[1]

    def remove(self, st: RequestState) -> bool:
        if self.policy == "fcfs":
            try:
                self._fifo.remove(st)
            except ValueError:
                return False
            return True
        for i, (_, other) in enumerate(self._heap):
            if other is st:
                self._heap[i] = self._heap[-1]
                self._heap.pop()
                heapq.heapify(self._heap)
                return True
        return False


@dataclasses.dataclass(slots=True)
class Counters:
    preemptions: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    iterations: int = 0
    last_step_duration: float = 0.0


class BaseEngine:
    """Common machinery; subclasses provide ``_schedule`` and the queue key."""

    block_size: int
    max_model_len: int

    def __init__(
        self, config: EngineConfig, pool: BlockPool, cost: CostModel, rng: random.Random
    ) -> None:
        config.validate(pool.num_usable)
        self.config = config
        self.pool = pool
        self.cost = cost
        self.rng = rng
        self.block_size = config.block_size
        self.max_model_len = config.max_model_len
        self.eos_hazard = textgen.hazard_for_mean(config.mean_output_tokens)
        self.running: list[RequestState] = []
        self.waiting = WaitingQueue(config.queue_policy, self._queue_key)
        self.requests: dict[str, RequestState] = {}
        self.counters = Counters()
        self._order = 0

    # -- policy hooks ----------------------------------------------------------
    def _queue_key(self, st: RequestState) -> tuple[float, float, int]:
        raise NotImplementedError

    def _schedule(self) -> list[tuple[RequestState, int]]:
        """Pick this iteration's (request, tokens to compute) pairs, allocating blocks."""
        raise NotImplementedError

    def _num_paused(self) -> int:
        return 0

    def _drop_paused(self, st: RequestState) -> bool:
        return False

    # -- EngineModel -----------------------------------------------------------
    def add_request(self, request: SimRequest) -> None:
        if request.request_id in self.requests:
            raise InvalidRequestError(f"duplicate request id {request.request_id!r}", "request_id")
        if not request.prompt_token_ids:
            raise InvalidRequestError("the prompt is empty", "prompt")
        if request.max_tokens < 1:
            raise InvalidRequestError(
                f"max_tokens must be at least 1, got {request.max_tokens}.", "max_tokens"
            )
        n = len(request.prompt_token_ids)
        if n >= self.max_model_len:
            raise PromptTooLongError(n, self.max_model_len)
        tokens = list(request.prompt_token_ids)
        st = RequestState(
            req=request,
            tokens=tokens,
            num_prompt=n,
            max_total=min(n + request.max_tokens, self.max_model_len),
            stream=textgen.Stream.start(
                tokens, seed=request.seed, eos_hazard=self.eos_hazard, ignore_eos=request.ignore_eos
            ),
            order=self._order,
        )
        self._order += 1
        self.requests[request.request_id] = st
        self.waiting.add(st)

    def abort(self, request_id: str) -> bool:
        st = self.requests.pop(request_id, None)
        if st is None:
            return False
        if st in self.running:
            self.running.remove(st)
        elif not self.waiting.remove(st):
            self._drop_paused(st)
        self._free(st)
        return True

    def has_work(self) -> bool:
        return bool(self.requests)

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block (vLLM's ``/reset_prefix_cache``); False while busy."""
        return self.pool.reset()

    def stats(self) -> EngineStats:
        c = self.counters
        return EngineStats(
            running=len(self.running),
            waiting=len(self.waiting),
            paused=self._num_paused(),
            kv_usage=self.pool.usage(),
            block_size=self.block_size,
            blocks_total=self.pool.num_blocks,
            blocks_free=self.pool.num_free,
            blocks_used=self.pool.num_used,
            prefix_query_tokens=self.pool.query_tokens,
            prefix_hit_tokens=self.pool.hit_tokens,
            reused_blocks=self.pool.reused_blocks,
            missed_blocks=self.pool.missed_blocks,
            preemptions=c.preemptions,
            prompt_tokens=c.prompt_tokens,
            generation_tokens=c.generation_tokens,
            iterations=c.iterations,
            max_running=self.config.max_running,
            last_step_duration=c.last_step_duration,
        )

    def step(self, now: float) -> StepResult:
        """One iteration starting at ``now``.

        The model is otherwise time-free: ``now`` only stamps a request's first
        scheduling (``TokenEvent.scheduled_at`` on its first event), for both
        schedulers since they share this loop.
        """
        if not self.requests:
            return StepResult(duration=0.0, events=())
        scheduled = self._schedule()
        events: list[TokenEvent] = []
        prefill = decode = kv = 0
        for st, n in scheduled:
            if st.scheduled_at is None:
                st.scheduled_at = now
            if n == 1 and st.num_generated > 0 and st.num_computed == len(st.tokens) - 1:
                decode += 1
            else:
                prefill += n
            kv += st.num_computed + n
            st.num_computed += n
            self._cache_full_blocks(st)
            if st.num_computed == len(st.tokens):
                events.append(self._sample(st))
        duration = self.cost.step_seconds(prefill, decode, kv, self.rng)
        self.counters.iterations += 1
        self.counters.last_step_duration = duration
        return StepResult(duration=duration, events=tuple(events))

    # -- helpers for subclasses ------------------------------------------------
    def _blocks_needed(self, st: RequestState, num_new: int) -> int:
        total = -(-(st.num_computed + num_new) // self.block_size)
        return max(total - len(st.blocks), 0)

    def _prefix_hit(self, st: RequestState) -> list[int]:
        extend_block_hashes(
            st.hashes,
            st.tokens,
            self.block_size,
            root=root_hash(st.req.lora_name, st.req.cache_salt),
        )
        return self.pool.lookup(st.hashes, len(st.tokens))

    def _take_blocks(self, st: RequestState, hit: list[int], num_new_blocks: int) -> None:
        """Give a not-yet-running request its hit blocks plus fresh ones."""
        self.pool.acquire(hit)
        st.blocks = hit + self.pool.allocate(num_new_blocks)
        st.num_computed = len(hit) * self.block_size
        st.num_cached_blocks = len(hit)

    def _free(self, st: RequestState) -> None:
        if st.blocks:
            self.pool.release(st.blocks)
        st.blocks = []
        st.num_computed = 0
        st.num_cached_blocks = 0

    def _evict_to_recompute(self, st: RequestState) -> None:
        """Preempt by recompute: free KV, keep generated tokens."""
        self._free(st)
        st.num_preemptions += 1
        self.counters.preemptions += 1

    def _cache_full_blocks(self, st: RequestState) -> None:
        full = st.num_computed // self.block_size
        if full <= st.num_cached_blocks:
            return
        extend_block_hashes(
            st.hashes,
            st.tokens,
            self.block_size,
            upto=st.num_computed,
            root=root_hash(st.req.lora_name, st.req.cache_salt),
        )
        for i in range(st.num_cached_blocks, full):
            self.pool.cache(st.blocks[i], st.hashes[i])
        if self.pool.kv_events is not None and self.pool.enable_caching:
            # vLLM's cache_full_blocks: one BlockStored per request and step for all its
            # newly full blocks, chained to the last block cached before them.
            first, bs = st.num_cached_blocks, self.block_size
            self.pool.kv_events.append(
                BlockStored(
                    block_hashes=tuple(external_hash(h) for h in st.hashes[first:full]),
                    parent_hash=external_hash(st.hashes[first - 1]) if first else None,
                    token_ids=tuple(st.tokens[first * bs : full * bs]),
                    block_size=bs,
                    medium=MEDIUM,
                    lora_name=st.req.lora_name,
                    group=0,
                    spec_kind="full_attention",
                    cache_salt=None if first else st.req.cache_salt,
                )
            )
        st.num_cached_blocks = full

    def _sample(self, st: RequestState) -> TokenEvent:
        token = st.stream.next_token()
        st.tokens.append(token)
        st.num_generated += 1
        first = st.num_generated == 1
        if first:
            self.counters.prompt_tokens += st.num_prompt
        self.counters.generation_tokens += 1
        reason = textgen.finish_reason(
            token,
            st.num_generated,
            st.req.max_tokens,
            ignore_eos=st.req.ignore_eos,
            stop_token_ids=st.req.stop_token_ids,
        )
        if reason is None and len(st.tokens) >= st.max_total:
            reason = "length"
        if reason is not None:
            self.running.remove(st)
            del self.requests[st.request_id]
            self._free(st)
        return TokenEvent(
            request_id=st.request_id,
            token_ids=(token,),
            finish_reason="stop" if reason == "stop" else "length" if reason else None,
            cached_prompt_tokens=st.cached_prompt_tokens if first else 0,
            first=first,
            scheduled_at=st.scheduled_at if first else None,
        )
