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

Pure: no I/O, no clock. The subscriber (``fleetgate.router.kvfeed``) feeds it from
the event loop.
"""

from __future__ import annotations

import array
import hashlib
from collections.abc import Iterable, Sequence

from fleetgate.engines.base import (
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    KvEventBatch,
)
from fleetgate.router.scheduling.types import EndpointId

_ROOT = b"fg-kv-root"


def _root(block_size: int, salt: str | None) -> bytes:
    seed = _ROOT + block_size.to_bytes(4, "big") + (salt or "").encode()
    return hashlib.blake2b(seed, digest_size=8).digest()


def _step(parent: bytes, tokens: Sequence[int]) -> bytes:
    return hashlib.blake2b(parent + array.array("Q", tokens).tobytes(), digest_size=8).digest()


def block_keys(
    token_ids: Sequence[int], block_size: int, *, salt: str | None = None
) -> tuple[int, ...]:
    """Chain keys of every FULL ``block_size`` block of ``token_ids``.

    ``key[i]`` names the whole prefix ``token_ids[: (i + 1) * block_size]``; ``salt``
    separates namespaces that must never match (a LoRA adapter's blocks, say).
    """
    out: list[int] = []
    prev = _root(block_size, salt)
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        prev = _step(prev, token_ids[start : start + block_size])
        out.append(int.from_bytes(prev, "big"))
    return tuple(out)


def _next_key(
    parent_key: int | None, tokens: Sequence[int], block_size: int, salt: str | None
) -> int:
    parent = _root(block_size, salt) if parent_key is None else parent_key.to_bytes(8, "big")
    return int.from_bytes(_step(parent, tokens), "big")


class KvIndex:
    """Block key -> endpoints holding it, fed by KV events, queried per request.

    Not thread-safe: one router process, its event loop.
    """

    def __init__(self) -> None:
        self._holders: dict[int, set[EndpointId]] = {}
        self._by_engine_hash: dict[EndpointId, dict[BlockHash, int]] = {}

    # ------------------------------------------------------------------ feed

    def apply(self, endpoint: EndpointId, batch: KvEventBatch) -> None:
        """Apply one decoded batch of ``endpoint``'s events, in order."""
        for event in batch.events:
            if isinstance(event, BlockStored):
                self._stored(endpoint, event)
            elif isinstance(event, BlockRemoved):
                self._removed(endpoint, event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                self.clear(endpoint)

    def _stored(self, endpoint: EndpointId, event: BlockStored) -> None:
        if event.medium not in (None, "GPU", "gpu"):
            return
        if event.spec_kind not in (None, "full_attention"):
            return
        hashes = self._by_engine_hash.setdefault(endpoint, {})
        size = event.block_size
        if size <= 0 or len(event.token_ids) < size * len(event.block_hashes):
            return  # a partial block: never matched
        parent: int | None = None
        if event.parent_hash is not None:
            found = hashes.get(event.parent_hash)
            if found is None:
                return  # the parent was never seen: its chain cannot be keyed
            parent = found
        for i, engine_hash in enumerate(event.block_hashes):
            key = _next_key(
                parent, event.token_ids[i * size : (i + 1) * size], size, event.lora_name
            )
            hashes[engine_hash] = key
            self._holders.setdefault(key, set()).add(endpoint)
            parent = key

    def _removed(self, endpoint: EndpointId, engine_hashes: Iterable[BlockHash]) -> None:
        hashes = self._by_engine_hash.get(endpoint)
        if not hashes:
            return
        for engine_hash in engine_hashes:
            key = hashes.pop(engine_hash, None)
            if key is None:
                continue
            holders = self._holders.get(key)
            if holders is not None:
                holders.discard(endpoint)
                if not holders:
                    del self._holders[key]

    def clear(self, endpoint: EndpointId) -> None:
        """Forget everything ``endpoint`` held (AllBlocksCleared, an engine restart)."""
        hashes = self._by_engine_hash.pop(endpoint, None)
        if hashes:
            self._removed_keys(endpoint, hashes.values())

    def _removed_keys(self, endpoint: EndpointId, keys: Iterable[int]) -> None:
        for key in keys:
            holders = self._holders.get(key)
            if holders is not None:
                holders.discard(endpoint)
                if not holders:
                    del self._holders[key]

    # ----------------------------------------------------------------- query

    def blocks(self, endpoint: EndpointId) -> int:
        """Blocks ``endpoint`` is known to hold."""
        return len(self._by_engine_hash.get(endpoint, ()))

    def match(self, endpoint: EndpointId, keys: Sequence[int]) -> int:
        """Leading blocks of ``keys`` resident on ``endpoint`` (a chain: stop at the first gap)."""
        n = 0
        for key in keys:
            holders = self._holders.get(key)
            if holders is None or endpoint not in holders:
                break
            n += 1
        return n

    def __len__(self) -> int:
        return len(self._holders)
