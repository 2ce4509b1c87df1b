"""A LoRA adapter on the REAL vLLM 0.32 (CPU): how it is listed and how its blocks are
published, which is what the router's keys for adapter requests rest on
(``EngineAdapter.kv_salt``, docs/router.md "LoRA adapters").

The server is started with ``--enable-lora --lora-modules tiny-lora=<dir>`` (an adapter
written by :mod:`.lora_adapter`) and ``--kv-events-config``. One prompt goes to the
base model and then to the adapter; the checks: ``/v1/models`` lists the adapter with
its ``parent``, vLLM's adapter salts it with its name, the adapter's ``BlockStored``
events carry ``lora_name`` and hashes other than the base model's for the same
tokens, and an index fed the real events matches the adapter's keys only where the
adapter's blocks are, and the base model's only where its own are.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
import zmq
from realvllm import SERVED_MODEL, ensure_model, ensure_venv, free_port, run_real_vllm

from fleetgate.engines.base import BlockStored, KvEventBatch
from fleetgate.engines.vllm import ADAPTER as VLLM
from fleetgate.router.scheduling.exact import PromptKeys
from fleetgate.router.scheduling.kvindex import KvIndex
from fleetgate.router.scheduling.types import EndpointId

from . import kv_scenario as sc
from .lora_adapter import RANK, write_adapter

ADAPTER = "tiny-lora"
PROMPT = [30 + (i * 11) % 1900 for i in range(3 * sc.BLOCK_SIZE + 20)]  # 3 full blocks


def _batches(recording: list[dict[str, Any]], step: str) -> list[KvEventBatch]:
    return sc.decode([m for m in recording if m["step"] == step]).get(step, [])


@pytest.mark.realvllm
@pytest.mark.timeout(900)
def test_real_vllm_publishes_an_adapters_blocks_under_its_name(
    sub_socket: tuple[zmq.Socket[bytes], str], tmp_path: Path
) -> None:
    sub, pub_endpoint = sub_socket
    python = ensure_venv()
    model = ensure_model(python)
    adapter_dir = write_adapter(tmp_path / ADAPTER, model)
    flags = (
        "--kv-events-config", sc.kv_events_config(pub_endpoint, free_port()),
        "--enable-lora", "--max-lora-rank", str(RANK), "--max-loras", "1",
        "--lora-modules", f"{ADAPTER}={adapter_dir}",
    )  # fmt: skip
    recording: list[dict[str, Any]] = []
    with run_real_vllm(python, model, tmp_path / "server.log", flags) as server:
        sc.wait_connected(sub)
        with httpx.Client(base_url=server.base_url, timeout=120.0) as http:
            cards = http.get("/v1/models").json()["data"]
            for name in (SERVED_MODEL, ADAPTER):
                r = http.post(
                    "/v1/completions",
                    json={"model": name, "prompt": PROMPT, "max_tokens": 1, "temperature": 0},
                )
                assert r.status_code == 200, r.text
                sc._drain(sub, name, recording)
    by_id = {c["id"]: c for c in cards}
    assert by_id[ADAPTER]["parent"] == SERVED_MODEL and by_id[SERVED_MODEL]["parent"] is None
    assert {c["id"]: VLLM.kv_salt(c) for c in cards} == {SERVED_MODEL: None, ADAPTER: ADAPTER}

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
    full = len(PROMPT) // sc.BLOCK_SIZE * sc.BLOCK_SIZE
    adapter_keys = PromptKeys(PROMPT, salt=VLLM.kv_salt(by_id[ADAPTER]))
    base_keys = PromptKeys(PROMPT, salt=VLLM.kv_salt(by_id[SERVED_MODEL]))
    bs = sc.BLOCK_SIZE
    assert adapter_keys.resident_tokens(index, EndpointId("lora"), bs) == full
    assert adapter_keys.resident_tokens(index, EndpointId("base"), bs) == 0
    assert base_keys.resident_tokens(index, EndpointId("base"), bs) == full
    assert base_keys.resident_tokens(index, EndpointId("lora"), bs) == 0
