"""The autoscaling decision for one ``InferenceService``: pure, time injected.

Inputs: the demand the routers report (parsed from their ``/metrics`` text by
:func:`parse_router_metrics`, combined over router replicas by :func:`demand_for`),
the replicas the service has, its policy (``spec.autoscaling``) and the state of the
previous decision (kept in ``status.autoscaling`` so a restarted operator remembers
its windows). Output: a :class:`Decision` (desired replicas, a reason a person can
read, the next state).

How the recommendation is formed (docs/operator.md "Autoscaling decision"):

* **in flight**: ``load = in flight on the engines + queued + held in the routers``
  for this model; ``ceil(load_forecast / targetInFlightPerReplica)`` (while the load
  is one sample of what runs on the engines with nothing waiting in the routers, a
  scale-up only when it is beyond :data:`SAMPLE_SIGNIFICANCE` Poisson standard
  deviations of what the current replicas hold), where
  ``load_forecast`` scales what runs on the engines (never a backlog: queued or held
  requests) by the arrival rate forecast at ``now + coldStart`` over the rate now
  (only upwards, at most x2 the rate now): a ramp is met by replicas that are Ready
  when it arrives, not after the queue has built. The forecast is the ramp's fitted
  rate now plus its slope over the cold start (:func:`_ramp`): flat, then a straight
  rise from a breakpoint, fitted to the rate samples of the last max(coldStart,
  :data:`MIN_TREND_SPAN_SECONDS`) at every breakpoint that leaves
  :data:`RAMP_MIN_SAMPLES`, the most significant slope kept; it counts only when the
  samples cover :data:`MIN_TREND_COVER` of that span and the slope exceeds
  :data:`RAMP_SIGNIFICANCE` standard errors (the larger of the residuals' and a Poisson
  rate's noise). Over a minute, a line through 40 s of flat traffic and the first
  seconds of a ramp read a fraction of its slope (with a 15 s cold start the second
  replica was asked for when the first was already saturated, and 21 standard requests
  of the ramp missed their objective); over 20 s a line still saw the heavy trace's
  ramp a median 8-9 s in, and the recent mean it was added to was half a window old;
  the breakpoint fits the rise to its own samples. The ramp is read only from the
  samples
  after the last :data:`NO_TRAFFIC_SECONDS` without arrivals (a step after a pause is no
  ramp); the history of a service at zero
  replicas with nothing arriving is empty: the run at aacdde1 woke from zero, read the
  step 0 -> 3 req/s over a few ticks as a slope, doubled the released backlog and went
  to 3 replicas 1.3 s after the first was Ready, and a trend through the zeros kept
  inflating the quiet phase after. Once the service time ``S`` is measured (below),
  ``load`` is the mean by Little's law instead of one sample: the recent arrival rate
  x ``S``, plus the router queue as a backlog drained within a cold start (``queued /
  max(1, coldStart / S)``). The recent rate is the mean of the last
  :data:`STEADY_WINDOW_SECONDS`, cut where it changed (walking back from the newest
  tick, a tick whose count is more than :data:`CHANGE_SIGNIFICANCE` standard
  deviations from its share of it and the newer ticks' under one rate ends the
  window), so a stream that stops reads 0 at once; a mean within :data:`TOLERANCE` of
  ``target x current`` keeps ``current`` (the HPA's rule). One sample of a Poisson
  stream's in-flight count follows every burst, and the scale-down window then kept
  each burst's peak (2-3 replicas where 1 served,
  bench/results/autoscale-4f8d830-heavy.md);
* **held while replicas start**: a router holds a request only while no endpoint of
  the model can serve it, so the held requests are a backlog that waits for the
  replicas already starting (whatever their pods' Ready condition says), not a steady
  load, so the forecast does not scale them and they count only for what draining
  them within one cold start after those replicas are Ready needs: a replica takes
  ``targetInFlightPerReplica`` of them at once and as many again every service time
  ``S``, i.e. ``coldStart / S`` batches in a cold start, and the held requests count
  as ``held / max(1, coldStart / S)`` in flight. ``S`` is measured by Little's law on
  the service's own endpoints: in-flight seconds (the mean of a tick's two in-flight
  samples x its span) over completions, summed over the most recent ticks holding
  :data:`SERVICE_COMPLETIONS` completions (at most :data:`SERVICE_WINDOW_SECONDS`),
  and only once they hold :data:`MIN_SERVICE_COMPLETIONS` (in memory): the first tick
  after a cold start pairs a full engine with the few completions of part of a tick,
  and at a few requests per second 15 s of ticks are too few in-flight samples (at 3
  req/s x 0.4 s, ~1.2 in flight: one standard deviation of a 15-sample mean is ~23%,
  and the Little's-mean rule flapped a replica on it). The router queue
  counts as the same backlog while requests are held. Without a measured ``S`` (a
  service that has not served since the operator started) the held requests keep at
  most the replicas already asked for (``max(current, 1)``): the backlog's size alone
  says nothing about how fast it drains; so do the in-flight and queued requests of a
  service started from zero until ``S`` is measured (the backlog its first replica
  released, not a rate) or a cold start has passed since its release (what still
  runs then is demand: requests too long for 10 completions in a cold start kept a
  woken service at one replica through a burst). Why: requests held during a cold
  start read as demand for several replicas that were Ready only after the first one
  had drained them, then idled for the scale-down window
  (bench/results/autoscale-5b165c0-rate3-t8.md);
* **KV cache**: HPA's ratio, ``ceil(ready * meanKvUsage / target)``;
* **TTFT attainment**: one more replica while a class misses its attainment over
  the last decision interval (a reaction, so it only ever adds);
* **no scale-down while requests keep waiting**: when every decision of the last
  :data:`QUEUED_HOLD_SECONDS` saw requests in the routers' queues (held ones apart), the
  recommendation is at least the current replicas: one replica fewer cannot serve them
  sooner, and Little's mean reads a fleet at ~100% of its slots as just enough;
* **held at zero**: a request held by a router while the service has no replica
  recommends 1 at once, bypassing the scale-up window;
* **idle**: with ``minReplicas: 0``, nothing arriving, running, queued or held for
  ``scaleToZeroAfterSeconds`` recommends 0.

Stabilisation is HPA's: a scale-up goes to the lowest recommendation of the
scale-up window, a scale-down to the highest of the scale-down window, so a
flapping signal does not flap the replicas; except once the arrivals have stopped
(:func:`_stopped`, with nothing running, queued or held and every router answering
since): the recommendations made while they ran say nothing of now.

Demand sums: each request is counted by the one router that received it
(arrivals, queue, held, in flight are per router), so summing over routers never
counts a request twice; KV usage is a property of the engine that every router
scrapes, so it is the max per endpoint, not a sum.

Pure: no I/O; the clock is an argument (epoch seconds).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence

from prometheus_client.parser import text_string_to_metric_families

__all__ = [
    "ARRIVALS",
    "DEFAULT_IDLE_SECONDS",
    "DISPATCHES",
    "HELD",
    "IN_FLIGHT",
    "KV_USAGE",
    "QUEUE_DEPTH",
    "REQUESTS",
    "TTFT_OBJECTIVE",
    "Decision",
    "Demand",
    "Policy",
    "RouterSnapshot",
    "State",
    "choose_victims",
    "decide",
    "demand_for",
    "parse_router_metrics",
]

# The router's metric names (fleetgate/router/metrics.py; the operator may not import
# the router, so tests render these with RouterMetrics to keep them from drifting).
ARRIVALS = "fleetgate_arrivals"  # counter, {model, class}; exposed as ..._total
HELD = "fleetgate_held_requests"  # gauge, {model}
IN_FLIGHT = "fleetgate_endpoint_in_flight"  # gauge, {endpoint, engine}
KV_USAGE = "fleetgate_endpoint_kv_usage"  # gauge, {endpoint, engine}
QUEUE_DEPTH = "fleetgate_queue_depth"  # gauge, {model, class}
TTFT_OBJECTIVE = "fleetgate_ttft_objective"  # counter, {model, class, met}
REQUESTS = "fleetgate_requests"  # counter, {model, engine, endpoint, status}: completions
DISPATCHES = "fleetgate_dispatches"  # counter, {model, class}: the rate's fallback
HEALTHY = "fleetgate_endpoint_healthy"  # gauge, {endpoint, engine}: last /health probe 200

#: Idle window with ``minReplicas: 0`` when ``scaleToZeroAfterSeconds`` is unset.
DEFAULT_IDLE_SECONDS = 300
#: The arrival forecast may at most double the current load (a trend over a few
#: samples extrapolated over a long cold start must not ask for the whole cluster).
MAX_FORECAST_GROWTH = 2.0
#: Rate samples older than this many seconds (or a cold start, if longer) are dropped.
TREND_WINDOW_SECONDS = 60.0
#: The trend is fitted over the rate samples of the last this many seconds (or a cold
#: start, if longer) and counts only when they cover :data:`MIN_TREND_COVER` of it: over
#: a few ticks a step (a service woken from zero: 0 -> r) reads as a steep slope, and
#: over a minute a ramp's first seconds after flat traffic read a fraction of its slope.
MIN_TREND_SPAN_SECONDS = 20.0
#: The rate samples of a trend must cover this share of its span.
MIN_TREND_COVER = 0.75
#: A trend is read only from samples after the last stretch of at least this many
#: seconds without arrivals: traffic that starts after a pause is a step (0 -> r), and a
#: line through the zeros before it reads a steep ramp. At 3 req/s a 5 s gap happens by
#: chance once in ~3 million stretches; at 0.2 req/s every third one, where one replica
#: serves anyway.
NO_TRAFFIC_SECONDS = 5.0
#: A ramp counts only when its slope exceeds this many standard errors. The fit tries
#: every breakpoint of its span and keeps the one whose slope is the most significant,
#: so one test's one-sided rate (0.6% at 2.5) understates how often flat traffic reads a
#: ramp; and the test runs at every tick over overlapping windows. Over a 40 s quiet phase
#: of 3 req/s with 1 s ticks and a 20 s span, 10% of streams read one somewhere at 2.5
#: (with :data:`RAMP_MIN_SAMPLES` 5), 22% at 2.5 with 3 samples, 31% at 2 with 6
#: (``bench/bench_trend.py``). The straight line this replaced (2 standard errors) saw the
#: heavy trace's ramp a median 9 s in; this fit sees it ~7.5 s in, and its rate now is the
#: fitted line's, not a mean half a window old.
RAMP_SIGNIFICANCE = 2.5
#: A ramp's fitted rise must hold this many samples (its breakpoint and the ticks after
#: it): a critical burst (8 requests in one tick) read as the end of a 3-sample ramp and
#: asked for a replica in the middle of the heavy trace's peak.
RAMP_MIN_SAMPLES = 5
#: The service time is measured over the most recent ticks that hold this many
#: completions (fewer when the window below holds fewer): at a few requests per second
#: 15 s of ticks are too few in-flight samples (one a tick) for a steady reading.
SERVICE_COMPLETIONS = 100.0
#: Ticks older than this many seconds leave the service-time window.
SERVICE_WINDOW_SECONDS = 60.0
#: Completions the service-time window must hold before the service time counts as
#: measured: the first tick after a cold start pairs a full engine with the few
#: completions of part of a tick and reads twice the real time.
MIN_SERVICE_COMPLETIONS = 10.0


@dataclasses.dataclass(frozen=True, slots=True)
class RouterSnapshot:
    """What one router's ``/metrics`` said about demand."""

    in_flight: Mapping[str, float]
    """endpoint id -> requests in flight from this router."""
    kv_usage: Mapping[str, float]
    """endpoint id -> KV-cache fraction in use."""
    queued: Mapping[str, float]
    """model -> requests in the admission queue (all classes)."""
    held: Mapping[str, float]
    """model -> requests held for want of a ready endpoint."""
    arrivals: Mapping[str, float]
    """model -> cumulative arrivals (all classes)."""
    ttft: Mapping[tuple[str, str, str], float]
    """(model, class, met) -> cumulative requests."""
    dispatches: Mapping[str, float] = dataclasses.field(default_factory=dict)
    """model -> cumulative dispatches to engines (all classes): the arrival rate of a
    router that does not export arrivals (resumes count too, so it over-counts a bit)."""
    queued_by_class: Mapping[tuple[str, str], float] = dataclasses.field(default_factory=dict)
    """(model, class) -> requests in the admission queue."""
    arrivals_by_class: Mapping[tuple[str, str], float] = dataclasses.field(default_factory=dict)
    """(model, class) -> cumulative arrivals."""
    dispatches_by_class: Mapping[tuple[str, str], float] = dataclasses.field(default_factory=dict)
    """(model, class) -> cumulative dispatches."""
    completions: Mapping[str, float] = dataclasses.field(default_factory=dict)
    """endpoint id -> cumulative requests this router answered from it (any status)."""
    healthy: Mapping[str, bool] = dataclasses.field(default_factory=dict)
    """endpoint id -> whether this router's last /health probe of it answered 200."""
    held_by_class: Mapping[tuple[str, str], float] = dataclasses.field(default_factory=dict)
    """(model, class) -> requests held now; empty from an older router, whose held
    gauge has no ``class`` label."""


