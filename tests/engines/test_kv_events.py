"""Decoding of the engines' KV-cache events (pure): vLLM msgpack frames, TensorRT-LLM JSON."""

from __future__ import annotations

import json

import msgpack
import pytest
from recordings import VLLM_032

from fleetgate.engines import get_adapter
from fleetgate.engines.base import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineAdapter,
    KvEventBatch,
    KvEventsDecodeError,
    LoraAdapter,
)
from fleetgate.engines.vllm import decode_vllm_kv_events, encode_vllm_kv_batch

VLLM = get_adapter("vllm")
TRT = get_adapter("trtllm")


def _frames(payload: object, seq: int = 7, topic: bytes = b"kv") -> list[bytes]:
    return [topic, seq.to_bytes(8, "big"), msgpack.packb(payload, use_bin_type=True)]


def test_both_adapters_implement_the_protocol_method() -> None:
    for adapter in (VLLM, TRT):
        assert isinstance(adapter, EngineAdapter)


def test_vllm_map_events_as_0_32_sends_them() -> None:
    stored = {
        "type": "BlockStored",
        "block_hashes": [11, 12],
        "parent_block_hash": None,
        "token_ids": list(range(8)),
        "block_size": 4,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "group_idx": 0,
    }
    removed = {"type": "BlockRemoved", "block_hashes": [11], "medium": "GPU", "group_idx": 0}
    (batch,) = VLLM.decode_kv_events(
        _frames([1.7e9, [stored, removed, {"type": "AllBlocksCleared"}], 0])
    )
    assert batch == KvEventBatch(
        seq=7,
        ts=1.7e9,
        data_parallel_rank=0,
        events=(
            BlockStored((11, 12), None, tuple(range(8)), 4, medium="GPU", group=0),
            BlockRemoved((11,), medium="GPU", group=0),
            AllBlocksCleared(),
        ),
    )


def test_vllm_array_like_events_of_older_releases_and_bytes_hashes() -> None:
    h = b"\x01" * 32
    (batch,) = VLLM.decode_kv_events(
        _frames(
            [2.0, [["BlockStored", [h], h, [1, 2], 2, None, "CPU"], ["BlockRemoved", [h], None]]]
        )
    )
    assert batch.events == (
        BlockStored((h,), h, (1, 2), 2, medium="CPU"),
        BlockRemoved((h,)),
    )
    assert batch.data_parallel_rank is None


def test_vllm_replay_reply_and_end_marker() -> None:
    frames = _frames([1.0, [{"type": "AllBlocksCleared"}], 0], seq=3)
    (batch,) = VLLM.decode_kv_events([b"", *frames])
    assert batch.seq == 3
    end = [b"", b"", (-1).to_bytes(8, "big", signed=True), b""]
    assert VLLM.decode_kv_events(end) == ()


def test_vllm_encoder_round_trips() -> None:
    batch = KvEventBatch(
        seq=5,
        ts=123.5,
        data_parallel_rank=0,
        events=(BlockStored((1, 2), 9, (3,) * 8, 4, "GPU", None, 0), BlockRemoved((9,), "GPU")),
    )
    assert decode_vllm_kv_events(encode_vllm_kv_batch(5, batch, "t")) == (batch,)


@pytest.mark.parametrize(
    "frames",
    [
        pytest.param([b"kv", b"\x00" * 8], id="two-frames"),
        pytest.param([b"kv", b"\x00" * 4, b"\x90"], id="short-seq"),
        pytest.param([b"kv", b"\x00" * 8, b"\xc1"], id="not-msgpack"),
        pytest.param(_frames({"ts": 1}), id="not-a-batch"),
        pytest.param(_frames([1.0, [{"type": "Nope"}]]), id="unknown-type"),
        pytest.param(_frames([1.0, [{"type": "BlockRemoved"}]]), id="missing-field"),
        pytest.param(
            _frames(
                [
                    1.0,
                    [
                        {
                            "type": "BlockStored",
                            "block_hashes": [1],
                            "parent_block_hash": None,
                            "token_ids": ["a"],
                            "block_size": 1,
                        }
                    ],
                ]  # fmt: skip
            ),
            id="bad-tokens",
        ),
        pytest.param(_frames([float("nan"), []]), id="nan-ts"),
    ],
)
def test_vllm_malformed_messages_raise(frames: list[bytes]) -> None:
    with pytest.raises(KvEventsDecodeError):
        VLLM.decode_kv_events(frames)


