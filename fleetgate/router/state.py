"""Live router state per endpoint: health, ejection, scrapes and own traffic.

``Endpoint`` is the only mutable per-engine record; the scheduling pipeline
never sees it, only the frozen ``EndpointView`` that :meth:`Fleet.views`
builds from it at decision time. Everything here runs on the router's event
loop (no locks) and takes time as an argument (no clock reads), so ejection
and accounting are unit-tested with plain numbers.

Accounting invariant: every dispatch is matched by exactly one
:meth:`Endpoint.finish` (the proxy guarantees it in a ``finally``), so
``in_flight`` returns to 0 and the since-scrape counters stay honest.

Ejection (passive outlier detection): ``eject_after`` consecutive failures
(connect error, 5xx or timeout before the first byte) eject the endpoint for
``base x 2^(ejections-1)`` seconds (capped). When the time is up the endpoint
returns only after a successful ``/health`` probe; a success resets the
failure streak.

Decode speed: every successful scrape also updates ``Endpoint.speed``, a
:class:`~fleetgate.router.scheduling.speed.DecodeSpeed` (an EWMA of seconds per
output token from the deltas of the engine's decode-latency counters, with its
own reset and minimum-observation rules); views carry it as
``EndpointView.decode_s_per_token`` for the ``engine-speed`` scorer. A failed
scrape leaves it alone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from fleetgate.engines.base import (
    EngineAdapter,
    KvEventsEndpoint,
    LoadSnapshot,
    LoraAdapter,
    MetricsSource,
)
from fleetgate.router.priority.saturation import SaturationView
from fleetgate.router.scheduling.exact import PromptKeys
from fleetgate.router.scheduling.kvindex import KvIndex
from fleetgate.router.scheduling.kvsync import KvFeedStatus
from fleetgate.router.scheduling.load import (
    LoadParams,
    RouterCounts,
    estimate_load,
    replica_snapshot,
    slot_limit,
)
from fleetgate.router.scheduling.plugins.prefix_affinity import approximate_cached
from fleetgate.router.scheduling.prefix import PrefixIndex
from fleetgate.router.scheduling.scrape_pace import PaceInputs, ScrapePace, fresh_extension
from fleetgate.router.scheduling.speed import DecodeSpeed
from fleetgate.router.scheduling.types import CacheSource, EndpointId, EndpointView, RequestView
from fleetgate.router.served import ModelRename, served_models


@dataclasses.dataclass(frozen=True, slots=True)
class EjectionPolicy:
    after_failures: int = 3
    base_s: float = 2.0
    max_s: float = 60.0


@dataclasses.dataclass(eq=False)
class Endpoint:
    id: EndpointId
    pool: str
    engine: str
    url: str
    adapter: EngineAdapter
    metrics_source: MetricsSource
    capacity_hint: int | None = None
    """The replica's concurrency limit from its configuration, used while its metrics
    do not report one (:meth:`slot_limit`)."""
    schedulers: int = 1
    """Schedulers the replica runs (``EngineAdapter.schedulers``, TensorRT-LLM
    attention-DP ranks): a reported ``max_running`` is one of them's."""
    served_model: str | None = None
    """The name clients use for this endpoint's model, when the engine may list another
    (trtllm-serve lists its model path): shown in :attr:`models` in its place
    (:meth:`set_models`, :mod:`fleetgate.router.served`)."""
    engine_model: str | None = None
    """The engine's own name for :attr:`served_model` when it lists another (else None)."""
    models: frozenset[str] = frozenset()
    lora_adapters: Mapping[str, LoraAdapter] = dataclasses.field(default_factory=dict)
    """Model -> the LoRA adapter it is (served under its own model name; its blocks
    carry ``salt`` in the engine's KV events; ``EngineAdapter.lora_adapter``)."""
    max_model_len: int | None = None
    healthy: bool = False
    """Last /health probe answered 200 (False until the first probe); probes that time
    out count only after ``health.slow_probes_to_unhealthy`` in a row."""
    answered: bool = False
    """A /health probe has answered 200 at least once (until then the poller probes
    at ``health.startup_interval_s``)."""
    slow_probes: int = 0
    """Consecutive /health probes that timed out."""
    ejected_until: float | None = None
    ejections: int = 0
    consecutive_failures: int = 0
    snapshot: LoadSnapshot | None = None
    scrape_failing: bool = False
    scrape_errors: int = 0
    counts: RouterCounts = dataclasses.field(default_factory=RouterCounts)
    speed: DecodeSpeed = dataclasses.field(default_factory=DecodeSpeed)
    """Decode seconds per output token, smoothed over scrapes (``scheduling.speed``)."""
    prefilling: int = 0
    """Uncached prompt tokens of this router's requests here that have no first token
    yet: the prefill backlog ahead of a new request (``EndpointView.pending_prefill_tokens``)."""
    plain_waiting: dict[int, float] = dataclasses.field(default_factory=dict)
    """With ``scheduling.held_prefix_guard_s``: this router's requests here sent at their
    own class level (not raised by ``held_prefix_sooner``) with no first token yet, by
    identity, to when they were sent (oldest first)."""
    draining: bool = False
    """Marked for removal (Kubernetes discovery: the pod's ``fleetgate.dev/drain``
    annotation): the ``not-draining`` filter sends it no new work; what runs there
    finishes."""
    kv_events: KvEventsEndpoint | None = None
    """Where the engine publishes KV-cache events (None: no exact view of it)."""
    kv_feed: KvFeedStatus = dataclasses.field(default_factory=KvFeedStatus)
    """Its subscriber's state (``fleetgate.router.kvfeed``): the exact view in
    ``Fleet.kv_index`` is usable only while ``kv_feed.exact`` (state ``live``)."""
    kv_rank_feeds: tuple[KvFeedStatus, ...] = ()
    """With several attention-DP ranks (``kv_events.ranks``): each rank's feed, in rank
    order (``kv_feed`` is then the least usable of them); empty otherwise."""

    @property
    def kv_live(self) -> bool:
        """The exact view (``Fleet.kv_index``) speaks for this endpoint: its KV-event
        feed is ``live``; otherwise the approximate prefix index does."""
        return self.kv_feed.exact

    @property
    def block_size(self) -> int:
        """KV block size in tokens: the last scrape's, else the adapter's default."""
        snap = self.snapshot
        if snap is not None and snap.block_size:
            return snap.block_size
        return self.adapter.default_block_size

    # ---------------------------------------------------------------- models

    @property
    def echoes_any_model(self) -> bool:
        """The engine answers a request for any model name (TensorRT-LLM): the served
        name can go upstream as it is."""
        return bool(getattr(self.adapter, "accepts_any_model_name", False))

    def set_models(
        self, listed: Iterable[str], adapters: Mapping[str, LoraAdapter] | None = None
    ) -> None:
        """The engine's ``/v1/models`` ids, in order; the served name replaces its own.
        ``adapters``: the listed models that are LoRA adapters."""
        self.models, self.engine_model = served_models(listed, self.served_model)
        self.lora_adapters = dict(adapters or {})

    def model_rename(self) -> ModelRename | None:
        """A rewriter of answer bytes naming the engine's model, or None (names agree)."""
        if self.engine_model is None or self.served_model is None:
            return None
        return ModelRename(self.engine_model, self.served_model)

    # ---------------------------------------------------------------- traffic

    def dispatch(self, kv_tokens: int, prefill_tokens: int = 0) -> None:
        """A request was sent here; ``prefill_tokens`` of its prompt are (believed) uncached.

        The caller calls :meth:`prefilled` with the same figure exactly once: at the
        request's first token, or when it ends without one.
        """
        self.prefilling += max(0, prefill_tokens)
        c = self.counts
        self.counts = dataclasses.replace(
            c,
            in_flight=c.in_flight + 1,
            dispatched_since_scrape=c.dispatched_since_scrape + 1,
            dispatched_tokens_since_scrape=c.dispatched_tokens_since_scrape + kv_tokens,
        )

    def prefilled(self, prefill_tokens: int) -> None:
        """A request's prefill is over (first token seen, or the request ended)."""
        self.prefilling = max(0, self.prefilling - max(0, prefill_tokens))

    def finish(self, kv_tokens: int, held_tokens: int | None = None) -> None:
        """A request dispatched with ``kv_tokens`` ended, holding ``held_tokens`` of KV."""
        c = self.counts
        held = kv_tokens if held_tokens is None else min(kv_tokens, max(0, held_tokens))
        self.counts = dataclasses.replace(
            c,
            in_flight=max(0, c.in_flight - 1),
            finished_since_scrape=c.finished_since_scrape + 1,
            finished_tokens_since_scrape=c.finished_tokens_since_scrape + kv_tokens,
            freed_tokens_since_scrape=c.freed_tokens_since_scrape + held,
        )

    def scraped(self, snapshot: LoadSnapshot) -> None:
        self.snapshot = snapshot
        self.speed = self.speed.update(snapshot)
        self.scrape_failing = False
        self.counts = RouterCounts(in_flight=self.counts.in_flight)

    def replica_snapshot(self) -> LoadSnapshot | None:
        """The last scrape with its per-scheduler figures made the replica's
        (``replica_snapshot`` of the load module)."""
        return replica_snapshot(self.snapshot, self.schedulers)

    def slot_limit(self) -> int | None:
        """The most requests the replica runs at once (``slot_limit`` of the load module,
        from its last scrape), None when nothing says."""
        return slot_limit(self.replica_snapshot(), self.capacity_hint)

    def pace_inputs(self) -> PaceInputs:
        """What the scrape-interval rule (``scheduling.scrape_pace``) reads of this endpoint."""
        snap, c = self.snapshot, self.counts
        last_event = self.kv_feed.last_event_at
        return PaceInputs(
            feed_live=self.kv_live,
            scraped_ok=snap is not None and not self.scrape_failing,
            events_since_scrape=last_event is not None
            and (snap is None or last_event >= snap.scraped_at),
            in_flight=c.in_flight,
            dispatched_since_scrape=c.dispatched_since_scrape,
            running=snap.running if snap else None,
            waiting=snap.waiting if snap else None,
            kv_usage=snap.kv_usage if snap else None,
            capacity=self.slot_limit(),
        )

    def scrape_failed(self) -> None:
        self.scrape_failing = True
        self.scrape_errors += 1

    # ---------------------------------------------------------------- health

    def is_ejected(self, now: float) -> bool:
        """Ejected until its time is up AND a /health probe has answered 200 since."""
        return self.ejected_until is not None

    def record_success(self) -> None:
        self.consecutive_failures = 0

    def record_failure(self, now: float, policy: EjectionPolicy) -> bool:
        """Count a failure; True when this one ejected the endpoint."""
        self.consecutive_failures += 1
        if self.consecutive_failures < policy.after_failures or self.is_ejected(now):
            return False
        self.ejections += 1
        duration = min(policy.max_s, policy.base_s * 2 ** (self.ejections - 1))
        self.ejected_until = now + duration
        self.consecutive_failures = 0
        return True

    def probe_result(
        self, ok: bool, now: float, *, slow: bool = False, slow_limit: int = 1
    ) -> None:
        """A /health probe finished. Ejection ends on the first good probe after its time.

        ``slow``: the probe timed out. A healthy endpoint stays healthy until
        ``slow_limit`` probes in a row time out (busy, not dead); a refused connection
        or a bad status (``ok`` False, not ``slow``) counts at once."""
        self.slow_probes = self.slow_probes + 1 if slow else 0
        self.answered = self.answered or ok
        if slow and self.healthy and self.slow_probes < slow_limit:
            return
        self.healthy = ok
        if ok and self.ejected_until is not None and now >= self.ejected_until:
            self.ejected_until = None
            self.consecutive_failures = 0