def _add(d: dict[str, float], key: str, value: float) -> None:
    d[key] = d.get(key, 0.0) + value


def _add_c(d: dict[tuple[str, str], float], labels: Mapping[str, str], value: float) -> None:
    key = (labels["model"], labels.get("class", ""))
    d[key] = d.get(key, 0.0) + value


def parse_router_metrics(text: str) -> RouterSnapshot:
    """The demand series of one router's exposition; ValueError on unparsable text."""
    in_flight: dict[str, float] = {}
    kv: dict[str, float] = {}
    queued: dict[str, float] = {}
    held: dict[str, float] = {}
    held_c: dict[tuple[str, str], float] = {}
    arrivals: dict[str, float] = {}
    ttft: dict[tuple[str, str, str], float] = {}
    dispatches: dict[str, float] = {}
    queued_c: dict[tuple[str, str], float] = {}
    arrivals_c: dict[tuple[str, str], float] = {}
    dispatches_c: dict[tuple[str, str], float] = {}
    completions: dict[str, float] = {}
    healthy: dict[str, bool] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels, value = s.labels, float(s.value)
            if math.isnan(value):
                continue
            if s.name == IN_FLIGHT and "endpoint" in labels:
                _add(in_flight, labels["endpoint"], value)
            elif s.name == KV_USAGE and "endpoint" in labels:
                kv[labels["endpoint"]] = max(kv.get(labels["endpoint"], 0.0), value)
            elif s.name == QUEUE_DEPTH and "model" in labels:
                _add(queued, labels["model"], value)
                _add_c(queued_c, labels, value)
            elif s.name == HELD and "model" in labels:
                _add(held, labels["model"], value)
                if "class" in labels:
                    _add_c(held_c, labels, value)
            elif s.name == f"{ARRIVALS}_total" and "model" in labels:
                _add(arrivals, labels["model"], value)
                _add_c(arrivals_c, labels, value)
            elif s.name == f"{DISPATCHES}_total" and "model" in labels:
                _add(dispatches, labels["model"], value)
                _add_c(dispatches_c, labels, value)
            elif s.name == HEALTHY and "endpoint" in labels:
                healthy[labels["endpoint"]] = healthy.get(labels["endpoint"], False) or value > 0
            elif s.name == f"{REQUESTS}_total" and labels.get("endpoint", "none") != "none":
                _add(completions, labels["endpoint"], value)
            elif s.name == f"{TTFT_OBJECTIVE}_total" and "model" in labels:
                key = (labels["model"], labels.get("class", ""), labels.get("met", ""))
                ttft[key] = ttft.get(key, 0.0) + value
    return RouterSnapshot(
        in_flight,
        kv,
        queued,
        held,
        arrivals,
        ttft,
        dispatches,
        queued_c,
        arrivals_c,
        dispatches_c,
        completions,
        healthy,
        held_c,
    )


