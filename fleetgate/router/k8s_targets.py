"""Kubernetes objects -> the fleet the router should have (pure: plain dicts in and out).

The watching itself (LIST/WATCH, credentials, the fleet's mutation) is
:mod:`fleetgate.router.discovery_k8s`; its docstring says what is watched and why.
Here: the router YAML's ``discovery.kubernetes`` settings, the join of addresses
(read from slices and pods by :mod:`fleetgate.router.k8s_addresses`) with their
InferenceServices into :class:`Target` endpoints (:func:`desired_targets`; each
with its engine release and served name), the difference between two target sets
(:func:`plan`) and the InferenceServices that scale from zero, known with no pod at
all (:func:`known_service`, :func:`scale_from_zero`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Iterable, Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from fleetgate.engines import UnknownEngineError, get_adapter
from fleetgate.engines.base import EngineAdapter, KvEventsEndpoint
from fleetgate.router.k8s_addresses import (
    ANNOTATION_ENGINE_VERSION,
    ANNOTATION_KV_EVENTS,
    ANNOTATION_SERVED_MODEL,
    Address,
    ObjKey,
    parse_kv_events_annotation,
)
from fleetgate.router.scheduling.types import EndpointId


class KubernetesDiscoveryConfig(BaseModel):
    """``discovery.kubernetes`` in the router's YAML."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    source: Literal["endpointslices", "pods"] = "endpointslices"
    """Where addresses come from. ``endpointslices`` (production; least data) or
    ``pods`` (same labels, read from the pods; needed where the API server refuses the
    addresses in slices, e.g. the loopback pod IPs of the kwok test cluster)."""
    namespaces: tuple[str, ...] = ()
    """Namespaces to watch; empty watches all (needs the chart's ClusterRole)."""
    pools: tuple[str, ...] = ()
    """Only InferenceServices of these ``routing.pool`` values; empty takes every pool."""
    roles: tuple[Literal["latency", "throughput"], ...] = ()
    """Only these ``routing.role`` values; empty takes both."""
    kubeconfig: str | None = None
    """Kubeconfig file; default: in-cluster ServiceAccount, else KUBECONFIG/~/.kube/config."""
    port_name: str = "http"
    """EndpointSlice port carrying the engine's OpenAI API (the operator names it http)."""
    watch_timeout_s: int = Field(240, ge=1, le=3600)
    """Server-side timeout of one WATCH request; it then resumes from its version."""
    retry_max_s: float = Field(10.0, gt=0)
    """Longest wait between retries after an API error (doubling from 0.25 s)."""
    initial_sync_s: float = Field(10.0, gt=0)
    """How long start-up waits for the first LIST before serving anyway."""
    drain_from_pods: bool = True
    """With ``source: endpointslices``, also watch the pods labelled ``fleetgate.dev/pool``
    for the ``fleetgate.dev/drain`` annotation (slices carry none); needs pods
    get/list/watch. The ``pods`` source reads it anyway."""


