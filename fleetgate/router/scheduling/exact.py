"""A request's token ids and their exact-view block keys, computed once per block size.

Endpoints may differ in block size (16 on a GPU vLLM, 128 on the CPU build, 32 on
TensorRT-LLM); :func:`~fleetgate.router.scheduling.kvindex.block_keys` of one prompt
is computed once per block size per request and reused for every endpoint with that
size and for every later look-up (placement, reservation, the closed-loop metric).

Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Sequence

from fleetgate.router.scheduling.kvindex import KvIndex, block_keys
from fleetgate.router.scheduling.types import EndpointId


class PromptKeys:
    """One request's prompt as the engine's token ids, with block keys per block size."""

    __slots__ = ("_keys", "salt", "tokens")

    def __init__(self, token_ids: Sequence[int], *, salt: str | None = None) -> None:
        self.tokens: tuple[int, ...] = tuple(token_ids)
        self.salt = salt
        self._keys: dict[int, tuple[int, ...]] = {}

    def __len__(self) -> int:
        return len(self.tokens)

    def keys(self, block_size: int) -> tuple[int, ...]:
        """Chain keys of the prompt's whole ``block_size`` blocks (memoised)."""
        found = self._keys.get(block_size)
        if found is None:
            found = self._keys[block_size] = block_keys(self.tokens, block_size, salt=self.salt)
        return found

    def resident_tokens(
        self, index: KvIndex, endpoint: EndpointId, block_size: int, *, pending: bool = False
    ) -> int:
        """Leading prompt tokens resident on ``endpoint``: whole blocks x block size;
        ``pending``: blocks this router placed there and the engine has not confirmed
        yet count too (:meth:`KvIndex.match_believed`)."""
        if block_size <= 0:
            return 0
        keys = self.keys(block_size)
        n = index.match_believed(endpoint, keys) if pending else index.match(endpoint, keys)
        return n * block_size