@dataclasses.dataclass(frozen=True, slots=True)
class Demand:
    """One service's demand at one tick, combined over the routers."""

    in_flight: float = 0.0
    queued: float = 0.0
    """Requests in the routers' admission queues, not counting the held ones."""
    held: float = 0.0
    arrival_rate: float | None = None
    """Requests per second since the previous scrape (None on the first scrape)."""
    kv_usage: float | None = None
    """Mean KV usage over the service's endpoints the routers know (None: unknown)."""
    ttft_met: float = 0.0
    ttft_total: float = 0.0
    """The objective class's requests since the previous scrape (met / all)."""
    in_flight_by_endpoint: Mapping[str, float] = dataclasses.field(default_factory=dict)
    completion_rate: float | None = None
    """Requests per second the service's endpoints finished since the previous scrape
    (None on the first scrape)."""
    serving: frozenset[str] | None = None
    """The service's endpoints some router's last /health probe found serving (None: no
    router reports the health of any of them)."""
    partial: bool = False
    """A router that answered the previous scrape did not answer this one: its arrivals
    and load this tick are unknown, so a silence may be a failed scrape."""

    @property
    def load(self) -> float:
        return self.in_flight + self.queued + self.held

    @property
    def idle(self) -> bool:
        return self.load == 0 and not self.arrival_rate

    def shared(self, weight: float, *, objective: bool) -> Demand:
        """This service's part of a demand it takes with others
        (:func:`fleetgate.operator.pools.demand_shares`): ``weight`` of the queue, the
        held requests and the arrivals; its pods' in-flight and KV usage are its own;
        the TTFT objective's counts only if ``objective``."""
        return dataclasses.replace(
            self,
            queued=self.queued * weight,
            held=self.held * weight,
            arrival_rate=None if self.arrival_rate is None else self.arrival_rate * weight,
            ttft_met=self.ttft_met if objective else 0.0,
            ttft_total=self.ttft_total if objective else 0.0,
        )

    def as_status(self) -> dict[str, float]:
        out = {"inFlight": self.in_flight, "queued": self.queued, "held": self.held}
        if self.arrival_rate is not None:
            out["arrivalRate"] = round(self.arrival_rate, 4)
        if self.kv_usage is not None:
            out["kvCacheUtilization"] = round(self.kv_usage, 4)
        if self.ttft_total:
            out["ttftAttainment"] = round(self.ttft_met / self.ttft_total, 4)
        return out


def _delta(now: float, before: float | None) -> float:
    if before is None:
        return 0.0
    return now - before if now >= before else now  # a counter reset restarts at 0


