"""Engine releases and served names on the router side (``fleetgate.router.served``).

* the pure parts: adapters bound to a release, the model list with the served name in
  place of the engine's, the answer-byte rename (also split across chunks);
* static backends: ``version`` validated (the error names the key), the endpoint gets
  the release's adapter and metrics source, ``served_model``;
* through the router against an emulated trtllm-serve 1.0 that lists its model path:
  the router lists the served name, routes it, answers show it, and a prioritised
  request (no ``priority`` field on 1.0) succeeds where the unbound adapter gets 400;
* an engine that names its own model in answers: the raw relay and the splicer both
  show the served name (httpx.MockTransport engine).
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from routerkit import serve

from fleetgate.engines.base import EngineVersionError
from fleetgate.router.app import build_fleet, build_router
from fleetgate.router.config import ConfigError, parse_config
from fleetgate.router.served import ModelRename, adapter_for, served_models
from fleetgate.sim import EngineSpec, run_fleet

PATH = "Qwen/Qwen2.5-7B-Instruct"
SERVED = "qwen2.5-7b"


# --------------------------------------------------------------------------- pure


@pytest.mark.parametrize(
    "version, source, priority",
    [
        pytest.param("1.0.0", "iteration-stats", False, id="1.0"),
        pytest.param("1.0", "iteration-stats", False, id="1.0-line"),
        pytest.param("1.2.0rc3", "iteration-stats", False, id="1.2"),
        pytest.param("main", "prometheus", True, id="main"),
    ],
)
def test_adapter_bound_to_the_release(version: str, source: str, priority: bool) -> None:
    a = adapter_for("trtllm", version)
    assert a.metrics_sources[0].name == source
    assert ("priority" in a.priority_fields(2)) is priority


def test_adapter_without_version_and_bad_versions() -> None:
    assert adapter_for("trtllm", None).metrics_sources[0].name == "prometheus"  # registry's
    with pytest.raises(EngineVersionError, match="0.9"):
        adapter_for("trtllm", "0.9.0")
    with pytest.raises(EngineVersionError, match="vllm"):
        adapter_for("vllm", "0.11.0")


@pytest.mark.parametrize(
    "listed, served, models, engine_name",
    [
        pytest.param([PATH], None, {PATH}, None, id="no-served-name"),
        pytest.param([PATH], SERVED, {SERVED}, PATH, id="trtllm-path"),
        pytest.param([SERVED], SERVED, {SERVED}, None, id="engine-lists-it"),
        pytest.param([SERVED, "lora-a"], SERVED, {SERVED, "lora-a"}, None, id="vllm-lora"),
        pytest.param(["base", "lora-a"], SERVED, {SERVED, "lora-a"}, "base", id="first-is-base"),
        pytest.param([], SERVED, set(), None, id="nothing-listed"),
    ],
)
def test_served_models(
    listed: list[str], served: str | None, models: set[str], engine_name: str | None
) -> None:
    assert served_models(listed, served) == (frozenset(models), engine_name)


def test_rename_whole_body_and_text_that_only_looks_alike() -> None:
    r = ModelRename(PATH, SERVED)
    body = json.dumps(
        {"model": PATH, "choices": [{"text": json.dumps({"model": PATH})}]},
        separators=(",", ":"),
    ).encode()
    out = json.loads(r.whole(body))
    assert out["model"] == SERVED
    assert json.loads(out["choices"][0]["text"]) == {"model": PATH}  # escaped: untouched
    assert r.whole(b'{"model":"other"}') == b'{"model":"other"}'


def test_rename_stream_split_at_every_byte() -> None:
    event = f'data: {{"id":"x","model":"{PATH}","choices":[]}}\n\n'.encode()
    stream = event * 3
    want = stream.replace(PATH.encode(), SERVED.encode())
    for cut in range(1, len(event) * 2):
        r = ModelRename(PATH, SERVED)
        parts = [r.feed(stream[:cut]), r.feed(stream[cut:]), r.flush()]
        assert b"".join(parts) == want, cut
        # A complete event is never held back.
        if cut % len(event) == 0:
            assert parts[0] == stream[:cut].replace(PATH.encode(), SERVED.encode())


def test_rename_holds_a_lookalike_tail_until_the_end() -> None:
    r = ModelRename(PATH, SERVED)
    assert r.feed(b'x "model":"Qw') == b"x "
    assert r.flush() == b'"model":"Qw'


# --------------------------------------------------------------------------- static config


def _static(*backends: dict[str, Any]) -> dict[str, Any]:
    return {"pools": [{"backends": [{"url": "http://127.0.0.1:1", **b} for b in backends]}]}


@pytest.mark.parametrize(
    "backend",
    [
        pytest.param({"engine": "trtllm", "version": "0.21.0"}, id="unsupported-release"),
        pytest.param({"engine": "trtllm", "version": "latest"}, id="not-a-version"),
        pytest.param({"engine": "vllm", "version": "0.11.0"}, id="engine-without-releases"),
    ],
)
def test_backend_version_is_validated_and_names_the_key(backend: dict[str, Any]) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(_static(backend))
    assert str(err.value).startswith("pools.0.backends.0.version"), str(err.value)


def test_backend_version_and_served_name_reach_the_endpoint() -> None:
    old, new = build_fleet(
        parse_config(
            _static(
                {"engine": "trtllm", "version": "1.0.0", "served_model": SERVED},
                {"engine": "trtllm", "url": "http://127.0.0.1:2"},
            )
        )
    )
    assert old.metrics_source.name == "iteration-stats" and old.served_model == SERVED
    assert old.adapter.priority_fields(2) == {}
    assert new.metrics_source.name == "prometheus" and new.served_model is None
    pinned = {"engine": "trtllm", "version": "1.0", "metrics_source": "prometheus"}
    with pytest.raises(ConfigError, match="prometheus"):  # 1.0 publishes no load there
        build_fleet(parse_config(_static(pinned)))


# --------------------------------------------------------------------------- emulated trtllm-serve


def _routed(backends: list[dict[str, Any]], **sections: Any) -> Any:
    """A test config (fast probes and scrapes, as ``routerkit.router_config``)."""
    data: dict[str, Any] = {
        "test_mode": True,
        "pools": [{"name": "default", "backends": backends}],
        "scrape": {"interval_s": 0.05, "timeout_s": 1.0},
        "health": {"interval_s": 0.1, "timeout_s": 1.0, "eject_base_s": 0.5},
        **sections,
    }
    return parse_config(data)


@pytest.mark.parametrize("priority", [None, {}], ids=["immediate", "class-queue"])
async def test_trtllm_1_0_listing_its_path_serves_under_the_served_name(
    priority: dict[str, Any] | None,
) -> None:
    specs = [EngineSpec(kind="trtllm", model=PATH, version="1.0.0")]
    sections: dict[str, Any] = {} if priority is None else {"priority": priority}
    async with (
        run_fleet(specs, "127.0.0.1", 0) as fleet,
        httpx.AsyncClient(timeout=30) as c,
    ):
        url = fleet.engines[0].url
        # The emulated engine lists the path and accepts (echoes) any model name.
        listed = (await c.get(url + "/v1/models")).json()["data"]
        assert [m["id"] for m in listed] == [PATH]
        direct = await c.post(
            url + "/v1/completions", json={"model": SERVED, "prompt": "hi", "max_tokens": 2}
        )
        assert direct.status_code == 200 and direct.json()["model"] == SERVED

        backend = {"engine": "trtllm", "url": url, "capacity": 8, "version": "1.0.0",
                   "served_model": SERVED}  # fmt: skip
        app = build_router(_routed([backend], **sections))
        async with serve(app) as router:
            e = next(iter(app.state.router.fleet))
            assert (e.metrics_source.name, e.engine_model) == ("iteration-stats", PATH)
            assert e.echoes_any_model  # the served name goes upstream unchanged
            models = (await c.get(router + "/v1/models")).json()["data"]
            assert [m["id"] for m in models] == [SERVED]
            chat = {"model": SERVED, "messages": [{"role": "user", "content": "Hi"}],
                    "max_tokens": 4}  # fmt: skip
            for stream in (False, True):
                for path, body in (
                    ("/v1/completions", {"model": SERVED, "prompt": "hi", "max_tokens": 4}),
                    ("/v1/chat/completions", chat),
                ):
                    resp = await c.post(
                        router + path,
                        json={**body, "stream": stream},
                        headers={"x-fleetgate-priority": "critical"},  # no field on 1.0
                    )
                    assert resp.status_code == 200, resp.text
                    if stream:
                        events = [
                            json.loads(line[6:])
                            for line in resp.content.split(b"\n")
                            if line.startswith(b"data: {")
                        ]
                        assert events and {ev["model"] for ev in events} == {SERVED}
                    else:
                        assert resp.json()["model"] == SERVED
            # The engine's own name is not a model of the router's.
            wrong = await c.post(
                router + "/v1/completions", json={"model": PATH, "prompt": "hi", "max_tokens": 2}
            )
            assert wrong.status_code == 404, wrong.text
            assert e.snapshot is not None and e.scrape_errors == 0


async def test_unbound_adapter_sends_priority_that_trtllm_1_0_rejects() -> None:
    """The failure the release binding prevents (the emulator is as strict as 1.0)."""
    specs = [EngineSpec(kind="trtllm", model=PATH, version="1.0.0")]
    async with (
        run_fleet(specs, "127.0.0.1", 0) as fleet,
        httpx.AsyncClient(timeout=30) as c,
    ):
        backend = {"engine": "trtllm", "url": fleet.engines[0].url, "capacity": 8,
                   "metrics_source": "iteration-stats"}  # fmt: skip
        app = build_router(_routed([backend], priority={}))
        async with serve(app) as router:
            resp = await c.post(
                router + "/v1/completions",
                json={"model": PATH, "prompt": "hi", "max_tokens": 2},
                headers={"x-fleetgate-priority": "critical"},
            )
            assert resp.status_code == 400, resp.text


# --------------------------------------------------------------------------- own-name engine


def _own_name_engine(request: httpx.Request) -> httpx.Response:
    """An engine that lists and answers with its model path, whatever was asked."""
    if request.url.path == "/health":
        return httpx.Response(200)
    if request.url.path == "/v1/models":
        return httpx.Response(200, json={"object": "list", "data": [{"id": PATH}]})
    if request.url.path == "/v1/completions":
        doc = json.loads(request.content)
        head = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": PATH}
        if not doc.get("stream"):
            choice = {"index": 0, "text": " ok", "finish_reason": "length"}
            usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
            body = {**head, "choices": [choice], "usage": usage}
            return httpx.Response(200, content=json.dumps(body, separators=(",", ":")))
        events = [
            {**head, "choices": [{"index": 0, "text": t, "finish_reason": f}]}
            for t, f in ((" o", None), ("k", "length"))
        ]
        sse = b"".join(
            b"data: " + json.dumps(ev, separators=(",", ":")).encode() + b"\n\n" for ev in events
        )
        return httpx.Response(
            200, content=sse + b"data: [DONE]\n\n", headers={"content-type": "text/event-stream"}
        )
    return httpx.Response(404)


@pytest.mark.parametrize("priority", [None, {}], ids=["raw-relay", "splicer"])
async def test_answers_naming_the_engine_model_show_the_served_name(
    priority: dict[str, Any] | None,
) -> None:
    backend = {"engine": "trtllm", "url": "http://127.0.0.1:9", "capacity": 8,
               "version": "main", "served_model": SERVED}  # fmt: skip
    sections: dict[str, Any] = {} if priority is None else {"priority": priority}
    app = build_router(
        _routed([backend], **sections), transport=httpx.MockTransport(_own_name_engine)
    )
    transport = httpx.ASGITransport(app=app)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=transport, base_url="http://router") as c,
    ):
        body = {"model": SERVED, "prompt": "hi", "max_tokens": 2}
        plain = await c.post("/v1/completions", json=body)
        assert plain.status_code == 200, plain.text
        assert plain.json()["model"] == SERVED
        streamed = await c.post("/v1/completions", json={**body, "stream": True})
        assert streamed.status_code == 200, streamed.text
        assert PATH.encode() not in streamed.content
        assert streamed.content.count(f'"model":"{SERVED}"'.encode()) >= 2


async def test_mixed_fleet_one_name_for_vllm_and_trtllm() -> None:
    """vLLM serves the name itself (``--served-model-name``); trtllm-serve 1.0 lists its
    path: the router lists one model and spreads its requests over both engines."""
    specs = [
        EngineSpec(kind="vllm", model=SERVED),
        EngineSpec(kind="trtllm", model=PATH, version="1.0.0"),
    ]
    async with (
        run_fleet(specs, "127.0.0.1", 0) as fleet,
        httpx.AsyncClient(timeout=30) as c,
    ):
        vllm, trt = (e.url for e in fleet.engines)
        backends = [
            {"engine": "vllm", "url": vllm, "capacity": 8, "served_model": SERVED},
            {"engine": "trtllm", "url": trt, "capacity": 8, "version": "1.0.0",
             "served_model": SERVED},
        ]  # fmt: skip
        # Rendezvous placement of new prefixes, so that a trickle reaches both engines.
        app = build_router(_routed(backends, scheduling={"router_replicas": 2}))
        async with serve(app) as router:
            models = (await c.get(router + "/v1/models")).json()["data"]
            assert [m["id"] for m in models] == [SERVED]
            seen: dict[str, set[str]] = {}
            for i in range(16):
                prompt = f"conversation {i}: " + "alpha beta " * 40
                resp = await c.post(
                    router + "/v1/completions",
                    json={"model": SERVED, "prompt": prompt, "max_tokens": 2},
                )
                assert resp.status_code == 200, resp.text
                seen.setdefault(resp.headers["x-fleetgate-endpoint"], set()).add(
                    resp.json()["model"]
                )
            assert len(seen) == 2 and all(names == {SERVED} for names in seen.values())


def _strict_engine(request: httpx.Request) -> httpx.Response:
    """A vLLM-like engine: serves only its own name (404 otherwise) and answers with it."""
    if request.url.path == "/health":
        return httpx.Response(200)
    if request.url.path == "/v1/models":
        return httpx.Response(200, json={"object": "list", "data": [{"id": PATH}]})
    if request.url.path == "/v1/completions":
        if json.loads(request.content).get("model") != PATH:
            return httpx.Response(404, json={"error": {"message": "no such model"}})
        return _own_name_engine(request)
    return httpx.Response(404)


@pytest.mark.parametrize("priority", [None, {}], ids=["raw-relay", "splicer"])
async def test_an_engine_that_checks_names_gets_its_own(priority: dict[str, Any] | None) -> None:
    backend = {"engine": "vllm", "url": "http://127.0.0.1:9", "capacity": 8,
               "served_model": SERVED}  # fmt: skip
    sections: dict[str, Any] = {} if priority is None else {"priority": priority}
    app = build_router(
        _routed([backend], **sections), transport=httpx.MockTransport(_strict_engine)
    )
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://r") as c,
    ):
        assert [m["id"] for m in (await c.get("/v1/models")).json()["data"]] == [SERVED]
        body = {"model": SERVED, "prompt": "hi", "max_tokens": 2}
        for stream in (False, True):
            resp = await c.post("/v1/completions", json={**body, "stream": stream})
            assert resp.status_code == 200, resp.text
            assert PATH.encode() not in resp.content and SERVED.encode() in resp.content
