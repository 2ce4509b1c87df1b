"""TensorRT-LLM KV-cache events: trtllm-serve's ``POST /kv_cache_events`` JSON (pure).

Source (read through the code index, NVIDIA/TensorRT-LLM at commit ed53795b,
``tensorrt_llm/_utils.py`` ``KVCacheEventSerializer``; the route is registered in
``tensorrt_llm/serve/openai_server.py`` as ``/kv_cache_events``, methods ``["POST"]``):

* Events are on when the LLM-API options set ``kv_cache_config.event_buffer_max_size``
  > 0 (with ``enable_block_reuse``); the executor keeps that many events.
* ``POST /kv_cache_events`` DRAINS the buffer and answers a JSON list; each item is
  ``{"event_id": int, "data": {...}, "window_size": int}`` (+ ``"attention_dp_rank"``
  when attention data parallelism is on). ``data["type"]`` is one of

  - ``created``: ``{"num_blocks_per_cache_level": [...]}`` - a new (empty) cache;
  - ``stored``: ``{"parent_hash": int | null, "blocks": [{"type": "stored_block",
    "block_hash": int, "tokens": [{"type": "unique_token", "token_id": int,
    "token_extra_id": int}, ...], "cache_level": int, "priority": int}, ...]}``;
  - ``removed``: ``{"block_hashes": [int, ...]}``;
  - ``updated``: ``{"block_hash", "cache_level": {"type": "event_diff", "new_value",
    "old_value"}, "priority": {...}}`` (a block moved between cache levels or changed
    priority).

Mapping to :mod:`fleetgate.engines.base`: ``created`` -> ``AllBlocksCleared``;
``stored`` -> one ``BlockStored`` per run of consecutive blocks of the same token
count and cache level (``block_size`` = that count; ``medium`` ``GPU`` for cache level
0, ``CPU`` for the secondary level 1); ``removed`` -> ``BlockRemoved``; ``updated`` is
a cache-level change: away from level 0 it is a removal from ``GPU``; back to level 0
it is dropped (the event has no tokens to store), as are priority-only updates.
``window_size`` becomes ``group``.
Each event is its own batch with ``seq = event_id`` (ids are consecutive, so a jump
is a gap). With attention data parallelism every rank's ``KVCacheEventManager`` counts
its own ``event_id`` from 0 and tags its events with its rank; rank 0 gathers the other
ranks' events into its own buffer (``cpp/tensorrt_llm/batch_manager/kvCacheEventManager``,
read through the code index), so one drain interleaves several sequences: the batch
carries ``data_parallel_rank`` and the router sequences each rank apart. The newer
streaming ZeroMQ publisher (``kv_cache_config.kv_events_config``) is :mod:`.kv_zmq`;
which one a release line uses is :mod:`.versions`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from fleetgate.engines.base import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEvent,
    KvEventBatch,
    KvEventsDecodeError,
)

__all__ = [
    "KV_EVENTS_PATH",
    "TRTLLM_KV_EVENTS_FORMAT",
    "decode_trtllm_kv_events",
    "trtllm_event_items",
]

KV_EVENTS_PATH = "/kv_cache_events"
TRTLLM_KV_EVENTS_FORMAT = "trtllm-http-json"
_MEDIA = {0: "GPU", 1: "CPU"}
_LEVELS = {"GPU": 0, "CPU": 1}
#: The retention priority a block gets by default (KvCacheRetentionConfig).
DEFAULT_PRIORITY = 35


def _int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise KvEventsDecodeError(f"{what} must be an int, not {value!r}")
    return value


def _medium(level: Any) -> str | None:
    return None if level is None else _MEDIA.get(_int(level, "cache_level"), str(level))


def _stored(data: dict[str, Any], group: int | None) -> list[KvEvent]:
    blocks = data.get("blocks")
    if not isinstance(blocks, list):
        raise KvEventsDecodeError("stored event without a blocks list")
    parent_raw = data.get("parent_hash")
    parent = None if parent_raw is None else _int(parent_raw, "parent_hash")
    out: list[KvEvent] = []
    run: list[tuple[int, tuple[int, ...]]] = []
    run_key: tuple[int, str | None] | None = None

    def flush() -> None:
        nonlocal parent
        if run and run_key is not None:
            out.append(
                BlockStored(
                    block_hashes=tuple(h for h, _ in run),
                    parent_hash=parent,
                    token_ids=tuple(t for _, toks in run for t in toks),
                    block_size=run_key[0],
                    medium=run_key[1],
                    group=group,
                )
            )
            parent = run[-1][0]
            run.clear()

    for block in blocks:
        if not isinstance(block, dict):
            raise KvEventsDecodeError("a stored block must be an object")
        tokens = block.get("tokens")
        if not isinstance(tokens, list) or not tokens:
            raise KvEventsDecodeError("a stored block needs a non-empty tokens list")
        ids = tuple(
            _int(t.get("token_id") if isinstance(t, dict) else None, "token_id") for t in tokens
        )
        key = (len(ids), _medium(block.get("cache_level")))
        if key != run_key:
            flush()
            run_key = key
        run.append((_int(block.get("block_hash"), "block_hash"), ids))
    flush()
    return out


def _event(item: Any) -> KvEventBatch:
    if not isinstance(item, dict) or not isinstance(item.get("data"), dict):
        raise KvEventsDecodeError("an event must be an object with a data object")
    seq = _int(item.get("event_id"), "event_id")
    window = item.get("window_size")
    group = None if window is None else _int(window, "window_size")
    rank = item.get("attention_dp_rank")
    data = item["data"]
    kind = data.get("type")
    events: list[KvEvent]
    if kind == "created":
        events = [AllBlocksCleared()]
    elif kind == "stored":
        events = _stored(data, group)
    elif kind == "removed":
        hashes = data.get("block_hashes")
        if not isinstance(hashes, list):
            raise KvEventsDecodeError("removed event without a block_hashes list")
        events = [
            BlockRemoved(tuple(_int(h, "block_hashes") for h in hashes), medium="GPU", group=group)
        ]
    elif kind == "updated":
        events = []
        diff = data.get("cache_level")
        if isinstance(diff, dict) and diff.get("new_value") != diff.get("old_value"):
            h = _int(data.get("block_hash"), "block_hash")
            if diff.get("old_value") == 0:
                events = [BlockRemoved((h,), medium="GPU", group=group)]
    else:
        raise KvEventsDecodeError(f"unknown KV event type {kind!r}")
    return KvEventBatch(
        seq=seq,
        events=tuple(events),
        data_parallel_rank=None if rank is None else _int(rank, "attention_dp_rank"),
    )


def decode_trtllm_kv_events(frames: Sequence[bytes]) -> tuple[KvEventBatch, ...]:
    """One ``/kv_cache_events`` response body (a single frame) -> one batch per event."""
    if len(frames) != 1:
        raise KvEventsDecodeError(f"expected one response body, got {len(frames)} frames")
    try:
        items = json.loads(frames[0])
    except ValueError as e:
        raise KvEventsDecodeError(f"not JSON: {e}") from None
    if not isinstance(items, list):
        raise KvEventsDecodeError("the body must be a JSON list of events")
    return tuple(_event(item) for item in items)


def trtllm_event_items(
    first_id: int, events: Sequence[KvEvent], window_size: int, num_blocks: int
) -> list[dict[str, Any]]:
    """``events`` as the items trtllm-serve returns (the emulator's encoder), ids from
    ``first_id``: a ``BlockStored`` is one ``stored`` event, its tokens cut into blocks
    of ``block_size``; ``AllBlocksCleared`` is ``created`` (``num_blocks`` primary
    blocks, no secondary ones)."""
    items: list[dict[str, Any]] = []
    for event in events:
        data: dict[str, Any]
        if isinstance(event, BlockStored):
            size = event.block_size
            level = _LEVELS.get(event.medium or "GPU", 0)
            data = {
                "type": "stored",
                "parent_hash": event.parent_hash,
                "blocks": [
                    {
                        "type": "stored_block",
                        "block_hash": h,
                        "tokens": [
                            {"type": "unique_token", "token_id": t, "token_extra_id": 0}
                            for t in event.token_ids[i * size : (i + 1) * size]
                        ],
                        "cache_level": level,
                        "priority": DEFAULT_PRIORITY,
                    }
                    for i, h in enumerate(event.block_hashes)
                ],
            }
        elif isinstance(event, BlockRemoved):
            data = {"type": "removed", "block_hashes": list(event.block_hashes)}
        else:
            data = {"type": "created", "num_blocks_per_cache_level": [num_blocks, 0]}
        items.append({"event_id": first_id + len(items), "data": data, "window_size": window_size})
    return items