def demand_for(
    now: Mapping[str, RouterSnapshot],
    previous: Mapping[str, RouterSnapshot] | None,
    elapsed: float,
    *,
    model: str,
    endpoints: Iterable[str],
    ttft_class: str | None = None,
    classes: Callable[[str], bool] | None = None,
) -> Demand:
    """Combine router snapshots (keyed by router) into the service's demand.

    ``previous`` are the snapshots of the last tick, ``elapsed`` seconds ago; the
    counters' increases are taken per router (a router restart resets only its own),
    a router new since then contributes nothing to the rate this tick.

    ``classes`` (None: all) keeps only the queue and arrivals of the priority classes
    it accepts: the share of a model's demand that one role of a pool serves
    (:mod:`fleetgate.operator.pools`), held requests included (the routers count them
    per class). From a router whose held gauge has no class (older ones) a role gets
    the held requests in proportion to its classes' share of this tick's arrivals, and
    all of them when nothing arrived this tick (a held request must wake some replica;
    waking one too many is the lesser harm).
    In-flight and KV usage are per endpoint (the service's own pods) either way.
    """
    eps = set(endpoints)
    in_flight_by: dict[str, float] = {e: 0.0 for e in eps}
    kv_by: dict[str, float] = {}
    queued = held = held_unlabelled = arrived = arrived_all = met = total = completed = 0.0
    rate_known = previous is not None and elapsed > 0
    probed: set[str] = set()
    serving: set[str] = set()
    for router, snap in now.items():
        for ep, ok in snap.healthy.items():
            if ep in eps:
                probed.add(ep)
                if ok:
                    serving.add(ep)
        for ep, value in snap.in_flight.items():
            if ep in eps:
                in_flight_by[ep] += value
        for ep, value in snap.kv_usage.items():
            if ep in eps:
                kv_by[ep] = max(kv_by.get(ep, 0.0), value)
        # A router with class queues keeps its held requests in the admission queue
        # too (fleetgate/router/admission_queue.py: a held request is queued with a
        # hold bound), so its queue depth includes them; without class queues it
        # exports no depth. Either way queue - held, per router, is what waits for an
        # engine that serves; counting both counted every held request twice.
        h = snap.held.get(model, 0.0)
        q_all = snap.queued.get(model, 0.0)
        by_class = [(c, v) for (m, c), v in snap.held_by_class.items() if m == model]
        if classes is None:
            q = q_all
            held += h
        else:
            q = sum(v for (m, c), v in snap.queued_by_class.items() if m == model and classes(c))
            if by_class:
                h = sum(v for c, v in by_class if classes(c))
                held += h
            else:  # an older router: no class on its held gauge
                h = h * (q / q_all) if q_all > 0 else h
                held_unlabelled += snap.held.get(model, 0.0)
        queued += max(0.0, q - h) if q_all > 0 else 0.0
        before = (previous or {}).get(router)
        if before is None:
            continue
        for ep, value in snap.completions.items():
            if ep in eps:
                completed += _delta(value, before.completions.get(ep, 0.0))
        # a series new on a router we saw before started at 0 since then
        if classes is None:
            if model in snap.arrivals:
                arrived += _delta(snap.arrivals[model], before.arrivals.get(model, 0.0))
            elif model in snap.dispatches:
                arrived += _delta(snap.dispatches[model], before.dispatches.get(model, 0.0))
        else:
            if model in snap.arrivals:
                series, earlier = snap.arrivals_by_class, before.arrivals_by_class
            else:
                series, earlier = snap.dispatches_by_class, before.dispatches_by_class
            for (m, c), value in series.items():
                if m == model:
                    d = _delta(value, earlier.get((m, c), 0.0))
                    arrived_all += d
                    arrived += d if classes(c) else 0.0
        if ttft_class is not None:
            for m in ("true", "false"):
                key = (model, ttft_class, m)
                if key in snap.ttft:
                    d = _delta(snap.ttft[key], before.ttft.get(key, 0.0))
                    total += d
                    met += d if m == "true" else 0.0
    if held_unlabelled > 0:
        held += held_unlabelled * (arrived / arrived_all if arrived_all > 0 else 1.0)
    return Demand(
        partial=previous is not None and not set(previous) <= set(now),
        in_flight=sum(in_flight_by.values()),
        queued=queued,
        held=held,
        arrival_rate=arrived / elapsed if rate_known else None,
        kv_usage=sum(kv_by.values()) / len(kv_by) if kv_by else None,
        ttft_met=met,
        ttft_total=total,
        in_flight_by_endpoint=in_flight_by,
        completion_rate=completed / elapsed if rate_known else None,
        serving=frozenset(serving) if probed else None,
    )


@dataclasses.dataclass(frozen=True, slots=True)
class Policy:
    """``spec.autoscaling`` in the decision's terms (seconds, fractions)."""

    min_replicas: int
    max_replicas: int
    cold_start: float
    target_in_flight: float | None = None
    target_kv: float | None = None
    ttft_class: str | None = None
    ttft_attainment: float = 0.99
    ttft_min_requests: int = 20
    up_window: float = 0.0
    down_window: float = 300.0
    idle_window: float | None = None
    """Seconds idle before 0 (None: never, i.e. minReplicas >= 1)."""


@dataclasses.dataclass(frozen=True, slots=True)
class State:
    """What the decision remembers between ticks."""

    recommendations: tuple[tuple[float, int], ...] = ()
    """Change points ``(since, replicas)`` of the raw recommendation (persisted)."""
    idle_since: float | None = None
    """Persisted."""
    last_scale_time: float | None = None
    """Persisted."""
    rates: tuple[tuple[float, float], ...] = ()
    """Recent ``(time, arrival rate)`` samples for the trend (memory only: after a
    restart the trend restarts after two scrapes; the windows above do not)."""
    service_time: float | None = None
    """Smoothed seconds a request spends on an engine (Little's law: in flight over
    completions per second); memory only, None until the service has served."""
    service_samples: tuple[tuple[float, float, float], ...] = ()
    """Recent ``(time, in-flight x seconds, completions)`` per tick, the service time is
    measured over (:data:`SERVICE_WINDOW_SECONDS`); memory only."""
    woken: bool = False
    """Scaled up from zero with the service time not measured yet (cleared once it is,
    or a cold start after the backlog was released): until then what its engines run
    and queue is the backlog released by the first replica, not a rate. Memory only."""
    released_at: float | None = None
    """While woken: when the held backlog was released (the first tick with a Ready
    replica and nothing held). Memory only."""
    last_tick: float | None = None
    """When the previous decision ran (memory only): the span of this tick's samples."""
    last_in_flight: float = 0.0
    """The requests in flight at the previous decision (memory only): a tick's mean in
    flight is taken as the mean of its two ends."""
    queued_since: float | None = None
    """Since when every decision has seen requests in the routers' queues (memory only;
    None: none queued at the last one)."""
    partial_at: float | None = None
    """When a decision last ran on a partial scrape (:attr:`Demand.partial`; memory
    only): a silence that spans it is no evidence that the arrivals stopped."""


@dataclasses.dataclass(frozen=True, slots=True)
class Decision:
    desired: int
    reason: str
    """``ScaledUp: ...`` / ``ScaledDown: ...`` when desired differs from current,
    else what holds the replicas where they are."""
    recommendation: int
    """The raw recommendation before stabilisation."""
    state: State
    need: float | None = None
    """The requests in flight the in-flight target sized for (Little's mean or the
    sample, its forecast and the backlog, less the ``credit``; while requests are held
    or a woken service's time is not measured yet, its load); None without an
    in-flight target."""

    @property
    def changed(self) -> bool:
        return self.reason.startswith(("ScaledUp", "ScaledDown"))