def _tok(*ids: int) -> list[dict[str, int | str]]:
    return [{"type": "unique_token", "token_id": t, "token_extra_id": 0} for t in ids]


def test_trtllm_drain_body() -> None:
    body = [
        {"event_id": 0, "data": {"type": "created", "num_blocks_per_cache_level": [10, 0]},
         "window_size": 64},
        {"event_id": 1, "window_size": 64, "data": {"type": "stored", "parent_hash": None,
                                                    "blocks": [
            {"type": "stored_block", "block_hash": 100, "tokens": _tok(1, 2), "cache_level": 0,
             "priority": 35},
            {"type": "stored_block", "block_hash": 101, "tokens": _tok(3, 4), "cache_level": 0,
             "priority": 35},
            {"type": "stored_block", "block_hash": 102, "tokens": _tok(5), "cache_level": 0,
             "priority": 35},
        ]}},
        {"event_id": 2, "window_size": 64, "data": {"type": "removed", "block_hashes": [100]}},
        {"event_id": 3, "window_size": 64, "data": {"type": "updated", "block_hash": 101,
         "cache_level": {"type": "event_diff", "new_value": 1, "old_value": 0},
         "priority": {"type": "event_diff", "new_value": 35, "old_value": 35}}},
    ]  # fmt: skip
    batches = TRT.decode_kv_events([json.dumps(body).encode()])
    assert [b.seq for b in batches] == [0, 1, 2, 3]
    assert batches[0].events == (AllBlocksCleared(),)
    assert batches[1].events == (
        BlockStored((100, 101), None, (1, 2, 3, 4), 2, medium="GPU", group=64),
        BlockStored((102,), 101, (5,), 1, medium="GPU", group=64),
    )
    assert batches[2].events == (BlockRemoved((100,), medium="GPU", group=64),)
    assert batches[3].events == (BlockRemoved((101,), medium="GPU", group=64),)


@pytest.mark.parametrize(
    "body",
    [b"{}", b"not json", b'[{"event_id": 1}]', b'[{"event_id": 1, "data": {"type": "x"}}]'],
)
def test_trtllm_malformed_bodies_raise(body: bytes) -> None:
    with pytest.raises(KvEventsDecodeError):
        TRT.decode_kv_events([body])


def test_vllm_salts_a_lora_adapters_blocks_with_its_name_and_trtllm_lists_none() -> None:
    """vLLM lists an adapter as a card whose ``parent`` is the base model and publishes
    its blocks with ``lora_name`` = that card's id; the base model's card has ``parent:
    null`` (the recorded 0.32 list). trtllm-serve lists only its model."""
    listed = json.loads((VLLM_032 / "models.json").read_text())["response"]["body_json"]["data"]
    assert [VLLM.lora_adapter(card) for card in listed] == [None] * len(listed)
    adapter = {"id": "sql-lora", "object": "model", "root": "/adapters/sql",
               "parent": listed[0]["id"]}  # fmt: skip
    assert VLLM.lora_adapter(adapter) == LoraAdapter(salt="sql-lora", base_model=listed[0]["id"])
    assert VLLM.lora_adapter({"id": "x", "parent": ""}) is None
    assert VLLM.lora_adapter({"parent": "base"}) is None  # no id: nothing to salt
    assert TRT.lora_adapter(adapter) is None
