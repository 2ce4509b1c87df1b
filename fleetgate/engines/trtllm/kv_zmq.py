"""TensorRT-LLM's streaming KV-cache events: the ZeroMQ ``KVEventsConfig`` publisher (pure).

Facts, read from TensorRT-LLM's own source through the code index (NVIDIA/TensorRT-LLM,
``tensorrt_llm/_torch/pyexecutor/kv_cache_events.py`` at commit 13599e98 and its test
``tests/unittest/kv_cache_manager_v2_tests/test_streaming_kv_events.py`` at 1454f28a;
added by pull request #17023), and from the LLM-API reference pages of 1.3.0rc27 and
1.4.0rc4 (``KvCacheConfig``, ``KVEventsConfig``). Not checked against a running engine:
TensorRT-LLM needs an NVIDIA GPU and cannot run here.

Configuration (LLM-API options YAML): ``kv_cache_config.kv_events_config`` is a
``KVEventsConfig`` (strict: unknown keys are refused) with ``enable_kv_cache_events``,
``publisher`` (``zmq``/``null``; ``zmq`` when events are on), ``endpoint`` (default
``tcp://*:5557``), ``replay_endpoint`` (default none), ``buffer_steps`` (10000),
``hwm``, ``max_queue_size`` and ``topic`` (``""``). The streaming path exists only for
the PyTorch backend's KV cache manager V2 (``kv_cache_config.use_kv_cache_manager_v2``,
``bool | "auto"``); the older buffered path (``event_buffer_max_size``,
``POST /kv_cache_events``, :mod:`.kv_events`) is kept beside it, and in streaming mode
its pull API returns nothing.

Sockets (``ZmqEventPublisher``): the PUB socket always BINDS its endpoint (also a
specific host such as ``tcp://0.0.0.0:5557``; only ``tcp``/``ipc``/``inproc``); each
attention-data-parallel rank binds ``base_port + rank`` (rank 0 the base port itself),
the replay ROUTER socket likewise. Sending runs on a background thread fed by a bounded
queue.

Wire format:

* one PUB message per engine iteration that produced events, three frames:
  ``(topic utf-8, seq 8-byte big-endian unsigned, payload)``; ``seq`` counts 0, 1, 2 ...
  from the publisher's start and is reserved when a batch is accepted, so a batch lost
  to a full queue or a failed send leaves a gap (the engine says: resynchronise);
* replay: a client sends ``(b"", start seq 8-byte big-endian)`` to the ROUTER socket and
  receives ``(b"", topic, seq, payload)`` for each of the last ``buffer_steps`` batches
  with ``seq >= start``, then the end marker ``(b"", b"", -1 as 8-byte signed, b"")``:
  the same protocol as vLLM's (:mod:`fleetgate.engines.vllm`);
* payload: msgpack (msgspec) of the batch envelope as a positional array
  ``[ts, [event, ...], data_parallel_rank]`` (the rank is always set by the publisher;
  ``omit_defaults`` would drop it when None). Events are msgpack MAPS tagged with
  ``"type"`` (unlike vLLM's array-like structs; the source says the map form keeps field
  order out of the contract), fields equal to their default omitted:

  - ``BlockStored {block_hashes, parent_block_hash, token_ids, block_size, lora_id,
    medium, lora_name}`` + optional ``extra_keys``, ``group_idx``,
    ``kv_cache_spec_kind``, ``kv_cache_spec_sliding_window``, ``locality``, ``mm_keys``
    (per block, lists of ``{"type": "mm_key", hash, start_offset, uuid?}``).
    ``token_ids`` items are ``int | str``. Only FULL blocks of the largest attention
    window are published (trailing partial blocks are suppressed, with their removals);
    consecutive blocks are coalesced into one event; ``medium`` is ``"GPU"``.
  - ``BlockRemoved {block_hashes, medium}`` + optional ``group_idx``, ``locality``.
  - ``AllBlocksCleared {}``: defined, but the streaming manager publishes no creation
    event (``add_created_event`` does nothing) and nothing seen emits it.

* block hashes: SIGNED 64-bit ints, the first 8 bytes (big-endian) of the V2 radix
  block key, wrapped below zero when the high bit is set (the test's
  ``int.from_bytes(key[:8], "big") - 2**64``).

Mapping to :mod:`fleetgate.engines.base`: ``seq`` from the frame, ``ts`` and
``data_parallel_rank`` from the envelope; events one to one. A stored block whose
tokens are not all ints, or that carries ``mm_keys``, is decoded with ``spec_kind``
``multimodal``: its identity is not its token ids, so the router's index never keys it
(nor what chains from it). ``lora_name`` salts keys; without it a ``lora_id`` does
(``lora-id:N``), so an adapter's blocks never match base-model prompts. Anything
malformed raises :class:`~fleetgate.engines.base.KvEventsDecodeError`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import msgpack

from fleetgate.engines._common import kv_hashes, kv_opt_int, kv_opt_text, kv_removed_or_cleared
from fleetgate.engines.base import (
    BlockHash,
    BlockRemoved,
    BlockStored,
    KvEvent,
    KvEventBatch,
    KvEventsDecodeError,
    KvEventsEndpoint,
)

__all__ = [
    "KV_EVENTS_PORT",
    "KV_EVENTS_TOPIC",
    "KV_REPLAY_PORT",
    "REPLAY_END_SEQ",
    "TRTLLM_ZMQ_FORMAT",
    "decode_trtllm_zmq",
    "encode_trtllm_kv_batch",
    "kv_events_config",
    "lora_id_salt",
    "signed_hash",
]

TRTLLM_ZMQ_FORMAT = "trtllm-zmq-msgpack"
#: Container ports of the publisher (rank 0) and of the replay socket (operator defaults);
#: TensorRT-LLM's default endpoint is 5557 and it has no default replay endpoint. Ranks > 0
#: would bind base + rank, and the engine refuses base ports closer than its ranks per
#: host (``validate_endpoint_ranges``): 10 apart leaves room for up to 10.
KV_EVENTS_PORT = 5557
KV_REPLAY_PORT = 5567
KV_EVENTS_TOPIC = "kv-events"
REPLAY_END_SEQ = -1
_INT64_MIN = -(2**63)
_UINT64_MAX = 2**64 - 1


_LORA_ID = "lora-id:"


def lora_id_salt(lora_id: int) -> str:
    """The key salt of the blocks of LoRA task ``lora_id``: the streaming publisher sends
    ``lora_id`` (the task id, ``lora_request.lora_int_id`` of an OpenAI request) and
    ``lora_name`` None (``_StreamingEventSource.drain_events``)."""
    return f"{_LORA_ID}{lora_id}"


def _lora_id(salt: str | None) -> int | None:
    """The task id :func:`lora_id_salt` made ``salt`` of, else None."""
    if salt is None or not salt.startswith(_LORA_ID):
        return None
    tail = salt[len(_LORA_ID) :]
    return int(tail) if tail.lstrip("-").isdigit() else None


def signed_hash(value: int) -> int:
    """A 64-bit hash as TensorRT-LLM publishes it: signed (high bit set -> negative)."""
    value &= _UINT64_MAX
    return value - 2**64 if value >= 2**63 else value


def _int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise KvEventsDecodeError(f"{what} must be an int, not {value!r}")
    return value


def _hash(value: Any, what: str) -> int:
    h = _int(value, what)
    if not _INT64_MIN <= h <= _UINT64_MAX:
        raise KvEventsDecodeError(f"{what}: {h} is not a 64-bit hash")
    return h


def _hashes(value: Any) -> tuple[BlockHash, ...]:
    return kv_hashes(value, _hash)


def _stored(raw: dict[str, Any]) -> BlockStored:
    tokens = raw["token_ids"]
    if not isinstance(tokens, list):
        raise KvEventsDecodeError("token_ids must be a list")
    textual = False
    ints: list[int] = []
    for t in tokens:
        if isinstance(t, str):
            textual = True
        elif isinstance(t, int) and not isinstance(t, bool) and t >= 0:
            ints.append(t)
        else:
            raise KvEventsDecodeError(f"token_ids items must be ints or strings, not {t!r}")
    size = _int(raw["block_size"], "block_size")
    if size < 1:
        raise KvEventsDecodeError(f"block_size must be positive, not {size}")
    mm_keys = raw.get("mm_keys")
    if mm_keys is not None and not isinstance(mm_keys, list):
        raise KvEventsDecodeError("mm_keys must be a list")
    multimodal = textual or any(bool(keys) for keys in mm_keys or ())
    lora_name = kv_opt_text(raw.get("lora_name"), "lora_name")
    lora_id = kv_opt_int(raw.get("lora_id"), "lora_id")
    if lora_name is None and lora_id is not None:
        lora_name = lora_id_salt(lora_id)
    parent = raw.get("parent_block_hash")
    return BlockStored(
        block_hashes=_hashes(raw["block_hashes"]),
        parent_hash=None if parent is None else _hash(parent, "parent_block_hash"),
        # a multimodal block's placeholders are not token ids: its tokens are dropped,
        # which makes it a partial block the index never keys
        token_ids=() if multimodal else tuple(ints),
        block_size=size,
        medium=kv_opt_text(raw.get("medium"), "medium"),
        lora_name=lora_name,
        group=kv_opt_int(raw.get("group_idx"), "group_idx"),
        spec_kind=(
            "multimodal"
            if multimodal
            else kv_opt_text(raw.get("kv_cache_spec_kind"), "kv_cache_spec_kind")
        ),
    )


def _event(raw: Any) -> KvEvent:
    if not isinstance(raw, dict):
        raise KvEventsDecodeError(
            f"a TensorRT-LLM KV event must be a map tagged with 'type', not {type(raw).__name__}"
        )
    kind = raw.get("type")
    if kind == "BlockStored":
        try:
            return _stored(raw)
        except KeyError as e:
            raise KvEventsDecodeError(f"{kind} event without field {e.args[0]!r}") from None
    return kv_removed_or_cleared(kind, raw, _hash)


def decode_trtllm_zmq(frames: Sequence[bytes]) -> tuple[KvEventBatch, ...]:
    """One ZeroMQ message (PUB, or a replay reply with its empty delimiter) -> its batch;
    the replay end marker -> ``()``."""
    parts = list(frames)
    if len(parts) == 4 and parts[0] == b"":
        parts = parts[1:]
    if len(parts) != 3:
        raise KvEventsDecodeError(f"expected 3 frames (topic, seq, payload), got {len(parts)}")
    _topic, seq_bytes, payload = parts
    if len(seq_bytes) != 8:
        raise KvEventsDecodeError(f"sequence frame of {len(seq_bytes)} bytes, expected 8")
    if int.from_bytes(seq_bytes, "big", signed=True) == REPLAY_END_SEQ and not payload:
        return ()
    seq = int.from_bytes(seq_bytes, "big")
    try:
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (ValueError, msgpack.UnpackException) as e:
        raise KvEventsDecodeError(f"payload is not msgpack: {e}") from None
    if not isinstance(batch, list) or not 2 <= len(batch) <= 3 or not isinstance(batch[1], list):
        raise KvEventsDecodeError("payload is not a batch [ts, events, data_parallel_rank]")
    ts = batch[0]
    if isinstance(ts, bool) or not isinstance(ts, int | float) or not math.isfinite(ts):
        raise KvEventsDecodeError(f"batch ts must be a number, not {ts!r}")
    rank = kv_opt_int(batch[2] if len(batch) > 2 else None, "data_parallel_rank")
    events = tuple(_event(e) for e in batch[1])
    return (KvEventBatch(seq=seq, events=events, ts=float(ts), data_parallel_rank=rank),)


def encode_trtllm_kv_batch(
    seq: int, batch: KvEventBatch, topic: str = ""
) -> tuple[bytes, bytes, bytes]:
    """The 3-frame PUB message TensorRT-LLM would send for ``batch`` (the emulator's).

    Hashes are written signed; consecutive removals are coalesced into one
    ``BlockRemoved`` as the engine does; optional fields that are None are omitted.
    """
    events: list[dict[str, Any]] = []
    for e in batch.events:
        if isinstance(e, BlockStored):
            lora_id = _lora_id(e.lora_name)
            stored: dict[str, Any] = {
                "type": "BlockStored",
                "block_hashes": [signed_hash(int(h)) for h in e.block_hashes],
                "parent_block_hash": (
                    None if e.parent_hash is None else signed_hash(int(e.parent_hash))
                ),
                "token_ids": list(e.token_ids),
                "block_size": e.block_size,
                # the engine sends a LoRA task's id and never a name
                "lora_id": lora_id,
                "medium": e.medium or "GPU",
                "lora_name": e.lora_name if lora_id is None else None,
            }
            if e.group is not None:
                stored["group_idx"] = e.group
            events.append(stored)
        elif isinstance(e, BlockRemoved):
            hashes = [signed_hash(int(h)) for h in e.block_hashes]
            last = events[-1] if events else None
            medium = e.medium or "GPU"
            if (
                last is not None
                and last["type"] == "BlockRemoved"
                and last["medium"] == medium
                and last.get("group_idx") == e.group
            ):
                last["block_hashes"].extend(hashes)
                continue
            removed: dict[str, Any] = {
                "type": "BlockRemoved",
                "block_hashes": hashes,
                "medium": medium,
            }
            if e.group is not None:
                removed["group_idx"] = e.group
            events.append(removed)
        else:
            events.append({"type": "AllBlocksCleared"})
    rank = batch.data_parallel_rank if batch.data_parallel_rank is not None else 0
    payload = msgpack.packb([batch.ts, events, rank], use_bin_type=True)
    return topic.encode(), seq.to_bytes(8, "big"), payload


def kv_events_config(endpoint: KvEventsEndpoint) -> dict[str, Any]:
    """``kv_cache_config.kv_events_config`` binding the PUB and replay sockets on all pod
    addresses (rank 0: the base ports themselves)."""
    config: dict[str, Any] = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{endpoint.port}",
    }
    if endpoint.replay_port is not None:
        config["replay_endpoint"] = f"tcp://*:{endpoint.replay_port}"
    if endpoint.topic:
        config["topic"] = endpoint.topic
    return config