@dataclasses.dataclass(frozen=True, slots=True)
class Ramp:
    """A rise of the arrival rate read from its recent samples."""

    rate: float
    """The fitted rate now (requests/s)."""
    slope: float
    """Its rise, requests/s per s (> 0)."""


def _ramp(rates: Sequence[tuple[float, float]], span: float) -> Ramp | None:
    """The ramp the rate samples of the last ``span`` seconds rise on, or None when they
    are no evidence of one: fewer than :data:`RAMP_MIN_SAMPLES` + 1 samples, covering
    less than :data:`MIN_TREND_COVER` of ``span``, or no slope beyond
    :data:`RAMP_SIGNIFICANCE` standard errors.

    The model is flat, then a straight rise from a breakpoint (``rate = a + b x max(0,
    t - tau)``), least squares, tried at every sample as ``tau`` that leaves
    :data:`RAMP_MIN_SAMPLES` from it on (``tau`` at the first sample is a straight line
    through all of them); the most significant slope wins. A line through the whole
    span reads a ramp that began a few seconds ago at a fraction of its slope, among
    the flat samples before it, so it was seen late; the breakpoint lets the rise be
    fitted to its own samples. The standard error takes the larger of the residuals'
    variance and a Poisson rate's (the mean rate over the mean tick), so a short flat
    stream's chance wiggle is no ramp."""
    if rates:
        rates = [(t, r) for t, r in rates if t >= rates[-1][0] - span]
    if len(rates) <= RAMP_MIN_SAMPLES or rates[-1][0] - rates[0][0] < MIN_TREND_COVER * span:
        return None
    rates = _without_spikes(rates)
    n = len(rates)
    if n <= RAMP_MIN_SAMPLES:
        return None
    ts = [t for t, _ in rates]
    rs = [r for _, r in rates]
    mean_rate = sum(rs) / n
    if mean_rate <= 0:
        return None  # no arrivals left (a trickle's one spike was all there was)
    poisson = mean_rate / ((ts[-1] - ts[0]) / (n - 1))  # a rate's variance per sample
    best: tuple[float, Ramp] | None = None
    for k in range(n - RAMP_MIN_SAMPLES + 1):
        x = [max(0.0, t - ts[k]) for t in ts]
        mx = sum(x) / n
        var = sum((xi - mx) ** 2 for xi in x)
        if var == 0:
            continue
        slope = sum((xi - mx) * (r - mean_rate) for xi, r in zip(x, rs, strict=True)) / var
        sse = sum((r - mean_rate - slope * (xi - mx)) ** 2 for xi, r in zip(x, rs, strict=True))
        z = slope / math.sqrt(max(sse / (n - 3), poisson) / var)
        if z > RAMP_SIGNIFICANCE and (best is None or z > best[0]):
            best = (z, Ramp(mean_rate + slope * (x[-1] - mx), slope))
    return best[1] if best is not None else None


#: A rate sample is a spike when its arrivals exceed the window's median rate over its
#: tick by this many Poisson standard deviations (plus one arrival) while its
#: neighbours' do not.
SPIKE_SIGNIFICANCE = 3.0


