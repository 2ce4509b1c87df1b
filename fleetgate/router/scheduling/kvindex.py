"""The exact prefix view: which engine holds which KV blocks, from the engines' own events.

Keys are the router's own, computed from token ids, never the engines' hashes: vLLM
hashes blocks with sha256 (or builtin ``hash``) over its own extra keys, TensorRT-LLM
with its own function, and the emulator with another; but every engine's
``BlockStored`` carries the blocks' token ids. So a block's key is a chain hash of
token ids (:func:`block_keys`), the same function the router applies to a request's
prompt tokens, whatever engine published the block. Each endpoint keeps a map from
its engine's hash to the router key, which is how a ``BlockRemoved`` (hashes only)
finds its entries.

Block size is part of the key (a block of 16 tokens and one of 32 never share a
key), so engines with different block sizes share one index.

Bounded (:class:`KvIndex` ``max_blocks``): past the bound the index evicts, from the
endpoint that holds the most entries, its least recently stored or matched ones. An
evicted entry only makes the view a subset of the truth (a block the engine still
holds is not matched; never the other way round). Memory per entry is measured by
``python -m fleetgate_tools.bench.kvindex_memory`` (docs/router.md).

Pure: no I/O, no clock. The subscriber (``fleetgate.router.kvfeed``) feeds it from
the event loop.
"""

from __future__ import annotations

import array
import hashlib
from collections.abc import Callable, Sequence
from itertools import islice
from typing import Literal

from fleetgate.engines.base import (
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    KvEventBatch,
)
from fleetgate.router.scheduling.kvpending import PendingBlocks
from fleetgate.router.scheduling.types import EndpointId

_ROOT = b"fg-kv-root"


def chain_salt(lora_name: str | None, cache_salt: str | None) -> str | None:
    """The one salt of a chain's root from what the engine hashes into its first block
    besides the tokens: a LoRA adapter's name and a request's cache salt (vLLM puts
    both in the first block's extra keys). The request side and the event side both
    salt through here, so they agree."""
    if cache_salt is None:
        return lora_name
    # vLLM forbids NUL in a cache salt, so the separator cannot be forged
    return f"{lora_name or ''}\0cache_salt={cache_salt}"


def _root(block_size: int, salt: str | None) -> bytes:
    seed = _ROOT + block_size.to_bytes(4, "big") + (salt or "").encode()
    return hashlib.blake2b(seed, digest_size=8).digest()


def _step(parent: bytes, tokens: bytes) -> bytes:
    """The next chain key from the parent's and one block's token ids (uint64 bytes)."""
    return hashlib.blake2b(parent + tokens, digest_size=8).digest()


