"""Both admissions: eligibility from the pipeline, reservation, queue, drain on release."""

from __future__ import annotations

import asyncio

import httpx
from pathkit import request, services

from fleetgate.engines.base import LoadSnapshot
from fleetgate.router.admission import ImmediateAdmission, Refusal
from fleetgate.router.admission_queue import ClassQueueAdmission
from fleetgate.router.placement import Placer
from fleetgate.router.request import Request
from fleetgate.router.services import Services
from fleetgate.router.state import Endpoint


def ok(_: httpx.Request) -> httpx.Response:
    return httpx.Response(200, json={})


def placer(s: Services) -> Placer:
    return Placer(s.fleet, s.pipeline, s.metrics, s.rng)


async def test_immediate_places_at_once_and_never_twice_on_a_failed_endpoint() -> None:
    s, _, (a, b) = services(ok)
    adm = ImmediateAdmission(s.config, placer(s), s.classes, s.clock)
    req = request(s, {"prompt": "x"})
    first = await adm.admit(req)
    assert isinstance(first, Endpoint) and first.counts.in_flight == 1
    adm.release(req)
    req.failed.add(first.id)
    req.failures, req.last_cause = 1, "connect"
    second = await adm.admit(req)
    assert isinstance(second, Endpoint) and second is not first
    adm.forget(req)
    req.failed.add(second.id)
    refused = await adm.admit(req)
    assert isinstance(refused, Refusal) and refused.status == 503 and "connect" in refused.message
    assert a.counts.in_flight == b.counts.in_flight == 0


async def test_eligibility_is_the_pipelines_hard_filters() -> None:
    s, _, (a, b) = services(ok)
    a.healthy = False
    b.models = frozenset({"other"})
    adm = ImmediateAdmission(s.config, placer(s), s.classes, s.clock)
    got = await adm.admit(request(s, {"prompt": "x"}))
    assert isinstance(got, Refusal) and "serves model" in got.message


def saturate(e: Endpoint, now: float) -> None:
    """A fresh scrape: every slot of the engine's 8 taken, 2 more waiting."""
    e.scraped(LoadSnapshot(scraped_at=now, running=8, waiting=2, kv_usage=0.5, max_running=8))


async def test_class_queue_places_while_free_then_queues_and_drains_on_release() -> None:
    s, _, (a, b) = services(ok, priority={})
    assert s.config.priority is not None
    adm = ClassQueueAdmission(s.config.priority, placer(s), s.classes, s.clock)
    now = s.clock()
    saturate(b, now)
    a.scraped(LoadSnapshot(scraped_at=now, running=7, waiting=0, kv_usage=0.5, max_running=8))
    first = request(s, {"prompt": "one"})
    got = await adm.admit(first)
    assert got is a and first.id in adm.running  # the one free slot
    waiting = request(s, {"prompt": "two"}, headers={"x-fleetgate-priority": "batch"})
    task = asyncio.get_running_loop().create_task(adm.admit(waiting))
    await asyncio.sleep(0.01)
    assert not task.done() and waiting.queued, "pool saturated: it waits in the router"
    adm.release(first)  # a slot frees: the drain dispatches the queued request
    placed = await asyncio.wait_for(task, 2)
    assert placed is a and not waiting.queued
    adm.forget(waiting)
    adm.close()
    assert a.counts.in_flight == 0


async def test_class_queue_refuses_a_full_class_at_once() -> None:
    classes = [{"name": "only", "level": 0, "ttft_objective_s": 1, "max_queue_time_s": 5,
                "max_queued": 1, "sheddable": True}]  # fmt: skip
    s, _, endpoints = services(ok, priority={"classes": classes, "default_class": "only"})
    assert s.config.priority is not None
    adm = ClassQueueAdmission(s.config.priority, placer(s), s.classes, s.clock)
    for e in endpoints:
        saturate(e, s.clock())
    queued = asyncio.get_running_loop().create_task(adm.admit(request(s, {"prompt": "1"})))
    await asyncio.sleep(0.01)
    refused = await adm.admit(request(s, {"prompt": "2"}))
    assert isinstance(refused, Refusal) and refused.shed and refused.status == 429
    queued.cancel()
    adm.close()


DOC = "a long shared document about fleets of engines. " * 40


