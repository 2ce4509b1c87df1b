"""Priority classes through the real router app against emulated vLLM fleets (127.0.0.1).

The router runs with a ``priority:`` section (fleetgate/router/admission.py,
resume.py). The emulator's output is a pure function of (context, seed)
(fleetgate/sim/core/textgen.py), so a request preempted and resumed from token
ids must produce exactly the tokens of an uninterrupted run. Slow engines
(``fixed_s`` 10 ms per step) and a router capacity of 2 sequences per engine
make saturation happen on purpose. Checked:

* a flood of ``batch`` requests and a burst of ``critical`` ones: critical
  TTFT within its objective, batch requests preempted, every batch answer
  (streaming and not) identical token for token to an uninterrupted twin run
  on an idle engine, one ``[DONE]`` per stream, metrics counted;
* a stream whose engine is killed mid-answer completes on the other engine
  with the same output;
* shedding: 429 + Retry-After for sheddable (queue full and queue timeout),
  503 + Retry-After for others; unknown class / bad tenant -> 400;
* tenant fairness through HTTP (WFQ): a late tenant is not starved;
* configuration errors of the ``priority:`` section are one-line ConfigErrors.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from routerkit import router_config, serve

from fleetgate.engines import get_adapter
from fleetgate.router.app import build_router
from fleetgate.router.config import ConfigError, parse_config
from fleetgate.router.priority.config import PriorityConfig
from fleetgate.router.priority.continuation import request_kind
from fleetgate.router.request import Request
from fleetgate.router.scheduling.types import RequestView
from fleetgate.sim import EngineSpec, run_fleet

MODEL = "m"
SLOW = {"fixed_s": 0.01}

CLASSES: list[dict[str, Any]] = [
    {"name": "critical", "level": 8, "ttft_objective_s": 0.5, "max_queue_time_s": 10,
     "max_queued": 100, "preempt_after_fraction": 0.2},
    {"name": "standard", "level": 0, "ttft_objective_s": 2.0, "max_queue_time_s": 0.3,
     "max_queued": 100},
    {"name": "batch", "level": -5, "ttft_objective_s": 60, "max_queue_time_s": 60,
     "max_queued": 1000, "max_preemptions_per_request": 3},
    {"name": "sheddable", "level": -10, "ttft_objective_s": 5, "sheddable": True,
     "max_queue_time_s": 0.3, "max_queued": 2, "retry_after_s": 2},
]  # fmt: skip


def priority_section(**extra: Any) -> dict[str, Any]:
    return {"classes": CLASSES, "saturation": {"kv_usage_max": 0.95}, **extra}


@contextlib.asynccontextmanager
async def rig(
    n: int, capacity: int = 2, queue: bool = True, *, raw_streams: bool = False, **priority: Any
) -> AsyncIterator[tuple[str, list[Any], Any]]:
    """``queue=False``: the same fleet with immediate admission (no priority section);
    ``raw_streams``: ``resume_streams: false`` (immediate admission only)."""
    specs = [EngineSpec(kind="vllm", overrides=SLOW) for _ in range(n)]
    async with run_fleet(specs, "127.0.0.1", 0, model=MODEL) as fleet:
        backends = [("vllm", e.url) for e in fleet.engines]
        sections: dict[str, Any] = {"priority": priority_section(**priority)} if queue else {}
        if raw_streams:
            sections["resume_streams"] = False
        cfg = router_config(backends, capacity=capacity, **sections)
        app = build_router(cfg)
        async with serve(app) as url:
            yield url, fleet.engines, app


def body(prompt: str, max_tokens: int, *, stream: bool, seed: int = 7) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "seed": seed,
        "temperature": 0.8,
    }
    if stream:
        doc["stream"] = True
        doc["stream_options"] = {"include_usage": True}
    return doc


def events(raw: bytes) -> list[dict[str, Any]]:
    out = []
    for line in raw.split(b"\n"):
        if line.startswith(b"data: ") and line != b"data: [DONE]":
            out.append(json.loads(line[6:]))
    return out


def pieces(raw: bytes) -> list[str]:
    return [c.get("text") or "" for ev in events(raw) for c in ev.get("choices", [])]


def usage_of(raw: bytes) -> dict[str, Any]:
    found = [ev["usage"] for ev in events(raw) if ev.get("usage")]
    assert len(found) == 1, found
    return dict(found[0])


def scrape_sum(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name) or line[len(name)] not in " {":
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def post(
    c: httpx.AsyncClient, url: str, doc: dict[str, Any], headers: dict[str, str]
) -> tuple[int, bytes, float | None, dict[str, str]]:
    """(status, body, seconds to the first token event or None, headers)."""
    t0 = time.monotonic()
    first: float | None = None
    data = b""
    async with c.stream("POST", url + "/v1/completions", json=doc, headers=headers) as resp:
        async for chunk in resp.aiter_raw():
            data += chunk
            if first is None and b'"text"' in data:
                first = time.monotonic() - t0
        return resp.status_code, data, first, dict(resp.headers)


async def test_critical_burst_preempts_batch_flood_and_batch_output_is_exact(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="fleetgate.router.admission")
    async with rig(2) as (url, engines, _), httpx.AsyncClient(timeout=60) as c:
        batch_docs = [
            body(f"batch job {i}: summarise the quarterly report", 40, stream=i % 2 == 0, seed=i)
            for i in range(8)
        ]
        hb = {"x-fleetgate-priority": "batch", "x-fleetgate-tenant": "etl"}
        flood = [
            asyncio.create_task(post(c, url, d, {**hb, "x-request-id": f"batch-{i}"}))
            for i, d in enumerate(batch_docs)
        ]
        await asyncio.sleep(0.15)  # the 4 slots are busy, 4 batch requests queue
        crit_docs = [body(f"critical {i}: page me", 5, stream=True, seed=100 + i) for i in range(3)]
        hc = {"x-fleetgate-priority": "critical"}
        crit = await asyncio.gather(*(post(c, url, d, hc) for d in crit_docs))
        batch = await asyncio.gather(*flood)
        text = (await c.get(url + "/metrics")).text

        for status, raw, ttft, _ in crit:
            assert status == 200, raw
            assert ttft is not None and ttft < 0.5, f"critical TTFT {ttft}"
            assert raw.count(b"data: [DONE]") == 1
        preempted = scrape_sum(text, "fleetgate_preemptions_total", **{"class": "batch"})
        resumed = scrape_sum(
            text, "fleetgate_resumes_total", cause="preempted", **{"class": "batch"}
        )
        assert preempted >= 1 and resumed == preempted, (preempted, resumed)
        # Victims had produced tokens (10 ms steps, preempted ~0.25 s in): resumed from ids.
        assert scrape_sum(text, "fleetgate_resume_refed_tokens_total", **{"class": "batch"}) > 0
        victims = {
            int(m.split()[1].removeprefix("batch-"))
            for m in caplog.messages
            if m.startswith("preempt batch-")
        }
        # Both kinds of client were preempted (even = streaming, odd = non-streaming).
        assert {v % 2 for v in victims} == {0, 1}, victims
        met = scrape_sum(
            text, "fleetgate_ttft_objective_total", met="true", **{"class": "critical"}
        )
        assert met == 3

        # Every batch answer equals its uninterrupted twin on an idle engine.
        for doc, (status, raw, _, _) in zip(batch_docs, batch, strict=True):
            assert status == 200, raw
            twin = await c.post(engines[0].url + "/v1/completions", json=doc)
            if doc.get("stream"):
                assert raw.count(b"data: [DONE]") == 1 and raw.endswith(b"data: [DONE]\n\n")
                assert pieces(raw) == pieces(twin.content)
                assert len([p for p in pieces(raw) if p]) == 40
                assert (
                    usage_of(raw)["completion_tokens"]
                    == usage_of(twin.content)["completion_tokens"]
                )
                ids = {ev["id"] for ev in events(raw)}
                assert len(ids) == 1  # one identity across segments
            else:
                got, want = json.loads(raw), twin.json()
                assert got["choices"][0]["text"] == want["choices"][0]["text"]
                assert got["choices"][0]["finish_reason"] == "length"
                assert got["usage"]["completion_tokens"] == want["usage"]["completion_tokens"]
                assert got["usage"]["prompt_tokens"] == want["usage"]["prompt_tokens"]
        # Queue drained, gauges back at 0.
        text = (await c.get(url + "/metrics")).text
        assert scrape_sum(text, "fleetgate_queue_depth") == 0
        assert scrape_sum(text, "fleetgate_dispatches_total", **{"class": "critical"}) == 3


async def test_without_preemption_critical_waits_for_batch() -> None:
    """Negative control for the ablation switch: ``priority.preemption: false``."""
    async with rig(1, preemption=False) as (url, _, _), httpx.AsyncClient(timeout=60) as c:
        hb = {"x-fleetgate-priority": "batch"}
        flood = [
            asyncio.create_task(post(c, url, body(f"b{i}", 60, stream=True), hb)) for i in range(2)
        ]
        await asyncio.sleep(0.1)
        status, raw, ttft, _ = await post(
            c, url, body("crit", 3, stream=True), {"x-fleetgate-priority": "critical"}
        )
        await asyncio.gather(*flood)
        text = (await c.get(url + "/metrics")).text
        assert status == 200
        assert ttft is not None and ttft > 0.3  # waited for a batch request to end
        assert scrape_sum(text, "fleetgate_preemptions_total") == 0


@pytest.mark.parametrize("queue", [True, False], ids=["class-queue", "immediate"])
@pytest.mark.parametrize("how", ["crash", "driver-stop"])
async def test_engine_killed_mid_stream_completes_on_the_other_engine(
    how: str, queue: bool
) -> None:
    """One serve loop: the answer resumes seamlessly with and without a priority section."""
    async with rig(2, queue=queue) as (url, engines, _), httpx.AsyncClient(timeout=60) as c:
        doc = body("a long answer that will lose its engine", 60, stream=True, seed=3)
        data = b""
        async with c.stream("POST", url + "/v1/completions", json=doc) as resp:
            assert resp.status_code == 200
            where = resp.headers["x-fleetgate-endpoint"]
            victim = next(e for e in engines if e.url.endswith(where))
            survivor = next(e for e in engines if e is not victim)
            it = resp.aiter_raw()
            async for chunk in it:
                data += chunk
                if data.count(b'"text"') >= 10:
                    break
            # The victim's listeners close; then either every connection drops at once
            # (crash) or its engine loop stops (the emulator ends open streams with an
            # error event, as vLLM does when its engine core dies).
            for listener in victim.server.servers:
                listener.close()
            if how == "crash":
                for conn in list(victim.server.server_state.connections):
                    conn.transport.abort()
            else:
                await victim.engine.driver.stop()
            async for chunk in it:
                data += chunk
        twin = await c.post(survivor.url + "/v1/completions", json=doc)
        assert pieces(data) == pieces(twin.content)
        assert data.count(b"data: [DONE]") == 1
        assert usage_of(data)["completion_tokens"] == 60
        text = (await c.get(url + "/metrics")).text
        assert scrape_sum(text, "fleetgate_resumes_total", cause="engine_failure") == 1
        victim_id = victim.url.removeprefix("http://")
        assert scrape_sum(text, "fleetgate_upstream_errors_total", endpoint=victim_id) == 1
        survivor_id = survivor.url.removeprefix("http://")
        assert scrape_sum(text, "fleetgate_dispatches_total") == 2
        # The answer was finished by the survivor (the request is logged on its last endpoint).
        assert scrape_sum(text, "fleetgate_requests_total", endpoint=survivor_id) == 1


async def test_shedding_queue_limits_and_bad_class() -> None:
    async with rig(1, capacity=1) as (url, _, _), httpx.AsyncClient(timeout=60) as c:
        # An unknown class (header or body) and a bad tenant are 400s, before any queueing.
        r = await c.post(url + "/v1/completions", json=body("x", 2, stream=False),
                         headers={"x-fleetgate-priority": "urgent"})  # fmt: skip
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["param"] == "x-fleetgate-priority" and "urgent" in err["message"]
        r = await c.post(url + "/v1/completions", json={**body("x", 2, stream=False),
                                                         "priority": "vip"})  # fmt: skip
        assert r.status_code == 400 and r.json()["error"]["param"] == "priority"
        r = await c.post(url + "/v1/completions", json=body("x", 2, stream=False),
                         headers={"x-fleetgate-tenant": "t" * 200})  # fmt: skip
        assert r.status_code == 400 and r.json()["error"]["param"] == "x-fleetgate-tenant"
        # Occupy the only slot with critical work nobody may preempt.
        blocker = asyncio.create_task(
            post(c, url, body("block", 80, stream=True), {"x-fleetgate-priority": "critical"})
        )
        await asyncio.sleep(0.1)
        hs = {"x-fleetgate-priority": "sheddable"}
        t0 = time.monotonic()
        shed = await asyncio.gather(
            *(post(c, url, body(f"s{i}", 2, stream=False), hs) for i in range(3)),
            post(c, url, body("std", 2, stream=True), {}),  # default class: standard
        )
        waited = time.monotonic() - t0
        statuses = sorted(s for s, _, _, _ in shed[:3])
        assert statuses == [429, 429, 429]
        for _, raw, _, headers in shed[:3]:
            assert headers["retry-after"] == "2"
            assert json.loads(raw)["error"]["type"] == "RateLimitError"
        status, raw, _, headers = shed[3]
        assert status == 503 and "retry-after" in headers, raw
        assert 0.3 <= waited < 5
        await blocker
        text = (await c.get(url + "/metrics")).text
        assert (
            scrape_sum(text, "fleetgate_sheds_total", status="429", **{"class": "sheddable"}) == 3
        )
        assert scrape_sum(text, "fleetgate_sheds_total", status="503", **{"class": "standard"}) == 1
        failed = scrape_sum(text, "fleetgate_ttft_objective_total", met="false")
        assert failed == 4
        # Series of every configured class exist (at 0 where nothing happened).
        assert 'fleetgate_queue_depth{class="batch",model="m"} 0.0' in text
        assert 'fleetgate_preemptions_total{class="critical",model="m"} 0.0' in text


async def test_tenant_fairness_through_http() -> None:
    async with rig(1, capacity=1) as (url, _, _), httpx.AsyncClient(timeout=60) as c:
        hb = {"x-fleetgate-priority": "batch"}
        blocker = asyncio.create_task(post(c, url, body("block", 20, stream=False), hb))
        await asyncio.sleep(0.05)
        done: list[str] = []

        async def one(tenant: str, i: int) -> None:
            h = {**hb, "x-fleetgate-tenant": tenant}
            status, raw, _, _ = await post(c, url, body(f"{tenant}{i}", 2, stream=False), h)
            assert status == 200, raw
            done.append(tenant)

        flood = [asyncio.create_task(one("a", i)) for i in range(6)]
        await asyncio.sleep(0.02)
        late = [asyncio.create_task(one("b", i)) for i in range(2)]
        await asyncio.gather(blocker, *flood, *late)
        # WFQ interleaves the late tenant at once instead of after the whole flood.
        assert len(done) == 8
        last_b = max(i for i, t in enumerate(done) if t == "b")
        assert last_b <= 4, done


def test_priority_section_errors_are_one_line() -> None:
    with pytest.raises(ConfigError, match=r"priority\.classes"):
        parse_config({"priority": {"classes": [{"name": "x", "level": 99}]}})
    with pytest.raises(ConfigError, match="not both"):
        parse_config({"priority": {"preemption": False, "preemption_enabled": True}})
    with pytest.raises(ConfigError, match=r"priority\.bogus"):
        parse_config({"priority": {"bogus": 1}})
    cfg = parse_config(
        {"priority": {"preemption": False, "engine_priority": {"pools": {"trt": False}}}}
    )
    assert cfg.priority is not None and not cfg.priority.preemption_enabled
    assert not cfg.engine_priority.enabled("trt", "e1") and cfg.engine_priority.enabled("p", "e1")
    assert parse_config({}).priority is None


def _sse_answer(request: httpx.Request) -> httpx.Response:
    """A vLLM-shaped stream with token ids, whatever was asked (mock engine)."""
    evs = []
    for i, word in enumerate([" one", " two"]):
        choice = {"index": 0, "text": word, "logprobs": None,
                  "finish_reason": "length" if i == 1 else None, "stop_reason": None,
                  "token_ids": [10 + i],
                  "prompt_token_ids": [1, 2] if i == 0 else None}  # fmt: skip
        evs.append({"id": "cmpl-9", "object": "text_completion", "created": 1, "model": "m",
                    "choices": [choice]})  # fmt: skip
    evs.append({"id": "cmpl-9", "object": "text_completion", "created": 1, "model": "m",
                "choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 2,
                                         "total_tokens": 4}})  # fmt: skip
    data = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in evs)
    return httpx.Response(
        200, content=data + b"data: [DONE]\n\n", headers={"content-type": "text/event-stream"}
    )


@pytest.mark.parametrize("engine_priority", [True, False])
async def test_engine_body_carries_engine_priority_and_stream_options(
    engine_priority: bool,
) -> None:
    sent: list[dict[str, Any]] = []

    async def route(request: httpx.Request) -> httpx.Response:
        sent.append(json.loads(request.content))
        return _sse_answer(request)

    cfg = router_config(
        [("vllm", "http://127.0.0.1:18011")],
        priority=priority_section(engine_priority={"default": engine_priority}),
    )
    app = build_router(cfg, transport=httpx.MockTransport(route), start_background=False)
    for e in app.state.router.fleet:
        e.healthy = True
        e.models = frozenset({MODEL})
    async with serve(app) as url, httpx.AsyncClient(timeout=30) as c:
        doc = {"model": MODEL, "prompt": "x", "max_tokens": 2, "priority": "critical"}
        r = await c.post(url + "/v1/completions", json=doc)
        assert r.status_code == 200, r.text
        got = r.json()
        assert got["choices"][0]["text"] == " one two"
        assert got["choices"][0]["token_ids"] is None  # the client did not ask for ids
        assert got["usage"]["completion_tokens"] == 2
        up = sent[-1]
        assert up["stream"] is True and up["stream_options"] == {"include_usage": True}
        assert up["return_token_ids"] is True
        if engine_priority:
            assert up["priority"] == get_adapter("vllm").priority_fields(8)["priority"]
        else:
            assert "priority" not in up  # the client's class name never reaches the engine


def chat_pieces(raw: bytes) -> list[str]:
    out = []
    for ev in events(raw):
        for ch in ev.get("choices", []):
            out.append((ch.get("delta") or {}).get("content") or "")
    return out


@pytest.mark.parametrize("stream", [True, False])
async def test_chat_preempted_resumes_exactly_and_non_resumable_passes_through(
    stream: bool, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="fleetgate.router.admission")
    async with rig(1, capacity=1) as (url, engines, _), httpx.AsyncClient(timeout=60) as c:
        chat: dict[str, Any] = {
            "model": MODEL, "messages": [{"role": "user", "content": "tell me a long story"}],
            "max_tokens": 50, "ignore_eos": True, "seed": 11, "temperature": 0.7,
        }  # fmt: skip
        if stream:
            chat["stream"] = True
        hb = {"x-fleetgate-priority": "batch", "x-request-id": "chat-victim"}
        victim = asyncio.create_task(c.post(url + "/v1/chat/completions", json=chat, headers=hb))
        await asyncio.sleep(0.15)
        crit = await c.post(
            url + "/v1/completions",
            json=body("urgent", 3, stream=False),
            headers={"x-fleetgate-priority": "critical"},
        )
        assert crit.status_code == 200
        got = await victim
        assert got.status_code == 200, got.text
        assert any(m.startswith("preempt chat-victim") for m in caplog.messages)
        twin = await c.post(engines[0].url + "/v1/chat/completions", json=chat)
        if stream:
            assert "".join(chat_pieces(got.content)) == "".join(chat_pieces(twin.content))
            assert chat_pieces(got.content) == chat_pieces(twin.content)
            assert got.content.count(b'"role":"assistant"') == 1
            assert got.content.count(b"data: [DONE]") == 1
        else:
            want = twin.json()
            assert (
                got.json()["choices"][0]["message"]["content"]
                == (want["choices"][0]["message"]["content"])
            )
            assert got.json()["usage"]["completion_tokens"] == 50
        # n > 1 cannot be spliced: relayed unchanged, never preempted.
        multi = {**body("two answers", 3, stream=stream), "n": 2}
        r = await c.post(
            url + "/v1/completions", json=multi, headers={"x-fleetgate-priority": "batch"}
        )
        assert r.status_code == 200
        if stream:
            assert {ch["index"] for ev in events(r.content) for ch in ev["choices"]} == {0, 1}
        else:
            assert len(r.json()["choices"]) == 2


async def test_cache_closed_loop_is_counted_on_the_priority_path() -> None:
    """Predicted vs engine-reported cached tokens are exported with classes on too,
    so a silent 0% hit rate stays visible whatever the router's mode."""
    shared = "shared document " * 60
    async with rig(1) as (url, _, _), httpx.AsyncClient(timeout=30) as c:
        for i in range(3):
            doc = body(f"{shared} question {i}", 4, stream=i % 2 == 0)
            status, _, _, _ = await post(c, url, doc, {"x-fleetgate-priority": "standard"})
            assert status == 200
        text = (await c.get(url + "/metrics")).text
    assert scrape_sum(text, "fleetgate_prompt_tokens_total") > 3 * 60
    assert scrape_sum(text, "fleetgate_predicted_cached_tokens_total") > 0
    assert scrape_sum(text, "fleetgate_actual_cached_tokens_total") > 0