def _without_spikes(rates: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """The rate samples without isolated spikes: a burst of requests sent at once (8
    critical requests in one tick of a 3.8 req/s class) is no rate, but at the end of
    a window the breakpoint fit read it as the top of a steep ramp and forecast x4.2 in
    a cold start (a second TensorRT-LLM replica at the heavy trace's peak on 4 of 6
    mixed runs at cca9caf). A rise that lasts is no spike: its second high sample is kept with
    the first, so a step is read one tick later at most."""
    n = len(rates)
    if n < 3:
        return list(rates)
    ordered = sorted(r for _, r in rates)
    median = ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2
    tick = (rates[-1][0] - rates[0][0]) / (n - 1)

    def high(k: int) -> bool:
        dt = rates[k][0] - rates[k - 1][0] if k > 0 else tick
        expected = median * dt
        return rates[k][1] * dt > expected + SPIKE_SIGNIFICANCE * math.sqrt(expected) + 1

    highs = [high(k) for k in range(n)]
    return [
        x
        for k, x in enumerate(rates)
        if not (highs[k] and not (k > 0 and highs[k - 1]) and not (k + 1 < n and highs[k + 1]))
    ]


def _since_traffic(rates: Sequence[tuple[float, float]]) -> Sequence[tuple[float, float]]:
    """The rate samples after the last run of zero rates spanning at least
    :data:`NO_TRAFFIC_SECONDS` (all of them when there is none)."""
    run_end: int | None = None  # index of the newest zero of the run being walked
    for k in range(len(rates) - 1, -1, -1):
        t, r = rates[k]
        if r > 0:
            run_end = None
        elif run_end is None:
            run_end = k
        elif rates[run_end][0] - t >= NO_TRAFFIC_SECONDS:
            return rates[run_end + 1 :]
    return rates


def _window(recs: Sequence[tuple[float, int]], now: float, window: float) -> list[int]:
    """Recommendations in force at some time within ``[now - window, now]``."""
    cutoff = now - window
    inside = [(t, r) for t, r in recs if t >= cutoff]
    before = [r for t, r in recs if t < cutoff]
    values = [r for _, r in inside]
    if before and (not inside or inside[0][0] > cutoff):
        values.append(before[-1])  # still in force at the cutoff
    return values


def _fmt(x: float) -> str:
    return f"{x:.1f}".rstrip("0").rstrip(".") if x != int(x) else str(int(x))


#: Arrival-rate samples averaged for the Little's-law in-flight estimate (seconds, cut
#: where the rate changed): at 3 req/s a 5 s mean is +-26% (one standard deviation), so
#: a mean of 1.6 in flight often read above a target of 2 (the heavy trace at 2e7a267).
#: On a ramp the mean is half the window old (a 10 s window read a 3 -> 15 req/s ramp ~2
#: req/s low): there the forecast starts from the ramp's fitted rate now instead.
STEADY_WINDOW_SECONDS = 10.0
#: Requests seen in the routers' queues at every decision for this many seconds hold
#: the replicas (no scale-down). Not one tick: a request queued between two scrapes of
#: a free engine is no shortage (a 7d1e0c8 guard on any queued request undid the e2e
#: test's drain under a 2-stream trickle).
QUEUED_HOLD_SECONDS = 3.0
#: Before the service time is measured, a sample of what runs on the engines adds
#: replicas only when it exceeds what the current ones hold (``target x current``) by
#: this many standard deviations of a Poisson count with that mean: at 3 req/s of 0.5 s
#: requests (1.5 in flight) a sample of 3 or more comes one tick in five, and with a
#: target of 2 one asked for a replica at the heavy trace's first tick that went again
#: 13 s later (all 4 seeds at 223bc39, bench/results/autoscale-cold15.md runs ab). A
#: surge (16 where 4 are held) is far beyond it; requests waiting in the routers (queued
#: or held) are a shortage, not noise, and count at once.
SAMPLE_SIGNIFICANCE = 2.0
#: Little's mean within this fraction of ``target x current`` keeps ``current`` (the
#: HPA's default ``--horizontal-pod-autoscaler-tolerance``): a mean estimated from a
#: few seconds of a Poisson stream is that uncertain.
TOLERANCE = 0.1


#: A tick's arrivals differ from the newer ticks' (a change of rate, not noise) when
#: its count is this many standard deviations from its share of both under one rate.
CHANGE_SIGNIFICANCE = 3.0
#: A rise cuts the recent window only once the newer ticks span this many seconds (a
#: drop cuts at once). On the cluster a critical burst (8 requests at once) in the newest
#: tick or two read as a new, higher rate: Little's mean jumped from 7.6 to 12.5 in flight
#: within 4 s at the heavy trace's peak, and asked for a replica that came a cold start
#: later, when the peak was nearly over (36138dd, seeds 0 and 3 at target 4). A surge
#: that lasts is read 2 s later; the requests it queues count at once.
RISE_CUT_SECONDS = 2.0


def _recent_rate(rates: Sequence[tuple[float, float]], now: float) -> float | None:
    """The arrival rate over the last :data:`STEADY_WINDOW_SECONDS`, cut where it
    changed: walking back from the newest tick, a tick whose count is more than
    :data:`CHANGE_SIGNIFICANCE` standard deviations from its share of its own and the
    newer ticks' arrivals (binomial, by duration, under one rate) ends the window, a
    tick above its share at once, one below it (the newer ticks rose) once they span
    :data:`RISE_CUT_SECONDS`. A stream that stops (the end of a peak) reads 0 within a
    tick instead of fading over the window; a burst is no new rate. None without
    samples."""
    count = span = 0.0
    for k in range(len(rates) - 1, -1, -1):
        t, r = rates[k]
        if t < now - STEADY_WINDOW_SECONDS:
            break
        dt = t - rates[k - 1][0] if k > 0 else 0.0
        if dt <= 0:
            if span == 0:
                return r  # one sample: its rate
            break
        c = r * dt
        if span > 0:
            n, p = count + c, dt / (span + dt)
            sd = math.sqrt(n * p * (1 - p))
            if abs(c - n * p) > CHANGE_SIGNIFICANCE * sd and (
                c > n * p or span >= RISE_CUT_SECONDS
            ):
                break
        count, span = count + c, span + dt
    return count / span if span > 0 else None


#: The arrivals stopped (the scale-down window no longer applies) once the silence since
#: the last tick with arrivals would have held this many arrivals at the rate before it:
#: a Poisson stream is silent that long with probability e^-6.9, about 0.1%. At the
#: heavy trace's peak (15 req/s) that is one tick; at 1 req/s 7 s; a trickle of 0.1
#: req/s never reads as stopped before its idle window.
STOP_EVIDENCE = 6.9


def _stopped(rates: Sequence[tuple[float, float]], now: float) -> tuple[float, float] | None:
    """``(since, rate before)`` when the arrivals stopped: every rate sample after the
    last one with arrivals is 0, and the silence since that sample's end would have held
    :data:`STOP_EVIDENCE` arrivals at the mean rate of the
    :data:`STEADY_WINDOW_SECONDS` before it. None otherwise (also without a rate to
    judge the silence by)."""
    last = max((k for k, (_, r) in enumerate(rates) if r > 0), default=None)
    if last is None or last == len(rates) - 1:
        return None
    since = rates[last][0]
    count = span = 0.0
    for k in range(last, 0, -1):
        t, r = rates[k]
        if t <= since - STEADY_WINDOW_SECONDS:
            break
        dt = t - rates[k - 1][0]
        count, span = count + r * dt, span + dt
    if span <= 0 or count / span * (now - since) < STOP_EVIDENCE:
        return None
    return since, count / span


def decide(
    policy: Policy,
    demand: Demand,
    current: int,
    ready: int,
    now: float,
    state: State,
    *,
    credit: float = 0.0,
) -> Decision:
    """The replicas to run now, and why. ``credit``: requests in flight of this
    demand that other replicas serve (the room the pool's latency role has beyond its
    own classes, :func:`fleetgate.operator.pools.spare_room`): the in-flight target
    sizes for the need less it."""
    # -- the trend of arrivals, over max(cold start, a minute)
    keep = max(policy.cold_start, TREND_WINDOW_SECONDS)
    rates = tuple((t, r) for t, r in state.rates if t >= now - keep)
    if current == 0 and demand.idle:
        # a service at zero with nothing arriving has no history: the stream that wakes
        # it is a step (0 -> r req/s), and over the ticks that follow a least-squares
        # line through the zeros before it reads a steep ramp
        rates = ()
    elif demand.arrival_rate is not None:
        rates = (*rates, (now, demand.arrival_rate))
    # the forecast: the ramp's rate now plus its rise over a cold start, fitted only to
    # the samples since traffic (re)started: a step after a pause is no ramp (the heavy
    # trace's start read x1.5-x2 over the idle seconds before it, and a replica came and
    # went in the quiet phase in 5 of 6 runs, 12-28 replica-seconds each)
    ramp = _ramp(_since_traffic(rates), max(policy.cold_start, MIN_TREND_SPAN_SECONDS))

    def growth_over(rate: float | None) -> float:
        """The arrival rate forecast at ``now + coldStart`` over ``rate``, a rate read
        now: the ramp's fitted rate plus its rise over a cold start, at most
        MAX_FORECAST_GROWTH times the larger of the two rates now, never below ``rate``
        (1 without a ramp)."""
        if ramp is None or not rate or rate <= 0:
            return 1.0
        ahead = ramp.rate + ramp.slope * policy.cold_start
        return max(1.0, min(MAX_FORECAST_GROWTH * max(rate, ramp.rate), ahead) / rate)

    # what one sample of the load follows: the ramp's own rise
    growth = growth_over(ramp.rate if ramp is not None else None)

    # -- the service time, by Little's law on the service's own endpoints: in-flight
    # seconds over completions, summed over a window. A ratio per tick is biased and
    # jumpy when a tick sees one or two completions (1 in flight over 1 completion per
    # s reads 1 s, over 0.33 reads 3 s), and lower traffic is noisier.
    samples = tuple(x for x in state.service_samples if x[0] >= now - SERVICE_WINDOW_SECONDS)
    if ready > 0 and demand.completion_rate is not None and state.last_tick is not None:
        dt = now - state.last_tick
        if dt > 0:
            mean = (state.last_in_flight + demand.in_flight) / 2
            samples = (*samples, (now, mean * dt, demand.completion_rate * dt))
    service_time = state.service_time
    busy = completed = 0.0
    for _, f, c in reversed(samples):
        if completed >= SERVICE_COMPLETIONS:
            break
        busy, completed = busy + f, completed + c
    if completed >= MIN_SERVICE_COMPLETIONS:
        service_time = busy / completed
    woken = state.woken and service_time is None
    # The released backlog drains within a cold start (the premise of the held rule
    # below); what still runs and queues a cold start after its release is demand,
    # even when requests so long that 10 have not completed leave S unmeasured (the
    # e2e burst of 8 s streams in the CI run of e70fedb stayed at 1 replica for its 15 s).
    released_at = state.released_at if woken else None
    if woken and released_at is None and ready > 0 and demand.held == 0:
        released_at = now
    if released_at is not None and now - released_at >= policy.cold_start:
        woken, released_at = False, None

    partial_at = now if demand.partial else state.partial_at
    # -- idle bookkeeping
    idle_since = (
        (state.idle_since if state.idle_since is not None else now) if demand.idle else None
    )

    # -- the raw recommendation and the reason for it
    candidates: list[tuple[int, str]] = []
    replicas_now = max(current, 1)
    need: float | None = None
    if policy.target_in_flight is not None:
        target = policy.target_in_flight
        # the router holds a request only while no endpoint of the model can serve it,
        # so held requests always wait for replicas that are starting, whatever the
        # pods' Ready condition says (a pod can be Ready before its engine answers)
        starting = demand.held > 0
        note = ""
        # Little's mean: the recent arrival rate x the measured service time (None while
        # either is unknown, or while requests are held)
        recent = None if starting or not service_time else _recent_rate(rates, now)
        steady = None if recent is None or not service_time else recent * service_time
        if service_time and (starting or steady is not None):
            # With a measured service time S: what runs on the engines, plus the router
            # queue and the held requests as a backlog drained within a cold start
            # (coldStart / S batches; module docstring). What runs is Little's mean
            # (arrival rate x S, times the arrival forecast) when nothing is held: one
            # sample of a Poisson stream's in-flight count follows every burst, and the
            # scale-down window then keeps each burst's peak. While requests are held it
            # is the sample, unforecast: the engines of the replicas already up, and the
            # rest is backlog, not a rate.
            batches = max(1.0, policy.cold_start / service_time)
            if steady is not None:  # Little's mean follows the recent mean rate
                growth = growth_over(recent)
            running = demand.in_flight if steady is None else steady * growth
            backlog = demand.queued + demand.held
            need = max(0.0, running + backlog / batches - credit)
            want = math.ceil(need / target - 1e-9)
            if (
                steady is not None
                and current > 0
                and abs(need / (target * current) - 1) <= TOLERANCE
            ):
                want = current  # within the tolerance of what runs: noise (the HPA's rule)
            if steady is None:  # requests held
                note = (
                    f"; {_fmt(demand.held)} held drain in {_fmt(batches)} batches "
                    f"of {_fmt(service_time)}s per cold start"
                )
            else:
                note = f"; {_fmt(steady)} mean in flight (arrivals x {_fmt(service_time)}s)"
        elif not starting and not woken:
            need = max(0.0, demand.load * growth - credit)
            want = math.ceil(need / target - 1e-9)
            held_at = target * current
            noise = SAMPLE_SIGNIFICANCE * math.sqrt(held_at)
            if (
                want > current > 0
                and demand.load == demand.in_flight
                and (demand.in_flight * growth - credit <= held_at + noise)
            ):
                # one sample within the noise of what the replicas hold (module docstring)
                want = current
                note = f"; one sample, within the noise of {_fmt(held_at)}"
        else:
            # not measured yet, and requests held, or released by the replicas started
            # from zero: a backlog, whose size alone says nothing about how fast it
            # drains; it keeps at most the replicas asked for (no forecast either)
            need = demand.load
            want = min(math.ceil(need / target - 1e-9), replicas_now)
            if starting:
                note = f"; {_fmt(demand.held)} held wait for the {replicas_now} starting"
            else:
                note = f"; the backlog released to the {replicas_now} started from zero"
            note += " (service time not measured yet)"
        if credit > 0 and need is not None:
            note += f"; {_fmt(round(credit, 1))} of it on the latency role's room"
        per = demand.load / replicas_now
        trend = f" (arrivals x{growth:.2f} in {_fmt(policy.cold_start)}s)" if growth > 1.005 else ""
        cmp = ">" if want > current else "<" if want < current else "~"
        candidates.append(
            (
                want,
                f"in-flight {_fmt(per)}/replica{trend} {cmp} target {_fmt(target)}{note}",
            )
        )
    if policy.target_kv is not None and demand.kv_usage is not None and ready > 0:
        want = math.ceil(ready * demand.kv_usage / policy.target_kv - 1e-9)
        cmp = ">" if want > current else "<" if want < current else "~"
        candidates.append(
            (
                want,
                f"KV cache {demand.kv_usage:.0%} {cmp} target {policy.target_kv:.0%}",
            )
        )
    if policy.ttft_class is not None and demand.ttft_total >= policy.ttft_min_requests:
        attained = demand.ttft_met / demand.ttft_total
        if attained < policy.ttft_attainment:
            candidates.append(
                (
                    current + 1,
                    f"{policy.ttft_class} TTFT attainment {attained:.1%} < "
                    f"{policy.ttft_attainment:.1%}",
                )
            )
    raw, why = max(candidates, key=lambda c: c[0]) if candidates else (current, "no signal")
    queued_since = (
        (state.queued_since if state.queued_since is not None else now)
        if demand.queued > 0
        else None
    )
    if raw < current and queued_since is not None and now - queued_since >= QUEUED_HOLD_SECONDS:
        # requests have waited for a slot at every decision for a while: one replica
        # fewer cannot serve them sooner. Little's mean reads a fleet at ~100% of its
        # slots as just enough, and a rate estimate 5% low then removes a replica the
        # queue still needs (bench/results/autoscale-cold15.md, run c)
        raw = current
        why += f"; requests queued for {_fmt(now - queued_since)}s: no scale-down"
    to_zero = False
    if current == 0 and not demand.idle:
        raw = max(raw, 1)
        if demand.held > 0:
            why = f"{_fmt(demand.held)} requests held at 0 replicas"
    elif policy.min_replicas == 0 and not (current == 0 and demand.idle):
        if idle_since is not None and policy.idle_window is not None:
            idle_for = now - idle_since
            if idle_for >= policy.idle_window:
                raw, why, to_zero = 0, f"idle {_fmt(idle_for)}s", True
            else:
                raw = max(raw, 1)  # not idle long enough for zero
        else:
            raw = max(raw, 1)
    raw = max(policy.min_replicas, min(policy.max_replicas, raw))

    # -- stabilisation (HPA's: up to the min of the up window, down to the max of the down)
    recs = list(state.recommendations)
    if not recs or recs[-1][1] != raw:
        recs.append((now, raw))
    horizon = max(policy.up_window, policy.down_window)
    while len(recs) > 1 and recs[1][0] < now - horizon:
        recs.pop(0)  # the entry in force at the horizon stays
    desired = current
    if raw > current:
        if current == 0:
            desired = raw  # from zero: nothing to stabilise, a request waits
        else:
            desired = max(current, min(_window(recs, now, policy.up_window)))
    elif raw < current:
        # the idle window is the stabilisation of a scale to zero
        in_window = _window(recs, now, policy.down_window)
        stop = _stopped(rates, now) if demand.load == 0 else None
        if stop is not None and (partial_at is None or partial_at < stop[0]):
            # The window keeps a noisy signal's dips from removing replicas; a stream
            # that has stopped is no dip: the recommendations made while it ran say
            # nothing of now. Every run of the heavy trace kept the peak's replicas
            # idle for the whole window after its last request (~10 s x 2 replicas,
            # 5% of its replica-seconds; docs/operator.md "Autoscaling decision").
            in_window = [raw]
            why += (
                f"; arrivals stopped {_fmt(now - stop[0])}s ago "
                f"(after {_fmt(round(stop[1], 1))} req/s): no window"
            )
        desired = min(current, 0 if to_zero else max(in_window))
    desired = max(policy.min_replicas, min(policy.max_replicas, desired))
    if desired > current:
        reason = f"ScaledUp: {why}"
    elif desired < current:
        reason = f"ScaledDown: {why}"
    elif raw != current:
        span = policy.up_window if raw > current else policy.down_window
        reason = f"Stabilizing: {why}; holding {current} for the {_fmt(span)}s window"
    else:
        reason = f"Steady: {why}"
    return Decision(
        desired=desired,
        reason=reason,
        recommendation=raw,
        need=need,
        state=State(
            recommendations=tuple(recs),
            idle_since=idle_since,
            last_scale_time=now if desired != current else state.last_scale_time,
            rates=rates,
            service_time=service_time,
            service_samples=samples,
            woken=woken or (current == 0 and desired > 0 and service_time is None),
            released_at=released_at,
            last_tick=now,
            last_in_flight=demand.in_flight,
            queued_since=queued_since,
            partial_at=partial_at,
        ),
    )


def choose_victims(
    pods: Sequence[tuple[str, float]], n: int, serving: Collection[str] | None = None
) -> list[str]:
    """The ``n`` replicas to drain first: ``(pod, in flight)``; pods not in ``serving``
    (None: all serve) first, then the least in flight (ties by name, so repeated ticks
    pick the same ones). A pod can be Ready before its engine answers (a readiness
    probe on the port, not the model; every kwok pod): on the cluster a scale-down
    drained the replica that had served all along while the one asked for 11 s before
    was still starting, and the routers held 11 requests for ~4 s (a1da059, target 3,
    seed 0)."""

    def key(p: tuple[str, float]) -> tuple[bool, float, str]:
        return (serving is None or p[0] in serving, p[1], p[0])

    return [p for p, _ in sorted(pods, key=key)[: max(0, n)]]


@dataclasses.dataclass(frozen=True, slots=True)
class Drain:
    """One tick of a scale-down by draining (:func:`plan_drain`)."""

    draining: tuple[tuple[str, float], ...]
    """``(pod, drain start)`` of every replica draining after this tick (new ones too)."""
    new: tuple[str, ...]
    """Replicas that start draining now (annotate them)."""
    released: tuple[str, ...]
    """Replicas that drained and go back to work (remove the annotation)."""
    busy: tuple[tuple[str, float], ...]
    """Draining replicas still waited for: ``(pod, in flight)``."""
    remove: int
    """Replicas to remove now (the drained ones: every draining replica, or 0)."""
    removed: tuple[tuple[str, float], ...] = ()
    """``(pod, in flight)`` of the replicas removed now, by pod name: 0 in flight
    (drained) or past the drain timeout."""

    def outcome(self) -> str:
        """Why each removed replica may go: ``pod a drained, pod b drain timeout, 2 in flight``."""
        return ", ".join(
            f"pod {p} drained" if n <= 0 else f"pod {p} drain timeout, {_fmt(n)} in flight"
            for p, n in self.removed
        )


def plan_drain(
    draining: Sequence[tuple[str, float]],
    in_flight: Mapping[str, float],
    wanted: int,
    now: float,
    timeout: float,
    serving: Collection[str] | None = None,
) -> Drain:
    """Which replicas drain for a scale-down by ``wanted`` (> 0), and whether they go.

    ``draining``: ``(pod, since)`` of the replicas already draining; ``in_flight``:
    every Ready replica of the service and what it runs (a draining pod missing from it
    is gone: removed, or deleted by someone); ``serving``: the pods the routers find
    serving (None: unknown), the others drain first (:func:`choose_victims`). Every
    replica to remove drains at once and they go together: the victims share the lowest
    deletion cost, so a scale-down by their number removes exactly them once all are
    idle (removing one while another still drains could take the busy one; one at a time
    made 10 -> 2 with minute-long requests eight drains in a row). Demand partly back
    (more draining than wanted): the busiest go back to work. A replica past ``timeout``
    seconds of draining counts as drained whatever it still runs.
    """
    live = [(p, since) for p, since in draining if p in in_flight]
    released: list[str] = []
    if len(live) > wanted:
        live.sort(key=lambda d: (in_flight[d[0]], d[0]))
        released = [p for p, _ in live[wanted:]]
        live = live[:wanted]
    marked = {p for p, _ in live}
    new = choose_victims(
        [(p, n) for p, n in in_flight.items() if p not in marked], wanted - len(live), serving
    )
    live += [(p, now) for p in new]
    busy = [(p, in_flight[p]) for p, since in live if in_flight[p] > 0 and now - since < timeout]
    remove = len(live) if live and not new and not busy else 0
    removed = tuple(sorted((p, in_flight[p]) for p, _ in live)) if remove else ()
    return Drain(tuple(live), tuple(new), tuple(released), tuple(busy), remove, removed)
