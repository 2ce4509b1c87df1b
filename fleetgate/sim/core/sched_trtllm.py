"""A model of TensorRT-LLM's in-flight batching scheduler.

Facts used (TensorRT-LLM's ``llmapi/llm_args.py`` and its "Useful Runtime Options" docs):

* The **capacity scheduler** decides which requests may hold KV:

  - ``GUARANTEED_NO_EVICT`` (the default) "guarantee[s] that a started request
    is never paused": a request is admitted only if
    ``ceil(min(prompt + max_tokens, max_model_len) / tokens_per_block)``
    blocks can be *reserved* on top of what running requests may still claim
    (Dynamo's mocker models it the same way). Otherwise it queues. No pauses,
    no preemption, ever - a running request that cannot get a block is a bug
    and raises ``RuntimeError``.
  - ``MAX_UTILIZATION`` admits greedily (only this step's blocks must fit) and,
    when a running request cannot get a block, **pauses the newest** running
    request: its blocks are freed (they stay reusable in the cache), its
    generated tokens are kept, and it waits in the paused list, which is
    resumed (oldest first) before any waiting request is admitted. Pauses are
    counted (``numPausedRequests`` is the current paused count; the cumulative
    count is reported in ``EngineStats.preemptions``).

* The **waiting queue** is FCFS, or under ``waiting_queue_policy=priority``
  ordered by **descending** float priority (default 0.5, the executor's
  ``kDefaultPriority``), first-come first-served among equals
  (``insertRequestInOrder`` with ``upper_bound``). Note the opposite direction
  from vLLM.
* The **micro-batch scheduler** fills at most ``max_batch_size`` requests and
  ``max_num_tokens`` tokens per iteration: generation requests first, then
  context requests (chunked only when ``enable_chunked_context``).
* **Block reuse** is counted in blocks (``kv_trtllm``); every context
  admission, including a resumed paused request, is counted.
"""

from __future__ import annotations

import random

from fleetgate.sim.core.engine_base import BaseEngine, CostModel, EngineConfig, RequestState
from fleetgate.sim.core.kv_trtllm import TrtllmBlockPool

DEFAULT_PRIORITY = 0.5


class TrtllmEngine(BaseEngine):
    """TensorRT-LLM: GUARANTEED_NO_EVICT or MAX_UTILIZATION, 32-token blocks."""

    pool: TrtllmBlockPool

    def __init__(self, config: EngineConfig, cost: CostModel, rng: random.Random) -> None:
        pool = TrtllmBlockPool(
            config.num_blocks, config.block_size, enable_caching=config.prefix_caching
        )
        super().__init__(config, pool, cost, rng)
        self.paused: list[RequestState] = []

    # -- policy hooks ------------------------------------------------------------
    def _queue_key(self, st: RequestState) -> tuple[float, float, int]:
        return (-st.req.priority, float(st.order), st.order)

    def _num_paused(self) -> int:
        return len(self.paused)

    def _drop_paused(self, st: RequestState) -> bool:
        if st in self.paused:
            self.paused.remove(st)
            return True
        return False

    @property
    def guaranteed(self) -> bool:
        return self.config.capacity_policy == "GUARANTEED_NO_EVICT"

    def _reserve(self, st: RequestState) -> int:
        return -(-st.max_total // self.block_size)

    def _pause(self, st: RequestState) -> None:
        self.running.remove(st)
        self._evict_to_recompute(st)
        self.paused.append(st)
        self.paused.sort(key=lambda r: r.order)

    # -- scheduling ----------------------------------------------------------------
    def _schedule(self) -> list[tuple[RequestState, int]]:
        budget = self.config.max_step_tokens
        scheduled: dict[str, tuple[RequestState, int]] = {}
        paused_now: set[str] = set()
        for st in list(self.running):
            if budget <= 0:
                break
            if st.request_id in paused_now:
                continue
            n = min(len(st.tokens) - st.num_computed, budget)
            while True:
                need = self._blocks_needed(st, n)
                if need <= self.pool.num_free:
                    st.blocks.extend(self.pool.allocate(need))
                    scheduled[st.request_id] = (st, n)
                    budget -= n
                    break
                if self.guaranteed:
                    raise RuntimeError(
                        f"GUARANTEED_NO_EVICT reservation broken for {st.request_id!r}"
                    )
                victim = self.running[-1]
                self._pause(victim)
                paused_now.add(victim.request_id)
                if victim.request_id in scheduled:
                    budget += scheduled.pop(victim.request_id)[1]
                if victim is st:
                    break
        if not paused_now:
            self._admit(budget, scheduled)
        return list(scheduled.values())

    def _admit(self, budget: int, scheduled: dict[str, tuple[RequestState, int]]) -> None:
        outstanding = 0
        if self.guaranteed:
            outstanding = sum(max(self._reserve(r) - len(r.blocks), 0) for r in self.running)
        while budget > 0 and len(self.running) < self.config.max_running:
            from_paused = bool(self.paused)
            st = self.paused[0] if from_paused else self.waiting.peek()
            if st is None:
                break
            hit = self._prefix_hit(st)
            hit_tokens = len(hit) * self.block_size
            n = len(st.tokens) - hit_tokens
            if n > budget:
                if not self.config.chunked_prefill:
                    break
                n = budget
            step_blocks = -(-(hit_tokens + n) // self.block_size) - len(hit)
            if self.guaranteed:
                reserve = self._reserve(st)
                if self.pool.cost_of(hit, reserve - len(hit)) > self.pool.num_free - outstanding:
                    break
                outstanding += reserve - len(hit) - step_blocks
            elif self.pool.cost_of(hit, step_blocks) > self.pool.num_free:
                break
            if from_paused:
                self.paused.pop(0)
            else:
                self.waiting.pop()
            self.pool.record_context(len(st.tokens), len(hit))
            if not st.admitted:
                st.cached_prompt_tokens = hit_tokens
            st.admitted = True
            self._take_blocks(st, hit, step_blocks)
            self.running.append(st)
            scheduled[st.request_id] = (st, n)
            budget -= n
