"""LoRA adapters in the exact view: vLLM publishes an adapter's blocks with its
``lora_name`` and hashes them apart from the base model's, so the router salts an
adapter request's keys with the same name (``EngineAdapter.lora_adapter``, read from the
adapter's ``/v1/models`` card, whose ``parent`` is the base model).

Pure where it can be: an index fed by hand-built events, endpoint records with live
feeds; the ``/v1/models`` read goes through the poller with a fake getter serving the
recorded vLLM 0.32 list plus one adapter card in vLLM's shape.
"""

from __future__ import annotations

import json

import msgpack
from endpoints import loopback_endpoint
from recordings import VLLM_032
from routerkit import router_config

from fleetgate.engines.base import BlockStored, KvEventBatch, LoraAdapter
from fleetgate.router.app import build_fleet
from fleetgate.router.client import make_client
from fleetgate.router.config import parse_config
from fleetgate.router.metrics import RouterMetrics
from fleetgate.router.poller import Poller
from fleetgate.router.request import ParseSettings, parse_request
from fleetgate.router.scheduling.exact import PromptKeys
from fleetgate.router.scheduling.kvindex import KvIndex
from fleetgate.router.scheduling.load import LoadParams
from fleetgate.router.scheduling.prefix import PrefixIndex
from fleetgate.router.scheduling.types import EndpointId
from fleetgate.router.served import adapter_for
from fleetgate.router.state import Fleet

BS = 16
BASE = "base-model"
LORA = "sql-lora"
TOKENS = [1000 + (i * 7919) % 30000 for i in range(8 * BS)]


def _stored(tokens: list[int], lora_name: str | None) -> KvEventBatch:
    blocks = len(tokens) // BS
    return KvEventBatch(
        seq=0,
        ts=1.0,
        events=(
            BlockStored(
                block_hashes=tuple(range(1, blocks + 1)),
                parent_hash=None,
                token_ids=tuple(tokens),
                block_size=BS,
                lora_name=lora_name,
            ),
        ),
    )


def _fleet() -> Fleet:
    eps = []
    for name in ("base-holder", "lora-holder"):
        e = loopback_endpoint("vllm", name, 18400)
        e.healthy = True
        e.set_models([BASE, LORA], {LORA: LoraAdapter(salt=LORA, base_model=BASE)})
        e.kv_feed.set("live", 1.0)
        eps.append(e)
    return Fleet(eps, index=PrefixIndex(1024), load_params=LoadParams(), kv_index=KvIndex())


def test_an_adapter_request_matches_its_own_blocks_and_never_the_base_models() -> None:
    fleet = _fleet()
    assert fleet.kv_index is not None
    # the same document prefilled for the base model on one engine, for the adapter
    # on the other: the same token ids, different blocks
    fleet.kv_index.apply(EndpointId("base-holder"), _stored(TOKENS, None))
    fleet.kv_index.apply(EndpointId("lora-holder"), _stored(TOKENS, LORA))
    base_ep, lora_ep = (
        fleet.endpoints[EndpointId("base-holder")],
        fleet.endpoints[EndpointId("lora-holder")],
    )
    assert fleet.kv_salt(BASE) is None and fleet.kv_salt(LORA) == LORA
    adapter_keys = PromptKeys(TOKENS, salt=fleet.kv_salt(LORA))
    base_keys = PromptKeys(TOKENS, salt=fleet.kv_salt(BASE))
    assert fleet.exact_cached(lora_ep, adapter_keys) == len(TOKENS)
    assert fleet.exact_cached(base_ep, adapter_keys) == 0  # the base blocks are no hit
    assert fleet.exact_cached(base_ep, base_keys) == len(TOKENS)
    assert fleet.exact_cached(lora_ep, base_keys) == 0
    # unsalted, an adapter request read the base model's blocks as its own
    assert fleet.exact_cached(base_ep, PromptKeys(TOKENS)) == len(TOKENS)


def test_an_adapters_base_model_goes_by_the_name_clients_use() -> None:
    """An adapter is tokenized with its base model's tokenizer, which the router's
    config names by the served name; an engine that lists its model under another
    name (its path) names the adapter's parent that way."""
    e = loopback_endpoint("vllm", "renamed", 18401, served_model="llama")
    e.set_models(["/models/llama", LORA], {LORA: LoraAdapter(LORA, "/models/llama")})
    fleet = Fleet([e], index=PrefixIndex(1024), load_params=LoadParams(), kv_index=KvIndex())
    assert e.models == {"llama", LORA}
    assert fleet.base_model(LORA) == "llama" and fleet.base_model("llama") is None


