"""Scoring on the exact resident prefix (KV events), per-endpoint fallback to the
approximate view, and the closed-loop metrics by source.

The router app runs in-process over an httpx mock transport (the engines answer with
a usage block); its ``KvIndex`` is fed with ``BlockStored`` / ``BlockRemoved`` events
carrying the real token ids, as the KV-event subscriber would.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import httpx
import pytest
from routerkit import router_config

from fleetgate.engines.base import BlockRemoved, BlockStored, KvEventBatch
from fleetgate.router.app import build_router, decision_trace
from fleetgate.router.config import TokenizerSpec
from fleetgate.router.scheduling.exact import PromptKeys
from fleetgate.router.scheduling.kvindex import KvIndex
from fleetgate.router.scheduling.pipeline import default_pipeline
from fleetgate.router.scheduling.tokenize import HfTokenizer
from fleetgate.router.scheduling.types import EndpointId, EndpointView, RequestView
from fleetgate.router.services import Services
from fleetgate.router.state import Endpoint
from fleetgate.router.tokenizer_files import load_tokenizer

from .views import load

MODEL = "m"
URLS = ("http://127.0.0.1:18041", "http://127.0.0.1:18042")
SYSTEM = (
    "You are the support assistant of a parcel company. Answer politely, cite the "
    "order number, never invent tracking data, and keep every answer short. "
) * 8
TOK = load_tokenizer("m", TokenizerSpec(kind="emulator"))
BS = 16  # the vLLM adapter's default block size (no scrape in these tests)


def chat(question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def shared_tokens() -> list[int]:
    """The tokens every ``chat(...)`` shares: BOS + the system turn."""
    a, b = TOK.encode_chat(chat("first?")), TOK.encode_chat(chat("second!"))
    n = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    return a[:n]


def stored(tokens: list[int], first_hash: int) -> KvEventBatch:
    n = len(tokens) // BS
    hashes = tuple(range(first_hash, first_hash + n))
    event = BlockStored(
        block_hashes=hashes, parent_hash=None, token_ids=tuple(tokens[: n * BS]), block_size=BS
    )
    return KvEventBatch(seq=None, events=(event,))


def removed(first_hash: int, n: int) -> KvEventBatch:
    return KvEventBatch(
        seq=None, events=(BlockRemoved(block_hashes=tuple(range(first_hash, first_hash + n))),)
    )


class Router:
    """A router app over two mock engines; records which endpoint got each request."""

    def __init__(self, live: tuple[bool, bool] = (True, True)) -> None:
        self.got: list[str] = []
        cfg = router_config(
            [("vllm", u) for u in URLS], scheduling={"tokenizers": {MODEL: {"kind": "emulator"}}}
        )
        self.app = build_router(
            cfg, transport=httpx.MockTransport(self.engine), start_background=False
        )
        self.s: Services = self.app.state.router
        self.s.fleet.kv_index = KvIndex()
        self.eps: list[Endpoint] = list(self.s.fleet)
        for e, on in zip(self.eps, live, strict=True):
            e.healthy, e.models = True, frozenset({MODEL})
            e.kv_feed.set("live" if on else "off", 0.0)
        self.by_url = {e.url: e.id for e in self.eps}

    def engine(self, request: httpx.Request) -> httpx.Response:
        self.got.append(self.by_url[f"http://{request.url.host}:{request.url.port}"])
        body = json.loads(request.content)
        prompt = len(TOK.encode_chat(body["messages"]))
        usage = {
            "prompt_tokens": prompt,
            "completion_tokens": 1,
            "total_tokens": prompt + 1,
            "prompt_tokens_details": {"cached_tokens": 0},
        }
        answer = {
            "id": "x",
            "object": "chat.completion",
            "model": MODEL,
            "choices": [
                {"index": 0, "message": {"role": "assistant", "content": "ok"},
                 "finish_reason": "stop"}
            ],
            "usage": usage,
        }  # fmt: skip
        return httpx.Response(200, json=answer)

    def apply(self, e: Endpoint, batch: KvEventBatch) -> None:
        assert self.s.fleet.kv_index is not None
        self.s.fleet.kv_index.apply(e.id, batch)

    async def ask(self, question: str) -> str:
        transport = httpx.ASGITransport(app=self.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as c:
            r = await c.post(
                "/v1/chat/completions", json={"model": MODEL, "messages": chat(question)}
            )
        assert r.status_code == 200, r.text
        return self.got[-1]

    def decisions(self, reason: str, source: str) -> float:
        """``fleetgate_decisions_total`` for ``reason`` and ``source``, any decided_by."""
        return sum(
            sample.value
            for metric in self.s.metrics.decisions.collect()
            for sample in metric.samples
            if sample.name == "fleetgate_decisions_total"
            and sample.labels["reason"] == reason
            and sample.labels["source"] == source
        )

    def sample(self, name: str, **labels: str) -> float:
        return self.s.metrics.registry.get_sample_value(name, labels) or 0.0


@pytest.mark.parametrize("holder", [0, 1])
async def test_an_evicted_prefix_stops_attracting_requests(holder: int) -> None:
    r = Router()
    a, b = r.eps[holder], r.eps[1 - holder]
    prefix = shared_tokens()
    n = len(prefix) // BS
    assert n >= 8
    r.apply(a, stored(prefix, 1000))
    for i in range(4):
        assert await r.ask(f"where is order {i}?") == a.id
    hit = r.sample(
        "fleetgate_decisions_total",
        model=MODEL, reason="affinity-hit", decided_by="scorer:prefix-affinity", source="events",
    )  # fmt: skip
    assert hit == 4
    # the engine evicts the prefix; the same blocks appear on the other engine
    r.apply(a, removed(1000, n))
    r.apply(b, stored(prefix, 5000))
    for i in range(3):
        assert await r.ask(f"and order {i + 10}?") == b.id
    # evicted everywhere: nothing pulls; the pick is a cold placement
    r.apply(b, removed(5000, n))
    await r.ask("a last question")
    assert r.decisions("cold", "events") == 1
    assert r.decisions("affinity-hit", "events") == 4 + 3


async def test_the_closed_loop_metrics_are_labelled_by_source() -> None:
    r = Router(live=(True, False))
    a = r.eps[0]
    prefix = shared_tokens()
    r.apply(a, stored(prefix, 1000))
    assert await r.ask("q1") == a.id
    n_blocks = len(prefix) // BS
    predicted = r.sample(
        "fleetgate_predicted_cached_tokens_total", endpoint=a.id, engine="vllm", source="events"
    )
    assert predicted == n_blocks * BS
    assert r.sample("fleetgate_cache_prediction_error_ratio_count", source="events") == 1
    # the engine said 0 cached: the error is the whole prediction over the prompt
    prompt = len(TOK.encode_chat(chat("q1")))
    assert r.sample("fleetgate_cache_prediction_error_ratio_sum", source="events") == pytest.approx(
        n_blocks * BS / prompt
    )
    assert (
        r.sample(
            "fleetgate_actual_cached_tokens_total", endpoint=a.id, engine="vllm", source="events"
        )
        == 0
    )
    # the other endpoint's feed is not live: what it gets is predicted approximately
    a.healthy = False
    other = await r.ask("q2")
    assert other == r.eps[1].id
    assert r.sample("fleetgate_cache_prediction_error_ratio_count", source="approximate") == 1


async def test_replicas_fed_the_same_events_pick_the_same_endpoints() -> None:
    one, two = Router(), Router()
    docs = [
        [{"role": "system", "content": "Alpha manual. " * 60}],
        [{"role": "system", "content": "Beta handbook 1234 5678. " * 50}],
    ]
    for router in (one, two):
        for i, doc in enumerate(docs):
            tokens = TOK.encode_chat(doc, add_generation_prompt=False)
            router.apply(router.eps[i], stored(tokens, 100 * (i + 1)))
    questions = [(d, q) for q in ("why?", "how much?", "when?") for d in (0, 1)]
    picks: list[list[str]] = []
    for router in (one, two):
        got = []
        for d, q in questions:
            msgs = [*docs[d], {"role": "user", "content": q}]
            transport = httpx.ASGITransport(app=router.app)
            async with httpx.AsyncClient(transport=transport, base_url="http://r") as c:
                resp = await c.post("/v1/chat/completions", json={"model": MODEL, "messages": msgs})
            assert resp.status_code == 200
            got.append(router.got[-1])
        picks.append(got)
    assert picks[0] == picks[1]
    assert picks[0] == [one.eps[d].id for d, _ in questions]  # each document's holder


# ------------------------------------------------------------ pure scoring


def ev(name: str, *, match: int = 0, exact: int | None = None, rank: int = 0) -> EndpointView:
    return EndpointView(
        id=EndpointId(name),
        engine="vllm",
        models=frozenset({MODEL}),
        healthy=True,
        ejected=False,
        load=load(),
        prefix_match=match,
        exact_cached_tokens=exact,
        rendezvous_rank=rank,
    )


REQ = RequestView(model=MODEL, chunks=10, prompt_tokens=1000, max_tokens=16)


def test_exact_and_approximate_compete_in_tokens() -> None:
    pipe = default_pipeline()

    # approximate: 6 of 10 chunks ~ 600 tokens; exact: 640 resident tokens
    d = pipe.schedule(
        REQ, [ev("approx", match=6), ev("exact", exact=640, rank=1)], random.Random(0)
    )
    assert d.pick == "exact" and d.reason == "affinity-hit" and d.cache_source == "events"
    assert d.predicted_cached_tokens == 640
    d = pipe.schedule(
        REQ, [ev("approx", match=7), ev("exact", exact=640, rank=1)], random.Random(0)
    )
    assert (
        d.pick == "approx" and d.cache_source == "approximate" and d.predicted_cached_tokens == 700
    )
    # a live feed that says "nothing resident" is believed over a stale approximate guess
    d = pipe.schedule(REQ, [ev("a", exact=0), ev("b", exact=0, rank=1)], random.Random(0))
    assert d.reason == "cold" and d.predicted_cached_tokens == 0


def test_exact_blocks_count_even_when_the_prompt_is_shorter_than_one_chunk() -> None:
    short = RequestView(model=MODEL, chunks=0, prompt_tokens=20, max_tokens=16)

    d = default_pipeline().schedule(
        short, [ev("a", exact=0), ev("b", exact=16, rank=1)], random.Random(0)
    )
    assert d.pick == "b" and d.reason == "affinity-hit"
    d = default_pipeline().schedule(short, [ev("a"), ev("b", rank=1)], random.Random(0))
    assert d.reason == "fallback"


def test_fleet_views_use_the_exact_view_only_where_the_feed_is_live() -> None:
    r = Router(live=(True, False))
    a, b = r.eps
    prefix = shared_tokens()
    r.apply(a, stored(prefix, 1000))
    r.apply(b, stored(prefix, 2000))  # b's events are applied but its feed is not live
    keys = PromptKeys(TOK.encode_chat(chat("x")))
    views = {v.id: v for v in r.s.fleet.views((), [], 0.0, keys)}
    full = len(prefix) // BS * BS
    assert views[a.id].exact_cached_tokens == full
    assert views[b.id].exact_cached_tokens is None
    b.kv_feed.set("live", 0.0)
    assert r.s.fleet.views((), [], 0.0, keys)[1].exact_cached_tokens == full
    r.s.fleet.kv_index = None
    assert all(v.exact_cached_tokens is None for v in r.s.fleet.views((), [], 0.0, keys))
    assert keys.keys(BS) is keys.keys(BS), "keys are computed once per block size"


async def test_requests_without_a_tokenizer_keep_the_approximate_view() -> None:
    r = Router()
    r.s.tokenizers = {}
    r.apply(r.eps[1], stored(shared_tokens(), 1000))
    pick = await r.ask("no tokenizer")  # no token ids: the exact view cannot apply
    assert r.sample(
        "fleetgate_predicted_cached_tokens_total", endpoint=pick, engine="vllm",
        source="approximate",
    ) == 0  # fmt: skip
    assert r.sample("fleetgate_cache_prediction_error_ratio_count", source="events") == 0
    assert r.sample("fleetgate_cache_prediction_error_ratio_count", source="approximate") == 1


def test_a_partial_feed_speaks_only_where_it_knows_blocks() -> None:
    """A partial feed (batches older than the replay buffer never seen) under-reports:
    what it knows is believed, and where it knows nothing the approximate view speaks."""
    r = Router(live=(False, False))
    a, b = r.eps
    prefix = shared_tokens()
    r.apply(a, stored(prefix, 1000))
    keys = PromptKeys(TOK.encode_chat(chat("x")))
    full = len(prefix) // BS * BS
    for e in (a, b):
        e.kv_feed.set("partial", 0.0)
    views = {v.id: v for v in r.s.fleet.views((), [], 0.0, keys)}
    assert views[a.id].exact_cached_tokens == full
    assert views[b.id].exact_cached_tokens is None  # knows nothing: approximate decides
    b.kv_feed.set("live", 0.0)
    views = {v.id: v for v in r.s.fleet.views((), [], 0.0, keys)}
    assert views[b.id].exact_cached_tokens == 0  # a live feed saying "nothing" is believed
    b.kv_feed.set("broken", 0.0)
    assert {v.id: v for v in r.s.fleet.views((), [], 0.0, keys)}[b.id].exact_cached_tokens is None


async def test_the_decision_trace_records_each_placement_and_its_usage() -> None:
    r = Router()
    records: list[dict[str, object]] = []
    r.s.metrics.trace = records.append
    a = r.eps[0]
    r.apply(a, stored(shared_tokens(), 1000))
    assert await r.ask("where is order 7?") == a.id
    placement, usage = records
    assert placement["pick"] == a.id and placement["reason"] == "affinity-hit"
    eps = placement["eps"]
    assert isinstance(eps, dict)
    exact, approximate, _work, backlog, affinity = eps[a.id]
    assert exact == len(shared_tokens()) // BS * BS and approximate == 0 and backlog == 0
    assert affinity and affinity > 0.5
    assert eps[r.eps[1].id][0] == 0  # a live feed that knows nothing: 0, not null
    assert usage["usage"] == placement["id"] and usage["ep"] == a.id
    assert usage["pred"] == exact and usage["src"] == "events" and usage["cached"] == 0


def test_the_decision_trace_is_off_unless_a_path_is_given(tmp_path: Path) -> None:
    assert decision_trace(None) is None and decision_trace("") is None
    write = decision_trace(str(tmp_path / "trace"))
    assert write is not None
    write({"a": 1})
    write({"b": [1, None]})
    (out,) = tmp_path.iterdir()
    assert [json.loads(line) for line in out.read_text().splitlines()] == [
        {"a": 1},
        {"b": [1, None]},
    ]


async def test_the_router_reuses_the_shared_prefix_tokens_of_its_requests() -> None:
    """The request path tokenizes through the prefix token cache: the second question
    on the same system prompt reuses its ids, and the exact view scores it the same as
    tokenizing it whole would."""
    r = Router()
    tok = r.s.tokenizers[MODEL]
    assert isinstance(tok, HfTokenizer) and tok.prefix_cache is not None
    shared = shared_tokens()
    r.apply(r.eps[1], stored(shared, 500))
    assert await r.ask("first?") == r.eps[1].id
    hits = tok.prefix_cache.hits
    assert await r.ask("second, on the same document!") == r.eps[1].id
    assert tok.prefix_cache.hits == hits + 1 and tok.prefix_cache.reused_ids > 0
    assert tok.prefix_cache.mismatches == 0
    # and says so on /metrics
    assert r.sample("fleetgate_token_cache_lookups_total", model=MODEL, result="hit") == hits + 1
    assert r.sample("fleetgate_token_cache_reused_tokens_total", model=MODEL) > 0
    assert r.sample("fleetgate_token_cache_enabled", model=MODEL) == 1.0