async def test_unknown_slot_limit_is_warned_once_per_endpoint(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """vLLM exports no --max-num-seqs: a backend without ``capacity`` gets one warning."""
    specs = [EngineSpec(kind="vllm", overrides=SLOW) for _ in range(2)]
    async with run_fleet(specs, "127.0.0.1", 0, model=MODEL) as fleet:
        cfg = router_config([("vllm", e.url) for e in fleet.engines], priority=priority_section())
        # router_config gives every backend capacity 8; drop it on the second one
        raw = cfg.model_dump()
        raw["pools"][0]["backends"][1]["capacity"] = None
        cfg = type(cfg).model_validate(raw)
        app = build_router(cfg)
        with caplog.at_level(logging.WARNING, logger="fleetgate.router.admission"):
            async with serve(app):
                rt = app.state.admission
                endpoints = list(app.state.router.fleet)
                for _ in range(200):
                    if all(e.snapshot is not None for e in endpoints) and rt.unknown_slot_limit:
                        break
                    await asyncio.sleep(0.02)
                await asyncio.sleep(0.2)  # several more scrapes: still one warning
        assert rt.unknown_slot_limit == {endpoints[1].id}
        warned = [r for r in caplog.records if "no concurrent-sequence limit" in r.getMessage()]
        assert len(warned) == 1
        assert endpoints[1].id in warned[0].getMessage()


def make_request(
    rid: str, *, path: str = "/v1/completions", prompt: int, max_tokens: int, now: float
) -> Request:
    """A batch-class request record as the parser would build it, sizes given."""
    return Request(
        id=rid,
        client_id=None,
        path=path,
        kind=request_kind(path),
        body=b"{}",
        doc={},
        headers=[],
        model=MODEL,
        stream=False,
        cls=PriorityConfig().get("batch"),
        tenant="t",
        arrival=now,
        chain=(),
        order=[],
        view=RequestView(model=MODEL, chunks=1, prompt_tokens=prompt, max_tokens=max_tokens),
        kv_tokens=prompt + max_tokens,
        resumable=True,
    )


def test_saturation_counts_a_victims_freed_kv_before_the_next_scrape() -> None:
    """KV over the bound at the scrape; a preempted request's held blocks free it at once."""
    from fleetgate.engines.base import LoadSnapshot
    from fleetgate.router.priority.saturation import endpoint_verdict

    cfg = router_config([("vllm", "http://127.0.0.1:18011")], capacity=64, priority={})
    app = build_router(cfg, transport=httpx.MockTransport(_sse_answer), start_background=False)
    services = app.state.router
    rt = app.state.admission
    (e,) = list(services.fleet)
    e.healthy, e.models = True, frozenset({MODEL})
    now = services.clock()

    def job(rid: str, prompt: int, max_tokens: int) -> Request:
        return make_request(rid, prompt=prompt, max_tokens=max_tokens, now=now)

    victim, newcomer = job("victim", 300, 500), job("new", 100, 100)
    rt.placer.reserve(victim, e)  # running when the engine is scraped
    # 100 blocks of 16 tokens, 95% in use
    e.scraped(LoadSnapshot(scraped_at=now, kv_usage=0.95, running=10, waiting=0,
                           block_size=16, blocks_total=100, blocks_free=5))  # fmt: skip
    thresholds = rt.cfg.saturation
    (view,) = rt.views(newcomer, now)
    assert view.kv_usage == pytest.approx(0.95)
    assert endpoint_verdict(view, thresholds).verdict == "over"
    victim.generated = 100
    rt.release(victim)  # preempted: it held 300 + 100 tokens, not its 800-token estimate
    (view,) = rt.views(newcomer, now)
    assert view.kv_usage == pytest.approx(0.95 - 400 / 1600)
    assert endpoint_verdict(view, thresholds).verdict == "free"
    rt.placer.reserve(newcomer, e)  # dispatched after the scrape: its estimate counts at once
    (view,) = rt.views(newcomer, now)
    assert view.kv_usage == pytest.approx(0.95 - 400 / 1600 + 200 / 1600)
    e.scraped(LoadSnapshot(scraped_at=now, kv_usage=0.5, running=10, waiting=0,
                           block_size=16, blocks_total=100, blocks_free=50))  # fmt: skip
    (view,) = rt.views(newcomer, now)
    assert view.kv_usage == pytest.approx(0.5), "a new scrape replaces the estimate"


def test_chat_on_an_engine_without_token_ids_is_never_a_victim_and_resumes_where_it_can() -> None:
    """TRT returns no token ids: its chat answers would resume from text (inexact seam)."""

    cfg = router_config(
        [("vllm", "http://127.0.0.1:18011"), ("trtllm", "http://127.0.0.1:18012")],
        capacity=8,
        priority={},
    )
    app = build_router(cfg, transport=httpx.MockTransport(_sse_answer), start_background=False)
    services = app.state.router
    rt = app.state.admission
    vllm, trt = list(services.fleet)
    for e in (vllm, trt):
        e.healthy, e.models = True, frozenset({MODEL})
    now = services.clock()

    def job(rid: str, *, chat: bool) -> Request:
        path = "/v1/chat/completions" if chat else "/v1/completions"
        return make_request(rid, path=path, prompt=50, max_tokens=50, now=now)

    placed = {
        ("chat", "vllm"): (job("c-v", chat=True), vllm),
        ("chat", "trtllm"): (job("c-t", chat=True), trt),
        ("completions", "trtllm"): (job("p-t", chat=False), trt),
    }
    for j, e in placed.values():
        rt.placer.reserve(j, e)
        rt.running[j.id] = j
    victims = {v.request_id: v.resumable for v in rt._victims()}
    assert victims == {"c-v": True, "c-t": False, "p-t": True}

    # a parked text-only chat answer (its engine died) resumes where the partial
    # assistant message is continued: vLLM, not TensorRT-LLM
    parked = job("dead", chat=True)
    parked.needs_final_message, parked.parked_at = True, now
    assert [e.id for e in rt.placer.eligible(parked, now)] == [vllm.id]
    parked.needs_final_message = False
    assert [e.id for e in rt.placer.eligible(parked, now)] == [vllm.id, trt.id]


async def test_resume_streams_off_relays_raw_bytes_and_a_dead_engine_ends_the_stream() -> None:
    """``resume_streams: false``: the engine's own bytes reach the client (no token ids
    asked for, nothing spliced), and an engine that dies mid-stream ends the stream
    with an error event instead of a resume."""
    async with (
        rig(2, queue=False, raw_streams=True) as (url, engines, _),
        httpx.AsyncClient(timeout=60) as c,
    ):
        doc = body("a long answer that will lose its engine", 60, stream=True, seed=3)
        data = b""
        async with c.stream("POST", url + "/v1/completions", json=doc) as resp:
            assert resp.status_code == 200
            where = resp.headers["x-fleetgate-endpoint"]
            victim = next(e for e in engines if e.url.endswith(where))
            it = resp.aiter_raw()
            async for chunk in it:
                data += chunk
                if data.count(b'"text"') >= 10:
                    break
            assert b'"token_ids":[' not in data, "the router asked for no token ids"
            for listener in victim.server.servers:
                listener.close()
            await victim.engine.driver.stop()
            async for chunk in it:
                data += chunk
        assert b'"error"' in data, data[-300:]
        assert not [ev for ev in events(data) if ev.get("usage")], "not resumed to its end"
        text = (await c.get(url + "/metrics")).text
        assert scrape_sum(text, "fleetgate_resumes_total") == 0


def test_resume_streams_off_is_refused_with_a_priority_section() -> None:
    with pytest.raises(ConfigError, match="resume_streams"):
        parse_config({"resume_streams": False, "priority": {}})
