"""KV-cache events: the real vLLM's stream, recorded, and the emulator's, checked alike.

The real half starts its own vLLM 0.32 (CPU) with ``--kv-events-config`` (the shared
``real_vllm`` server has events off), runs :mod:`.kv_scenario`, and checks the stream
with the vLLM adapter's decoder. ``FLEETGATE_RECORD_KV_FIXTURES=1`` also rewrites the
committed recording ``fixtures/vllm-0.32-kv-events.jsonl``, which the non-real tests
decode without a server. The emulator half runs the same scenario and checks.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import zmq
from realvllm import (
    MAX_MODEL_LEN,
    SERVED_MODEL,
    ensure_model,
    ensure_venv,
    run_real_vllm,
)

from fleetgate.engines.vllm import decode_vllm_kv_events, encode_vllm_kv_batch

from . import kv_scenario as sc
from .backends import BLOCK_SIZE, NUM_BLOCKS, run_emulator


@pytest.mark.realvllm
@pytest.mark.timeout(900)
def test_real_vllm_kv_events(sub_socket: tuple[zmq.Socket[bytes], str], tmp_path: Path) -> None:
    sub, pub_endpoint = sub_socket
    replay = sc.replay_endpoint_beside(pub_endpoint)
    python = ensure_venv()
    model = ensure_model(python)
    flags = ("--kv-events-config", sc.kv_events_config(pub_endpoint, replay))
    recording: list[dict[str, Any]] = []
    try:
        with run_real_vllm(
            python, model, tmp_path / "server.log", flags, {"VLLM_SERVER_DEV_MODE": "1"}
        ) as server:
            sc.record(server.base_url, server.model, sub, replay, recording)
    finally:
        sc.save(recording, tmp_path / "recording.jsonl")
        if os.environ.get("FLEETGATE_RECORD_KV_FIXTURES") == "1":
            sc.save(recording, sc.FIXTURE)
    sc.check_stream(recording)


def test_recorded_real_stream_decodes_and_passes() -> None:
    """The committed real-vLLM recording meets the expectations (no server needed)."""
    sc.check_stream(sc.load(sc.FIXTURE))


def test_encoder_reproduces_real_payloads_byte_for_byte() -> None:
    """decode -> encode gives back the real vLLM's exact frames (the emulator's encoder)."""
    n = 0
    for m in sc.load(sc.FIXTURE):
        if m["channel"] != "pub":
            continue
        frames = sc.frames_of(m)
        (batch,) = decode_vllm_kv_events(frames)
        assert batch.seq is not None
        assert encode_vllm_kv_batch(batch.seq, batch, sc.TOPIC) == tuple(frames)
        n += 1
    assert n > 0


def test_emulator_kv_events(sub_socket: tuple[zmq.Socket[bytes], str], tmp_path: Path) -> None:
    sub, pub_endpoint = sub_socket
    replay = sc.replay_endpoint_beside(pub_endpoint)
    engine = (
        "vllm", "serve", SERVED_MODEL, "--host", "127.0.0.1", "--port", "{port}",
        "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "4",
        "--num-gpu-blocks-override", str(NUM_BLOCKS), "--block-size", str(BLOCK_SIZE),
        "--enable-prefix-caching", "--scheduling-policy", "priority",
        "--kv-events-config", sc.kv_events_config(pub_endpoint, replay),
    )  # fmt: skip
    with run_emulator(tmp_path / "sim.log", engine) as backend:
        recording: list[dict[str, Any]] = []
        sc.record(backend.base_url, backend.model, sub, replay, recording)
    sc.check_stream(recording)
