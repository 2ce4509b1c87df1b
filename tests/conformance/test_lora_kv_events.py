"""A LoRA adapter on the REAL vLLM 0.32 (CPU): how it is listed and how its blocks are
published, which is what the router's keys for adapter requests rest on
(``EngineAdapter.lora_adapter``, docs/router.md "LoRA adapters").

The server is started with ``--enable-lora --lora-modules tiny-lora=<dir>`` (an adapter
written by :mod:`.lora_adapter`) and ``--kv-events-config``; the emulator, started with
the same flags, must meet the same checks. One prompt goes to the
base model and then to the adapter; the checks: ``/v1/models`` lists the adapter with
its ``parent``, vLLM's adapter salts it with its name, the adapter's ``BlockStored``
events carry ``lora_name`` and hashes other than the base model's for the same
tokens, and an index fed the real events matches the adapter's keys only where the
adapter's blocks are, and the base model's only where its own are.

The same run checks vLLM's per-request ``cache_salt`` (one more prompt to the base model
and to the adapter, each salted): the salt is published in the first block's
``extra_keys`` and hashed into the whole chain, so salted keys
(:func:`~fleetgate.router.scheduling.kvindex.chain_salt`) match only the salted blocks;
and a salt vLLM forbids is a 400.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
import zmq
from realvllm import (
    MAX_MODEL_LEN,
    SERVED_MODEL,
    ensure_model,
    ensure_venv,
    run_real_vllm,
)

from fleetgate.engines.base import BlockStored, KvEventBatch, LoraAdapter
from fleetgate.engines.vllm import ADAPTER as VLLM
from fleetgate.router.scheduling.exact import PromptKeys
from fleetgate.router.scheduling.kvindex import KvIndex, chain_salt
from fleetgate.router.scheduling.types import EndpointId

from . import kv_scenario as sc
from .backends import NUM_BLOCKS, run_emulator
from .lora_adapter import RANK, write_adapter

ADAPTER = "tiny-lora"
PROMPT = [30 + (i * 11) % 1900 for i in range(3 * sc.BLOCK_SIZE + 20)]  # 3 full blocks
SALT = "tenant-a"
#: (step, model, cache_salt)
STEPS = (
    (SERVED_MODEL, SERVED_MODEL, None),
    (ADAPTER, ADAPTER, None),
    ("salted", SERVED_MODEL, SALT),
    ("adapter-salted", ADAPTER, SALT),
)


def _batches(recording: list[dict[str, Any]], step: str) -> list[KvEventBatch]:
    return sc.decode([m for m in recording if m["step"] == step]).get(step, [])


def _run(base_url: str, sub: zmq.Socket[bytes]) -> tuple[list[dict[str, Any]], list[Any]]:
    """The base model's card list, then one prompt per step of :data:`STEPS`; returns
    the cards and every KV-event message, by step."""
    recording: list[dict[str, Any]] = []
    sc.wait_connected(sub)
    with httpx.Client(base_url=base_url, timeout=120.0) as http:
        cards = http.get("/v1/models").json()["data"]
        for step, name, salt in STEPS:
            body: dict[str, Any] = {
                "model": name, "prompt": PROMPT, "max_tokens": 1, "temperature": 0
            }  # fmt: skip
            if salt is not None:
                body["cache_salt"] = salt
            r = http.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            assert r.json()["model"] == name
            sc._drain(sub, step, recording)
        for bad in ("a/b", "", 7):
            r = http.post(
                "/v1/completions",
                json={"model": SERVED_MODEL, "prompt": PROMPT, "max_tokens": 1,
                      "cache_salt": bad},
            )  # fmt: skip
            assert r.status_code == 400, (bad, r.text)
            assert "cache_salt" in r.text, r.text
    return cards, recording


def _check(cards: list[dict[str, Any]], recording: list[dict[str, Any]]) -> None:
    by_id = {c["id"]: c for c in cards}
    assert by_id[ADAPTER]["parent"] == SERVED_MODEL and by_id[SERVED_MODEL]["parent"] is None
    assert {c["id"]: VLLM.lora_adapter(c) for c in cards} == {
        SERVED_MODEL: None,
        ADAPTER: LoraAdapter(salt=ADAPTER, base_model=SERVED_MODEL),
    }

    base, lora = _batches(recording, SERVED_MODEL), _batches(recording, ADAPTER)
    stored_base = [e for b in base for e in b.events if isinstance(e, BlockStored)]
    stored_lora = [e for b in lora for e in b.events if isinstance(e, BlockStored)]
    assert stored_base and stored_lora
    assert {e.lora_name for e in stored_base} == {None}
    assert {e.lora_name for e in stored_lora} == {ADAPTER}
    # the same tokens, other blocks: the engine hashed the adapter's apart
    hashes_base = {h for e in stored_base for h in e.block_hashes}
    hashes_lora = {h for e in stored_lora for h in e.block_hashes}
    assert hashes_base.isdisjoint(hashes_lora)

    index = KvIndex()
    for b in base:
        index.apply(EndpointId("base"), b)
    for b in lora:
        index.apply(EndpointId("lora"), b)
    bs = sc.BLOCK_SIZE
    full = len(PROMPT) // bs * bs
    adapter_keys = PromptKeys(PROMPT, salt=ADAPTER)
    base_keys = PromptKeys(PROMPT)
    assert adapter_keys.resident_tokens(index, EndpointId("lora"), bs) == full
    assert adapter_keys.resident_tokens(index, EndpointId("base"), bs) == 0
    assert base_keys.resident_tokens(index, EndpointId("base"), bs) == full
    assert base_keys.resident_tokens(index, EndpointId("lora"), bs) == 0

    # cache_salt: published on the chain's first block, hashed into all of it
    for step, lora in (("salted", None), ("adapter-salted", ADAPTER)):
        batches = _batches(recording, step)
        stored = [e for b in batches for e in b.events if isinstance(e, BlockStored)]
        assert stored, step
        assert stored[0].parent_hash is None and stored[0].cache_salt == SALT, stored[0]
        assert {e.lora_name for e in stored} == {lora}
        assert {e.spec_kind for e in stored} <= {None, "full_attention"}
        hashes = {h for e in stored for h in e.block_hashes}
        assert hashes.isdisjoint(hashes_base | hashes_lora), step
        ep = EndpointId(step)
        for b in batches:
            index.apply(ep, b)
        salted = PromptKeys(PROMPT, salt=chain_salt(lora, SALT))
        assert salted.resident_tokens(index, ep, bs) == full, step
        assert salted.resident_tokens(index, EndpointId("lora" if lora else "base"), bs) == 0
        assert PromptKeys(PROMPT, salt=lora).resident_tokens(index, ep, bs) == 0, step


def _lora_flags(pub_endpoint: str, adapter_dir: Path) -> tuple[str, ...]:
    replay = sc.replay_endpoint_beside(pub_endpoint)
    return (
        "--kv-events-config", sc.kv_events_config(pub_endpoint, replay),
        "--enable-lora", "--max-lora-rank", str(RANK), "--max-loras", "1",
        "--lora-modules", f"{ADAPTER}={adapter_dir}",
    )  # fmt: skip


@pytest.mark.realvllm
@pytest.mark.timeout(900)
def test_real_vllm_publishes_an_adapters_blocks_under_its_name(
    sub_socket: tuple[zmq.Socket[bytes], str], tmp_path: Path
) -> None:
    sub, pub_endpoint = sub_socket
    python = ensure_venv()
    model = ensure_model(python)
    adapter_dir = write_adapter(tmp_path / ADAPTER, model)
    flags = _lora_flags(pub_endpoint, adapter_dir)
    with run_real_vllm(python, model, tmp_path / "server.log", flags) as server:
        cards, recording = _run(server.base_url, sub)
    _check(cards, recording)


def test_emulator_publishes_an_adapters_blocks_under_its_name(
    sub_socket: tuple[zmq.Socket[bytes], str], tmp_path: Path
) -> None:
    sub, pub_endpoint = sub_socket
    engine = (
        "vllm", "serve", SERVED_MODEL, "--host", "127.0.0.1", "--port", "{port}",
        "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "4",
        "--num-gpu-blocks-override", str(NUM_BLOCKS), "--block-size", str(sc.BLOCK_SIZE),
        "--enable-prefix-caching", *_lora_flags(pub_endpoint, tmp_path / ADAPTER),
    )  # fmt: skip
    with run_emulator(tmp_path / "sim.log", engine) as backend:
        cards, recording = _run(backend.base_url, sub)
    _check(cards, recording)
