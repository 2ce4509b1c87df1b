"""Admission: when, and on which endpoint, a request (or its continuation) may run.

The serve loop asks ``await admission.admit(req)`` before every attempt and gets
an :class:`~fleetgate.router.state.Endpoint` (reserved for the request:
``Request.reserve``) or a :class:`Refusal`. After the attempt it calls
``release(req)``; when the request is over, ``forget(req)``; to try again
elsewhere (an engine failure, a preemption), ``park(req, cause)`` and then
``admit`` again. Two implementations:

* :class:`ImmediateAdmission` (the router YAML has no ``priority:`` section):
  every admission runs the scheduling pipeline at once over the endpoints the
  request has not failed on; nothing queues and nothing is preempted.
* :class:`~fleetgate.router.admission_queue.ClassQueueAdmission` (a ``priority:``
  section, in its own module): a request is placed at
  once while its pool is not saturated (hot path: one saturation check plus the
  pipeline); otherwise it waits in the
  :class:`~fleetgate.router.priority.queue.AdmissionQueue` (strict class order,
  weighted fair queueing among tenants) and one event-driven drain dispatches,
  sheds and preempts (:func:`~fleetgate.router.priority.policy.drain`). Drain
  events: a request had to queue, an attempt ended, the poller saw a change, and
  ONE timer armed at the next queue expiry or preemption threshold. Nothing
  polls. A preemption cancels the victim's running attempt while it awaits the
  engine, never while it writes to the client (``Request.sending``).

Both decide eligibility with the pipeline's own hard filters
(``Pipeline.eligible``) and place with the same pipeline (:class:`Placer`).

Scale from zero (:class:`Holds`): a request for an autoscaled model
(``Fleet.standby``: at zero replicas, or with every replica starting) that no
endpoint can serve now is *held* rather than refused: in the class queue with a
tighter expiry (``ClassQueueAdmission``), or in a small per-model wait list
(``ImmediateAdmission``). It waits at most
``min(cold start x limits.hold_cold_start_factor, its class's max_queue_time_s)``,
at most ``limits.max_held_requests`` per model are held, and when an endpoint
becomes eligible the held requests go out in class order (most urgent first).
Beyond a bound: 503 + ``Retry-After``.

Accounting invariant: a placement reserves its endpoint at once, so two
drains on consecutive loop turns never overfill an endpoint before the
request's attempt runs; the reservation is released exactly once
(``Request.release`` is idempotent).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
from collections import Counter
from collections.abc import Callable
from typing import Protocol

from fleetgate.router.config import RouterConfig
from fleetgate.router.metrics import ClassMetrics
from fleetgate.router.placement import Placer
from fleetgate.router.request import Request
from fleetgate.router.state import Endpoint, Fleet

log = logging.getLogger("fleetgate.router.admission")


@dataclasses.dataclass(frozen=True, slots=True)
class Refusal:
    """Admission will not place the request: the client gets ``status``."""

    status: int
    message: str
    retry_after: float | None = None
    shed: bool = False
    """True when the class queue refused or expired it (counted as a shed)."""


class Admission(Protocol):
    preempts: bool
    """Whether a running attempt may be cut short to make room (needs the splicer)."""

    async def admit(self, req: Request) -> Endpoint | Refusal:
        """Place the request (reserving the endpoint), or refuse it."""
        ...

    def release(self, req: Request) -> None:
        """The request's attempt ended: its endpoint's reservation is given back."""
        ...

    def park(self, req: Request, cause: str) -> None:
        """The attempt was cut short (``preempted`` or ``engine_failure``): admit again."""
        ...

    def forget(self, req: Request) -> None:
        """The request is over (any outcome, the client gone included)."""
        ...

    def on_fleet_change(self) -> None:
        """The poller saw a scrape, a health or a model-list change."""
        ...


Clock = Callable[[], float]


class Holds:
    """Requests held while their model scales from zero: bounds, counts, the gauge.

    Shared by both admissions, so "may this request be held, for how long, and what
    does the client get past it" has one answer.
    """

    def __init__(self, config: RouterConfig, fleet: Fleet, classes: ClassMetrics) -> None:
        self.limits = config.limits
        self.fleet = fleet
        self.classes = classes
        self.count: Counter[str] = Counter()
        self.generation = 0
        """+1 whenever a model's first request is held (its count goes 0 -> 1): the
        signal that wakes an autoscaler at once (``GET /held``, :meth:`changed`)."""
        self._changed = asyncio.Event()
        self.closed = False
        """The router is draining: every wait in :meth:`changed` ends now."""

    def close(self) -> None:
        """End every pending and future :meth:`changed` wait (the router shuts down: a
        long poll must not hold its drain up for the poll's whole ``wait``)."""
        self.closed = True
        self._changed.set()

    async def changed(self, after: int, within_s: float) -> int:
        """Wait until :attr:`generation` differs from ``after`` (at most ``within_s``,
        not at all once :meth:`close` ran); returns it. A router that restarted counts
        again from 0, so any difference (not only a larger number) answers at once."""
        if self.generation == after and within_s > 0 and not self.closed:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(within_s):
                    await self._changed.wait()
        return self.generation

    def cold_start(self, model: str) -> float:
        sb = self.fleet.standby.get(model)
        declared = sb.cold_start_s if sb is not None else None
        return declared if declared is not None else self.limits.default_cold_start_s

    def bound(self, req: Request) -> float | None:
        """Seconds ``req`` may be held, or None: its model does not scale from zero (or
        holding is off), so "nothing can serve it" is a 503 at once."""
        if req.model not in self.fleet.standby or self.limits.max_held_requests <= 0:
            return None
        wait = self.cold_start(req.model) * self.limits.hold_cold_start_factor
        return min(wait, req.cls.max_queue_time_s)

    def full(self, model: str) -> bool:
        return self.count[model] >= self.limits.max_held_requests

    def hold(self, req: Request) -> None:
        if req.held:
            return
        req.held = True
        self.count[req.model] += 1
        if self.count[req.model] == 1:
            self.generation += 1
            woken, self._changed = self._changed, asyncio.Event()
            woken.set()
        self.classes.m.child(self.classes.held, req.model, req.cls.name).inc()

    def unhold(self, req: Request) -> None:
        if not req.held:
            return
        req.held = False
        self.count[req.model] -= 1
        if self.count[req.model] <= 0:
            del self.count[req.model]
        self.classes.m.child(self.classes.held, req.model, req.cls.name).dec()

    def refusal(self, req: Request, now: float, *, full: bool = False) -> Refusal:
        """503 + Retry-After for a held request past its bound (or no room to hold it):
        retry when the cold start should be over, at least the class's own delay."""
        cold = self.cold_start(req.model)
        waited = max(0.0, now - req.arrival)
        retry = max(req.cls.retry_after_s, math.ceil(cold - waited))
        self.classes.m.child(self.classes.sheds, req.model, req.cls.name, "503").inc()
        if full:
            why = f"{self.limits.max_held_requests} requests are already held"
        else:
            why = f"held {waited:.1f}s, over the bound of {self.bound(req) or 0.0:g}s"
        sb = self.fleet.standby.get(req.model)
        state = "its replicas are starting" if sb and sb.min_replicas else "scaling from zero"
        return Refusal(
            503,
            f"model `{req.model}` has no ready endpoint yet ({state}; {why}); retry later",
            retry,
            shed=True,
        )


class ImmediateAdmission:
    """Place every request at once; an engine failure is placed again elsewhere."""

    preempts = False

    def __init__(
        self,
        config: RouterConfig,
        placer: Placer,
        classes: ClassMetrics,
        clock: Clock,
    ) -> None:
        self.config = config
        self.placer = placer
        self.classes = classes
        self.clock = clock
        self.holds = Holds(config, placer.fleet, classes)
        self.waiting: dict[str, dict[str, Request]] = {}
        """model -> held requests (by id), each awaiting its ``waiter``."""

    async def admit(self, req: Request) -> Endpoint | Refusal:
        """Place now; for a model scaling from zero with no eligible endpoint, hold
        (bounded) until :meth:`on_fleet_change` sees one, then place."""
        deadline: float | None = None
        while True:
            got = self._place(req, waited=deadline is not None)
            if isinstance(got, Endpoint):
                return got
            now = self.clock()
            bound = self.holds.bound(req)
            if bound is None or self.placer.eligible(req, now):
                return got  # not a cold start: nothing can serve it, or all failed
            if deadline is None:
                deadline = now + bound
            if now >= deadline:
                return self.holds.refusal(req, now)
            if not req.held and self.holds.full(req.model):
                return self.holds.refusal(req, now, full=True)
            req.waiter = asyncio.get_running_loop().create_future()
            self.holds.hold(req)
            self.waiting.setdefault(req.model, {})[req.id] = req
            try:
                async with asyncio.timeout(deadline - now):
                    await req.waiter
            except TimeoutError:
                return self.holds.refusal(req, self.clock())
            finally:
                req.waiter = None
                self._unwait(req)

    def _unwait(self, req: Request) -> None:
        self.holds.unhold(req)
        held = self.waiting.get(req.model)
        if held is not None:
            held.pop(req.id, None)
            if not held:
                del self.waiting[req.model]

    def _place(self, req: Request, *, waited: bool = False) -> Endpoint | Refusal:
        now = self.clock()
        retry_after = self.config.limits.retry_after_s
        if req.needs_final_message and req.parked_at is not None:
            allowed: set[str] = {e.id for e in self.placer.eligible(req, now)}
        else:  # the pipeline's own filters decide the rest, in one pass over the fleet
            allowed = set(self.placer.fleet.endpoints)
        allowed.difference_update(req.failed)
        e = self.placer.pick(req, allowed, now) if allowed else None
        if e is None:
            if req.failures:
                msg = f"no healthy endpoint could serve the request ({req.last_cause})"
            else:
                msg = f"no healthy endpoint serves model `{req.model}`"
            return Refusal(503, msg, retry_after)
        if not req.dispatched_once:
            self.classes.m.child(self.classes.wait, req.model, req.cls.name).observe(
                max(0.0, now - req.arrival) if waited else 0.0
            )
        return self.placer.reserve(req, e)

    def release(self, req: Request) -> None:
        req.release()

    def park(self, req: Request, cause: str) -> None:
        req.parked_at = self.clock()
        req.park_cause = cause

    def forget(self, req: Request) -> None:
        self._unwait(req)
        req.release()

    def on_fleet_change(self) -> None:
        now = self.clock()
        self.classes.precreate(self.placer.fleet.models(healthy_only=False, now=now))
        for model, held in list(self.waiting.items()):
            first = next(iter(held.values()))
            gone = model not in self.placer.fleet.standby  # no longer scales: 503 now
            if not gone and not self.placer.eligible(first, now):
                continue
            # Wake them most urgent first: each resumes, in this order, to place itself.
            for req in sorted(held.values(), key=lambda r: (-r.cls.level, r.arrival)):
                if req.waiter is not None and not req.waiter.done():
                    req.waiter.set_result(None)
