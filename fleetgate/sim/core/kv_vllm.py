"""A vLLM V1-style paged KV block pool with prefix caching.

Modelled on vLLM's ``v1/core/block_pool.py`` and ``kv_cache_utils.py`` and
checked against the recordings of a real vLLM 0.32 server (``tests/recordings.py``):

* **Block 0 is the null block** and never handed out, so a pool of ``N`` blocks
  has ``N - 1`` usable ones and ``usage = 1 - free / (N - 1)``
  (``block_pool.get_usage``).
* **Chained block hashes over full blocks only**: block ``i``'s hash is
  ``hash((hash of block i-1 or NONE_HASH, tuple(its token ids)))``. A partial
  last block is never cached or matched. Python's ``hash`` of a tuple of ints
  is not salted by ``PYTHONHASHSEED``, so hashes are stable across processes.
* **Reference counts + an LRU free queue.** A block whose refcount drops to 0
  goes to the *tail* of the free queue but keeps its hash: it is still a
  prefix-cache hit until allocation pops it from the *head* and evicts it.
  A request's blocks are freed tail-first, so the end of a prompt is evicted
  before its (more shared) beginning. Cached-but-idle blocks count as free,
  exactly as in vLLM's usage gauge.
* **Prefix lookup** returns the longest run of cached blocks matching the
  request's leading full-block hashes, capped so at least one prompt token is
  left to compute (vLLM needs the last token's logits): at most
  ``(num_tokens - 1) // block_size`` blocks. Counters are in TOKENS:
  ``queries += num_tokens``, ``hits += hit_blocks * block_size`` - the fixture
  pair A/B (377 shared tokens, 128-token blocks) shows ``hits = 256``.

* **KV-cache events** (off unless :meth:`BlockPool.enable_kv_events`): a hash that
  leaves the index at eviction is one ``BlockRemoved`` (one per hash, as vLLM's
  ``_emit_block_removed_events``), :meth:`BlockPool.reset` is ``AllBlocksCleared``;
  ``BlockStored`` needs the tokens and is added by the engine
  (``BaseEngine._cache_full_blocks``). Hashes are published as unsigned 64-bit ints,
  like vLLM's default ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``
  (:func:`external_hash`). Whoever publishes drains them with
  :meth:`BlockPool.take_kv_events` after each step.

Pure data structure: no clock, no I/O.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

from fleetgate.engines.base import AllBlocksCleared, BlockRemoved, KvEvent

#: Parent "hash" of the first block: a fixed int (a str would be salted by PYTHONHASHSEED).
NONE_HASH = 0x5F3759DF_9E3779B9


def root_hash(lora_name: str | None, cache_salt: str | None = None) -> int:
    """The parent "hash" of a sequence's first block: :data:`NONE_HASH`, or one derived
    from a LoRA adapter's name and a request's cache salt (vLLM puts the adapter's name
    in every block's extra hash keys and the salt in the first block's, so such blocks
    never match the base model's or an unsalted request's). blake2b, not ``hash()``: a
    str's ``hash`` changes with PYTHONHASHSEED."""
    if lora_name is None and cache_salt is None:
        return NONE_HASH
    seed = f"{lora_name or ''}\0{cache_salt or ''}".encode()
    salt = int.from_bytes(hashlib.blake2b(seed, digest_size=8).digest(), "big")
    return hash((NONE_HASH, salt))


def extend_block_hashes(
    hashes: list[int],
    token_ids: Sequence[int],
    block_size: int,
    upto: int | None = None,
    *,
    root: int = NONE_HASH,
) -> None:
    """Append the hashes of every newly *full* block of ``token_ids[:upto]`` to ``hashes``
    (``root``: the first block's parent, :func:`root_hash`)."""
    full = (len(token_ids) if upto is None else min(upto, len(token_ids))) // block_size
    parent = hashes[-1] if hashes else root
    for i in range(len(hashes), full):
        parent = hash((parent, tuple(token_ids[i * block_size : (i + 1) * block_size])))
        hashes.append(parent)


#: Where vLLM's GPU block pool says its blocks live (``MEDIUM_GPU``).
MEDIUM = "GPU"


def external_hash(block_hash: int) -> int:
    """A block hash as published in KV events: an unsigned 64-bit int."""
    return block_hash & 0xFFFF_FFFF_FFFF_FFFF


