"""TensorRT-LLM attention data parallelism: one replica of several ranks (pure).

Facts, read in TensorRT-LLM's source through the code index (the PyTorch executor's
attention-DP router module, ``AttentionDpConfig`` in ``llmapi/llm_args.py``, the C++
``KVCacheEventManager``); not checked against a running engine (no GPU here):

* with ``enable_attention_dp`` each of the ``tp_size`` GPUs is a rank with its own
  requests, its own scheduler limits (``max_batch_size``, ``max_num_tokens``) and its
  own KV cache, which publishes its own events;
* the ranks run every iteration together (the MoE layers exchange tokens between
  them; a rank without work runs a dummy request), so an iteration lasts as long as
  the slowest rank's;
* every new request goes to one rank. ``DefaultADPRouter``: the rank with the fewest
  active prompt tokens, then the fewest active requests. With
  ``attention_dp_config.enable_kv_cache_aware_routing`` (``KVCacheAwareADPRouter``):
  the lowest ``(prompt tokens - the rank's cached prefix) + beta x load``, ``load`` the
  rank's share of all active prompt tokens times the request's prompt tokens, ``beta``
  ``kv_cache_routing_load_balance_weight`` (1.0).

Not modelled: the per-rank fair-share cap on new requests, the cache-aware router's
match-rate threshold and cold-start warm-up, ``enable_balance``'s batching waits.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from fleetgate.sim.core.api import EngineStats, SimRequest, StepResult
from fleetgate.sim.core.kv_vllm import extend_block_hashes, root_hash
from fleetgate.sim.core.sched_trtllm import TrtllmEngine

__all__ = ["AttentionDpModel"]


class AttentionDpModel:
    """An :class:`~fleetgate.sim.core.api.EngineModel` of ``len(ranks)`` ranks."""

    def __init__(
        self,
        ranks: Sequence[TrtllmEngine],
        *,
        cache_aware: bool = False,
        load_weight: float = 1.0,
    ) -> None:
        if not ranks:
            raise ValueError("attention DP needs at least one rank")
        self.ranks = list(ranks)
        self.block_size = self.ranks[0].block_size
        self.max_model_len = self.ranks[0].max_model_len
        self.config = self.ranks[0].config
        self.cache_aware = cache_aware
        self.load_weight = load_weight
        self._placed: dict[str, tuple[int, int]] = {}
        """request id -> (rank, prompt tokens) while active."""
        self._tokens = [0] * len(self.ranks)
        self._requests = [0] * len(self.ranks)
        self.placements = [0] * len(self.ranks)
        """Requests placed on each rank so far (a counter, for tests and metrics)."""
        self._iterations = 0
        self._last_duration = 0.0
        self._last_new = [0] * len(self.ranks)

    @property
    def pools(self) -> list[object]:
        """Each rank's block pool (its own KV cache and event list), in rank order."""
        return [r.pool for r in self.ranks]

    # -- the rank choice ---------------------------------------------------------
    def choose(self, request: SimRequest) -> int:
        """The rank the engine gives ``request`` (module docstring)."""
        if not self.cache_aware:
            return min(range(len(self.ranks)), key=lambda r: (self._tokens[r], self._requests[r]))
        n = len(request.prompt_token_ids)
        hashes: list[int] = []
        extend_block_hashes(
            hashes,
            request.prompt_token_ids,
            self.block_size,
            root=root_hash(request.lora_name, request.cache_salt),
        )
        total = sum(self._tokens)
        best, best_score = 0, float("inf")
        for r, rank in enumerate(self.ranks):
            cached = len(rank.pool.lookup(hashes, n)) * self.block_size
            load = self._tokens[r] / max(total, n) * n
            score = (n - cached) + self.load_weight * load
            if score < best_score:
                best, best_score = r, score
        return best

    # -- EngineModel ---------------------------------------------------------------
    def add_request(self, request: SimRequest) -> None:
        r = self.choose(request)
        self.ranks[r].add_request(request)  # may refuse it: then nothing is recorded
        n = len(request.prompt_token_ids)
        self._placed[request.request_id] = (r, n)
        self._tokens[r] += n
        self._requests[r] += 1
        self.placements[r] += 1

    def _release(self, request_id: str) -> int | None:
        placed = self._placed.pop(request_id, None)
        if placed is None:
            return None
        r, n = placed
        self._tokens[r] -= n
        self._requests[r] -= 1
        return r

    def abort(self, request_id: str) -> bool:
        r = self._release(request_id)
        return r is not None and self.ranks[r].abort(request_id)

    def has_work(self) -> bool:
        return any(r.has_work() for r in self.ranks)

    def reset_prefix_cache(self) -> bool:
        return all([r.reset_prefix_cache() for r in self.ranks])

    def step(self, now: float) -> StepResult:
        by_rank = [r.step(now) if r.has_work() else None for r in self.ranks]
        results = [res for res in by_rank if res is not None]
        if not results:
            return StepResult(duration=0.0, events=())
        self._last_new = [
            0 if res is None else sum(1 for e in res.events if e.first) for res in by_rank
        ]
        events = tuple(e for res in results for e in res.events)
        for e in events:
            if e.finish_reason is not None:
                self._release(e.request_id)
        duration = max(res.duration for res in results)
        self._iterations += 1
        self._last_duration = duration
        return StepResult(duration=duration, events=events)

    def rank_figures(self) -> list[tuple[EngineStats, int]]:
        """Each rank's own figures and the requests that started on it in the last
        iteration, in rank order (for main's one iteration-stats row per rank)."""
        return [(r.stats(), new) for r, new in zip(self.ranks, self._last_new, strict=True)]

    def stats(self) -> EngineStats:
        """The replica's figures as TensorRT-LLM reports them with attention DP: rank 0's
        executor fills the iteration stats (on main every rank's row copies its scalars
        and KV figures, ``adp_iter_stats.py``), so the active requests, the limit and the
        KV blocks are rank 0's; the waiting requests (the engine's queue, on rank 0,
        holds every rank's) and the cumulative counters are summed over the ranks (the
        engine's counters are rank 0's: the sums keep the emulator's own hit rates the
        replica's). Iterations: the replica's lockstep ones."""
        each = [r.stats() for r in self.ranks]
        summed = ("waiting", "paused", "prefix_query_tokens", "prefix_hit_tokens",
                  "reused_blocks", "missed_blocks", "preemptions", "prompt_tokens",
                  "generation_tokens")  # fmt: skip
        return dataclasses.replace(
            each[0],
            **{name: sum(getattr(s, name) for s in each) for name in summed},
            block_size=self.block_size,
            iterations=self._iterations,
            last_step_duration=self._last_duration,
        )
