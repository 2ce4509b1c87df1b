"""The autoscaling loop: scrape the routers, decide, drain, scale, report.

Every ``autoscale_interval`` seconds :class:`Autoscaler` scrapes each router's
``/metrics`` once (router pods found by ``router_selector``, or fixed URLs), then,
for each InferenceService with ``spec.autoscaling``, under the same per-service
lock as the reconciler, *plans* (steps 1-2) for every service first and *acts*
(steps 3-5) after the pools' GPU budgets (``--pool-gpu-budget``) are shared over the
plans (:func:`fleetgate.operator.pools.share_budget`); a model served by both roles
in a pool takes only its role's classes' demand (:func:`fleetgate.operator.pools.
demand_roles`, ``--class-role``):

1. reads the service's pods (their endpoint ids are ``namespace/pod``, as the
   router names them) and combines the routers' demand for its model and pods
   (:func:`fleetgate.operator.autoscale.demand_for`);
2. decides (:func:`fleetgate.operator.autoscale.decide`) with the state kept in
   ``status.autoscaling``;
3. scales up at once through the scale subresource (``spec.replicas``; the
   reconciler turns it into the Deployment's replicas);
4. scales down without losing work: every replica to remove (least in flight
   first) is annotated at once ``fleetgate.dev/drain: "true"`` (the routers send
   it no new work) and ``controller.kubernetes.io/pod-deletion-cost`` (the
   ReplicaSet removes the cheapest pods first); once the routers report nothing in
   flight on any of them (or ``drainTimeoutSeconds`` passed for each still busy)
   ``spec.replicas`` drops by their number and the ReplicaSet removes exactly those
   pods: together, since one removed while another still drains could be the busy
   one. If demand returns first, the annotations go and nothing is removed; if it
   returns in part, the least loaded victims stay and the rest are given back;
5. writes ``status.autoscaling`` and an ``Autoscaling`` condition, posts an Event
   for every scale and drain, and exports the decision as operator metrics.

No router answering is not "no demand": the decision is skipped (condition
``Autoscaling=False``, reason ``NoMetrics``) and replicas stay.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import ipaddress
import json
import logging
import os
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from pydantic import ValidationError

from fleetgate.api.v1alpha1 import KIND, InferenceServiceSpec
from fleetgate.operator import autoscale, manifests, pools, status
from fleetgate.operator.kube import KubeApi, KubeError
from fleetgate.operator.metrics import OperatorMetrics
from fleetgate.operator.options import OperatorOptions
from fleetgate.operator.reconcile import API_VERSION, Reconciler, event_object

__all__ = ["ANNOTATION_DELETION_COST", "ANNOTATION_DRAIN", "Autoscaler", "fetch_text"]

log = logging.getLogger(__name__)

ANNOTATION_DRAIN = "fleetgate.dev/drain"
ANNOTATION_DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
#: The victim's deletion cost: below every pod without the annotation (cost 0).
VICTIM_COST = "-1000"
_CONDITION = "Autoscaling"
#: The reason of a decision the pool's GPU budget cut short.
LIMITED = "ScaleUpLimited"
_DEMAND_KEYS = ("inFlight", "queued", "held", "arrivalRate", "kvCacheUtilization", "ttftAttainment")


#: How long one ``GET /held`` long poll waits on the router before asking again.
HELD_POLL_S = 30.0


def held_url(metrics_url: str, after: int, wait: float) -> str:
    """The router's ``/held`` long poll next to its ``/metrics``."""
    parts = urllib.parse.urlsplit(metrics_url)
    query = urllib.parse.urlencode({"after": after, "wait": f"{wait:g}"})
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, "/held", query, ""))


def fetch_text(url: str, timeout: float = 3.0) -> str:
    """GET ``url`` and return its body (the routers' /metrics)."""
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        body: bytes = resp.read()
    return body.decode("utf-8", "replace")


def _loopback(url: str) -> bool:
    host = urllib.parse.urlsplit(url).hostname or ""
    try:
        return bool(ipaddress.ip_address(host).is_loopback)
    except ValueError:
        return host == "localhost"


def _parse_time(text: str | None) -> float | None:
    if not text:
        return None
    try:
        return dt.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def _draining(auto_status: Mapping[str, Any]) -> list[dict[str, Any]]:
    """``status.autoscaling.draining``: a list, or one object (before 2026-12-04)."""
    value = auto_status.get("draining")
    items = [value] if isinstance(value, Mapping) else value if isinstance(value, list) else []
    return [dict(d) for d in items if isinstance(d, Mapping) and d.get("pod")]