async def _affinity_case(priority: dict[str, object]) -> tuple[Endpoint, Endpoint, Endpoint]:
    """Both engines full; ``a`` holds DOC. A question on DOC is queued first, then a
    prompt nobody holds (its rendezvous target b); then ``b`` frees a slot, then
    ``a``. Returns (a, where the DOC question went, where the cold prompt went)."""
    s, _, (a, b) = services(ok, priority=priority)
    assert s.config.priority is not None
    adm = ClassQueueAdmission(s.config.priority, placer(s), s.classes, s.clock)
    on_doc = request(s, {"prompt": DOC + "question one?"})
    cold = next(  # a prompt nobody holds whose rendezvous target is b
        r
        for i in range(64)
        if (r := request(s, {"prompt": f"something else entirely {i} " * 40})).order[0] == b.id
    )
    assert on_doc.chain, "the prompt is long enough to have prefix blocks"
    s.fleet.index.record(a.id, on_doc.chain)  # a answered an earlier question on DOC
    now = s.clock()
    saturate(a, now)
    saturate(b, now)
    loop = asyncio.get_running_loop()
    doc_task = loop.create_task(adm.admit(on_doc))
    await asyncio.sleep(0.01)
    cold_task = loop.create_task(adm.admit(cold))
    await asyncio.sleep(0.01)
    assert on_doc.queued and cold.queued
    b.scraped(LoadSnapshot(scraped_at=s.clock(), running=7, waiting=0, kv_usage=0.5,
                           max_running=8))  # fmt: skip
    adm.on_fleet_change()
    done, _ = await asyncio.wait(
        {doc_task, cold_task}, timeout=2, return_when=asyncio.FIRST_COMPLETED
    )
    await asyncio.sleep(0.01)
    assert len(done) == 1 and not (doc_task.done() and cold_task.done()), "one slot: one placed"
    a.scraped(LoadSnapshot(scraped_at=s.clock(), running=7, waiting=0, kv_usage=0.5,
                           max_running=8))  # fmt: skip
    adm.on_fleet_change()
    doc_at, cold_at = await asyncio.wait_for(asyncio.gather(doc_task, cold_task), 2)
    assert isinstance(doc_at, Endpoint) and isinstance(cold_at, Endpoint)
    adm.forget(on_doc)
    adm.forget(cold)
    adm.close()
    return a, doc_at, cold_at


async def test_a_queued_request_waits_for_the_busy_holder_of_its_prefix() -> None:
    a, doc_at, cold_at = await _affinity_case({})
    assert doc_at is a, "the question on DOC waited for the engine that holds DOC"
    assert cold_at is not a, "the cold prompt took the engine that freed first"


async def test_without_affinity_dispatch_the_queue_head_takes_the_first_free_engine() -> None:
    a, doc_at, cold_at = await _affinity_case({"affinity_wait_s": None})
    assert doc_at is not a and cold_at is a


def test_affinity_targets_are_the_best_holders_else_the_prefixs_rendezvous_target() -> None:
    s, _, (a, b) = services(ok, priority={})
    req = request(s, {"prompt": DOC + "question two?"})
    p = placer(s)
    now = s.clock()
    rendezvous = frozenset({req.order[0]})

    def targets(r: Request) -> frozenset[str]:
        return p.affinity_targets(r, p.eligible(r, now))

    assert targets(req) == rendezvous, "nobody holds it: its rendezvous target"
    assert p.affinity(req, p.eligible(req, now))[1] == 0, "nothing cached: nothing at stake"
    other = b if req.order[0] == a.id else a
    s.fleet.index.record(other.id, req.chain)
    assert targets(req) == {other.id}, "a holder wins over rendezvous"
    stake = p.affinity(req, p.eligible(req, now))[1]
    held = s.fleet.believed_cached(other, req.chain, req.prompt, req.view)[0]
    assert stake == held > 0, "what it loses elsewhere: the tokens its holder has"
    other.scraped(LoadSnapshot(scraped_at=now, running=8, waiting=5, kv_usage=0.95, max_running=8))
    assert targets(req) == {other.id}, "load plays no part"
    s.fleet.index.record(req.order[0], req.chain)
    assert targets(req) == rendezvous, "both hold it all: rendezvous decides"
    short = request(s, {"prompt": "hi"})
    assert not short.chain and targets(short) == frozenset()


async def test_one_drain_reads_the_fleet_once_however_long_the_queue() -> None:
    """A drain looks at every request of the affinity window; the fleet's views and
    each endpoint's saturation inputs are read once per drain, not once per request
    (plus the pipeline's own read for each dispatch)."""
    s, _, (a, b) = services(ok, priority={})
    assert s.config.priority is not None
    adm = ClassQueueAdmission(s.config.priority, placer(s), s.classes, s.clock)
    for e in (a, b):
        saturate(e, s.clock())
    loop = asyncio.get_running_loop()
    queued = [request(s, {"prompt": DOC + f"question {i}?"}) for i in range(12)]
    s.fleet.index.record(a.id, queued[0].chain)  # a holds DOC: all of them prefer a
    tasks = [loop.create_task(adm.admit(r)) for r in queued]
    await asyncio.sleep(0.01)
    assert all(r.queued for r in queued)

    reads: dict[str, int] = {"views": 0, "saturation": 0}
    views, saturation_view = s.fleet.views, s.fleet.saturation_view

    def counted_views(*args: object, **kw: object) -> object:
        reads["views"] += 1
        return views(*args, **kw)  # type: ignore[arg-type]

    def counted_saturation(*args: object, **kw: object) -> object:
        reads["saturation"] += 1
        return saturation_view(*args, **kw)  # type: ignore[arg-type]

    s.fleet.views = counted_views  # type: ignore[method-assign]
    s.fleet.saturation_view = counted_saturation  # type: ignore[method-assign]
    # b frees one slot: the drain weighs the whole window (each waits for a), then
    # gives b to the one that loses least by moving
    b.scraped(LoadSnapshot(scraped_at=s.clock(), running=7, waiting=0, kv_usage=0.5,
                           max_running=8))  # fmt: skip
    drains = adm.drains
    adm.on_fleet_change()
    await asyncio.sleep(0.01)
    assert adm.drains == drains + 1
    placed = [t for t in tasks if t.done()]
    assert len(placed) == 1 and placed[0].result() is b
    assert reads == {"views": 1 + len(placed), "saturation": 2}
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    adm.close()
