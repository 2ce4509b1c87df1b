"""Priority admission at run time: the queue, the event-driven drain, preemption.

This is the I/O half of ``fleetgate/router/priority/`` (whose package
docstring gives the wiring steps followed here). One :class:`PriorityRuntime`
per router app (built in ``app.build_router`` when the YAML has a
``priority:`` section) owns:

* the :class:`~fleetgate.router.priority.queue.AdmissionQueue` (pool = model);
* the running jobs (the in-flight set preemption chooses victims from);
* one drain scheduler: :meth:`PriorityRuntime.kick` coalesces events into one
  :func:`~fleetgate.router.priority.policy.drain` call on the next loop turn.
  Events: a request arrived (only when it had to queue), a request's segment
  ended, a scrape landed / a probe changed health / models changed (the
  poller's ``on_change`` hook), and ONE timer armed at the earlier of
  ``queue.next_expiry()`` and the next moment a queued request crosses its
  class's preemption threshold. Nothing polls.

Hot path: a request whose pool has nothing queued and at least one available
endpoint (:func:`~fleetgate.router.priority.saturation.pool_saturation`) is
placed at once, without the queue or a drain (one saturation check plus the
usual scheduling pipeline).

Accounting invariant: a dispatch decided here reserves its endpoint at once
(``Endpoint.dispatch``), so two drains on consecutive loop turns never
overfill an endpoint before the request's task runs; the reservation is
released exactly once, by the segment that used it or by :meth:`forget`.

Settings (router YAML ``priority:``): every field of
:class:`~fleetgate.router.priority.config.PriorityConfig`, plus
``preemption: false`` (alias of ``preemption_enabled``, the ablation switch) and
``engine_priority`` (:class:`EnginePriority`: whether an endpoint is sent the
engine's own priority field; vLLM rejects a non-zero ``priority`` unless it
runs ``--scheduling-policy priority``, which the emulator and operator-made
vLLM do by default, engines.md section 2).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from prometheus_client import Counter as PromCounter
from prometheus_client import Gauge, Histogram
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from fleetgate.router.config import ConfigError
from fleetgate.router.priority.config import PriorityClass, PriorityConfig
from fleetgate.router.priority.policy import Dispatch, Preempt, drain
from fleetgate.router.priority.preemption import InFlight as VictimView
from fleetgate.router.priority.queue import AdmissionQueue, QueueItem, Shed
from fleetgate.router.priority.saturation import EndpointView, pool_saturation
from fleetgate.router.scheduling.pipeline import NoEndpointError
from fleetgate.router.scheduling.plugins import uncached_tokens
from fleetgate.router.scheduling.types import EndpointId, RequestView
from fleetgate.router.state import Endpoint

if TYPE_CHECKING:
    from fleetgate.router.metrics import RouterMetrics
    from fleetgate.router.proxy import Services

log = logging.getLogger("fleetgate.router.priority")

_WAIT = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 600)


class EnginePriority(BaseModel):
    """Which endpoints get the engine's own priority field (``priority.engine_priority``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    default: bool = True
    pools: dict[str, bool] = Field(default_factory=dict)
    endpoints: dict[str, bool] = Field(default_factory=dict)

    def enabled(self, pool: str, endpoint: str) -> bool:
        if endpoint in self.endpoints:
            return self.endpoints[endpoint]
        return self.pools.get(pool, self.default)


@dataclasses.dataclass(frozen=True, slots=True)
class PrioritySettings:
    config: PriorityConfig
    engine_priority: EnginePriority


def parse_priority(raw: Mapping[str, Any] | None) -> PrioritySettings | None:
    """The YAML ``priority:`` section, validated; None when absent (priority off)."""
    if raw is None:
        return None
    data = dict(raw)
    engine = data.pop("engine_priority", None)
    if "preemption" in data:
        if "preemption_enabled" in data:
            raise ConfigError("priority: give 'preemption' or 'preemption_enabled', not both")
        data["preemption_enabled"] = data.pop("preemption")
    try:
        cfg = PriorityConfig.model_validate(data)
        ep = EnginePriority.model_validate(engine if engine is not None else {})
    except ValidationError as e:
        where = "; ".join(
            "priority." + ".".join(str(p) for p in err["loc"]) + f": {err['msg']}"
            if err["loc"]
            else f"priority: {err['msg']}"
            for err in e.errors()
        )
        raise ConfigError(where) from None
    return PrioritySettings(cfg, ep)


