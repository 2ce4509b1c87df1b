"""TensorRT-LLM's streaming (ZeroMQ) KV events: the decoder against hand-built frames.

The frames are written here with msgpack by hand, as TensorRT-LLM's
``tensorrt_llm/_torch/pyexecutor/kv_cache_events.py`` sends them (notes in
:mod:`fleetgate.engines.trtllm.kv_zmq`): ``(topic, seq 8-byte big-endian, payload)``,
payload ``[ts, [event map, ...], data_parallel_rank]``, events maps tagged ``type``
with default-valued optional fields left out, hashes signed 64-bit. Not frames recorded
from a running engine (none can run here).
"""

from __future__ import annotations

from typing import Any

import msgpack
import pytest

from fleetgate.engines import get_adapter
from fleetgate.engines.base import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEventBatch,
    KvEventsDecodeError,
)
from fleetgate.engines.trtllm.kv_zmq import (
    decode_trtllm_zmq,
    encode_trtllm_kv_batch,
    signed_hash,
)
from fleetgate.router.scheduling.kvindex import KvIndex, block_keys
from fleetgate.router.scheduling.types import EndpointId

TRT = get_adapter("trtllm")

# As TensorRT-LLM's own test: the wire hash is the first 8 bytes of the radix key,
# big-endian, wrapped below zero when the high bit is set.
FIRST = int.from_bytes(b"\x80\x00\x00\x00\x00\x00\x00\x01", "big") - 2**64
SECOND = int.from_bytes(b"\x00\x00\x00\x00\x00\x00\x00\x02", "big")


def frames(seq: int, events: list[Any], *, ts: float = 1.5, rank: Any = 0,
           topic: bytes = b"kv-events") -> list[bytes]:  # fmt: skip
    envelope: list[Any] = [ts, events] if rank is ... else [ts, events, rank]
    return [topic, seq.to_bytes(8, "big"), msgpack.packb(envelope, use_bin_type=True)]


STORED = {
    "type": "BlockStored",
    "block_hashes": [FIRST, SECOND],
    "parent_block_hash": None,
    "token_ids": [1, 2, 3, 4, 5, 6, 7, 8],
    "block_size": 4,
    "lora_id": None,
    "medium": "GPU",
    "lora_name": None,
}
REMOVED = {"type": "BlockRemoved", "block_hashes": [FIRST, SECOND], "medium": "GPU"}


def test_stored_and_removed_as_the_engine_writes_them() -> None:
    (batch,) = TRT.decode_kv_events(frames(7, [STORED, REMOVED], ts=12.25, rank=0))
    assert batch.seq == 7 and batch.ts == 12.25 and batch.data_parallel_rank == 0
    stored, removed = batch.events
    assert stored == BlockStored(
        block_hashes=(FIRST, SECOND),
        parent_hash=None,
        token_ids=(1, 2, 3, 4, 5, 6, 7, 8),
        block_size=4,
        medium="GPU",
    )
    assert FIRST < 0, "a hash with the high bit set arrives negative"
    assert removed == BlockRemoved(block_hashes=(FIRST, SECOND), medium="GPU")


def test_optional_fields_when_present() -> None:
    event = {
        **STORED,
        "parent_block_hash": SECOND,
        "block_hashes": [FIRST],
        "token_ids": [9, 9, 9, 9],
        "group_idx": 1,
        "kv_cache_spec_kind": "sliding_window",
        "kv_cache_spec_sliding_window": 128,
        "locality": "local",
        "extra_keys": [None],
    }
    removed = {**REMOVED, "group_idx": 1, "locality": "local"}
    (batch,) = decode_trtllm_zmq(frames(0, [event, removed, {"type": "AllBlocksCleared"}]))
    stored, gone, cleared = batch.events
    assert isinstance(stored, BlockStored)
    assert stored.parent_hash == SECOND and stored.group == 1
    assert stored.spec_kind == "sliding_window"  # the index keys full attention only
    assert isinstance(gone, BlockRemoved) and gone.group == 1
    assert cleared == AllBlocksCleared()


def test_rank_omitted_and_replay_frames() -> None:
    (batch,) = decode_trtllm_zmq(frames(3, [REMOVED], rank=...))
    assert batch.data_parallel_rank is None
    # a replay reply carries the ROUTER's empty delimiter in front
    (replayed,) = decode_trtllm_zmq([b"", *frames(3, [REMOVED])])
    assert replayed.seq == 3 and replayed.events == batch.events
    # the end marker: empty topic, seq -1 (signed), empty payload
    assert decode_trtllm_zmq([b"", b"", (-1).to_bytes(8, "big", signed=True), b""]) == ()
    assert TRT.kv_replay_request(5) == (b"", (5).to_bytes(8, "big"))


