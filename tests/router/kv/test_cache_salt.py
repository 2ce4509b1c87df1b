"""vLLM's per-request ``cache_salt`` in the exact view.

vLLM hashes a request's ``cache_salt`` into the first block of its sequence (and so,
through the parent hashes, into every block after it) and publishes it in that block's
``extra_keys``. Before this, the router keyed a salted request as an unsalted one: it
read another tenant's blocks of the same document as resident (a hit the engine would
not give), and the salted blocks it indexed never matched the salted requests that
follow. Now the adapter decodes the salt, the index salts the chain's root with it, and
the router salts a request's keys with the ``cache_salt`` of its body.

Pure tests of the decoder and the index, then the emulator (which salts as vLLM does)
behind a router: a salted follow-up is an affinity hit and the engine confirms it.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import msgpack
import pytest

from fleetgate.engines.base import BlockStored, KvEventBatch, KvEventsDecodeError
from fleetgate.engines.vllm import encode_vllm_kv_batch
from fleetgate.router.app import build_router
from fleetgate.router.config import parse_config
from fleetgate.router.request import ParseSettings, parse_request
from fleetgate.router.scheduling.exact import PromptKeys
from fleetgate.router.scheduling.kvindex import KvIndex, chain_salt
from fleetgate.router.scheduling.types import EndpointId
from fleetgate.router.served import adapter_for
from fleetgate.router.state import Fleet
from fleetgate.sim.core import tokenizer as sim_tokenizer
from fleetgate.sim.fleet import run_fleet

from .test_exact_routing import SYSTEM, chat, sched_config
from .test_kvfeed import BS, metric, until, vllm_spec

VLLM = adapter_for("vllm", None)
TOKENS = tuple(500 + i for i in range(4 * BS))
EP = EndpointId("e")


def _frames(events: list[dict[str, Any]]) -> list[bytes]:
    return [b"", (3).to_bytes(8, "big"), msgpack.packb([1.0, events, 0])]


def _stored(extra_keys: Any, *, parent: int | None = None, lora: str | None = None) -> Any:
    (batch,) = VLLM.decode_kv_events(
        _frames(
            [
                {
                    "type": "BlockStored",
                    "block_hashes": [21, 22],
                    "parent_block_hash": parent,
                    "token_ids": list(range(2 * BS)),
                    "block_size": BS,
                    "lora_id": None,
                    "medium": "GPU",
                    "lora_name": lora,
                    "extra_keys": extra_keys,
                    "group_idx": 0,
                    "kv_cache_spec_kind": "full_attention",
                }
            ]
        )
    )
    (event,) = batch.events
    assert isinstance(event, BlockStored)
    return event


def test_the_decoder_reads_the_salt_from_the_first_blocks_extra_keys() -> None:
    plain = _stored([None, None])
    assert (plain.cache_salt, plain.spec_kind) == (None, "full_attention")
    salted = _stored([["tenant-a"], None])
    assert (salted.cache_salt, salted.spec_kind) == ("tenant-a", "full_attention")
    # a LoRA adapter's name comes first in every block's keys, the salt after it
    both = _stored([["sql", "tenant-a"], ["sql"]], lora="sql")
    assert (both.lora_name, both.cache_salt, both.spec_kind) == (
        "sql",
        "tenant-a",
        "full_attention",
    )
    assert _stored([["sql"], ["sql"]], lora="sql").cache_salt is None


def test_blocks_keyed_by_more_than_their_tokens_are_not_keyable() -> None:
    # an image ((mm_identifier, offset)), prompt embeddings (a digest), or a string
    # where vLLM never puts a salt (past the sequence's first block)
    for extra in ([None, [["img-sha", 0]]], [[b"\x01" * 32], None], [None, ["x"]]):
        assert _stored(extra).spec_kind == "multimodal", extra
    assert _stored([["tenant-a"], None], parent=7).spec_kind == "multimodal"
    with pytest.raises(KvEventsDecodeError):
        _stored({"not": "a list"})
    with pytest.raises(KvEventsDecodeError):
        _stored(["not a list"])


def test_the_encoder_writes_what_the_decoder_reads() -> None:
    event = BlockStored(
        (1, 2), None, TOKENS[: 2 * BS], BS, medium="GPU", lora_name="sql", cache_salt="t"
    )
    frames = encode_vllm_kv_batch(0, KvEventBatch(seq=0, events=(event,), ts=1.0))
    raw = msgpack.unpackb(frames[2], raw=False)[1][0]
    assert raw["extra_keys"] == [["sql", "t"], ["sql"]]
    (batch,) = VLLM.decode_kv_events(frames)
    assert batch.events == (event,)


def test_the_approximate_view_keys_a_salted_request_apart_too() -> None:
    """Without events the router's own chunk chain is the view: a salted request's
    chain starts from its salt, so it neither hits an unsalted request's placements
    nor another tenant's, and follows its own tenant's."""

    def chain(salt: object) -> tuple[int, ...]:
        body: dict[str, Any] = {"model": "m", "prompt": SYSTEM, "max_tokens": 1}
        if salt is not None:
            body["cache_salt"] = salt
        req = parse_request(
            "/v1/completions",
            json.dumps(body).encode(),
            [],
            settings=ParseSettings(priority=parse_config({}).classes),
            known_models=["m"],
            endpoints=[],
            new_id=lambda: "fg-1",
            now=1.0,
        )
        assert req.cache_salt == (salt if isinstance(salt, str) and salt else None)
        return req.chain

    plain, a, b = chain(None), chain("tenant-a"), chain("tenant-b")
    assert len(plain) == len(a) == len(b) > 3
    assert not set(plain) & set(a) and not set(a) & set(b)
    assert chain("tenant-a") == a
    # a salt the engine will refuse (its 400) is no salt to the router
    assert chain("") == plain and chain(7) == plain


def test_the_index_salts_a_chain_with_its_first_blocks_salt() -> None:
    index = KvIndex()
    salt = chain_salt(None, "tenant-a")
    first = BlockStored((1, 2), None, TOKENS[: 2 * BS], BS, cache_salt="tenant-a")
    # the next step's blocks chain from the salted parent and carry no salt themselves
    rest = BlockStored((3, 4), 2, TOKENS[2 * BS :], BS)
    index.apply(EP, KvEventBatch(seq=0, events=(first, rest), ts=1.0))
    assert index.match(EP, PromptKeys(TOKENS, salt=salt).keys(BS)) == 4
    assert index.match(EP, PromptKeys(TOKENS).keys(BS)) == 0
    assert index.match(EP, PromptKeys(TOKENS, salt=chain_salt(None, "tenant-b")).keys(BS)) == 0
    # with a LoRA adapter too: both salt the root, neither alone matches
    index.apply(EP, KvEventBatch(seq=1, events=(BlockStored((9,), None, TOKENS[:BS], BS,
                lora_name="sql", cache_salt="tenant-a"),), ts=2.0))  # fmt: skip
    assert index.match(EP, PromptKeys(TOKENS, salt=chain_salt("sql", "tenant-a")).keys(BS)) == 1
    assert index.match(EP, PromptKeys(TOKENS, salt="sql").keys(BS)) == 0
    assert chain_salt("sql", None) == "sql" and chain_salt(None, None) is None


async def test_a_salted_request_is_no_hit_on_unsalted_blocks_and_follows_its_own() -> None:
    spec = vllm_spec(num_gpu_blocks=200, max_model_len=512)
    async with run_fleet([spec, spec], time_scale=0) as sim:
        app = build_router(sched_config(list(sim.engines)))
        fleet: Fleet = app.state.router.fleet
        metrics = app.state.router.metrics
        model = sim.engines[0].model
        index = fleet.kv_index
        assert index is not None
        system = sim_tokenizer.encode_chat(chat(SYSTEM, "")[:1], add_generation_prompt=False)
        plain = PromptKeys(system).keys(BS)
        salted = PromptKeys(system, salt=chain_salt(None, "tenant-a")).keys(BS)
        assert len(plain) >= 5

        def decisions(reason: str) -> float:
            return metric(metrics, "fleetgate_decisions_total", reason=reason)

        async def post(c: httpx.AsyncClient, question: str, salt: str | None) -> httpx.Response:
            body: dict[str, Any] = {"model": model, "messages": chat(SYSTEM, question),
                                    "max_tokens": 2}  # fmt: skip
            if salt is not None:
                body["cache_salt"] = salt
            r = await c.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            return r

        def cached(r: httpx.Response) -> int:
            details = r.json()["usage"].get("prompt_tokens_details") or {}
            return int(details.get("cached_tokens") or 0)

        async with app.router.lifespan_context(app):
            await until(lambda: all(e.kv_feed.state == "live" for e in fleet), "feeds live")
            # the document prefilled unsalted on one engine, behind the router's back
            holder = next(e for e in fleet if e.url == sim.engines[0].url)
            async with httpx.AsyncClient(base_url=sim.engines[0].url, timeout=30) as direct:
                await post(direct, "What is a pool?", None)
                await until(
                    lambda: index.match(holder.id, plain) == len(plain),
                    "the unsalted system prompt indexed",
                )
                # the emulator salts as vLLM does: a salted request computes afresh
                assert cached(await post(direct, "What is a pool?", "tenant-z")) == 0
                assert cached(await post(direct, "What is a pod?", None)) >= len(plain) * BS
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(
                transport=transport, base_url="http://router", timeout=30
            ) as c:
                # a tenant's request for the same document: the unsalted blocks are no
                # hit for it (keyed unsalted, the router called this an affinity hit)
                hits, cold = decisions("affinity-hit"), decisions("cold")
                r = await post(c, "What is a replica?", "tenant-a")
                assert (decisions("affinity-hit"), decisions("cold")) == (hits, cold + 1)
                assert cached(r) == 0
                first = r.headers["x-fleetgate-endpoint"]
                await until(
                    lambda: index.match(first, salted) == len(salted),  # type: ignore[arg-type]
                    "the salted system prompt indexed under salted keys",
                )
                # its follow-up goes where its own salted blocks are, and the engine
                # confirms the hit
                r = await post(c, "How do I drain?", "tenant-a")
                assert r.headers["x-fleetgate-endpoint"] == first
                assert decisions("affinity-hit") == hits + 1
                assert cached(r) >= len(salted) * BS