class PriorityMetrics:
    """The priority metrics (docs/router.md), registered in the app's registry."""

    def __init__(self, metrics: RouterMetrics, config: PriorityConfig) -> None:
        r = metrics.registry
        self.m = metrics
        self.config = config
        mc = ["model", "class"]
        self.depth = Gauge(
            "fleetgate_queue_depth", "Requests waiting in the admission queue (incl. parked).",
            mc, registry=r,
        )  # fmt: skip
        self.wait = Histogram(
            "fleetgate_queue_wait_seconds",
            "Arrival to first dispatch (0 when placed at once).",
            mc, buckets=_WAIT, registry=r,
        )  # fmt: skip
        self.dispatches = PromCounter(
            "fleetgate_dispatches", "Requests (and resumes) sent to an engine.", mc, registry=r
        )
        self.preemptions = PromCounter(
            "fleetgate_preemptions", "In-flight requests preempted (class of the victim).",
            mc, registry=r,
        )  # fmt: skip
        self.resumes = PromCounter(
            "fleetgate_resumes",
            "Parked requests dispatched again as a continuation (cause preempted|engine_failure).",
            ["model", "class", "cause"], registry=r,
        )  # fmt: skip
        self.resume_latency = Histogram(
            "fleetgate_resume_latency_seconds",
            "Park to the first continuation token.",
            mc, buckets=_WAIT, registry=r,
        )  # fmt: skip
        self.sheds = PromCounter(
            "fleetgate_sheds",
            "Requests refused by the admission queue (queue full or queue timeout).",
            ["model", "class", "status"], registry=r,
        )  # fmt: skip
        self.ttft_objective = PromCounter(
            "fleetgate_ttft_objective",
            "Requests that got a first token (met = within the class TTFT objective) or failed.",
            ["model", "class", "met"], registry=r,
        )  # fmt: skip
        self.refed = PromCounter(
            "fleetgate_resume_refed_tokens",
            "Generated tokens sent back to an engine as prompt by continuations "
            "(re-prefilled unless the engine still caches them).",
            mc, registry=r,
        )  # fmt: skip
        self._models: set[str] = set()

    def precreate(self, models: Sequence[str]) -> None:
        """Series at 0 for every configured class of every (new) model."""
        for model in models:
            if model in self._models:
                continue
            self._models.add(model)
            for c in self.config.classes:
                lv = (model, c.name)
                self.m.child(self.depth, *lv).set(0)
                self.m.child(self.wait, *lv)
                self.m.child(self.dispatches, *lv)
                self.m.child(self.preemptions, *lv)
                self.m.child(self.refed, *lv)
                self.m.child(self.resume_latency, *lv)
                for cause in ("preempted", "engine_failure"):
                    self.m.child(self.resumes, *lv, cause)
                self.m.child(self.sheds, *lv, str(c.reject_status()))
                for met in ("true", "false"):
                    self.m.child(self.ttft_objective, *lv, met)


@dataclasses.dataclass(eq=False)
class Job:
    """One request under priority control (the queue payload and the victim record)."""

    request_id: str
    cls: PriorityClass
    tenant: str
    model: str
    arrival: float
    view: RequestView
    chain: tuple[int, ...]
    order: list[EndpointId]
    kv_tokens: int
    resumable: bool
    waiter: asyncio.Future[Endpoint | Shed[Job]] | None = None
    holding: Endpoint | None = None
    """The endpoint reserved for this job and not yet released."""
    prefill: int = 0
    """Uncached prompt tokens counted in ``holding``'s prefill backlog until the
    segment's first token (``PriorityRuntime.prefilled``)."""
    segment: asyncio.Task[str] | None = None
    sending: bool = False
    preempt_pending: bool = False
    preemptions: int = 0
    resumes: int = 0
    generated: int = 0
    started_at: float = 0.0
    parked_at: float | None = None
    park_cause: str = ""
    queued: bool = False
    dispatched_once: bool = False
    failed: set[str] = dataclasses.field(default_factory=set)
    chat: bool = False
    needs_final_message: bool = False
    """Parked chat answer without token ids: resume it where the engine continues a
    partial assistant message (``EngineAdapter.continues_final_message``)."""