def test_a_request_to_an_adapter_is_keyed_with_its_salt() -> None:
    req = parse_request(
        "/v1/completions",
        json.dumps({"model": LORA, "prompt": "select 1", "max_tokens": 4}).encode(),
        [],
        settings=ParseSettings(priority=parse_config({}).classes),
        known_models=[LORA],
        endpoints=[],
        new_id=lambda: "fg-1",
        now=1.0,
    )
    req.set_tokens(TOKENS, salt=LORA)
    assert req.prompt is not None and req.prompt.salt == LORA
    assert req.prompt.keys(BS) == PromptKeys(TOKENS, salt=LORA).keys(BS)
    assert req.prompt.keys(BS) != PromptKeys(TOKENS).keys(BS)
    assert req.view.prompt_tokens == len(TOKENS)


class _Getter:
    def __init__(self, body: bytes) -> None:
        self.body = body

    async def get(self, url: str, within_s: float) -> tuple[int, bytes]:
        assert url.endswith("/v1/models")
        return 200, self.body


async def test_the_poller_reads_which_models_are_adapters_from_v1_models() -> None:
    listed = json.loads((VLLM_032 / "models.json").read_text())["response"]["body_json"]
    base = listed["data"][0]
    assert base["parent"] is None
    # vLLM's card for an adapter loaded with --lora-modules sql-lora=/adapters/sql
    listed["data"].append(
        {"id": LORA, "object": "model", "created": base["created"], "owned_by": "vllm",
         "root": "/adapters/sql", "parent": base["id"], "max_model_len": None,
         "permission": base["permission"]}
    )  # fmt: skip
    config = router_config([("vllm", "http://127.0.0.1:1")])
    fleet = build_fleet(config)
    client = make_client(test_mode=True, max_connections=1, connect_timeout=1, read_timeout=1)
    await client.aclose()  # never used: the fake getter answers
    getter = _Getter(json.dumps(listed).encode())
    poller = Poller(fleet, client, config, RouterMetrics(), lambda: 100.0, getter=getter)
    (e,) = fleet
    await poller.load_models(e)
    assert LORA in e.models and base["id"] in e.models
    assert e.lora_adapters == {LORA: LoraAdapter(salt=LORA, base_model=base["id"])}
    assert fleet.kv_salt(LORA) == LORA and fleet.kv_salt(base["id"]) is None
    assert fleet.base_model(LORA) == base["id"] and fleet.base_model(base["id"]) is None


def test_a_tensorrt_llm_request_names_its_adapter_in_the_body() -> None:
    """trtllm-serve takes ``lora_request`` in the body and its streaming publisher sends
    the adapter's blocks with ``lora_id`` = the request's ``lora_int_id``: the router
    salts such a request as the decoder salts those blocks, so it neither reads the
    base model's blocks as its own nor misses its own."""
    trt = adapter_for("trtllm", None)
    body = {"model": BASE, "prompt": "x",
            "lora_request": {"lora_name": "sql", "lora_int_id": 3, "lora_path": "/a"}}  # fmt: skip
    assert trt.request_lora_salt(body) == "lora-id:3"
    for bad in ({}, {"lora_request": "sql"}, {"lora_request": {"lora_int_id": True}}):
        assert trt.request_lora_salt(bad) is None
    assert adapter_for("vllm", None).request_lora_salt(body) is None  # vLLM: by model

    e = loopback_endpoint("trtllm", "trt", 18402)
    e.kv_feed.set("live", 1.0)
    fleet = Fleet([e], index=PrefixIndex(1024), load_params=LoadParams(), kv_index=KvIndex())
    assert fleet.request_lora_salt(body) == "lora-id:3"
    bs = e.block_size
    assert fleet.request_lora_salt({"model": BASE}) is None
    # the adapter's blocks as the streaming publisher sends them (lora_id, no name)
    raw = {"type": "BlockStored", "block_hashes": [-5, 6], "parent_block_hash": None,
           "token_ids": TOKENS[: 2 * bs], "block_size": bs, "lora_id": 3, "medium": "GPU",
           "lora_name": None}  # fmt: skip
    frames = [b"", (0).to_bytes(8, "big"), msgpack.packb([1.0, [raw], 0])]
    assert fleet.kv_index is not None
    for batch in trt.decode_kv_events(frames):
        fleet.kv_index.apply(e.id, batch)
    salted = PromptKeys(TOKENS, salt=fleet.request_lora_salt(body))
    assert fleet.exact_cached(e, salted) == 2 * bs
    assert fleet.exact_cached(e, PromptKeys(TOKENS)) == 0  # a base request: no hit
