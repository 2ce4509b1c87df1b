"""Class-queue admission (the router YAML has a ``priority:`` section): the
:class:`~fleetgate.router.admission.Admission` that queues, sheds and preempts.

A request is placed at once while its pool is not saturated (hot path: one
saturation check plus the pipeline); otherwise it waits in the
:class:`~fleetgate.router.priority.queue.AdmissionQueue` (strict class order, weighted
fair queueing among tenants) and one event-driven drain dispatches, sheds and
preempts (:func:`~fleetgate.router.priority.policy.drain`). Drain events: a request
had to queue, an attempt ended, the poller saw a change, and ONE timer armed at the
next queue expiry or preemption threshold. Nothing polls. A preemption cancels the
victim's running attempt while it awaits the engine, never while it writes to the
client (``Request.sending``). The protocol, :class:`Refusal`, the scale-from-zero
holds and immediate admission are in :mod:`fleetgate.router.admission`.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Sequence

from fleetgate.router.admission import Clock, Holds, Refusal
from fleetgate.router.config import RouterConfig
from fleetgate.router.metrics import ClassMetrics
from fleetgate.router.placement import Placer
from fleetgate.router.priority.class_queue import QueueItem
from fleetgate.router.priority.config import PriorityConfig
from fleetgate.router.priority.policy import Dispatch, Preempt, drain
from fleetgate.router.priority.preemption import InFlight as VictimView
from fleetgate.router.priority.queue import AdmissionQueue, Shed
from fleetgate.router.priority.saturation import SaturationView, pool_saturation
from fleetgate.router.request import Request
from fleetgate.router.scheduling.types import EndpointId, EndpointView
from fleetgate.router.state import Endpoint

log = logging.getLogger("fleetgate.router.admission")


class ClassQueueAdmission:
    """Queue, drain scheduling and preemption for one router app (module docstring)."""

    def __init__(
        self,
        cfg: PriorityConfig,
        placer: Placer,
        classes: ClassMetrics,
        clock: Clock,
        holds: Holds | None = None,
    ) -> None:
        self.cfg = cfg
        self.holds = holds if holds is not None else Holds(RouterConfig(), placer.fleet, classes)
        self.placer = placer
        self.fleet = placer.fleet
        self.classes = classes
        self.clock = clock
        self.preempts = cfg.preemption_enabled
        self.queue: AdmissionQueue[Request] = AdmissionQueue(cfg)
        self.running: dict[str, Request] = {}
        self.preempting_for: dict[str, str] = {}
        """waiting request id -> victim request id, while that preemption is in progress."""
        self._queued: Counter[str] = Counter()
        self._scheduled = False
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: float | None = None
        self.drains = 0
        self.unknown_slot_limit: set[str] = set()
        """Endpoints warned about: no configured capacity and none in their metrics."""

    # -- the Admission protocol ------------------------------------------------

    async def admit(self, req: Request) -> Endpoint | Refusal:
        # The waiter exists before the request can be queued: a drain resolves it.
        req.waiter = asyncio.get_running_loop().create_future()
        got: Endpoint | Shed[Request] | Refusal | None
        try:
            if req.queued:  # parked: unless nothing can serve it any more, the drain places it
                got = self._unservable(req, self.clock())
                if got is not None and self.queue.remove(req.id) is not None:
                    self._dequeued(req)
            else:
                got = self._offer(req)
            if got is None:
                got = await req.waiter
        finally:
            req.waiter = None
        if isinstance(got, Refusal):
            return got
        if isinstance(got, Shed):
            return Refusal(got.status, got.message, got.retry_after_s, shed=True)
        assert isinstance(got, Endpoint)
        self.running[req.id] = req
        return got

    def release(self, req: Request) -> None:
        req.release()
        self.running.pop(req.id, None)
        self.kick()  # capacity freed: an event for the drain

    def park(self, req: Request, cause: str) -> None:
        """Re-queue a preempted / engine-died request (its original arrival kept)."""
        now = self.clock()
        req.parked_at = now
        req.park_cause = cause
        req.preempt_pending = False
        for waiting, victim in list(self.preempting_for.items()):
            if victim == req.id:
                del self.preempting_for[waiting]
        self.queue.park(req.id, req.cls, req.tenant, req.arrival, now, req, pool=req.model)
        self._enqueued(req)
        self.kick()

    def forget(self, req: Request) -> None:
        if req.queued and self.queue.remove(req.id) is not None:
            self._dequeued(req)
        self.preempting_for.pop(req.id, None)
        self.release(req)

    def on_fleet_change(self) -> None:
        self.classes.precreate(self.fleet.models(healthy_only=False, now=self.clock()))
        self._warn_unknown_slot_limits()
        self.kick()

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    # -- placing ---------------------------------------------------------------

    def _unservable(self, req: Request, now: float) -> Refusal | None:
        """A 503 when no endpoint can serve the request at all (all down, ejected or not
        serving its model): answered at once, never held for the class's queue time,
        unless its model scales from zero (then it waits in the queue, held)."""
        if self.placer.eligible(req, now) or self.holds.bound(req) is not None:
            return None
        return Refusal(
            503, f"no healthy endpoint serves model `{req.model}`", req.cls.retry_after_s
        )

    def _offer(self, req: Request) -> Endpoint | Shed[Request] | Refusal | None:
        """Place at once (hot path), refuse (class full, nothing can serve it), or queue
        (None: await the waiter)."""
        now = self.clock()
        self.classes.precreate((req.model,))
        able = self.placer.eligible(req, now)
        if not able:
            bound = self.holds.bound(req)
            if bound is None:
                return self._unservable(req, now)
            if self.holds.full(req.model):
                return self.holds.refusal(req, now, full=True)
            return self._queue(req, now, max_wait_s=bound)
        if not self._queued[req.model]:
            views = [self.fleet.saturation_view(e, now) for e in able]
            sat = pool_saturation(
                views, self.cfg.saturation, lambda: _holding(self.placer.affinity(req, able))
            )
            if not sat.saturated:
                e = self.placer.pick(req, sat.available, now)
                if e is not None:
                    self.classes.m.child(self.classes.wait, req.model, req.cls.name).observe(0.0)
                    return self.placer.reserve(req, e)
        return self._queue(req, now)

    def _queue(
        self, req: Request, now: float, *, max_wait_s: float | None = None
    ) -> Shed[Request] | None:
        """Queue ``req`` (None: await the waiter); ``max_wait_s`` marks it held."""
        got = self.queue.offer(
            req.id, req.cls, req.tenant, now, req, cost=1.0, pool=req.model, max_wait_s=max_wait_s
        )
        if isinstance(got, Shed):
            self._count_shed(got)
            return got
        self._enqueued(req)
        if max_wait_s is not None:
            self.holds.hold(req)
        self.kick()
        return None

    def views(
        self,
        req: Request,
        now: float,
        fleet_views: Sequence[EndpointView] | None = None,
        known: dict[str, SaturationView] | None = None,
    ) -> list[SaturationView]:
        """Saturation inputs of every endpoint that may serve ``req``. A drain passes
        the fleet's views and a per-endpoint cache (``known``, filled here) so that it
        reads the fleet once however many queued requests it looks at."""
        out = []
        for e in self.placer.eligible(req, now, fleet_views):
            v = known.get(e.id) if known is not None else None
            if v is None:
                v = self.fleet.saturation_view(e, now)
                if known is not None:
                    known[e.id] = v
            out.append(v)
        return out

    def _request_preempt(self, req: Request) -> bool:
        """Stop the request's running attempt (closing its upstream); False if none runs."""
        seg = req.segment
        if seg is None or seg.done() or req.preempt_pending:
            return False
        req.preempt_pending = True
        if not req.sending:
            seg.cancel()
        return True

    # -- drain -----------------------------------------------------------------

    def kick(self) -> None:
        """Run one drain on the next loop turn (events coalesce; nothing queued: no-op)."""
        if self._queued and not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._drain_now)

    def _drain_now(self) -> None:
        self._scheduled = False
        if not self._queued:
            self._arm(None)
            return
        self.drains += 1
        now = self.clock()
        self._refuse_unservable(now)
        # One drain reads the fleet at one ``now``: its views and each endpoint's
        # saturation inputs once, each queued request's eligible subset of them once
        # (per request, these were most of the router's CPU under a queue).
        fleet_views = self.fleet.views((), [], now)
        saturation: dict[str, SaturationView] = {}
        cache: dict[int, list[SaturationView]] = {}

        def views_for(item: QueueItem[Request]) -> list[SaturationView]:
            key = id(item.payload)
            if key not in cache:
                cache[key] = self.views(item.payload, now, fleet_views, saturation)
            return cache[key]

        holders: dict[int, tuple[frozenset[str], int]] = {}

        def affinity(item: QueueItem[Request]) -> tuple[frozenset[str], int]:
            key = id(item.payload)
            if key not in holders:
                able = [self.fleet.endpoints[EndpointId(v.endpoint)] for v in views_for(item)]
                holders[key] = self.placer.affinity(item.payload, able)
            return holders[key]

        def prefer(item: QueueItem[Request]) -> frozenset[str]:
            return affinity(item)[0]

        def holds(item: QueueItem[Request]) -> frozenset[str]:
            return _holding(affinity(item))

        def stake(item: QueueItem[Request]) -> float:
            return affinity(item)[1]

        def kv_share(item: QueueItem[Request], endpoint: str) -> float:
            snap = self.fleet.endpoints[EndpointId(endpoint)].replica_snapshot()
            pool = snap.total_kv_tokens if snap else None
            return item.payload.kv_tokens / pool if pool else 0.0

        def pick(item: QueueItem[Request], available: tuple[str, ...]) -> str:
            e = self.placer.pick(item.payload, available, now)
            return e.id if e is not None else available[0]

        actions = drain(
            self.queue,
            now,
            config=self.cfg,
            views_for=views_for,
            pick=pick,
            in_flight=self._victims,
            preempting_for=self.preempting_for.keys(),
            prefer=prefer if self.cfg.affinity_wait_s is not None else None,
            kv_share=kv_share,
            stake=stake,
            holds=holds,
        )
        for a in actions:
            if isinstance(a, Shed):
                req = a.item.payload
                held = req.held
                self._dequeued(req)
                self.preempting_for.pop(a.item.request_id, None)
                if held:  # past the cold-start bound: 503 + the time left to wait
                    _resolve(req, self.holds.refusal(req, now))
                    continue
                self._count_shed(a)
                _resolve(req, a)
            elif isinstance(a, Dispatch):
                req = a.item.payload
                self._dequeued(req)
                self.preempting_for.pop(req.id, None)
                if req.waiter is None or req.waiter.done():
                    continue
                if not req.dispatched_once:
                    self.classes.m.child(self.classes.wait, req.model, req.cls.name).observe(
                        now - req.arrival
                    )
                self.classes.m.child(
                    self.classes.queue_dispatches, req.model, req.cls.name, a.how
                ).inc()
                e = self.fleet.endpoints[EndpointId(a.endpoint)]
                _resolve(req, self.placer.reserve(req, e))
            elif isinstance(a, Preempt):
                victim = self.running.get(a.victim.request_id)
                if victim is not None and self._request_preempt(victim):
                    self.preempting_for[a.for_item.request_id] = victim.id
                    victim.preemptions += 1
                    waiting = a.for_item.payload
                    log.info("preempt %s for %s: %s", victim.label, waiting.label, a.reason)
                    self.classes.m.child(
                        self.classes.preemptions, victim.model, victim.cls.name
                    ).inc()
        self._arm(now)

    def _refuse_unservable(self, now: float) -> None:
        """Answer 503 at once to every queued request of a model no endpoint can serve
        any more (the hard filters are per model: healthy, not ejected, serves it)."""
        served = set(self.fleet.models(healthy_only=True, now=now)) | set(self.fleet.standby)
        dead = {m for m in self._queued if m not in served}
        if not dead:
            return
        for item in self.queue.ordered():
            req = item.payload
            if req.model not in dead or self.queue.remove(req.id) is None:
                continue
            self._dequeued(req)
            self.preempting_for.pop(req.id, None)
            refusal = Refusal(
                503, f"no healthy endpoint serves model `{req.model}`", req.cls.retry_after_s
            )
            if req.waiter is not None and not req.waiter.done():
                req.waiter.set_result(refusal)

    def _arm(self, now: float | None) -> None:
        """One timer at the next expiry or preemption-threshold crossing."""
        at: float | None = None
        if now is not None and self._queued:
            at = self.queue.next_expiry()
            if self.cfg.preemption_enabled:
                for cls in self.cfg.classes:
                    after = cls.preempt_after_s
                    if after is None:
                        continue
                    for item in self.queue.items(cls.name):
                        t = item.enqueued_at + after
                        if not item.parked and t > now and (at is None or t < at):
                            at = t
        if at == self._timer_at:
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._timer_at = at
        if at is not None:
            delay = max(0.0, at - self.clock()) + 1e-4
            self._timer = asyncio.get_running_loop().call_later(delay, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._timer_at = None
        self.kick()

    # -- helpers ---------------------------------------------------------------

    def _victims(self, below: int | None = None) -> list[VictimView]:
        """The running requests as preemption sees them; with ``below``, only those of
        a class level under it (the only ones a request at that level may preempt)."""
        # A chat answer streaming from an engine that returns no token ids could only
        # resume from text (``chat-assistant-prefix``), whose seam is not exact: it is
        # never chosen as a victim (an engine failure still resumes it that way).
        return [
            VictimView(
                request_id=r.id,
                endpoint=r.holding.id if r.holding is not None else "",
                class_name=r.cls.name,
                level=r.cls.level,
                prompt_tokens=r.view.prompt_tokens,
                generated_tokens=r.generated,
                preemptions=r.preemptions,
                started_at=r.started_at,
                resumable=r.resumable
                and not r.preempt_pending
                and r.holding is not None
                and (r.kind != "chat" or r.holding.adapter.returns_token_ids),
            )
            for r in self.running.values()
            if below is None or r.cls.level < below
        ]

    def _warn_unknown_slot_limits(self) -> None:
        """Once per endpoint: its slot limit is neither configured nor scraped.

        vLLM does not export ``--max-num-seqs``; without the backend's ``capacity``
        (Kubernetes discovery takes it from the InferenceService) saturation sees
        such an engine as free until its own queue shows waiting requests, so urgent
        work can queue inside the engine behind lower classes (measured on
        priority-storm: critical attainment 64% without capacity, 100% with it).
        """
        for e in self.fleet:
            if e.id in self.unknown_slot_limit or e.capacity_hint is not None:
                continue
            snap = e.snapshot
            if snap is not None and snap.max_running is None:
                self.unknown_slot_limit.add(e.id)
                log.warning(
                    "endpoint %s (%s) reports no concurrent-sequence limit and its backend "
                    "sets no capacity: priority saturation will only see its own queue; set "
                    "capacity to the engine's --max-num-seqs",
                    e.id,
                    e.engine,
                )

    def _enqueued(self, req: Request) -> None:
        req.queued = True
        self._queued[req.model] += 1
        self.classes.m.child(self.classes.depth, req.model, req.cls.name).inc()

    def _dequeued(self, req: Request) -> None:
        self.holds.unhold(req)
        if not req.queued:
            return
        req.queued = False
        self._queued[req.model] -= 1
        if self._queued[req.model] <= 0:
            del self._queued[req.model]
        self.classes.m.child(self.classes.depth, req.model, req.cls.name).dec()

    def _count_shed(self, shed: Shed[Request]) -> None:
        req = shed.item.payload
        self.classes.m.child(self.classes.sheds, req.model, req.cls.name, str(shed.status)).inc()


def _resolve(req: Request, value: Endpoint | Shed[Request] | Refusal) -> None:
    if req.waiter is not None and not req.waiter.done():
        req.waiter.set_result(value)


def _holding(affinity: tuple[frozenset[str], int]) -> frozenset[str]:
    """The holders of a request's prompt from ``Placer.affinity``'s answer: its targets
    when they hold part of the prompt, none for its rendezvous fallback."""
    targets, cached = affinity
    return targets if cached > 0 else frozenset()