def test_multimodal_and_lora_blocks_never_match_text_prompts() -> None:
    mm = {**STORED, "token_ids": [1, "img", 3, 4, 5, 6, 7, 8]}
    keyed = {**STORED, "mm_keys": [[{"type": "mm_key", "hash": "ab", "start_offset": 0}], []]}
    lora = {**STORED, "lora_id": 3}
    (batch,) = decode_trtllm_zmq(frames(0, [mm, keyed, lora]))
    a, b, c = batch.events
    assert isinstance(a, BlockStored) and isinstance(b, BlockStored)
    assert a.spec_kind == b.spec_kind == "multimodal" and a.token_ids == ()
    assert isinstance(c, BlockStored) and c.lora_name == "lora-id:3"
    # what the router's index makes of them: nothing a plain prompt matches
    index = KvIndex()
    eid = EndpointId("e")
    index.apply(eid, batch)
    keys = block_keys(list(range(1, 9)), 4)
    assert index.match(eid, keys) == 0
    plain = BlockStored((FIRST, SECOND), None, (1, 2, 3, 4, 5, 6, 7, 8), 4)
    index.apply(eid, KvEventBatch(seq=1, events=(plain,)))
    assert index.match(eid, block_keys([1, 2, 3, 4, 5, 6, 7, 8], 4)) == 2


@pytest.mark.parametrize(
    ("message", "error"),
    [
        pytest.param([b"t", b"\x00" * 8], "expected 3 frames", id="two-frames"),
        pytest.param([b"t", b"\x00" * 4, b""], "sequence frame of 4", id="short-seq"),
        pytest.param([b"t", b"\x00" * 8, b"\xc1"], "not msgpack", id="not-msgpack"),
        pytest.param(frames(0, [])[:2] + [msgpack.packb({"ts": 1})], "not a batch", id="map"),
        pytest.param(frames(0, [], ts=float("nan")), "ts must be a number", id="nan-ts"),
        # vLLM's older array-like event shape is not TensorRT-LLM's
        pytest.param(frames(0, [["BlockRemoved", [1], "GPU"]]), "must be a map", id="array"),
        pytest.param(frames(0, [{"type": "BlockMoved"}]), "unknown KV event type", id="type"),
        pytest.param(frames(0, [{"type": "BlockRemoved"}]), "without field", id="missing"),
        pytest.param(frames(0, [{**REMOVED, "block_hashes": [True]}]), "must be an int", id="bool"),
        pytest.param(frames(0, [{**STORED, "block_size": 0}]), "positive", id="size"),
        pytest.param(frames(0, [{**STORED, "token_ids": [1.5]}]), "ints or strings", id="tok"),
        pytest.param(frames(0, [{**STORED, "block_hashes": "x"}]), "must be a list", id="hl"),
        pytest.param(frames(0, [REMOVED], rank="0"), "must be an int", id="rank"),
    ],
)
def test_malformed_messages_are_errors(message: list[bytes], error: str) -> None:
    with pytest.raises(KvEventsDecodeError, match=error):
        TRT.decode_kv_events(message)


def test_the_http_drain_body_is_still_decoded_by_the_same_adapter() -> None:
    body = b'[{"event_id": 4, "data": {"type": "removed", "block_hashes": [9]}, "window_size": 32}]'
    (batch,) = TRT.decode_kv_events([body])
    assert batch.seq == 4 and batch.events == (BlockRemoved((9,), medium="GPU", group=32),)


def test_the_emulator_encoder_writes_what_the_decoder_reads() -> None:
    high = 2**63 + 5  # an unsigned hash the emulator's pool would use
    batch = KvEventBatch(
        seq=None,
        events=(
            BlockStored((high, 2), None, tuple(range(8)), 4, medium="GPU"),
            BlockRemoved((high,), medium="GPU"),
            BlockRemoved((2,), medium="GPU"),
        ),
        ts=3.0,
        data_parallel_rank=0,
    )
    topic, seq, payload = encode_trtllm_kv_batch(11, batch, "kv-events")
    raw = msgpack.unpackb(payload)
    assert raw[2] == 0 and raw[1][0]["type"] == "BlockStored"
    assert "extra_keys" not in raw[1][0] and "group_idx" not in raw[1][0]
    # consecutive removals coalesce into one event, as the engine's
    assert raw[1][1] == {"type": "BlockRemoved", "block_hashes": [signed_hash(high), 2],
                         "medium": "GPU"}  # fmt: skip
    (back,) = decode_trtllm_zmq([topic, seq, payload])
    assert back.seq == 11 and back.events[0].block_hashes == (signed_hash(high), 2)  # type: ignore[union-attr]
    assert signed_hash(high) == high - 2**64
