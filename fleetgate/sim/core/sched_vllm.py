"""A model of the vLLM V1 scheduler (``vllm/v1/core/sched/scheduler.py``).

Per iteration, as that scheduler does:

1. **Running requests first**, in running order: each gets the tokens it still
   needs (1 for a decode, the rest of its prompt - or as much of it as the
   token budget ``max_num_batched_tokens`` allows - for a chunked prefill).
   If the KV pool cannot supply the blocks, a running request is **preempted
   by recompute**: victim = ``max(running, key=(priority, arrival))`` under the
   ``priority`` policy, ``running[-1]`` under ``fcfs``. Its blocks are freed,
   its computed tokens reset, it goes to the FRONT of the waiting queue and
   ``num_preemptions`` grows by one. If the victim is the request itself it
   is not scheduled this step. A victim already scheduled earlier in this
   step gives its token budget back.
2. **Then waiting requests**, only if nothing was preempted this step, while
   ``len(running) < max_num_seqs`` and budget remains: the head of the queue
   (FCFS deque, or a heap ordered by ``(priority, arrival_time, request_id)``,
   lower first) looks up its prefix-cache hit (whole blocks), computes the
   rest in one go or as a chunk, and is admitted only if its blocks fit. A
   head that does not fit blocks the queue (no skipping), as in vLLM.
   A higher-priority *waiting* request never preempts running ones.

Prefix-cache counters follow vLLM: only a request's first admission counts
(``queries += prompt tokens, hits += hit tokens``); re-admissions after a
preemption are kept out of the metric, as vLLM's ``PrefixCacheStats`` does.
"""

from __future__ import annotations

import random

from fleetgate.sim.core.engine_base import BaseEngine, CostModel, EngineConfig, RequestState
from fleetgate.sim.core.kv_vllm import BlockPool

DEFAULT_BLOCK_SIZE = 16


class VllmEngine(BaseEngine):
    """vLLM V1: recompute preemption, FCFS or (priority, arrival) scheduling."""

    def __init__(self, config: EngineConfig, cost: CostModel, rng: random.Random) -> None:
        pool = BlockPool(config.num_blocks, config.block_size, enable_caching=config.prefix_caching)
        super().__init__(config, pool, cost, rng)

    def _queue_key(self, st: RequestState) -> tuple[float, float, int]:
        # vLLM orders by (priority, arrival_time, request_id); the arrival order
        # stands in for the id so that equal timestamps stay first-come first-served.
        return (st.req.priority, st.req.arrival_time, st.order)

    def _victim(self) -> RequestState:
        if self.config.queue_policy == "priority":
            return max(self.running, key=lambda r: (r.req.priority, r.req.arrival_time, r.order))
        return self.running[-1]

    def _schedule(self) -> list[tuple[RequestState, int]]:
        budget = self.config.max_step_tokens
        scheduled: dict[str, tuple[RequestState, int]] = {}
        evicted: set[str] = set()
        for st in list(self.running):
            if budget <= 0:
                break
            if st.request_id in evicted:  # preempted earlier in this loop
                continue
            n = min(len(st.tokens) - st.num_computed, budget)
            if n <= 0:
                continue
            while True:
                need = self._blocks_needed(st, n)
                if need <= self.pool.num_free:
                    st.blocks.extend(self.pool.allocate(need))
                    scheduled[st.request_id] = (st, n)
                    budget -= n
                    break
                victim = self._victim()
                self.running.remove(victim)
                self._evict_to_recompute(victim)
                self.waiting.prepend(victim)
                evicted.add(victim.request_id)
                if victim.request_id in scheduled:
                    budget += scheduled.pop(victim.request_id)[1]
                if victim is st:
                    break
        if not evicted:
            budget = self._admit(budget, scheduled)
        return list(scheduled.values())

    def _admit(self, budget: int, scheduled: dict[str, tuple[RequestState, int]]) -> int:
        while budget > 0 and len(self.running) < self.config.max_running:
            st = self.waiting.peek()
            if st is None:
                break
            hit = self._prefix_hit(st)
            hit_tokens = len(hit) * self.block_size
            n = len(st.tokens) - hit_tokens
            if n > budget:
                if not self.config.chunked_prefill:
                    break
                n = budget
            total_blocks = -(-(hit_tokens + n) // self.block_size)
            if self.pool.cost_of(hit, total_blocks - len(hit)) > self.pool.num_free:
                break
            self.waiting.pop()
            if st.num_preemptions == 0 and not st.admitted:
                self.pool.record_lookup(len(st.tokens), len(hit))
                st.cached_prompt_tokens = hit_tokens
            st.admitted = True
            self._take_blocks(st, hit, total_blocks - len(hit))
            self.running.append(st)
            scheduled[st.request_id] = (st, n)
            budget -= n
        return budget