class PriorityRuntime:
    """Queue, drain scheduling and preemption for one router app (module docstring)."""

    def __init__(self, services: Services, settings: PrioritySettings) -> None:
        self.s = services
        self.cfg = settings.config
        self.engine_priority = settings.engine_priority
        self.queue: AdmissionQueue[Job] = AdmissionQueue(self.cfg)
        self.metrics = PriorityMetrics(services.metrics, self.cfg)
        self.running: dict[str, Job] = {}
        self.preempting_for: dict[str, str] = {}
        """waiting request id -> victim request id, while that preemption is in progress."""
        self._queued: Counter[str] = Counter()
        self._scheduled = False
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: float | None = None
        self.drains = 0
        self.unknown_slot_limit: set[str] = set()
        """Endpoints warned about: no configured capacity and none in their metrics."""

    # -- events ------------------------------------------------------------

    def on_fleet_change(self) -> None:
        """Poller hook: a scrape landed, health or the model list changed."""
        self.metrics.precreate(self.s.fleet.models(healthy_only=False, now=self.s.clock()))
        self._warn_unknown_slot_limits()
        self.kick()

    def _warn_unknown_slot_limits(self) -> None:
        """Once per endpoint: its slot limit is neither configured nor scraped.

        vLLM does not export ``--max-num-seqs``; without the backend's
        ``capacity`` (Kubernetes discovery takes it from the InferenceService)
        saturation sees such an engine as free until its own queue shows
        waiting requests, so urgent work can queue inside the engine behind
        lower classes (measured on priority-storm: critical attainment 64%
        without capacity, 100% with it).
        """
        for e in self.s.fleet:
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

    def kick(self) -> None:
        """Run one drain on the next loop turn (events coalesce; nothing queued: no-op)."""
        if self._queued and not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._drain_now)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    # -- admission -----------------------------------------------------------

    def admit(self, job: Job) -> Endpoint | Shed[Job] | None:
        """Place at once (hot path), refuse (class full), or queue (None: await ``job.waiter``)."""
        now = self.s.clock()
        self.metrics.precreate((job.model,))
        if not self._queued[job.model]:
            views = self.views(job, now)
            sat = pool_saturation(views, self.cfg.saturation)
            if not sat.saturated:
                eid = self.pick(job, sat.available, now)
                self.metrics.m.child(self.metrics.wait, job.model, job.cls.name).observe(0.0)
                return self._reserve(job, eid)
        got = self.queue.offer(
            job.request_id, job.cls, job.tenant, now, job, cost=1.0, pool=job.model
        )
        if isinstance(got, Shed):
            self._count_shed(got)
            return got
        self._enqueued(job)
        self.kick()
        return None

    def park(self, job: Job, cause: str) -> None:
        """Re-queue a preempted / engine-died job (its original arrival kept)."""
        now = self.s.clock()
        job.parked_at = now
        job.park_cause = cause
        job.preempt_pending = False
        for waiting, victim in list(self.preempting_for.items()):
            if victim == job.request_id:
                del self.preempting_for[waiting]
        self.queue.park(job.request_id, job.cls, job.tenant, job.arrival, now, job, pool=job.model)
        self._enqueued(job)
        self.kick()

    def forget(self, job: Job) -> None:
        """The job's request is over (any outcome, incl. client gone)."""
        if job.queued and self.queue.remove(job.request_id) is not None:
            self._dequeued(job)
        self.preempting_for.pop(job.request_id, None)
        self.release(job)
        self.running.pop(job.request_id, None)
        self.kick()

    def prefilled(self, job: Job) -> None:
        """The job's current segment produced its first token (or ended): its prompt
        no longer counts in its endpoint's prefill backlog. Idempotent."""
        if job.prefill and job.holding is not None:
            job.holding.prefilled(job.prefill)
        job.prefill = 0

    def release(self, job: Job) -> None:
        self.prefilled(job)
        e = job.holding
        if e is not None:
            job.holding = None
            e.finish(job.kv_tokens, held_tokens=job.view.prompt_tokens + job.generated)

    def request_preempt(self, job: Job) -> bool:
        """Stop the job's current segment (closing its upstream); False if it is not running."""
        seg = job.segment
        if seg is None or seg.done() or job.preempt_pending:
            return False
        job.preempt_pending = True
        if not job.sending:
            seg.cancel()
        return True

    # -- drain -----------------------------------------------------------------

    def _drain_now(self) -> None:
        self._scheduled = False
        if not self._queued:
            self._arm(None)
            return
        self.drains += 1
        now = self.s.clock()
        cache: dict[int, list[EndpointView]] = {}

        def views_for(item: QueueItem[Job]) -> list[EndpointView]:
            key = id(item.payload)
            if key not in cache:
                cache[key] = self.views(item.payload, now)
            return cache[key]

        def pick(item: QueueItem[Job], available: tuple[str, ...]) -> str:
            return self.pick(item.payload, available, now)

        actions = drain(
            self.queue,
            now,
            config=self.cfg,
            views_for=views_for,
            pick=pick,
            in_flight=self._victims(),
            preempting_for=self.preempting_for.keys(),
        )
        for a in actions:
            if isinstance(a, Shed):
                self._dequeued(a.item.payload)
                self.preempting_for.pop(a.item.request_id, None)
                self._count_shed(a)
                _resolve(a.item.payload, a)
            elif isinstance(a, Dispatch):
                job = a.item.payload
                self._dequeued(job)
                self.preempting_for.pop(job.request_id, None)
                if job.waiter is None or job.waiter.done():
                    continue
                if not job.dispatched_once:
                    self.metrics.m.child(self.metrics.wait, job.model, job.cls.name).observe(
                        now - job.arrival
                    )
                _resolve(job, self._reserve(job, a.endpoint))
            elif isinstance(a, Preempt):
                victim = self.running.get(a.victim.request_id)
                if victim is not None and self.request_preempt(victim):
                    self.preempting_for[a.for_item.request_id] = victim.request_id
                    victim.preemptions += 1
                    log.info("preempt %s for %s: %s", victim.request_id, a.for_item.request_id,
                             a.reason)  # fmt: skip
                    self.metrics.m.child(
                        self.metrics.preemptions, victim.model, victim.cls.name
                    ).inc()
        self._arm(now)

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
            delay = max(0.0, at - self.s.clock()) + 1e-4
            self._timer = asyncio.get_running_loop().call_later(delay, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._timer_at = None
        self.kick()

    # -- helpers ---------------------------------------------------------------

    def eligible(self, job: Job, now: float) -> list[Endpoint]:
        out = [
            e for e in self.s.fleet if e.healthy and not e.is_ejected(now) and job.model in e.models
        ]
        if job.failed:
            kept = [e for e in out if e.id not in job.failed]
            out = kept or out
        if job.needs_final_message and job.parked_at is not None:
            # elsewhere the partial assistant message would be answered as a new turn;
            # with no such engine in the pool, resume anyway (documented risk)
            able = [e for e in out if e.adapter.continues_final_message]
            out = able or out
        return out

    def views(self, job: Job, now: float) -> list[EndpointView]:
        """Saturation inputs per eligible endpoint: the last scrape plus the router's counts.

        The scraped ``waiting`` is corrected by what the router saw end since the
        scrape: requests of ours that were in flight then and have finished since
        can no longer wait in the engine, so ``waiting - (at_scrape - in_flight)``
        (floored at 0). Without it one scrape that caught a request between
        arrival and its first step kept the endpoint "over" until the next
        scrape (measured: p99 +330 ms in bench_router_overhead at concurrency 1).

        The scraped KV use is corrected the same way, where the engine reports its
        pool size: plus the estimated need (prompt + max output) of what the
        router dispatched since, minus what the requests that ended since held
        (prompt + generated). A preempted victim's blocks therefore count as free
        at once, instead of the endpoint staying "over" until the next scrape and
        the still-waiting request preempting a second victim meanwhile.
        """
        out = []
        for e in self.eligible(job, now):
            snap, c = e.snapshot, e.counts
            at_scrape = c.in_flight - c.dispatched_since_scrape + c.finished_since_scrape
            waiting = snap.waiting if snap else None
            if waiting:
                waiting = max(0, waiting - max(0, at_scrape - c.in_flight))
            kv = snap.kv_usage if snap else None
            if kv is not None and snap is not None and snap.blocks_total and snap.block_size:
                delta = c.dispatched_tokens_since_scrape - c.freed_tokens_since_scrape
                kv = min(1.0, max(0.0, kv + delta / (snap.blocks_total * snap.block_size)))
            out.append(
                EndpointView(
                    endpoint=e.id,
                    kv_usage=kv,
                    waiting=waiting,
                    running=snap.running if snap else None,
                    in_flight=c.in_flight,
                    scrape_age_s=max(0.0, now - snap.scraped_at) if snap else None,
                    max_running=(snap.max_running if snap else None) or e.capacity_hint,
                    in_flight_at_scrape=at_scrape if snap else None,
                )
            )
        return out

    def pick(self, job: Job, available: Sequence[str], now: float) -> str:
        """The scheduling pipeline (prefix affinity, load) over ``available`` only."""
        allowed = set(available)
        views = [v for v in self.s.fleet.views(job.chain, job.order, now) if v.id in allowed]
        try:
            # the class level is the request's urgency for the scorers (engine speed)
            view = job.view
            if view.priority != job.cls.level:
                view = dataclasses.replace(view, priority=job.cls.level)
            decision = self.s.pipeline.schedule(view, views, self.s.rng)
        except NoEndpointError:
            return available[0]
        self.s.metrics.child(
            self.s.metrics.decisions, job.model, decision.reason, decision.decided_by
        ).inc()
        for eid in decision.ranking:
            if eid in allowed:
                return eid
        return available[0]

    def _reserve(self, job: Job, eid: str) -> Endpoint:
        e = self.s.fleet.endpoints[EndpointId(eid)]
        self.release(job)
        matched = self.s.fleet.index.match(e.id, job.chain) if job.chain else 0
        job.prefill = uncached_tokens(job.view, matched)
        e.dispatch(job.kv_tokens, job.prefill)
        job.holding = e
        return e

    def _victims(self) -> list[VictimView]:
        # A chat answer streaming from an engine that returns no token ids could only
        # resume from text (``chat-assistant-prefix``), whose seam is not exact: it is
        # never chosen as a victim (an engine failure still resumes it that way).
        return [
            VictimView(
                request_id=j.request_id,
                endpoint=j.holding.id if j.holding is not None else "",
                class_name=j.cls.name,
                level=j.cls.level,
                prompt_tokens=j.view.prompt_tokens,
                generated_tokens=j.generated,
                preemptions=j.preemptions,
                started_at=j.started_at,
                resumable=j.resumable
                and not j.preempt_pending
                and j.holding is not None
                and (not j.chat or j.holding.adapter.returns_token_ids),
            )
            for j in self.running.values()
        ]

    def _enqueued(self, job: Job) -> None:
        job.queued = True
        self._queued[job.model] += 1
        self.metrics.m.child(self.metrics.depth, job.model, job.cls.name).inc()

    def _dequeued(self, job: Job) -> None:
        if not job.queued:
            return
        job.queued = False
        self._queued[job.model] -= 1
        if self._queued[job.model] <= 0:
            del self._queued[job.model]
        self.metrics.m.child(self.metrics.depth, job.model, job.cls.name).dec()

    def _count_shed(self, shed: Shed[Job]) -> None:
        job = shed.item.payload
        self.metrics.m.child(self.metrics.sheds, job.model, job.cls.name, str(shed.status)).inc()


def _resolve(job: Job, value: Endpoint | Shed[Job]) -> None:
    if job.waiter is not None and not job.waiter.done():
        job.waiter.set_result(value)