def _stamp(t: float) -> str:
    return status.format_time(dt.datetime.fromtimestamp(t, dt.UTC))


def _is_ready(pod: Mapping[str, Any]) -> bool:
    for cond in (pod.get("status") or {}).get("conditions") or ():
        if cond.get("type") == "Ready":
            return bool(cond.get("status") == "True")
    return False


def measured_cold_start(pods: Sequence[Mapping[str, Any]]) -> float | None:
    """Longest creation-to-Ready time among pods that are Ready."""
    starts = []
    for pod in pods:
        created = _parse_time((pod.get("metadata") or {}).get("creationTimestamp"))
        for cond in (pod.get("status") or {}).get("conditions") or ():
            if cond.get("type") == "Ready" and cond.get("status") == "True":
                ready_at = _parse_time(cond.get("lastTransitionTime"))
                if created is not None and ready_at is not None and ready_at >= created:
                    starts.append(ready_at - created)
    return max(starts) if starts else None


@dataclasses.dataclass(frozen=True, slots=True)
class _Plan:
    """One service's reading and decision, before the pool's budget and any action."""

    ns: str
    name: str
    body: Mapping[str, Any]
    spec: InferenceServiceSpec
    policy: autoscale.Policy
    old: Mapping[str, Any]
    pods: Sequence[Mapping[str, Any]]
    endpoint: Mapping[str, str]
    cold: float
    measured: float | None
    demand: autoscale.Demand
    decision: autoscale.Decision
    current: int
    demand_classes: str
    serving: int = 0
    """Ready pods that a router's last ``/health`` probe found serving (a pod can be
    Ready before its engine answers where the readiness probe is not the engine's own,
    as on kwok's fake nodes; a pod no router has probed yet does not count)."""
    role: pools.Role | None = None
    """The role whose classes' demand it took (None: all classes)."""
    model: str = ""