@dataclasses.dataclass(frozen=True, slots=True)
class Target:
    """One engine endpoint the fleet should contain."""

    id: EndpointId
    pool: str
    engine: str
    url: str
    capacity: int | None
    namespace: str
    service: str
    model: str
    """The served name clients use (``fleetgate.dev/served-model``)."""
    engine_version: str | None = None
    """The engine release (``fleetgate.dev/engine-version``; :func:`engine_version`)."""
    draining: bool = False
    """The pod is marked ``fleetgate.dev/drain: "true"`` (a flag on the live endpoint,
    changed in place: :attr:`Plan.drain`)."""
    kv_events: KvEventsEndpoint | None = None
    """Where the pod publishes KV-cache events (``fleetgate.dev/kv-events``; ``pods``
    source only: EndpointSlices carry no annotations)."""
    kv_events_error: str | None = None
    """Why a present ``fleetgate.dev/kv-events`` annotation was not usable."""
    schedulers: int = 1
    """Schedulers per replica (``EngineAdapter.schedulers``: attention-DP ranks)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Plan:
    """What to change in the fleet: removals first, then additions, then drain flags."""

    add: tuple[Target, ...]
    remove: tuple[EndpointId, ...]
    drain: tuple[tuple[EndpointId, bool], ...] = ()
    """Endpoints that stay, whose drain flag changed: set in place (a replaced endpoint
    would lose its in-flight count, the operator's "is it idle yet" signal)."""


@dataclasses.dataclass(frozen=True, slots=True)
class KnownService:
    """An InferenceService the router knows whether or not it has pods."""

    namespace: str
    name: str
    model: str
    """The served name clients use (``spec.model.name``, else the service's name)."""
    pool: str
    min_replicas: int | None
    """``spec.autoscaling.minReplicas`` (None: no autoscaling section, or no integer)."""
    cold_start_s: float | None
    """``spec.autoscaling.coldStartSeconds`` when a positive number, else None."""

    @property
    def autoscaled(self) -> bool:
        """Its replicas follow demand: the router holds its requests while none serves
        (at zero, or all of them starting), and the held count wakes the operator."""
        return self.min_replicas is not None


def _concurrency(adapter: EngineAdapter, spec: Mapping[str, Any]) -> tuple[int | None, int]:
    """The replica's concurrency limit (vLLM metrics do not carry it) and its schedulers,
    as its engine's adapter reads the InferenceService."""
    engine_spec = spec.get("engine") or {}
    settings = engine_spec.get(adapter.spec_key) if isinstance(engine_spec, Mapping) else None
    parallelism = spec.get("parallelism") or {}
    tensor = parallelism.get("tensor", 1) if isinstance(parallelism, Mapping) else 1
    if not isinstance(settings, Mapping):
        return None, 1
    tensor = tensor if isinstance(tensor, int) and not isinstance(tensor, bool) else 1
    return adapter.concurrency_limit(settings, tensor), adapter.schedulers(settings, tensor)


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if value > 0 and value == value and value != float("inf") else None


def known_service(
    isvc: Mapping[str, Any], config: KubernetesDiscoveryConfig
) -> KnownService | None:
    """What the router knows of an InferenceService with or without pods; None when it
    is being deleted or the pool/role filters leave it out.

    ``spec.autoscaling`` is read defensively from the raw object (any missing or
    ill-typed field is None), so the router needs no particular API revision.
    """
    meta = isvc.get("metadata") or {}
    if not isinstance(meta, Mapping) or meta.get("deletionTimestamp"):
        return None
    spec = isvc.get("spec") or {}
    if not isinstance(spec, Mapping):
        return None
    routing = spec.get("routing") or {}
    routing = routing if isinstance(routing, Mapping) else {}
    pool = str(routing.get("pool", "default"))
    role = str(routing.get("role", "latency"))
    if (config.pools and pool not in config.pools) or (config.roles and role not in config.roles):
        return None
    name = str(meta.get("name", ""))
    model = spec.get("model") or {}
    served = model.get("name") if isinstance(model, Mapping) else None
    auto = spec.get("autoscaling")
    auto = auto if isinstance(auto, Mapping) else {}
    low = auto.get("minReplicas")
    return KnownService(
        namespace=str(meta.get("namespace", "")),
        name=name,
        model=str(served) if isinstance(served, str) and served else name,
        pool=pool,
        min_replicas=low if isinstance(low, int) and not isinstance(low, bool) else None,
        cold_start_s=_number(auto.get("coldStartSeconds")),
    )


def standby_services(
    services: Iterable[Mapping[str, Any]], config: KubernetesDiscoveryConfig
) -> dict[str, KnownService]:
    """Served model -> the autoscaled InferenceService whose requests the router holds
    while no replica can serve them: at zero replicas (``minReplicas: 0``), and with
    ``minReplicas`` >= 1 while every replica is starting (a first start, a rollout of
    all replicas, a lost node), where a 503 at once told clients to go away for what
    the autoscaler is already fixing. Two such services with one model name: the
    first by namespace/name wins (the router holds for a model, not a service)."""
    known = [k for s in services if (k := known_service(s, config)) is not None]
    out: dict[str, KnownService] = {}
    for k in sorted(known, key=lambda k: (k.namespace, k.name)):
        if k.autoscaled:
            out.setdefault(k.model, k)
    return out


def engine_version(a: Address, engine_spec: Mapping[str, Any]) -> str | None:
    """The release an address's engine runs, as the operator wrote its arguments for.

    The pod's ``fleetgate.dev/engine-version`` annotation (``pods`` source: exact per
    pod, also mid-rollout); else, as the operator resolves it, the InferenceService's
    ``spec.engine.version``, else its image tag (``...release:1.0.0`` -> ``1.0.0``; a
    ``-suffix`` dropped). None when none is given; whether the adapter supports it is
    :func:`fleetgate.router.served.adapter_for`'s to say.
    """
    noted = a.annotation(ANNOTATION_ENGINE_VERSION)
    if noted:
        return noted
    declared = engine_spec.get("version")
    if isinstance(declared, str) and declared.strip():
        return declared.strip()
    image = engine_spec.get("image")
    if not isinstance(image, str):
        return None
    last = image.split("@", 1)[0].rsplit("/", 1)[-1]
    tag = last.split(":", 1)[1] if ":" in last else ""
    return tag.split("-", 1)[0] or None


def target_for(
    a: Address, isvc: Mapping[str, Any], config: KubernetesDiscoveryConfig
) -> Target | None:
    """The fleet entry for a ready address of InferenceService ``isvc``, or None."""
    spec = isvc.get("spec") or {}
    routing = spec.get("routing") or {}
    pool = str(routing.get("pool", "default"))
    role = str(routing.get("role", "latency"))
    if not a.ready or routing.get("weight", 100) == 0:
        return None
    if (config.pools and pool not in config.pools) or (config.roles and role not in config.roles):
        return None
    engine_spec = spec.get("engine") or {}
    try:
        adapter = get_adapter(str(engine_spec.get("type", "")))
    except UnknownEngineError:
        return None
    engine = adapter.name
    capacity, schedulers = _concurrency(adapter, spec)
    who = a.pod or f"{a.service}/{a.address}:{a.port}"
    host = f"[{a.address}]" if a.ipv6 else a.address
    kv_events, kv_error = None, None
    noted = a.annotation(ANNOTATION_KV_EVENTS)
    if noted:
        try:
            kv_events = parse_kv_events_annotation(noted)
        except ValueError as e:
            kv_error = str(e)
    return Target(
        id=EndpointId(f"{a.namespace}/{who}"),
        pool=pool,
        engine=engine,
        url=f"http://{host}:{a.port}",
        capacity=capacity,
        schedulers=schedulers,
        namespace=a.namespace,
        service=a.service,
        model=a.annotation(ANNOTATION_SERVED_MODEL)
        or str((spec.get("model") or {}).get("name") or a.service),
        engine_version=engine_version(a, engine_spec) if _versioned(engine) else None,
        draining=a.draining,
        kv_events=kv_events,
        kv_events_error=kv_error,
    )


def _versioned(engine: str) -> bool:
    """The engine's adapter binds to releases (``for_version``); others ignore versions."""
    return hasattr(get_adapter(engine), "for_version")


def desired_targets(
    addresses: Iterable[Address],
    services: Mapping[ObjKey, Mapping[str, Any]],
    config: KubernetesDiscoveryConfig,
    draining: Collection[ObjKey] = (),
) -> dict[EndpointId, Target]:
    """Join addresses to the InferenceService of the same namespace and name;
    ``draining`` marks the addresses of those pods (``endpointslices`` source)."""
    out: dict[EndpointId, Target] = {}
    for a in addresses:
        if draining and a.pod is not None and (a.namespace, a.pod) in draining:
            a = dataclasses.replace(a, draining=True)
        isvc = services.get((a.namespace, a.service))
        if isvc is None or (isvc.get("metadata") or {}).get("deletionTimestamp"):
            continue
        t = target_for(a, isvc, config)
        if t is not None:
            out.setdefault(t.id, t)  # listed by two slices mid-update: one entry
    return out


def plan(current: Mapping[EndpointId, Target], desired: Mapping[EndpointId, Target]) -> Plan:
    """Changed targets (new IP, engine, pool...) are removed and added again; a change
    of the drain flag alone is made in place (:attr:`Plan.drain`)."""

    def same(a: Target | None, b: Target | None) -> bool:
        if a is None or b is None:
            return a is b
        return dataclasses.replace(a, draining=b.draining) == b

    remove = tuple(sorted(eid for eid, t in current.items() if not same(desired.get(eid), t)))
    add = tuple(t for eid, t in sorted(desired.items()) if not same(current.get(eid), t))
    drain = tuple(
        (eid, t.draining)
        for eid, t in sorted(desired.items())
        if eid in current and same(current[eid], t) and current[eid].draining != t.draining
    )
    return Plan(add=add, remove=remove, drain=drain)
