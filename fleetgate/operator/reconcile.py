"""One level-based reconcile of one ``InferenceService``: read, compare, apply, report.

The kopf handlers (:mod:`fleetgate.operator.handlers`) call :meth:`Reconciler.reconcile`
on every watch event of the service or of one of its children, and :class:`Resync`
calls it for every service periodically; it always does the same thing regardless
of *why* it was called:

1. parse the spec with the API models (refused -> ``InvalidSpec``, no retry loop:
   the status says why and the next spec change is picked up by the watch);
2. build the children (pure, :mod:`fleetgate.operator.manifests`);
3. for each child, GET the live object and server-side apply only when
   :func:`fleetgate.operator.diff.needs_apply` says so: an unchanged spec causes
   no writes, a deleted or edited child is restored (drift), a restarted operator
   finds everything in place and writes nothing (no duplicates: names are fixed);
4. delete optional children that are no longer wanted (TensorRT-LLM ConfigMap
   after an engine switch, ServiceMonitor when disabled);
5. read the Deployment and its pods, compute the status
   (:mod:`fleetgate.operator.status`), patch it only when it changed, and post a
   Kubernetes Event for each transition.

API errors never crash the loop: they become ``ApplyFailed`` in status (with the
API server's own message) and the next timer tick retries. A child whose name is
taken by an object we do not control is left alone (``NameConflict``).

Concurrency: handlers run in kopf's thread pool, so one lock per object keeps two
reconciles of the same service from interleaving. Time is injected (``clock``,
``monotonic``).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from pydantic import ValidationError

from fleetgate.api.v1alpha1 import GROUP, KIND, VERSION, InferenceServiceSpec, check_name
from fleetgate.engines.base import EngineError, EngineVersionError
from fleetgate.operator import diff, manifests, status
from fleetgate.operator.kube import KubeApi, KubeError, NotFound
from fleetgate.operator.metrics import OperatorMetrics
from fleetgate.operator.options import OperatorOptions

__all__ = ["Outcome", "Reconciler", "Resync", "event_object", "readable_validation_error"]

log = logging.getLogger(__name__)

API_VERSION = f"{GROUP}/{VERSION}"
_OPTIONAL_KINDS = (
    ("v1", "ConfigMap", "{name}-engine-config"),
    ("monitoring.coreos.com/v1", "ServiceMonitor", "{name}"),
)
_SERVICE_MONITOR_RECHECK_SECONDS = 300.0


@dataclasses.dataclass(frozen=True, slots=True)
class Outcome:
    """What one reconcile did (for logs, metrics and tests)."""

    reason: str
    writes: tuple[str, ...]
    """``Kind/name`` of every child applied or deleted."""
    status_written: bool
    events: tuple[status.Transition, ...]


def readable_validation_error(err: ValidationError) -> str:
    """``spec.a.b: message; ...`` from a pydantic error, short enough for a condition."""
    parts = []
    for item in err.errors()[:3]:
        where = ".".join(str(p) for p in item["loc"])
        msg = str(item["msg"]).removeprefix("Value error, ")
        parts.append(f"spec.{where}: {msg}" if where else f"spec: {msg}")
    return "; ".join(parts)


def event_object(
    body: Mapping[str, Any], transition: status.Transition, now: dt.datetime
) -> dict[str, Any]:
    """A core/v1 Event about the InferenceService ``body``."""
    meta = body["metadata"]
    stamp = status.format_time(now)
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
        "involvedObject": {
            "apiVersion": API_VERSION,
            "kind": KIND,
            "name": meta["name"],
            "namespace": meta["namespace"],
            "uid": meta.get("uid", ""),
        },
        "type": transition.type,
        "reason": transition.reason,
        "message": transition.message,
        "source": {"component": manifests.MANAGED_BY},
        "reportingComponent": manifests.MANAGED_BY,
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "count": 1,
    }


def _is_ours(live: Mapping[str, Any], uid: str) -> bool:
    refs = (live.get("metadata") or {}).get("ownerReferences") or []
    return any(r.get("uid") == uid and r.get("controller") for r in refs)


class Reconciler:
    """Reconciles InferenceServices through a :class:`KubeApi`."""

    def __init__(
        self,
        api: KubeApi,
        options: OperatorOptions,
        metrics: OperatorMetrics,
        *,
        clock: Callable[[], dt.datetime] = lambda: dt.datetime.now(dt.UTC),
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._api = api
        self._options = options
        self._metrics = metrics
        self._clock = clock
        self._monotonic = monotonic
        self._locks: dict[tuple[str, str], threading.Lock] = {}
        self._locks_guard = threading.Lock()
        # None (absent): keep what status has (an autoscaler that has not decided yet)
        self._extra_conditions: dict[tuple[str, str], tuple[dict[str, Any], ...]] = {}
        self._sm_supported: bool | None = None
        self._sm_checked_at = 0.0

    def _lock(self, namespace: str, name: str) -> threading.Lock:
        with self._locks_guard:
            return self._locks.setdefault((namespace, name), threading.Lock())

    def lock(self, namespace: str, name: str) -> threading.Lock:
        """The lock one service's reconciles and autoscaling decisions share."""
        return self._lock(namespace, name)

    def set_extra_conditions(
        self, namespace: str, name: str, conditions: tuple[dict[str, Any], ...]
    ) -> None:
        """Conditions owned elsewhere (the autoscaler's) that every status write keeps,
        even when the body a reconcile got predates them."""
        self._extra_conditions[(namespace, name)] = conditions

    def forget(self, namespace: str, name: str) -> None:
        """The InferenceService is gone: drop its lock and metrics series."""
        with self._locks_guard:
            self._locks.pop((namespace, name), None)
        self._extra_conditions.pop((namespace, name), None)
        self._metrics.forget(namespace, name)

    def _service_monitor_supported(self) -> bool:
        now = self._monotonic()
        stale = now - self._sm_checked_at > _SERVICE_MONITOR_RECHECK_SECONDS
        if self._sm_supported is None or stale:
            self._sm_supported = self._api.kind_exists("monitoring.coreos.com/v1", "ServiceMonitor")
            self._sm_checked_at = now
        return self._sm_supported

    def reconcile_by_name(self, namespace: str, name: str) -> Outcome | None:
        """Reconcile the named InferenceService (a child changed); None if it is gone."""
        try:
            body = self._api.get(API_VERSION, KIND, namespace, name)
        except KubeError as e:
            log.warning("cannot read %s/%s: %s", namespace, name, e)
            return None
        return None if body is None else self.reconcile(body)

    def reconcile(self, body: Mapping[str, Any]) -> Outcome | None:
        """Bring one InferenceService's children and status in line; None if deleting."""
        meta = body.get("metadata", {})
        if meta.get("deletionTimestamp"):
            return None
        namespace, name = str(meta["namespace"]), str(meta["name"])
        started = self._monotonic()
        with self._lock(namespace, name):
            if (body.get("spec") or {}).get("autoscaling"):
                # The autoscaler writes spec.replicas between watch events: a body queued
                # before its write would put the old count back on the Deployment (and
                # the ReplicaSet would add a pod, then remove one that was not drained).
                try:
                    fresh = self._api.get(API_VERSION, KIND, namespace, name)
                except KubeError as e:
                    log.warning("cannot re-read %s/%s: %s", namespace, name, e)
                    return None
                if fresh is None or (fresh.get("metadata") or {}).get("deletionTimestamp"):
                    return None
                body = fresh
            outcome = self._reconcile(body)
        self._metrics.duration.observe(max(0.0, self._monotonic() - started))
        result = {
            "InvalidSpec": "invalid",
            "UnknownEngineVersion": "invalid",
            "ApplyFailed": "error",
        }.get(outcome.reason, "ok")
        self._metrics.reconciles.labels(result=result).inc()
        if outcome.reason in status.DEGRADED_REASONS:
            self._metrics.errors.labels(reason=outcome.reason).inc()
        return outcome

    def _reconcile(self, body: Mapping[str, Any]) -> Outcome:
        meta = body["metadata"]
        name, namespace = str(meta["name"]), str(meta["namespace"])
        owner = manifests.Owner(name=name, namespace=namespace, uid=str(meta.get("uid", "")))
        generation = int(meta.get("generation", 0) or 0)
        base = status.Observation(
            name=name,
            generation=generation,
            desired_replicas=0,
            selector=manifests.selector_string(name),
        )
        rep = dataclasses.replace
        writes: list[str] = []
        bad_name = check_name(name)  # created before the CRD refused such names
        if bad_name is not None:
            return self._report(
                body, rep(base, failure_reason="InvalidSpec", failure_message=bad_name), writes
            )
        try:
            spec = InferenceServiceSpec.model_validate(body.get("spec") or {})
        except ValidationError as e:
            obs = rep(
                base,
                failure_reason="InvalidSpec",
                failure_message=readable_validation_error(e),
            )
            return self._report(body, obs, writes)
        base = rep(base, gpu_resource=spec.gpu.resource_name, desired_replicas=spec.replicas)
        try:
            children = manifests.build_children(
                owner,
                spec,
                self._options,
                service_monitor_supported=(
                    spec.metrics.service_monitor and self._service_monitor_supported()
                ),
            )
        except EngineError as e:
            reason = "UnknownEngineVersion" if isinstance(e, EngineVersionError) else "InvalidSpec"
            obs = rep(base, failure_reason=reason, failure_message=str(e))
            return self._report(body, obs, writes)
        except KubeError as e:
            obs = rep(base, failure_reason="ApplyFailed", failure_message=f"discovery: {e.message}")
            return self._report(body, obs, writes)
        base = rep(
            base,
            url=manifests.service_url(
                name, namespace, children.plan.port, self._options.cluster_domain
            ),
            served_model=children.served_model,
            engine=spec.engine.type,
        )
        deployment: dict[str, Any] | None = None
        try:
            try:
                deployment = self._ensure_all(children, owner, writes)
            except _MonitorKindGone:
                # Discovery still advertised ServiceMonitor but the CRD is gone (just
                # uninstalled): remember that and carry on without it.
                self._sm_supported, self._sm_checked_at = False, self._monotonic()
                children = dataclasses.replace(
                    children,
                    objects=tuple(o for o in children.objects if o["kind"] != "ServiceMonitor"),
                )
                deployment = self._ensure_all(children, owner, writes)
            self._prune(children, owner, writes)
            pods = self._api.list("v1", "Pod", namespace, manifests.selector_string(name))
        except _NameTaken as e:
            obs = rep(base, failure_reason="NameConflict", failure_message=str(e))
            return self._report(body, obs, writes)
        except KubeError as e:
            detail = f"{e.message} (HTTP {e.status})" if e.status else e.message
            obs = rep(base, failure_reason="ApplyFailed", failure_message=detail)
            return self._report(body, obs, writes)
        obs = rep(base, deployment=deployment, pods=pods)
        ready = int(((deployment or {}).get("status") or {}).get("readyReplicas", 0) or 0)
        self._metrics.replicas_ready.labels(namespace=namespace, name=name).set(ready)
        return self._report(body, obs, writes)

    def _ensure_all(
        self, children: manifests.Children, owner: manifests.Owner, writes: list[str]
    ) -> dict[str, Any] | None:
        """Ensure every child; returns the live Deployment."""
        deployment = None
        for obj in children.objects:
            live = self._ensure(obj, owner, writes)
            if obj["kind"] == "Deployment":
                deployment = live
        return deployment

    def _ensure(
        self, obj: Mapping[str, Any], owner: manifests.Owner, writes: list[str]
    ) -> dict[str, Any]:
        kind, child = str(obj["kind"]), str(obj["metadata"]["name"])
        stamped = diff.stamp(obj)
        try:
            live = self._api.get(obj["apiVersion"], kind, owner.namespace, child)
        except NotFound as e:
            if kind == "ServiceMonitor":
                raise _MonitorKindGone from e
            raise KubeError(e.status, f"{kind} {child}: {e.message}") from e
        except KubeError as e:
            raise KubeError(e.status, f"{kind} {child}: {e.message}") from e
        if live is not None and not _is_ours(live, owner.uid):
            raise _NameTaken(
                f"{kind} {child} already exists and is not owned by this InferenceService; "
                "rename the InferenceService or delete that object"
            )
        if not diff.needs_apply(stamped, live):
            assert live is not None
            return live
        try:
            applied = self._api.apply(stamped, self._options.field_manager)
        except NotFound as e:
            if kind == "ServiceMonitor":
                raise _MonitorKindGone from e
            raise KubeError(e.status, f"{kind} {child} was refused: {e.message}") from e
        except KubeError as e:
            raise KubeError(e.status, f"{kind} {child} was refused: {e.message}") from e
        writes.append(f"{kind}/{child}")
        self._metrics.writes.labels(kind=kind).inc()
        return applied

    def _prune(
        self, children: manifests.Children, owner: manifests.Owner, writes: list[str]
    ) -> None:
        wanted = {(o["kind"], o["metadata"]["name"]) for o in children.objects}
        for api_version, kind, pattern in _OPTIONAL_KINDS:
            child = pattern.format(name=owner.name)
            if (kind, child) in wanted:
                continue
            if kind == "ServiceMonitor" and not self._sm_supported:
                continue
            live = self._api.get(api_version, kind, owner.namespace, child)
            if live is not None and _is_ours(live, owner.uid):
                self._api.delete(api_version, kind, owner.namespace, child)
                writes.append(f"-{kind}/{child}")

    def _report(
        self, body: Mapping[str, Any], obs: status.Observation, writes: list[str]
    ) -> Outcome:
        meta = body["metadata"]
        now = self._clock()
        previous = body.get("status") or {}
        extra = self._extra_conditions.get((meta["namespace"], meta["name"]))
        if extra is None and not (body.get("spec") or {}).get("autoscaling"):
            extra = ()  # not autoscaled (any more): no Autoscaling condition
        report = status.compute_status(obs, previous, now, extra)
        written = False
        if _differs(report.status, previous):
            try:
                self._api.patch_status(
                    API_VERSION, KIND, meta["namespace"], meta["name"], report.status
                )
                written = True
            except KubeError as e:
                log.warning("status of %s/%s not written: %s", meta["namespace"], meta["name"], e)
        if written:
            for transition in report.transitions:
                try:
                    self._api.create(event_object(body, transition, now))
                except KubeError as e:
                    log.warning("event for %s not posted: %s", meta["name"], e)
        return Outcome(
            reason=report.reason,
            writes=tuple(writes),
            status_written=written,
            events=report.transitions if written else (),
        )