class Autoscaler:
    """Runs the decisions of every autoscaled InferenceService until stopped."""

    def __init__(
        self,
        api: KubeApi,
        reconciler: Reconciler,
        options: OperatorOptions,
        metrics: OperatorMetrics,
        namespaces: tuple[str, ...],
        stop: threading.Event,
        *,
        fetch: Callable[[str], str] = fetch_text,
        long_poll: Callable[[str, float], str] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._api = api
        self._reconciler = reconciler
        self._options = options
        self._metrics = metrics
        self._namespaces = namespaces or ("",)
        self._stop = stop
        self._fetch = fetch
        self._clock = clock
        self._previous: dict[str, autoscale.RouterSnapshot] | None = None
        self._previous_at = 0.0
        #: (ns, name) -> the last decision's state; its memory-only part (the arrival
        #: rates, the service time and its samples, ...) carries to the next tick, the
        #: rest is read from status.autoscaling every tick
        self._memory: dict[tuple[str, str], autoscale.State] = {}
        #: the services that stood down at the last tick -> their (pool, model)
        self._stood_down: dict[pools.Key, tuple[str, str]] = {}
        #: (pool, model) -> recent (time, summed load) of a group both roles serve
        self._group_loads: dict[tuple[str, str], list[tuple[float, float]]] = {}
        self._test_mode = os.environ.get("FLEETGATE_TEST_MODE") == "1"
        self._long_poll = long_poll
        self._wake = threading.Event()
        """Set by a router's ``/held`` answer: decide now, not at the next period."""
        self._routers: set[str] = set()
        self._watchers: dict[str, threading.Thread] = {}
        self._no_held: set[str] = set()
        """Routers that answered 404 to ``/held`` (older ones): not asked again."""
        self.wakeups = 0
        """Decisions started early because a router held a model's first request."""

    # -- the routers ------------------------------------------------------------------
    def _router_urls(self) -> list[str]:
        if self._options.router_metrics_urls:
            return list(self._options.router_metrics_urls)
        urls = []
        spaces = (
            (self._options.router_namespace,)
            if self._options.router_namespace is not None
            else self._namespaces
        )
        for ns in spaces:
            try:
                pods = self._api.list("v1", "Pod", ns, self._options.router_selector)
            except KubeError as e:
                log.warning("autoscaling: cannot list router pods in %r: %s", ns, e)
                continue
            for pod in pods:
                ip = (pod.get("status") or {}).get("podIP")
                if ip and _is_ready(pod):
                    host = f"[{ip}]" if ":" in ip else ip
                    urls.append(f"http://{host}:{self._options.router_metrics_port}/metrics")
        return urls

    def scrape(self) -> dict[str, autoscale.RouterSnapshot]:
        """One snapshot per router that answered."""
        found: dict[str, autoscale.RouterSnapshot] = {}
        urls = []
        for url in self._router_urls():
            if self._test_mode and not _loopback(url):
                log.warning("autoscaling: test mode, not scraping non-loopback %s", url)
                continue
            urls.append(url)
        self._watch_routers(urls)
        for url in urls:
            try:
                found[url] = autoscale.parse_router_metrics(self._fetch(url))
            except (OSError, ValueError) as e:
                self._metrics.autoscale_scrape_errors.inc()
                log.warning("autoscaling: router metrics %s: %s", url, e)
        return found

    def _watch_routers(self, urls: Sequence[str]) -> None:
        """One ``/held`` long-poll thread per router (none without ``long_poll``)."""
        self._routers = set(urls)
        if self._long_poll is None:
            return
        for url in urls:
            if url in self._no_held:
                continue
            thread = self._watchers.get(url)
            if thread is None or not thread.is_alive():
                thread = threading.Thread(
                    target=self._watch_holds, args=(url,), name="autoscale-held", daemon=True
                )
                self._watchers[url] = thread
                thread.start()
        for url in [u for u, t in self._watchers.items() if not t.is_alive()]:
            del self._watchers[url]

    def _watch_holds(self, url: str) -> None:
        """Long-poll one router's ``/held``; when a model's first request is held there,
        wake the loop (a service at zero replicas scales up now, not a period later).
        Ends when the router is no longer scraped, or has no ``/held`` (an older
        router: its holds are then seen at the next period only)."""
        assert self._long_poll is not None
        after, delay = -1, 0.5
        while not self._stop.is_set() and url in self._routers:
            try:
                body = json.loads(
                    self._long_poll(held_url(url, after, HELD_POLL_S), HELD_POLL_S + 5)
                )
                generation = int(body["generation"])
                held = dict(body.get("held") or {})
            except urllib.error.HTTPError as e:
                if e.code in (404, 405):
                    log.info("autoscaling: router %s has no /held (HTTP %d)", url, e.code)
                    self._no_held.add(url)
                    return
                log.warning("autoscaling: router %s /held: %s", url, e)
                self._stop.wait(delay)
                delay = min(delay * 2, self._options.autoscale_interval)
                continue
            except (OSError, ValueError, KeyError, TypeError) as e:
                log.debug("autoscaling: router %s /held: %s", url, e)
                self._stop.wait(delay)
                delay = min(delay * 2, self._options.autoscale_interval)
                continue
            delay = 0.5
            if after >= 0 and generation != after and held:
                log.info("autoscaling: router %s holds requests for %s: deciding now",
                         url, ", ".join(sorted(held)))  # fmt: skip
                self._wake.set()
            after = generation

    # -- the loop ---------------------------------------------------------------------
    def run(self) -> None:
        """Decide every ``autoscale_interval`` seconds, and at once when a router holds
        a model's first request (scale from zero)."""

        def stopper() -> None:
            self._stop.wait()
            self._wake.set()

        threading.Thread(target=stopper, name="autoscale-stop", daemon=True).start()
        while not self._stop.is_set():
            woken = self._wake.wait(self._options.autoscale_interval)
            self._wake.clear()
            if self._stop.is_set():
                break
            if woken:
                self.wakeups += 1
            try:
                self.run_once()
            except Exception:
                log.exception("autoscaling pass failed")

    def run_once(self) -> int:
        """Scrape once and decide for every autoscaled service; returns how many."""
        now = self._clock()
        bodies: list[dict[str, Any]] = []
        for ns in self._namespaces:
            try:
                bodies += self._api.list(API_VERSION, KIND, ns, "")
            except KubeError as e:
                log.warning("autoscaling: cannot list InferenceServices in %r: %s", ns, e)
        scaled = [b for b in bodies if (b.get("spec") or {}).get("autoscaling")]
        for body in bodies:
            if body not in scaled and (body.get("status") or {}).get("autoscaling"):
                self._switched_off(body)
        if not scaled:
            self._previous = None  # nothing to scale: no scraping either
            return 0
        snaps = self.scrape()
        previous, elapsed = self._previous, now - self._previous_at
        self._previous, self._previous_at = snaps, now
        live = [b for b in scaled if not b["metadata"].get("deletionTimestamp")]
        roles, shares = self._demand_split(live)
        # a role that stood down at the last tick leaves its classes to the other role,
        # whose decision then takes them (their arrivals' trend and queue as well as the
        # in-flight on its pods): it serves them all
        groups_down = set(self._stood_down.values())
        plans: list[_Plan] = []
        done = 0
        # the latency role first: with --pool-consolidation its room beyond its own
        # classes is the throughput role's credit (pools.spare_room)
        for body in sorted(live, key=lambda b: roles.get(_key(b)) != pools.LATENCY):
            key = _key(body)
            with self._reconciler.lock(*key):
                try:
                    fresh = self._api.get(API_VERSION, KIND, *key)
                    if fresh is not None:
                        role = roles.get(key)
                        all_classes = (
                            role is not None
                            and key not in self._stood_down
                            and _group(fresh) in groups_down
                        )
                        credit = 0.0
                        if (
                            self._options.pool_consolidation
                            and role == pools.THROUGHPUT
                            and not all_classes
                        ):
                            credit = self._latency_room(plans, _group(fresh))
                        plan = self.plan(
                            fresh, snaps, previous, elapsed, now, role,
                            all_classes=all_classes, credit=credit, share=shares.get(key),
                        )  # fmt: skip
                        if plan is not None:
                            plans.append(plan)
                        done += 1
                except KubeError as e:
                    log.warning("autoscaling %s/%s: %s", *key, e)
        plans = self._consolidate(plans)
        grants = self._budget_grants(plans)
        for plan in plans:
            with self._reconciler.lock(plan.ns, plan.name):
                try:
                    self.act(plan, grants.get((plan.ns, plan.name)), now)
                except KubeError as e:
                    log.warning("autoscaling %s/%s: %s", plan.ns, plan.name, e)
        for body in live:
            self._reconciler.reconcile_by_name(
                str(body["metadata"]["namespace"]), str(body["metadata"]["name"])
            )
        return done

    # -- the pool ---------------------------------------------------------------------
    def _demand_split(
        self, bodies: Sequence[Mapping[str, Any]]
    ) -> tuple[dict[pools.Key, pools.Role | None], dict[pools.Key, pools.Share]]:
        """Which role's classes each service's demand is made of (None: all), and the
        part of it each service takes when others of the same pool, model and role
        take it too (:func:`fleetgate.operator.pools.demand_shares`)."""
        specs: list[tuple[pools.Key, InferenceServiceSpec]] = []
        for body in bodies:
            try:
                spec = InferenceServiceSpec.model_validate(body.get("spec") or {})
            except ValidationError:
                continue
            specs.append((_key(body), spec))
        roles = pools.demand_roles(
            (key, spec.routing.pool, spec.model.name or key[1], spec.routing.role)
            for key, spec in specs
        )
        shares = pools.demand_shares(
            (
                key,
                (spec.routing.pool, spec.model.name or key[1], roles[key]),
                spec.replicas,
                spec.autoscaling.max_replicas,
            )
            for key, spec in specs
            if spec.autoscaling is not None
        )
        return roles, shares

    def _latency_room(self, plans: Sequence[_Plan], group: tuple[str, str]) -> float:
        """The room the latency-role services of ``group`` planned so far keep beyond
        their own classes' need (:func:`fleetgate.operator.pools.spare_room`); one that
        stood down at the last tick keeps none (it drains to zero)."""
        return pools.spare_room(
            (p.current, p.decision.desired, p.policy.target_in_flight, p.decision.need)
            for p in plans
            if p.role == pools.LATENCY
            and (p.spec.routing.pool, p.model) == group
            and (p.ns, p.name) not in self._stood_down
        )

    def _consolidate(self, plans: Sequence[_Plan]) -> list[_Plan]:
        """The plans, with a role that the pool's other role serves at zero
        (:func:`fleetgate.operator.pools.consolidate`) deciding 0 replicas; unchanged
        without ``--pool-consolidation``."""
        if not self._options.pool_consolidation:
            return list(plans)
        groups: dict[tuple[str, str], list[_Plan]] = {}
        for p in plans:
            if p.role is not None:
                groups.setdefault((p.spec.routing.pool, p.model), []).append(p)
        absorbed: dict[pools.Key, str] = {}
        now = self._clock()
        for gone in set(self._group_loads) - set(groups):
            del self._group_loads[gone]
        for gkey, group in groups.items():
            recent = [
                (t, x)
                for t, x in self._group_loads.get(gkey, ())
                if t > now - pools.LOAD_WINDOW_SECONDS
            ]
            recent.append((now, sum(p.demand.load for p in group)))
            self._group_loads[gkey] = recent
            absorbed.update(
                pools.consolidate(
                    [
                        pools.Sharer(
                            key=(p.ns, p.name),
                            role=p.spec.routing.role,
                            min_replicas=p.policy.min_replicas,
                            current=p.current,
                            ready=p.serving,
                            wanted=p.decision.desired,
                            load=p.demand.load,
                            arrivals=p.demand.arrival_rate,
                            target=p.policy.target_in_flight,
                        )
                        for p in group
                    ],
                    total=sum(x for _, x in recent) / len(recent),
                )
            )
        # a role that stood down and comes back this tick brings replicas for its
        # classes, which the serving role's decision (all classes) sized for as well
        back: dict[tuple[str, str], tuple[int, pools.Role]] = {}
        for p in plans:
            if (p.ns, p.name) in self._stood_down and (p.ns, p.name) not in absorbed:
                n, _ = back.get(self._stood_down[(p.ns, p.name)], (0, p.spec.routing.role))
                back[self._stood_down[(p.ns, p.name)]] = (
                    n + p.decision.desired,
                    p.spec.routing.role,
                )
        returning = set(self._stood_down)
        self._stood_down = {
            (p.ns, p.name): (p.spec.routing.pool, p.model)
            for p in plans
            if (p.ns, p.name) in absorbed
        }
        out = []
        for p in plans:
            gkey = (p.spec.routing.pool, p.model)
            if gkey in back and p.role is not None and (p.ns, p.name) not in returning:
                p = _less_what_comes_back(p, *back[gkey])
            why = absorbed.get((p.ns, p.name))
            if why is not None:
                kind = "ScaledDown" if p.current > 0 else "Consolidated"
                own = f"its own demand wants {p.decision.desired}"
                decision = dataclasses.replace(
                    p.decision, desired=0, reason=f"{kind}: {why}; {own}"
                )
                p = dataclasses.replace(p, decision=decision)
            out.append(p)
        return out

    def _budget_grants(self, plans: Sequence[_Plan]) -> dict[pools.Key, pools.Grant]:
        """The GPU budget of each pool that has one, shared over its services' plans."""
        grants: dict[pools.Key, pools.Grant] = {}
        for pool, budget in self._options.pool_gpu_budgets.items():
            members = [
                pools.Member(
                    key=(p.ns, p.name),
                    role=p.spec.routing.role,
                    gpus=p.spec.gpu.count,
                    min_replicas=p.policy.min_replicas,
                    current=p.current,
                    wanted=p.decision.desired,
                )
                for p in plans
                if p.spec.routing.pool == pool
            ]
            shares = pools.share_budget(pool, budget, members)
            grants.update(shares)
            gauge = self._metrics.pool_gpus
            gauge.labels(pool=pool, state="budget").set(budget)
            gauge.labels(pool=pool, state="wanted").set(sum(m.wanted * m.gpus for m in members))
            gauge.labels(pool=pool, state="granted").set(
                sum(shares[m.key].target * m.gpus for m in members)
            )
        return grants

    # -- one service ------------------------------------------------------------------
    def plan(
        self,
        body: Mapping[str, Any],
        snaps: Mapping[str, autoscale.RouterSnapshot],
        previous: Mapping[str, autoscale.RouterSnapshot] | None,
        elapsed: float,
        now: float,
        role: pools.Role | None = None,
        *,
        all_classes: bool = False,
        credit: float = 0.0,
        share: pools.Share | None = None,
    ) -> _Plan | None:
        """Read and decide for one service (no action yet); None if it is not
        autoscaled, its spec is invalid or no router answered. ``role``: take only the
        demand of that role's priority classes (None: all classes); ``all_classes``:
        take every class even so (the pool's other role stands down); ``credit``: the
        requests in flight other replicas run of that demand (the latency role's
        room, :func:`fleetgate.operator.pools.spare_room`); ``share``: its part of a
        demand other services take too (None: all of it)."""
        meta = body["metadata"]
        ns, name = str(meta["namespace"]), str(meta["name"])
        try:
            spec = InferenceServiceSpec.model_validate(body.get("spec") or {})
        except ValidationError:
            return None  # the reconciler reports InvalidSpec
        auto = spec.autoscaling
        if auto is None:
            return None
        old = dict(((body.get("status") or {}).get("autoscaling")) or {})
        pods = [
            p
            for p in self._api.list("v1", "Pod", ns, manifests.selector_string(name))
            if not (p.get("metadata") or {}).get("deletionTimestamp")
        ]
        ready_pods = [p for p in pods if _is_ready(p)]
        endpoint = {str(p["metadata"]["name"]): f"{ns}/{p['metadata']['name']}" for p in pods}
        measured = measured_cold_start(pods) or old.get("measuredColdStartSeconds")
        cold = float(auto.cold_start_seconds or measured or spec.startup_budget_seconds)
        policy = autoscale.Policy(
            min_replicas=auto.min_replicas,
            max_replicas=auto.max_replicas,
            cold_start=cold,
            target_in_flight=auto.target_in_flight_per_replica,
            target_kv=auto.target_kv_cache_utilization,
            ttft_class=auto.ttft_objective.priority_class if auto.ttft_objective else None,
            ttft_attainment=auto.ttft_objective.attainment if auto.ttft_objective else 0.99,
            ttft_min_requests=auto.ttft_objective.min_requests if auto.ttft_objective else 20,
            up_window=float(auto.scale_up_stabilization_seconds),
            down_window=float(auto.scale_down_stabilization_seconds),
            idle_window=(
                float(auto.scale_to_zero_after_seconds or autoscale.DEFAULT_IDLE_SECONDS)
                if auto.min_replicas == 0
                else None
            ),
        )
        current = spec.replicas
        if not snaps:
            self._condition(
                now, ns, name, body, "False", "NoMetrics", "no router /metrics answered"
            )
            return None
        classes = self._options.class_roles
        demand = autoscale.demand_for(
            snaps,
            previous,
            elapsed,
            model=spec.model.name or name,
            endpoints=endpoint.values(),
            ttft_class=policy.ttft_class,
            classes=classes.accepts(role) if role is not None and not all_classes else None,
        )
        if share is not None:
            demand = demand.shared(share.weight, objective=share.objective)
        state = dataclasses.replace(
            self._memory.get((ns, name), autoscale.State()),
            recommendations=tuple(
                (t, int(r["replicas"]))
                for r in old.get("recommendations") or ()
                if (t := _parse_time(r.get("time"))) is not None
            ),
            idle_since=_parse_time(old.get("idleSince")),
            last_scale_time=_parse_time(old.get("lastScaleTime")),
        )
        decision = autoscale.decide(
            policy, demand, current, len(ready_pods), now, state, credit=credit
        )
        self._memory[(ns, name)] = decision.state
        return _Plan(
            ns=ns,
            name=name,
            body=body,
            spec=spec,
            policy=policy,
            old=old,
            pods=pods,
            endpoint=endpoint,
            cold=cold,
            measured=measured,
            demand=demand,
            decision=decision,
            current=current,
            demand_classes=(
                "all classes"
                if role is None
                else "all classes (the pool's other role stands down)"
                if all_classes
                else classes.describe(role)
            )
            + (
                ""
                if share is None
                else f"; {share.weight:.0%} of it, shared by {share.of} services by replicas"
            ),
            serving=sum(
                1
                for p in ready_pods
                if endpoint[str(p["metadata"]["name"])] in (demand.serving or ())
            ),
            role=role,
            model=spec.model.name or name,
        )

    def act(self, plan: _Plan, grant: pools.Grant | None, now: float) -> str:
        """Scale or drain one service as planned, within its pool's GPU budget
        (``grant``, None: no budget); returns the reason."""
        ns, name, body, old, pods = plan.ns, plan.name, plan.body, plan.old, plan.pods
        endpoint, demand, decision, current = (
            plan.endpoint,
            plan.demand,
            plan.decision,
            plan.current,
        )
        auto = plan.spec.autoscaling
        assert auto is not None
        reason, target = decision.reason, decision.desired
        if grant is not None:
            target = grant.replicas
            if grant.note is not None:
                reason = f"{LIMITED}: {grant.note}; {reason.split(': ', 1)[-1]}"
        # the replicas draining for a scale-down: (pod, since); a pod gone is done
        draining = [
            (d["pod"], _parse_time(d.get("since")) or now)
            for d in _draining(old)
            if d["pod"] in endpoint
        ]
        in_flight = {
            pod: demand.in_flight_by_endpoint.get(address, 0.0) for pod, address in endpoint.items()
        }
        events: list[status.Transition] = []
        new_replicas = current
        if target < current and len(pods) > current:
            reason = f"{reason} (waiting for the ReplicaSet: {len(pods)} pods > {current})"
        elif target < current:
            if any(not _is_ready(p) for p in pods) or not pods:
                new_replicas = current - 1  # the ReplicaSet removes a not-ready pod first
            else:
                serving = (
                    None
                    if demand.serving is None
                    else {pod for pod, address in endpoint.items() if address in demand.serving}
                )
                step = autoscale.plan_drain(
                    draining,
                    in_flight,
                    current - target,
                    now,
                    auto.drain_timeout_seconds,
                    serving,
                )
                for pod in step.released:
                    self._mark(ns, pod, drain=False)
                for victim in step.new:
                    self._mark(ns, victim, drain=True)
                    events.append(
                        status.Transition(
                            "Normal",
                            "Draining",
                            f"pod {victim} ({autoscale._fmt(in_flight[victim])} in flight) "
                            f"drains before {reason}",
                        )
                    )
                draining = list(step.draining)
                if step.remove:
                    new_replicas = current - step.remove
                    reason = f"{reason} ({step.outcome()})"
                    draining = []
                else:
                    left = step.busy or tuple((p, in_flight[p]) for p, _ in draining)
                    pods_text = ", ".join(f"pod {p} ({n:g} in flight)" for p, n in left)
                    reason = f"Draining: {pods_text} before {reason}"
        elif draining:
            for pod, _ in draining:
                self._mark(ns, pod, drain=False)  # demand came back: keep them
            draining = []
        if target > current:
            new_replicas = target
        if new_replicas != current:
            self._api.patch(
                API_VERSION, KIND, ns, name, {"spec": {"replicas": new_replicas}}, "scale"
            )
            log.info(
                "autoscaling %s/%s: %d -> %d replicas (%d held; decided in %.3fs): %s",
                ns, name, current, new_replicas, round(demand.held), self._clock() - now,
                reason,
            )  # fmt: skip
            kind = "ScaledUp" if new_replicas > current else "ScaledDown"
            if not reason.startswith(kind) and not (
                kind == "ScaledUp" and reason.startswith(LIMITED)
            ):
                reason = f"{kind}: {reason.split(': ', 1)[-1]}"
            message = f"{current} -> {new_replicas} replicas; {reason.split(': ', 1)[1]}"
            events.append(status.Transition("Normal", kind, message))
            self._metrics.autoscale_decisions.labels(
                namespace=ns, name=name, direction="up" if kind == "ScaledUp" else "down"
            ).inc()
        elif reason.startswith(LIMITED) and not str(old.get("reason") or "").startswith(LIMITED):
            message = f"stays at {current}; {reason.split(': ', 1)[1]}"
            events.append(status.Transition("Normal", LIMITED, message))
        new_status: dict[str, Any] = {
            "desiredReplicas": target,
            "wantedReplicas": decision.desired if target != decision.desired else None,
            "demandClasses": plan.demand_classes,
            "reason": reason,
            "lastScaleTime": (_stamp(now) if new_replicas != current else old.get("lastScaleTime")),
            "recommendations": [
                {"time": _stamp(t), "replicas": r} for t, r in decision.state.recommendations
            ],
            "idleSince": (
                _stamp(decision.state.idle_since) if decision.state.idle_since is not None else None
            ),
            "draining": [{"pod": p, "since": _stamp(t)} for p, t in draining] or None,
            "coldStartSeconds": plan.cold,
            "measuredColdStartSeconds": plan.measured,
            "demand": {**dict.fromkeys(_DEMAND_KEYS), **demand.as_status()},
        }
        self._condition(now, ns, name, body, "True", reason.split(":", 1)[0], reason, new_status)
        for transition in events:
            try:
                self._api.create(
                    event_object(body, transition, dt.datetime.fromtimestamp(now, dt.UTC))
                )
            except KubeError as e:
                log.warning("autoscaling event for %s/%s not posted: %s", ns, name, e)
        self._metrics.autoscale_desired.labels(namespace=ns, name=name).set(target)
        for signal, value in demand.as_status().items():
            self._metrics.autoscale_demand.labels(namespace=ns, name=name, signal=signal).set(value)
        return reason

    def _switched_off(self, body: Mapping[str, Any]) -> None:
        """``spec.autoscaling`` was removed: undo a drain in progress (a pod left
        annotated would get no work for good) and drop the autoscaler's status."""
        meta = body["metadata"]
        ns, name = str(meta["namespace"]), str(meta["name"])
        with self._reconciler.lock(ns, name):
            old = (body.get("status") or {}).get("autoscaling") or {}
            try:
                for d in _draining(old):
                    self._mark(ns, d["pod"], drain=False)
                conditions = [
                    dict(c)
                    for c in (body.get("status") or {}).get("conditions") or ()
                    if c and c.get("type") != _CONDITION
                ]
                self._reconciler.set_extra_conditions(ns, name, ())
                self._api.patch_status(
                    API_VERSION, KIND, ns, name, {"autoscaling": None, "conditions": conditions}
                )
            except KubeError as e:
                log.warning("autoscaling switched off for %s/%s: %s", ns, name, e)
            self._memory.pop((ns, name), None)

    def _mark(self, ns: str, pod: str, *, drain: bool) -> None:
        annotations: dict[str, Any] = (
            {ANNOTATION_DRAIN: "true", ANNOTATION_DELETION_COST: VICTIM_COST}
            if drain
            else {ANNOTATION_DRAIN: None, ANNOTATION_DELETION_COST: None}
        )
        self._api.patch("v1", "Pod", ns, pod, {"metadata": {"annotations": annotations}})

    def _condition(
        self,
        now: float,
        ns: str,
        name: str,
        body: Mapping[str, Any],
        value: str,
        reason: str,
        message: str,
        autoscaling: Mapping[str, Any] | None = None,
    ) -> None:
        old_status = body.get("status") or {}
        conditions = [dict(c) for c in old_status.get("conditions") or () if c]
        previous = next((c for c in conditions if c.get("type") == _CONDITION), None)
        since = _stamp(now)
        if previous is not None and previous.get("status") == value:
            since = str(previous.get("lastTransitionTime") or since)
        cond = {
            "type": _CONDITION,
            "status": value,
            "reason": reason,
            "message": message[:480],
            "lastTransitionTime": since,
            "observedGeneration": int(body["metadata"].get("generation", 0) or 0),
        }
        self._reconciler.set_extra_conditions(ns, name, (cond,))
        patch: dict[str, Any] = {
            "conditions": [c for c in conditions if c.get("type") != _CONDITION] + [cond]
        }
        if autoscaling is not None:
            patch["autoscaling"] = dict(autoscaling)
        if previous == cond and (autoscaling is None or _same(old_status, autoscaling)):
            return
        self._api.patch_status(API_VERSION, KIND, ns, name, patch)


def _group(body: Mapping[str, Any]) -> tuple[str, str]:
    """(pool, served model) of an InferenceService body (its raw spec; defaults as the
    CRD's)."""
    spec = body.get("spec") or {}
    model = (spec.get("model") or {}).get("name") or str(body["metadata"]["name"])
    return str((spec.get("routing") or {}).get("pool") or "default"), str(model)


def _same(old_status: Mapping[str, Any], new: Mapping[str, Any]) -> bool:
    """True when a merge patch of ``new`` would not change ``status.autoscaling``."""
    old = old_status.get("autoscaling") or {}
    for key, value in new.items():
        if isinstance(value, dict):
            inner = old.get(key) or {}
            if any(inner.get(k) != v for k, v in value.items()):
                return False
        elif old.get(key) != value:
            return False
    return True


def _key(body: Mapping[str, Any]) -> pools.Key:
    """(namespace, name) of an InferenceService body."""
    meta = body["metadata"]
    return str(meta["namespace"]), str(meta["name"])


def _less_what_comes_back(plan: _Plan, replicas: int, role: pools.Role) -> _Plan:
    """``plan`` (the serving role's, on every class's demand) with a scale-up cut by
    the ``replicas`` the pool's other role comes back with this tick, never below its
    replicas now: the next tick's decision takes only its own classes again."""
    d = plan.decision
    if d.desired <= plan.current or replicas <= 0:
        return plan
    desired = max(plan.current, d.desired - replicas)
    why = d.reason.split(": ", 1)[-1]
    note = f"; {replicas} of the {d.desired - plan.current} wanted come back on the {role} role"
    kind = "ScaledUp" if desired > plan.current else "Steady"
    return dataclasses.replace(
        plan, decision=dataclasses.replace(d, desired=desired, reason=f"{kind}: {why}{note}")
    )
