"""The emulated trtllm-serve's KV-cache event buffer, drained by ``POST /kv_cache_events``.

As TensorRT-LLM (notes in :mod:`fleetgate.engines.trtllm.kv_events`): events are kept
in a buffer of ``kv_cache_config.event_buffer_max_size`` entries (the oldest are
dropped when it is full), every event has the next ``event_id``, the first is
``created`` (a new, empty cache), and a read returns and removes everything buffered.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any

from fleetgate.engines.base import AllBlocksCleared, KvEvent
from fleetgate.engines.trtllm.kv_events import trtllm_event_items

__all__ = ["TrtllmKvEventBuffer"]


class TrtllmKvEventBuffer:
    def __init__(self, max_size: int, window_size: int, num_blocks: int) -> None:
        self._items: deque[dict[str, Any]] = deque(maxlen=max_size)
        self._next_id = 0
        self._window = window_size
        self._blocks = num_blocks
        self.add([AllBlocksCleared()])

    def add(self, events: Sequence[KvEvent]) -> None:
        items = trtllm_event_items(self._next_id, events, self._window, self._blocks)
        self._next_id += len(items)
        self._items.extend(items)

    def drain(self) -> list[dict[str, Any]]:
        out = list(self._items)
        self._items.clear()
        return out