@dataclasses.dataclass(frozen=True, slots=True)
class Standby:
    """A model the router knows while it may have no endpoint: it is autoscaled.

    From the router YAML (``models: {NAME: {scale_from_zero: true}}``) or from an
    ``InferenceService`` with ``spec.autoscaling`` (Kubernetes discovery; at zero
    replicas with ``minReplicas: 0``, or with every replica starting). Requests for it
    are held while no endpoint can serve it (:mod:`fleetgate.router.admission`),
    instead of a 503 at once.
    """

    model: str
    pool: str = "default"
    cold_start_s: float | None = None
    """Expected time from zero to a ready replica (None: ``limits.default_cold_start_s``)."""
    min_replicas: int | None = None
    source: str = "config"
    """``config``, or the ``namespace/name`` of the InferenceService."""


class Fleet:
    """All endpoints, plus the prefix indexes over them (the approximate one from the
    router's own routing, the exact one from KV events). Built per app, never global."""

    def __init__(
        self,
        endpoints: Iterable[Endpoint],
        *,
        index: PrefixIndex,
        load_params: LoadParams,
        kv_index: KvIndex | None = None,
        standby: Iterable[Standby] = (),
        scrape_pace: ScrapePace | None = None,
    ) -> None:
        self.endpoints: dict[EndpointId, Endpoint] = {}
        for e in endpoints:
            if e.id in self.endpoints:
                raise ValueError(f"duplicate endpoint id {e.id!r}")
            self.endpoints[e.id] = e
        self.index = index
        self.load_params = load_params
        self.kv_index = kv_index if kv_index is not None else KvIndex()
        """The exact prefix view, fed by the engines' KV events (``fleetgate.router.kvfeed``)."""
        self.scrape_pace = scrape_pace if scrape_pace is not None else ScrapePace(busy_s=None)
        """When each endpoint is scraped; the default scrapes every 0.2 s whatever the feed."""
        self.standby: dict[str, Standby] = {s.model: s for s in standby}
        """Models that scale from zero, by served name (known with 0 endpoints)."""

    def __iter__(self) -> Iterator[Endpoint]:
        return iter(self.endpoints.values())

    def models(self, *, healthy_only: bool, now: float) -> list[str]:
        """Models the fleet serves: ``healthy_only``, those an endpoint can take new work
        for now (healthy, not ejected, not draining); else every model it knows, the
        ones that scale from zero (:attr:`standby`) included."""
        out: set[str] = set()
        for e in self.endpoints.values():
            if healthy_only and (not e.healthy or e.is_ejected(now) or e.draining):
                continue
            out |= e.models
        if not healthy_only:
            out.update(self.standby)
        return sorted(out)

    def _lora(self, model: str) -> tuple[Endpoint, LoraAdapter] | None:
        """The first endpoint that lists ``model`` as a LoRA adapter, and what it says."""
        for e in self.endpoints.values():
            lora = e.lora_adapters.get(model)
            if lora is not None:
                return e, lora
        return None

    def kv_salt(self, model: str) -> str | None:
        """The salt of ``model``'s blocks in the engines' KV events (a LoRA adapter's
        name); None for a model no endpoint lists as an adapter (a base model)."""
        found = self._lora(model)
        return None if found is None else found[1].salt

    def request_lora_salt(self, doc: Mapping[str, Any]) -> str | None:
        """The salt of the KV blocks of a request that names a LoRA adapter in its body
        (TensorRT-LLM's ``lora_request``), as the first of the fleet's engine adapters
        that reads one says (``EngineAdapter.request_lora_salt``); None: it names none."""
        seen: set[str] = set()
        for e in self.endpoints.values():
            if e.adapter.name in seen:
                continue
            seen.add(e.adapter.name)
            salt = e.adapter.request_lora_salt(doc)
            if salt is not None:
                return salt
        return None

    def base_model(self, model: str) -> str | None:
        """The model a LoRA adapter ``model`` adapts, by the name clients use for it
        (an endpoint's served name replaces the engine's own); None for a model no
        endpoint lists as an adapter. Its tokenizer is the adapter's."""
        found = self._lora(model)
        if found is None:
            return None
        e, lora = found
        if lora.base_model == e.engine_model and e.served_model is not None:
            return e.served_model
        return lora.base_model

    def exact_cached(self, e: Endpoint, prompt: PromptKeys | None) -> int | None:
        """Prompt tokens resident on ``e`` by the exact view; None when it does not
        speak for ``e``: no token ids for the request, no index, a feed that is neither
        ``live`` nor ``partial``, or a ``partial`` feed that knows none of this prompt.

        ``partial`` (in sync, but batches older than the engine's replay buffer were
        never seen: a router started beside a long-running engine) under-reports and
        never over-reports, so what it does know is believed, and where it knows
        nothing the approximate view speaks instead. Otherwise such a router would
        never use the exact view until the engine's next restart or cache reset.

        Blocks this router placed on ``e`` that its engine has not confirmed yet count
        as resident (``KvIndex.pending``, :mod:`~fleetgate.router.scheduling.kvpending`):
        an engine publishes a block only after prefilling it, and without them a burst
        for a new prefix would see it nowhere and spread over the fleet.
        """
        if prompt is None or self.kv_index is None:
            return None
        state = e.kv_feed.state
        if state not in ("live", "partial"):
            return None
        resident = prompt.resident_tokens(self.kv_index, e.id, e.block_size, pending=True)
        return resident if resident or state == "live" else None

    def believed_cached(
        self,
        e: Endpoint,
        chain: tuple[int, ...],
        prompt: PromptKeys | None,
        request: RequestView,
    ) -> tuple[int, CacheSource]:
        """Prompt tokens ``e`` is believed to hold and the view that says so (the same
        rule as the scorer's ``cached_tokens``)."""
        exact = self.exact_cached(e, prompt)
        if exact is not None:
            return min(request.prompt_tokens, exact), "events"
        matched = self.index.match(e.id, chain) if chain else 0
        return approximate_cached(request, matched), "approximate"

    def views(
        self,
        chain: tuple[int, ...],
        rendezvous: list[EndpointId],
        now: float,
        prompt: PromptKeys | None = None,
    ) -> list[EndpointView]:
        rank = {eid: i for i, eid in enumerate(rendezvous)}
        out = []
        for e in self.endpoints.values():
            load = estimate_load(
                e.replica_snapshot(),
                e.counts,
                now,
                self.load_params_for(e),
                capacity_hint=e.capacity_hint,
                block_size_hint=e.adapter.default_block_size,
                scrape_failing=e.scrape_failing,
            )
            out.append(
                EndpointView(
                    id=e.id,
                    engine=e.engine,
                    models=e.models,
                    healthy=e.healthy,
                    ejected=e.is_ejected(now),
                    load=load,
                    max_model_len=e.max_model_len,
                    prefix_match=self.index.match(e.id, chain) if chain else 0,
                    exact_cached_tokens=self.exact_cached(e, prompt),
                    rendezvous_rank=rank.get(e.id, len(rank)),
                    decode_s_per_token=e.speed.seconds_per_token,
                    pending_prefill_tokens=e.prefilling,
                    draining=e.draining,
                )
            )
        return out

    def load_params_for(self, e: Endpoint) -> LoadParams:
        """:attr:`load_params`, with freshness extended while ``e`` is scraped at the idle
        interval (``scrape_pace.fresh_extension``: a live feed confirms the idle scrape)."""
        p = self.load_params
        extra = fresh_extension(e.pace_inputs(), self.scrape_pace, p.fresh_for)
        if extra <= 0:
            return p
        return dataclasses.replace(
            p, fresh_for=p.fresh_for + extra, stale_after=p.stale_after + extra
        )

    def saturation_view(self, e: Endpoint, now: float) -> SaturationView:
        """What the saturation check reads of ``e``: its last scrape plus the router's counts.

        Same inputs as :meth:`views` (scrape + own traffic since it), corrected for
        what the router saw end since the scrape: requests of ours that were in
        flight then and have finished since can no longer wait in the engine, so
        ``waiting - (at_scrape - in_flight)`` (floored at 0). Without it one scrape
        that caught a request between arrival and its first step kept the endpoint
        "over" until the next scrape (measured: p99 +330 ms in
        bench_router_overhead at concurrency 1).

        The scraped KV use is corrected the same way where the engine reports its
        pool size: plus the estimated need (prompt + max output) of what the router
        dispatched since, minus what the requests that ended since held (prompt +
        generated). A preempted victim's blocks therefore count as free at once,
        instead of the endpoint staying "over" until the next scrape and the
        still-waiting request preempting a second victim meanwhile.
        """
        snap, c = e.replica_snapshot(), e.counts
        at_scrape = c.in_flight - c.dispatched_since_scrape + c.finished_since_scrape
        waiting = snap.waiting if snap else None
        if waiting:
            waiting = max(0, waiting - max(0, at_scrape - c.in_flight))
        kv = snap.kv_usage if snap else None
        pool = snap.total_kv_tokens if snap else None
        if kv is not None and pool:
            delta = c.dispatched_tokens_since_scrape - c.freed_tokens_since_scrape
            kv = min(1.0, max(0.0, kv + delta / pool))
        return SaturationView(
            endpoint=e.id,
            kv_usage=kv,
            waiting=waiting,
            running=snap.running if snap else None,
            in_flight=c.in_flight,
            scrape_age_s=max(0.0, now - snap.scraped_at) if snap else None,
            max_running=slot_limit(snap, e.capacity_hint),
            in_flight_at_scrape=at_scrape if snap else None,
        )