def block_keys(
    token_ids: Sequence[int], block_size: int, *, salt: str | None = None
) -> tuple[int, ...]:
    """Chain keys of every FULL ``block_size`` block of ``token_ids``.

    ``key[i]`` names the whole prefix ``token_ids[: (i + 1) * block_size]``; ``salt``
    separates namespaces that must never match (a LoRA adapter's blocks, say).
    """
    out: list[int] = []
    prev = _root(block_size, salt)
    # one conversion of the whole prompt, then a byte slice per block (the same bytes
    # as _step's per-block array: 30% less CPU at 16k tokens)
    data = array.array("Q", token_ids).tobytes()
    width = block_size * 8
    for start in range(0, len(token_ids) // block_size * width, width):
        prev = _step(prev, data[start : start + width])
        out.append(int.from_bytes(prev, "big"))
    return tuple(out)


def _next_key(
    parent_key: int | None, tokens: Sequence[int], block_size: int, salt: str | None
) -> int:
    parent = _root(block_size, salt) if parent_key is None else parent_key.to_bytes(8, "big")
    return int.from_bytes(_step(parent, array.array("Q", tokens).tobytes()), "big")


DEFAULT_MAX_BLOCKS = 2_000_000
"""Default bound on (endpoint, block) entries. An entry costs ~200 bytes (measured,
docs/router.md), so 2 million is ~380 MiB, within the chart's 1 GiB router limit; it
covers ~65 engines of 30k GPU blocks (an 80 GB card serving an 8B model at block
size 16). Set ``kv_events.max_blocks`` to the fleet's total GPU blocks or more."""


#: One KV cache: an endpoint's attention-data-parallel rank (0 when it has one cache).
Holder = tuple[EndpointId, int]
RankChoice = Literal["load", "cache"]
_ONE_RANK: tuple[int, RankChoice] = (1, "load")


class KvIndex:
    """Per KV cache: block key -> engine hash and back, fed by KV events, queried per request.

    A cache is a *holder*: an endpoint, or one attention-data-parallel rank of it (an
    engine whose ranks each keep their own KV cache and publish their own events,
    :meth:`set_ranks`). Each holder has two dicts: ``_order`` (router key -> engine
    hash, in recency order: the first entry is the least recently stored or matched)
    and ``_by_engine_hash`` (engine hash -> router key, for ``BlockRemoved`` and parent
    lookups). Nothing is shared between holders, so :meth:`match` is one dict lookup
    per key and rank and :meth:`clear` drops two dicts per rank.

    An endpoint with several ranks is matched as the engine will serve it: the router
    picks the endpoint, the engine picks the rank. ``load`` (the engine balances ranks
    by load alone, TensorRT-LLM's default): the prefix a request can expect is the
    mean of the ranks' chains; ``cache`` (the engine places a request on the rank with
    its prefix): the longest chain.

    Bound: at most ``max_blocks`` entries over all holders. When a store goes past
    it, entries are evicted from the holder with the most (fair: the biggest
    holder pays, a small engine keeps its view), oldest first, down to
    ``max_blocks - max_blocks // 256`` so evictions come in batches. Recency: a store
    puts the new blocks, then their parent, at the young end (a parent outlives its
    children); once the index is over half full, a match moves the matched run there
    deepest first (the root youngest).
    An evicted block's descendants stay but cannot match past it (a chain stops at
    the first gap), and a later ``BlockStored`` whose parent was evicted is dropped,
    so eviction only ever under-reports.

    One key under two engine hashes in one holder (the engine hashed something the
    router key does not see, e.g. a cache salt): the newer hash wins and the older
    one's later ``BlockRemoved`` is ignored; removing the newer removes the key
    (under-reporting again, never over).

    Not thread-safe: one router process, its event loop.
    """

    def __init__(
        self, max_blocks: int = DEFAULT_MAX_BLOCKS, *, pending: PendingBlocks | None = None
    ) -> None:
        if max_blocks < 1:
            raise ValueError(f"max_blocks must be >= 1, not {max_blocks}")
        self.max_blocks = max_blocks
        self.pending = pending
        """The router's own placements not confirmed by an event yet (None: no overlay);
        :meth:`match_believed` counts them, :meth:`match` never does."""
        self._low_water = max_blocks - max_blocks // 256
        self._touch_from = max_blocks // 2
        self._order: dict[Holder, dict[int, BlockHash]] = {}
        self._by_engine_hash: dict[Holder, dict[BlockHash, int]] = {}
        self._ranks: dict[EndpointId, tuple[int, RankChoice]] = {}
        self._total = 0
        self.evicted = 0
        """Entries evicted by the bound since the index was built (a counter)."""

    # ------------------------------------------------------------------ feed

    def set_ranks(self, endpoint: EndpointId, ranks: int, choice: RankChoice = "load") -> None:
        """``endpoint`` keeps ``ranks`` KV caches (attention-DP ranks), each fed by its own
        stream (:meth:`apply` with ``rank``); ``choice``: how the engine picks one."""
        if ranks < 1:
            raise ValueError(f"ranks must be >= 1, not {ranks}")
        for holder in [h for h in self._order if h[0] == endpoint and h[1] >= ranks]:
            self._drop(holder)
        if ranks == 1:
            self._ranks.pop(endpoint, None)
        else:
            self._ranks[endpoint] = (ranks, choice)

    def ranks(self, endpoint: EndpointId) -> int:
        """How many KV caches ``endpoint`` has (1 unless :meth:`set_ranks` said more)."""
        return self._ranks.get(endpoint, _ONE_RANK)[0]

    def apply(self, endpoint: EndpointId, batch: KvEventBatch, rank: int = 0) -> None:
        """Apply one decoded batch of the events of ``endpoint``'s rank ``rank``, in order."""
        holder = (endpoint, rank)
        for event in batch.events:
            if isinstance(event, BlockStored):
                self._stored(holder, event)
            elif isinstance(event, BlockRemoved):
                self._removed(holder, event)
            elif isinstance(event, AllBlocksCleared):
                if event.medium in (None, "GPU", "gpu"):
                    self._drop(holder)
        if self._total > self.max_blocks:
            self._evict(self._total - self._low_water)

    def _stored(self, holder: Holder, event: BlockStored) -> None:
        if event.medium not in (None, "GPU", "gpu"):
            return
        if event.spec_kind not in (None, "full_attention"):
            return
        size = event.block_size
        if size <= 0 or len(event.token_ids) < size * len(event.block_hashes):
            return  # a partial block: never matched
        hashes = self._by_engine_hash.get(holder)
        order = self._order.get(holder)
        if hashes is None or order is None:
            hashes = self._by_engine_hash[holder] = {}
            order = self._order[holder] = {}
        parent: int | None = None
        if event.parent_hash is not None:
            parent = hashes.get(event.parent_hash)
            if parent is None:
                return  # the parent was never seen (or evicted): the chain cannot be keyed
        added = 0
        new_keys: list[int] = []
        tokens = event.token_ids
        key = parent
        salt = chain_salt(event.lora_name, event.cache_salt)
        for i, engine_hash in enumerate(event.block_hashes):
            key = _next_key(key, tokens[i * size : (i + 1) * size], size, salt)
            old_key = hashes.get(engine_hash)
            if old_key is not None and old_key != key:
                # the engine reused a hash for other tokens: the old entry is gone
                if order.get(old_key) == engine_hash:
                    del order[old_key]
                    added -= 1
            old_hash = order.pop(key, None)
            if old_hash is None:
                added += 1
            elif old_hash != engine_hash:
                hashes.pop(old_hash, None)  # one key, two hashes: the newer wins
            hashes[engine_hash] = key
            order[key] = engine_hash
            new_keys.append(key)
        if self.pending is not None:
            for k in new_keys:
                self.pending.confirm(holder[0], k)
        # recency: the deepest block oldest, the parent youngest
        for k in reversed(new_keys[:-1]):
            order[k] = order.pop(k)
        if parent is not None and parent in order:
            order[parent] = order.pop(parent)
        self._total += added

    def _removed(self, holder: Holder, event: BlockRemoved) -> None:
        if event.medium not in (None, "GPU", "gpu"):
            return
        hashes = self._by_engine_hash.get(holder)
        if not hashes:
            return
        order = self._order[holder]
        for engine_hash in event.block_hashes:
            key = hashes.pop(engine_hash, None)
            if key is not None and order.get(key) == engine_hash:
                del order[key]
                self._total -= 1

    def _drop(self, holder: Holder) -> None:
        self._by_engine_hash.pop(holder, None)
        order = self._order.pop(holder, None)
        if order:
            self._total -= len(order)

    def clear(self, endpoint: EndpointId, rank: int | None = None) -> None:
        """Forget everything ``endpoint`` held, its rank count too (it left), or only what
        its rank ``rank`` held (that rank's stream restarted, or cannot be trusted)."""
        if rank is not None:
            self._drop((endpoint, rank))
            if self.ranks(endpoint) > 1:
                return  # the router's own placements cannot be told apart by rank
        else:
            for holder in [h for h in self._order if h[0] == endpoint]:
                self._drop(holder)
            self._ranks.pop(endpoint, None)
        if self.pending is not None:
            self.pending.clear(endpoint)

    def _evict(self, count: int) -> None:
        """Evict ``count`` entries, always from the holder with the most."""
        batch = max(1, self.max_blocks // 1024)
        while count > 0:
            holder = max(self._order, key=lambda h: len(self._order[h]))
            order = self._order[holder]
            if not order:
                return
            hashes = self._by_engine_hash[holder]
            victims = list(islice(order.items(), min(count, batch)))
            for key, engine_hash in victims:
                del order[key]
                hashes.pop(engine_hash, None)
            n = len(victims)
            self._total -= n
            self.evicted += n
            count -= n

    # ----------------------------------------------------------------- query

    def _holders(self, endpoint: EndpointId) -> list[Holder]:
        return [(endpoint, r) for r in range(self.ranks(endpoint))]

    def blocks(self, endpoint: EndpointId) -> int:
        """Blocks ``endpoint`` is known to hold (over all its ranks)."""
        return sum(len(self._order.get(h, ())) for h in self._holders(endpoint))

    def match(self, endpoint: EndpointId, keys: Sequence[int]) -> int:
        """Leading blocks of ``keys`` resident on ``endpoint`` (a chain: stop at the first
        gap); with several ranks, what the engine's rank choice can expect (class doc).

        Once the index is over half its bound, the matched run becomes the most
        recently used (deepest first, so the root is the youngest and eviction takes
        leaves before the prefixes they extend). Below that, eviction is not near and
        the move would cost ~8x the lookups (measured: 11 us against 1.4 us for 32
        keys), so order is store order until then.
        """
        ranks, choice = self._ranks.get(endpoint, _ONE_RANK)
        if ranks == 1:
            return self._match((endpoint, 0), keys)
        counts = [self._match((endpoint, r), keys) for r in range(ranks)]
        return max(counts) if choice == "cache" else sum(counts) // ranks

    def _match(self, holder: Holder, keys: Sequence[int]) -> int:
        order = self._order.get(holder)
        if not order:
            return 0
        n = 0
        for key in keys:
            if key not in order:
                break
            n += 1
        if n and self._total > self._touch_from:
            pop = order.pop
            for i in range(n - 1, -1, -1):
                key = keys[i]
                order[key] = pop(key)
        return n

    def _resident(self, endpoint: EndpointId) -> Callable[[int], bool]:
        """Whether a key is resident on some rank of ``endpoint``."""
        orders = [o for h in self._holders(endpoint) if (o := self._order.get(h))]
        if len(orders) == 1:
            return orders[0].__contains__
        return lambda key: any(key in o for o in orders)

    def match_believed(self, endpoint: EndpointId, keys: Sequence[int]) -> int:
        """Leading blocks of ``keys`` resident on ``endpoint`` OR pending there (placed by
        this router, not confirmed yet: :class:`PendingBlocks`); a chain of the two
        (with several ranks: from :meth:`match` on, a key resident on any rank or
        pending extends it, since the router cannot tell which rank a placement went to)."""
        n = self.match(endpoint, keys)
        if self.pending is None or n >= len(keys):
            return n
        pending = self.pending.pending_on(endpoint)
        if pending is None:
            return n
        resident = self._resident(endpoint)
        for key in keys[n:]:
            if not resident(key) and not pending(key):
                break
            n += 1
        return n

    def place(self, endpoint: EndpointId, keys: Sequence[int]) -> tuple[int, ...]:
        """This router sent a prompt with ``keys`` to ``endpoint``: the ones not resident
        become pending (:meth:`PendingBlocks.place`). Returns the keys to settle."""
        if self.pending is None or not keys:
            return ()
        return self.pending.place(endpoint, keys, self._resident(endpoint))

    def settle(self, endpoint: EndpointId, keys: Sequence[int]) -> None:
        """The prefill of a placement (:meth:`place`) is over."""
        if self.pending is not None and keys:
            self.pending.settle(endpoint, keys)

    def engine_hashes(self, endpoint: EndpointId, rank: int | None = None) -> frozenset[BlockHash]:
        """The engine's own hashes of the blocks ``endpoint`` (or its rank ``rank``) is
        known to hold (debugging, tests: compare with what the engine says it caches)."""
        holders = self._holders(endpoint) if rank is None else [(endpoint, rank)]
        out: set[BlockHash] = set()
        for h in holders:
            out.update(self._by_engine_hash.get(h, ()))
        return frozenset(out)

    def endpoints(self) -> list[EndpointId]:
        """Endpoints with at least one entry."""
        return list(dict.fromkeys(h[0] for h, order in self._order.items() if order))

    def __len__(self) -> int:
        """Entries over all holders ((holder, block) pairs: what ``max_blocks`` bounds)."""
        return self._total