class Resync:
    """Re-check every InferenceService every ``interval`` seconds until stopped.

    The level-based safety net: whatever the watches missed (a pod that became
    unschedulable, a child we do not watch, a lost event) is found here. One bad
    object never stops the loop: its error is logged and the next one goes on.
    """

    def __init__(
        self,
        api: KubeApi,
        reconciler: Reconciler,
        namespaces: tuple[str, ...],
        interval: float,
        stop: threading.Event,
    ) -> None:
        self._api = api
        self._reconciler = reconciler
        self._namespaces = namespaces or ("",)
        self._interval = interval
        self._stop = stop

    def run_once(self) -> int:
        """One pass over all services; returns how many were reconciled."""
        done = 0
        for namespace in self._namespaces:
            try:
                bodies = self._api.list(API_VERSION, KIND, namespace, "")
            except KubeError as e:
                log.warning("resync: cannot list InferenceServices in %r: %s", namespace, e)
                continue
            for body in bodies:
                if self._stop.is_set():
                    return done
                try:
                    self._reconciler.reconcile(body)
                    done += 1
                except Exception:
                    meta = body.get("metadata", {})
                    log.exception("resync of %s/%s failed", meta.get("namespace"), meta.get("name"))
        return done

    def run(self) -> None:
        """Loop until the stop event is set (first pass after one interval)."""
        while not self._stop.wait(self._interval):
            self.run_once()


class _NameTaken(Exception):
    pass


class _MonitorKindGone(Exception):
    """The API server no longer serves ServiceMonitor (404 on it)."""


def _differs(new: Mapping[str, Any], old: Mapping[str, Any]) -> bool:
    """True when the operator-owned status keys differ (other keys are left alone)."""
    return any(old.get(k) != v for k, v in new.items())
