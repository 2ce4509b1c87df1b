"""Scale from zero and scale-down drain, through the real router app and emulated vLLM
engines on 127.0.0.1 (fleetgate/router/admission.py ``Holds``, the ``not-draining``
filter, docs/router.md "Scale from zero and scale-down drain").

Endpoints join and get the drain flag the way Kubernetes discovery does it: through
:class:`~fleetgate.router.membership.FleetMembership` (``add`` a
:class:`~fleetgate.router.k8s_targets.Target`, ``set_draining``), polled by the
app's own poller. Checked, with both admissions (immediate and the class queue):

* a request for a model at zero replicas is held, then completes once an engine
  joins; its TTFT includes the wait; nothing failed; the metrics say so;
* held requests go out in class order (critical before batch);
* past the hold bound (cold start x factor), or with no room to hold: 503 +
  Retry-After + the OpenAI-style JSON error; an unknown model is still 404;
* a draining endpoint gets no new request while its in-flight stream completes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest
from routerkit import serve

from fleetgate.router.app import build_router
from fleetgate.router.config import parse_config
from fleetgate.router.k8s_targets import Target
from fleetgate.router.membership import FleetMembership
from fleetgate.router.scheduling.types import EndpointId
from fleetgate.router.state import Standby
from fleetgate.sim import EngineSpec, run_fleet

MODEL = "m"
SLOW = {"fixed_s": 0.01}


def config(*, queue: bool, cold_start_s: float = 30.0, **limits: Any) -> Any:
    data: dict[str, Any] = {
        "test_mode": True,
        "models": {MODEL: {"scale_from_zero": True, "cold_start_s": cold_start_s}},
        "scrape": {"interval_s": 0.05, "timeout_s": 1.0},
        "health": {"interval_s": 0.1, "timeout_s": 1.0},
        "limits": limits,
    }
    if queue:
        data["priority"] = {}
    return parse_config(data)


@contextlib.asynccontextmanager
async def router(cfg: Any) -> AsyncIterator[tuple[str, Any, FleetMembership]]:
    app = build_router(cfg)
    async with serve(app) as url:
        membership = FleetMembership(app.state.router.fleet, app.state.poller)
        try:
            yield url, app, membership
        finally:
            await membership.close()


def held_now(app: Any, model: str = MODEL) -> float:
    """``fleetgate_held_requests`` of ``model``, summed over its priority classes."""
    return sum(
        s.value
        for family in app.state.router.metrics.registry.collect()
        for s in family.samples
        if s.name == "fleetgate_held_requests" and s.labels.get("model") == model
    )


def target(eid: str, url: str, capacity: int = 8) -> Target:
    return Target(EndpointId(eid), "default", "vllm", url, capacity, "ns", "svc", MODEL)


def body(max_tokens: int = 8, *, stream: bool = True) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "model": MODEL,
        "prompt": "hello there",
        "max_tokens": max_tokens,
        "ignore_eos": True,
    }
    if stream:
        doc["stream"] = True
    return doc


def metric(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name) or line[len(name)] not in " {":
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def until(what: Callable[[], bool], within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    while not what():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


async def metrics_text(client: httpx.AsyncClient, url: str) -> str:
    return (await client.get(url + "/metrics")).text


def done_tokens(raw: bytes) -> int:
    """Text events of a completed stream (asserting exactly one ``[DONE]`` at the end)."""
    lines = [line for line in raw.split(b"\n") if line.startswith(b"data: ")]
    assert lines[-1] == b"data: [DONE]" and lines.count(b"data: [DONE]") == 1, raw[-300:]
    n = 0
    for line in lines[:-1]:
        ev = json.loads(line[6:])
        assert "error" not in ev, ev
        n += sum(1 for c in ev.get("choices", []) if c.get("text"))
    return n


@pytest.mark.parametrize("queue", [False, True], ids=["immediate", "class-queue"])
async def test_held_request_completes_when_the_first_engine_joins(queue: bool) -> None:
    async with (
        router(config(queue=queue)) as (url, app, membership),
        httpx.AsyncClient(timeout=30) as client,
    ):
        listed = (await client.get(url + "/v1/models")).json()["data"]
        assert [m["id"] for m in listed] == [MODEL]  # known at zero endpoints
        assert (await client.get(url + "/ready")).status_code == 200  # stays in its Service
        sent = time.monotonic()
        task = asyncio.create_task(
            client.post(
                url + "/v1/completions", json=body(), headers={"x-fleetgate-priority": "critical"}
            )
        )
        text = ""

        def held() -> bool:
            return metric(text, "fleetgate_held_requests", model=MODEL) == 1

        while not held():
            assert not task.done(), task.result().text
            await asyncio.sleep(0.05)
            text = await metrics_text(client, url)
        assert metric(text, "fleetgate_arrivals_total", model=MODEL, **{"class": "critical"}) == 1
        await asyncio.sleep(0.5)
        assert not task.done()  # still held: no endpoint yet
        async with run_fleet([EngineSpec(kind="vllm")], model=MODEL) as fleet:
            joined = time.monotonic()
            assert membership.add(target("ns/late-0", fleet.engines[0].url))
            r = await task
            finished = time.monotonic()
        assert r.status_code == 200, r.text
        assert done_tokens(r.content) == 8
        text = await metrics_text(client, url)
    waited = joined - sent  # from before the POST: the router's arrival is a little later
    assert waited >= 0.5
    slack = 0.05
    ttft_sum = metric(text, "fleetgate_time_to_first_token_seconds_sum", model=MODEL)
    assert waited - slack <= ttft_sum <= finished - sent + slack  # the TTFT includes the hold
    assert metric(text, "fleetgate_held_requests", model=MODEL) == 0
    assert metric(text, "fleetgate_requests_total", model=MODEL, status="200") == 1
    assert metric(text, "fleetgate_requests_total") == 1  # nothing else answered
    assert metric(text, "fleetgate_sheds_total", model=MODEL) == 0
    assert metric(text, "fleetgate_retries_total") == 0
    wait_sum = metric(text, "fleetgate_queue_wait_seconds_sum", model=MODEL)
    assert wait_sum >= waited - slack  # arrival to dispatch, the hold included


@pytest.mark.parametrize("queue", [False, True], ids=["immediate", "class-queue"])
async def test_held_requests_go_out_in_class_order(queue: bool) -> None:
    async with (
        router(config(queue=queue)) as (url, app, membership),
        httpx.AsyncClient(timeout=30) as client,
    ):
        placer = app.state.admission.placer
        order: list[str] = []
        reserve = placer.reserve

        def spy(req: Any, e: Any) -> Any:
            order.append(req.cls.name)
            return reserve(req, e)

        placer.reserve = spy
        classes = ["batch", "batch", "standard", "critical", "batch", "critical"]
        tasks = []
        for cls in classes:  # arrival order: batch first
            tasks.append(
                asyncio.create_task(
                    client.post(
                        url + "/v1/completions",
                        json=body(4),
                        headers={"x-fleetgate-priority": cls},
                    )
                )
            )
            await asyncio.sleep(0.02)
        await until(lambda: held_now(app) == len(classes))
        text = await metrics_text(client, url)
        for cls in ("batch", "standard", "critical"):  # by class, for the autoscaler's roles
            assert metric(text, "fleetgate_held_requests", model=MODEL, **{"class": cls}) == (
                classes.count(cls)
            )
        assert order == []
        async with run_fleet([EngineSpec(kind="vllm")], model=MODEL) as fleet:
            assert membership.add(target("ns/late-0", fleet.engines[0].url, capacity=1))
            answers = await asyncio.gather(*tasks)
        assert [a.status_code for a in answers] == [200] * len(classes)
        for a in answers:
            assert done_tokens(a.content) == 4
    assert order == ["critical", "critical", "standard", "batch", "batch", "batch"]


@pytest.mark.parametrize("queue", [False, True], ids=["immediate", "class-queue"])
async def test_past_the_hold_bound_503_retry_after_json(queue: bool) -> None:
    # cold start 0.4 s x factor 1.5: held at most 0.6 s; room for one held request.
    cfg = config(queue=queue, cold_start_s=0.4, max_held_requests=1)
    async with router(cfg) as (url, app, membership), httpx.AsyncClient(timeout=30) as client:
        t0 = time.monotonic()
        first = asyncio.create_task(client.post(url + "/v1/completions", json=body()))
        await until(lambda: held_now(app) == 1)
        full = await client.post(url + "/v1/completions", json=body(stream=False))
        assert full.status_code == 503, full.text
        assert int(full.headers["retry-after"]) >= 1
        err = full.json()["error"]
        assert err["code"] == 503 and "already held" in err["message"]
        r = await first
        elapsed = time.monotonic() - t0
        assert r.status_code == 503, r.text
        assert r.headers["content-type"].startswith("application/json")
        assert int(r.headers["retry-after"]) >= 1
        err = r.json()["error"]
        assert err["code"] == 503 and err["type"] == "ServiceUnavailableError"
        assert "scaling from zero" in err["message"] and "bound of 0.6s" in err["message"]
        assert 0.6 <= elapsed < 3.0
        unknown = await client.post(url + "/v1/completions", json={**body(), "model": "nope"})
        assert unknown.status_code == 404
        text = await metrics_text(client, url)
    assert metric(text, "fleetgate_held_requests", model=MODEL) == 0
    assert metric(text, "fleetgate_sheds_total", model=MODEL, status="503") == 2
    assert metric(text, "fleetgate_arrivals_total", model=MODEL) == 2
    assert metric(text, "fleetgate_requests_total", model=MODEL, status="503") == 2


@pytest.mark.parametrize("queue", [False, True], ids=["immediate", "class-queue"])
async def test_an_autoscaled_model_from_one_is_held_while_its_replicas_start(
    queue: bool,
) -> None:
    """An InferenceService with ``minReplicas: 1`` whose replicas are all starting (the
    heavy bench's first ``--min-replicas 1`` run: 9 requests got 503 at once) is held
    for like one at zero; past the bound the message says its replicas are starting."""
    cfg = parse_config({"test_mode": True, "health": {"interval_s": 0.1, "timeout_s": 1.0},
                        **({"priority": {}} if queue else {})})  # fmt: skip
    async with router(cfg) as (url, app, membership), httpx.AsyncClient(timeout=30) as client:
        refused = await client.post(url + "/v1/completions", json=body(stream=False))
        assert refused.status_code == 503  # not autoscaled: refused at once, not held
        assert "bound of" not in refused.json()["error"]["message"]
        one = Standby(MODEL, cold_start_s=0.4, min_replicas=1, source="ns/svc")
        assert membership.set_standby({MODEL: one})
        t0 = time.monotonic()
        late = await client.post(url + "/v1/completions", json=body(stream=False))
        assert late.status_code == 503, late.text  # held 0.6 s, then refused
        assert time.monotonic() - t0 >= 0.6
        message = late.json()["error"]["message"]
        assert "its replicas are starting" in message and "bound of 0.6s" in message
        # held, then served once the first replica's engine is up
        task = asyncio.create_task(client.post(url + "/v1/completions", json=body(4)))
        await until(lambda: held_now(app) == 1)
        async with run_fleet([EngineSpec(kind="vllm")], model=MODEL) as fleet:
            assert membership.add(target("ns/first-0", fleet.engines[0].url))
            answer = await task
        assert answer.status_code == 200, answer.text
        assert done_tokens(answer.content) == 4


@pytest.mark.parametrize("queue", [False, True], ids=["immediate", "class-queue"])
async def test_a_draining_endpoint_finishes_its_stream_and_gets_no_new_work(queue: bool) -> None:
    specs = [EngineSpec(kind="vllm", overrides=SLOW) for _ in range(2)]
    async with (
        run_fleet(specs, model=MODEL) as fleet,
        router(config(queue=queue)) as (url, app, membership),
        httpx.AsyncClient(timeout=60) as client,
    ):
        ids = [EndpointId(f"ns/e{i}") for i in range(2)]
        for eid, e in zip(ids, fleet.engines, strict=True):
            assert membership.add(target(eid, e.url))
        endpoints = app.state.router.fleet.endpoints
        await until(lambda: all(endpoints[i].healthy and endpoints[i].models for i in ids))

        async with client.stream("POST", url + "/v1/completions", json=body(120)) as long:
            assert long.status_code == 200
            victim = EndpointId(long.headers["x-fleetgate-endpoint"])
            other = next(i for i in ids if i != victim)
            raw = long.aiter_raw()
            chunks = [await raw.__anext__()]
            membership.set_draining(victim, True)
            assert endpoints[victim].draining
            shorts = await asyncio.gather(
                *(client.post(url + "/v1/completions", json=body(4)) for _ in range(6))
            )
            assert [s.headers["x-fleetgate-endpoint"] for s in shorts] == [other] * 6
            text = await metrics_text(client, url)
            assert metric(text, "fleetgate_endpoint_in_flight", endpoint=victim) == 1
            async for chunk in raw:
                chunks.append(chunk)
        assert done_tokens(b"".join(chunks)) == 120  # the whole answer, undisturbed
        text = await metrics_text(client, url)
    assert metric(text, "fleetgate_endpoint_in_flight", endpoint=victim) == 0
    assert metric(text, "fleetgate_requests_total", endpoint=victim, status="200") == 1
    assert metric(text, "fleetgate_requests_total", endpoint=other, status="200") == 6
    assert metric(text, "fleetgate_resumes_total") == 0
    assert metric(text, "fleetgate_retries_total") == 0


async def test_preemption_never_disturbs_a_draining_endpoints_stream() -> None:
    """Class queue, one slot per engine, both busy with batch streams; one engine is
    draining. A critical request must preempt the batch stream on the other engine
    (the only one it may use), never the draining engine's, which runs to the end in
    one piece."""
    specs = [EngineSpec(kind="vllm", overrides=SLOW) for _ in range(2)]
    async with (
        run_fleet(specs, model=MODEL) as fleet,
        router(config(queue=True)) as (url, app, membership),
        httpx.AsyncClient(timeout=60) as client,
    ):
        ids = [EndpointId(f"ns/e{i}") for i in range(2)]
        for eid, e in zip(ids, fleet.engines, strict=True):
            assert membership.add(target(eid, e.url, capacity=1))
        endpoints = app.state.router.fleet.endpoints
        await until(lambda: all(endpoints[i].healthy and endpoints[i].models for i in ids))
        placer = app.state.admission.placer
        placed: list[tuple[str, str]] = []
        reserve = placer.reserve

        def spy(req: Any, e: Any) -> Any:
            placed.append((req.id, e.id))
            return reserve(req, e)

        placer.reserve = spy
        batch = {"x-fleetgate-priority": "batch"}
        async with contextlib.AsyncExitStack() as stack:
            streams = []
            for _ in range(2):
                r = await stack.enter_async_context(
                    client.stream("POST", url + "/v1/completions", json=body(150), headers=batch)
                )
                raw = r.aiter_raw()
                streams.append((r, raw, [await raw.__anext__()]))
            (a, a_raw, a_chunks), (b, b_raw, b_chunks) = streams
            draining = EndpointId(a.headers["x-fleetgate-endpoint"])
            assert b.headers["x-fleetgate-endpoint"] != draining  # one slot each
            membership.set_draining(draining, True)
            critical = await client.post(
                url + "/v1/completions",
                json=body(4, stream=False),
                headers={"x-fleetgate-priority": "critical"},
            )
            assert critical.status_code == 200, critical.text
            assert critical.headers["x-fleetgate-endpoint"] != draining
            async for chunk in a_raw:
                a_chunks.append(chunk)
            async for chunk in b_raw:
                b_chunks.append(chunk)
        assert done_tokens(b"".join(a_chunks)) == 150
        assert done_tokens(b"".join(b_chunks)) == 150  # preempted, resumed, whole
        text = await metrics_text(client, url)
    a_id, b_id = a.headers["x-request-id"], b.headers["x-request-id"]
    assert [e for rid, e in placed if rid == a_id] == [draining]  # never moved
    assert len([e for rid, e in placed if rid == b_id]) == 2  # the victim: resumed once
    assert all(e != draining for rid, e in placed if rid != a_id)
    assert metric(text, "fleetgate_preemptions_total", model=MODEL, **{"class": "batch"}) == 1
    assert metric(text, "fleetgate_endpoint_in_flight", endpoint=draining) == 0


@pytest.mark.parametrize("queue", [False, True], ids=["immediate", "class-queue"])
async def test_held_long_poll_answers_when_a_model_first_holds(queue: bool) -> None:
    """``GET /held`` (what the operator's autoscaler waits on): at once for an unknown
    generation, then only when a model's held count goes 0 -> 1, not for the next
    held request of the same model, and after ``wait`` with nothing new."""
    async with (
        router(config(queue=queue)) as (url, app, membership),
        httpx.AsyncClient(timeout=30) as client,
    ):
        first = (await client.get(url + "/held", params={"after": -1, "wait": 5})).json()
        assert first == {"generation": 0, "held": {}}
        t0 = time.monotonic()
        idle = (await client.get(url + "/held", params={"after": 0, "wait": 0.3})).json()
        assert idle == {"generation": 0, "held": {}} and time.monotonic() - t0 >= 0.25
        poll = asyncio.create_task(client.get(url + "/held", params={"after": 0, "wait": 20}))
        await asyncio.sleep(0.2)
        assert not poll.done()
        sent = time.monotonic()
        tasks = [asyncio.create_task(client.post(url + "/v1/completions", json=body(4)))]
        woke = (await poll).json()
        assert woke == {"generation": 1, "held": {MODEL: 1}}
        assert time.monotonic() - sent < 2.0  # answered by the hold, not by `wait`
        tasks.append(asyncio.create_task(client.post(url + "/v1/completions", json=body(4))))
        await until(lambda: held_now(app) == 2)
        again = (await client.get(url + "/held", params={"after": 1, "wait": 0.2})).json()
        assert again == {"generation": 1, "held": {MODEL: 2}}  # a second hold wakes nobody
        for bad in ({"after": "x"}, {"wait": "nan"}, {"wait": 61}):
            r = await client.get(url + "/held", params=bad)
            assert r.status_code == 400 and "error" in r.json(), r.text
        async with run_fleet([EngineSpec(kind="vllm")], model=MODEL) as fleet:
            assert membership.add(target("ns/late-0", fleet.engines[0].url))
            answers = await asyncio.gather(*tasks)
        assert [a.status_code for a in answers] == [200, 200]


async def test_a_starting_endpoint_is_probed_at_the_startup_interval() -> None:
    """An endpoint that has not answered yet is probed every ``startup_interval_s``
    (0.05 s here), not every ``interval_s`` (5 s): a held request goes out within a
    few of those of the engine binding; once answered, the slow interval applies."""
    cfg = config(queue=False)
    cfg = cfg.model_copy(
        update={"health": cfg.health.model_copy(update={"interval_s": 5.0,
                                                        "startup_interval_s": 0.05})}
    )  # fmt: skip
    async with router(cfg) as (url, app, membership), httpx.AsyncClient(timeout=30) as client:
        async with run_fleet([EngineSpec(kind="vllm")], model=MODEL) as fleet:
            # the endpoint joins at a refusing address, then "binds": its URL turns
            # to the running engine's (a port that opens later, without a race)
            engine = fleet.engines[0].url
            closed = "http://127.0.0.1:9"  # discard port: refused
            assert membership.add(target("ns/late-0", closed))
            e = app.state.router.fleet.endpoints["ns/late-0"]
            poller = app.state.poller
            await asyncio.sleep(0.3)
            assert not e.healthy and not e.answered
            assert poller.probe_interval(e) == 0.05
            e.url = engine  # the engine "binds"
            t0 = time.monotonic()
            await until(lambda: e.healthy, within=3.0)
            assert time.monotonic() - t0 < 1.0  # not the 5 s interval
            assert e.answered and poller.probe_interval(e) == 5.0
            r = await client.post(url + "/v1/completions", json=body(4, stream=False))
            assert r.status_code == 200, r.text


async def test_a_pending_held_poll_ends_when_the_router_drains() -> None:
    """``end_long_polls`` (what the CLI's SIGTERM handler calls) answers a pending
    ``GET /held`` at once, and later ones without waiting, so the drain is not held up
    for the poll's ``wait``."""
    async with (
        router(config(queue=False)) as (url, app, membership),
        httpx.AsyncClient(timeout=30) as client,
    ):
        poll = asyncio.create_task(client.get(url + "/held", params={"after": 0, "wait": 30}))
        await asyncio.sleep(0.2)
        assert not poll.done()
        t0 = time.monotonic()
        app.state.end_long_polls()
        assert (await poll).json() == {"generation": 0, "held": {}}
        again = await client.get(url + "/held", params={"after": 0, "wait": 30})
        assert again.status_code == 200 and time.monotonic() - t0 < 2.0
