"""TensorRT-LLM's KV cache: 32-token blocks with block reuse.

Same data structure as vLLM's pool (``kv_vllm.BlockPool``: refcounts, chained
hashes over full blocks, an LRU free queue whose idle cached blocks stay
reusable until evicted) with TensorRT-LLM's accounting (its ``KvCacheConfig`` and
the ``kvCacheStats`` of trtllm-serve's ``/metrics``):

* ``KvCacheConfig.tokens_per_block`` defaults to **32**; ``enable_block_reuse``
  defaults to True.
* There is **no null block**: ``kvCacheStats`` reports ``maxNumBlocks``,
  ``freeNumBlocks``, ``usedNumBlocks`` and the utilisation gauge is
  ``usedNumBlocks / maxNumBlocks`` (``trtllm_kv_cache_utilization``).
* Reuse is counted in **blocks**: ``reusedBlocks`` (matched from the cache)
  and ``missedBlocks`` (allocated fresh for a context), ``cacheHitRate =
  reused / (reused + missed)``. The engine-neutral token counters are kept
  too (``queries`` = context tokens looked up, ``hits`` = reused blocks x 32).

Simplification (documented, deliberate): only whole blocks are reused;
TensorRT-LLM's ``enable_partial_reuse`` (copying a partially matching block)
is not modelled.
"""

from __future__ import annotations

from fleetgate.sim.core.kv_vllm import BlockPool

DEFAULT_BLOCK_SIZE = 32


class TrtllmBlockPool(BlockPool):
    """Block pool without a null block, with block-level reuse counters."""

    null_block = False

    def usage(self) -> float:
        """``usedNumBlocks / maxNumBlocks``."""
        return self.num_used / self.num_blocks

    def record_context(self, num_tokens: int, num_reused: int) -> None:
        """Count one context admission: reused vs freshly allocated prompt blocks."""
        prompt_blocks = -(-num_tokens // self.block_size)
        self.reused_blocks += num_reused
        self.missed_blocks += prompt_blocks - num_reused
        self.record_lookup(num_tokens, num_reused)

    def hit_rate(self) -> float:
        """``cacheHitRate``; 0 before any context was scheduled."""
        total = self.reused_blocks + self.missed_blocks
        return self.reused_blocks / total if total else 0.0