class BlockPool:
    """Blocks, their refcounts and hashes, the free queue and the hash index."""

    #: vLLM reserves block 0 as the null block; TensorRT-LLM's pool has none.
    null_block = True

    def __init__(self, num_blocks: int, block_size: int, *, enable_caching: bool = True) -> None:
        first = 1 if self.null_block else 0
        if num_blocks < first + 1:
            raise ValueError(f"the block pool needs at least {first + 1} blocks")
        if block_size < 1:
            raise ValueError("block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self._ref = [0] * num_blocks
        self._hash: list[int | None] = [None] * num_blocks
        self._cached: dict[int, int] = {}  # block hash -> block id
        # block id -> None, head = next to evict/allocate; the null block is never here
        self._free: OrderedDict[int, None] = OrderedDict(
            (b, None) for b in range(first, num_blocks)
        )
        self.query_tokens = 0
        self.hit_tokens = 0
        self.evictions = 0
        # TensorRT-LLM's block-level reuse accounting (kv_trtllm); vLLM leaves them 0.
        self.reused_blocks = 0
        self.missed_blocks = 0
        self.kv_events: list[KvEvent] | None = None
        """Pending KV-cache events, or None while events are off."""

    # -- KV-cache events ---------------------------------------------------------
    def enable_kv_events(self) -> None:
        if self.kv_events is None:
            self.kv_events = []

    def take_kv_events(self) -> list[KvEvent]:
        """The events since the last call, oldest first (empty while events are off)."""
        if not self.kv_events:
            return []
        events, self.kv_events = self.kv_events, []
        return events

    def reset(self) -> bool:
        """Forget every cached hash (vLLM ``reset_prefix_cache``); False while any block
        is in use, as vLLM refuses then."""
        if self.num_used:
            return False
        self._cached.clear()
        self._hash = [None] * self.num_blocks
        if self.kv_events is not None:
            self.kv_events.append(AllBlocksCleared())
        return True

    # -- gauges ------------------------------------------------------------
    @property
    def num_usable(self) -> int:
        return self.num_blocks - (1 if self.null_block else 0)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_usable - self.num_free

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def usage(self) -> float:
        """``1 - free/(total - 1)``, as vLLM's ``BlockPool.get_usage`` (``kv_cache_usage_perc``)."""
        return 1.0 - self.num_free / self.num_usable

    def ref_count(self, block_id: int) -> int:
        return self._ref[block_id]

    # -- prefix cache --------------------------------------------------------
    def lookup(self, block_hashes: Sequence[int], num_tokens: int) -> list[int]:
        """Cached block ids for the longest matching prefix (no side effects)."""
        if not self.enable_caching:
            return []
        limit = min(len(block_hashes), max(num_tokens - 1, 0) // self.block_size)
        hit: list[int] = []
        for h in block_hashes[:limit]:
            block = self._cached.get(h)
            if block is None:
                break
            hit.append(block)
        return hit

    def record_lookup(self, num_tokens: int, num_hit_blocks: int) -> None:
        """Count one prefix-cache query (in tokens, like ``vllm:prefix_cache_*``)."""
        self.query_tokens += num_tokens
        self.hit_tokens += num_hit_blocks * self.block_size

    def cost_of(self, hit_blocks: Sequence[int], num_new: int) -> int:
        """Free-queue entries consumed by acquiring ``hit_blocks`` plus ``num_new`` blocks."""
        return num_new + sum(1 for b in hit_blocks if self._ref[b] == 0)

    def acquire(self, hit_blocks: Sequence[int]) -> None:
        """Take a reference on cached blocks (removing idle ones from the free queue)."""
        for b in hit_blocks:
            if self._ref[b] == 0:
                del self._free[b]
            self._ref[b] += 1

    def allocate(self, n: int) -> list[int]:
        """Pop ``n`` blocks from the head of the free queue, evicting their hashes."""
        if n > len(self._free):
            raise RuntimeError(f"cannot allocate {n} blocks, only {len(self._free)} free")
        out: list[int] = []
        for _ in range(n):
            b, _none = self._free.popitem(last=False)
            h = self._hash[b]
            if h is not None:
                if self._cached.get(h) == b:
                    del self._cached[h]
                    self.evictions += 1
                    if self.kv_events is not None:
                        self.kv_events.append(
                            BlockRemoved((external_hash(h),), medium=MEDIUM, group=0)
                        )
                self._hash[b] = None
            self._ref[b] = 1
            out.append(b)
        return out

    def cache(self, block_id: int, block_hash: int) -> None:
        """Register a just-filled block under its hash (first writer wins)."""
        if not self.enable_caching or self._hash[block_id] is not None:
            return
        self._hash[block_id] = block_hash
        self._cached.setdefault(block_hash, block_id)

    def release(self, block_ids: Sequence[int]) -> None:
        """Drop one reference from each block; idle ones join the free queue tail-first."""
        for b in reversed(block_ids):
            if self._ref[b] <= 0:
                raise RuntimeError(f"block {b} released more often than acquired")
            self._ref[b] -= 1
            if self._ref[b] == 0:
                h = self._hash[b]
                if h is not None and self._cached.get(h) != b:
                    self._hash[b] = None  # a duplicate of a cached block: plain free block
                self._free[b] = None
