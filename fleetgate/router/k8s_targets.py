"""Kubernetes objects -> the fleet the router should have (pure: plain dicts in and out).

The watching itself (LIST/WATCH, credentials, the fleet's mutation) is
:mod:`fleetgate.router.discovery_k8s`; its docstring says what is watched and why.
Here: the router YAML's ``discovery.kubernetes`` settings, the addresses of one
EndpointSlice or pod, the join of addresses with their InferenceServices into
:class:`Target` endpoints (:func:`desired_targets`), the difference between two
target sets (:func:`plan`), the cache one LIST+WATCH keeps (:class:`WatchCache`:
a 410 Gone or an ERROR event raises, for the reflector to relist), the pods marked
for removal (``fleetgate.dev/drain: "true"``: :func:`draining_pods`) and the
InferenceServices that scale from zero, known with no pod at all
(:func:`known_service`, :func:`scale_from_zero`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Collection, Iterable, Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from fleetgate.engines import UnknownEngineError, get_adapter
from fleetgate.engines.base import KvEventsEndpoint
from fleetgate.router.scheduling.types import EndpointId

# The operator's discovery labels (fleetgate/operator/manifests.py). Copied, not
# imported: router and operator are independent packages (import-linter contract);
# tests/router/test_discovery_k8s.py checks that both sides agree.
LABEL_POOL = "fleetgate.dev/pool"
LABEL_MODEL = "fleetgate.dev/model"
LABEL_ENGINE = "fleetgate.dev/engine"
LABEL_ROLE = "fleetgate.dev/role"
LABEL_SERVICE_NAME = "kubernetes.io/service-name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
ANNOTATION_SERVED_MODEL = "fleetgate.dev/served-model"
ANNOTATION_ENGINE_VERSION = "fleetgate.dev/engine-version"
ANNOTATION_DRAIN = "fleetgate.dev/drain"
"""``"true"`` on a pod: the autoscaler chose it for removal; routers send it no new
work and its in-flight requests finish (``fleetgate_endpoint_in_flight`` reaches 0)."""
ANNOTATION_KV_EVENTS = "fleetgate.dev/kv-events"
ISVC_GROUP_VERSION = "fleetgate.dev/v1alpha1"
ISVC_PLURAL = "inferenceservices"

ObjKey = tuple[str, str]
"""(namespace, name)"""


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
    def scales_from_zero(self) -> bool:
        return self.min_replicas == 0


def _capacity(engine_spec: Mapping[str, Any]) -> int | None:
    """Concurrency limit from the InferenceService (vLLM metrics do not carry it)."""
    for section, field in (("vllm", "maxNumSeqs"), ("tensorrtLlm", "maxBatchSize")):
        value = (engine_spec.get(section) or {}).get(field)
        if isinstance(value, int) and value > 0:
            return value
    return None


@dataclasses.dataclass(frozen=True, slots=True)
class Address:
    """One engine address seen by either source, before the InferenceService join."""

    namespace: str
    service: str
    pod: str | None
    address: str
    ipv6: bool
    port: int
    ready: bool
    draining: bool = False
    """Marked for removal (``fleetgate.dev/drain: "true"`` on the pod)."""
    annotations: tuple[tuple[str, str], ...] = ()
    """The operator's discovery annotations of the pod (``pods`` source; slices have
    none), sorted."""

    def annotation(self, key: str) -> str | None:
        return next((v for k, v in self.annotations if k == key), None)


def addresses_from_slice(eps: Mapping[str, Any], port_name: str) -> list[Address]:
    """EndpointSlice -> addresses (``conditions.ready`` unset counts as ready)."""
    meta = eps.get("metadata") or {}
    service = (meta.get("labels") or {}).get(LABEL_SERVICE_NAME)
    kind = eps.get("addressType")
    ports = [p for p in eps.get("ports") or [] if isinstance(p.get("port"), int)]
    chosen = [p for p in ports if p.get("name") == port_name] or (ports if len(ports) == 1 else [])
    if not service or kind not in ("IPv4", "IPv6") or not chosen:
        return []
    out = []
    for ep in eps.get("endpoints") or []:
        ref = ep.get("targetRef") or {}
        for address in (ep.get("addresses") or [])[:1]:
            out.append(
                Address(
                    namespace=str(meta.get("namespace", "")),
                    service=str(service),
                    pod=ref.get("name") if ref.get("kind") == "Pod" else None,
                    address=str(address),
                    ipv6=kind == "IPv6",
                    port=int(chosen[0]["port"]),
                    ready=(ep.get("conditions") or {}).get("ready") is not False,
                )
            )
    return out


def addresses_from_pod(pod: Mapping[str, Any], port_name: str) -> list[Address]:
    """Pod -> its address: ready when the Ready condition is True and it is not terminating.

    The operator's pods carry ``app.kubernetes.io/instance: NAME`` (the Service's
    selector), which names the InferenceService.
    """
    meta = pod.get("metadata") or {}
    service = (meta.get("labels") or {}).get(LABEL_INSTANCE)
    status = pod.get("status") or {}
    ip = status.get("podIP")
    ports = [
        p
        for c in (pod.get("spec") or {}).get("containers") or []
        for p in c.get("ports") or []
        if p.get("name") == port_name and isinstance(p.get("containerPort"), int)
    ]
    if not service or not ip or not ports:
        return []
    ready = any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in status.get("conditions") or []
    )
    notes = meta.get("annotations") or {}
    if not isinstance(notes, Mapping):
        notes = {}
    annotations = tuple(
        sorted(
            (k, str(notes[k]))
            for k in (ANNOTATION_SERVED_MODEL, ANNOTATION_ENGINE_VERSION, ANNOTATION_KV_EVENTS)
            if notes.get(k)
        )
    )
    return [
        Address(
            namespace=str(meta.get("namespace", "")),
            service=str(service),
            pod=str(meta.get("name", "")),
            address=str(ip),
            ipv6=":" in str(ip),
            port=int(ports[0]["containerPort"]),
            ready=ready and not meta.get("deletionTimestamp"),
            draining=marked_draining(notes),
            annotations=annotations,
        )
    ]


def marked_draining(annotations: Mapping[str, Any]) -> bool:
    """``fleetgate.dev/drain: "true"`` (any case, surrounding blanks ignored)."""
    value = annotations.get(ANNOTATION_DRAIN)
    return isinstance(value, str) and value.strip().lower() == "true"


def draining_pods(pods: Iterable[Mapping[str, Any]]) -> frozenset[ObjKey]:
    """(namespace, name) of the pods marked for removal: the ``endpointslices`` source
    joins them to slice addresses by ``targetRef`` (slices carry no annotations)."""
    out = set()
    for p in pods:
        meta = p.get("metadata") or {}
        notes = meta.get("annotations") or {}
        if isinstance(notes, Mapping) and marked_draining(notes):
            out.add((str(meta.get("namespace", "")), str(meta.get("name", ""))))
    return frozenset(out)


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


def scale_from_zero(
    services: Iterable[Mapping[str, Any]], config: KubernetesDiscoveryConfig
) -> dict[str, KnownService]:
    """Served model -> the InferenceService that may run it at zero replicas
    (``spec.autoscaling.minReplicas: 0``). Two such services with one model name: the
    first by namespace/name wins (the router holds for a model, not a service)."""
    known = [k for s in services if (k := known_service(s, config)) is not None]
    out: dict[str, KnownService] = {}
    for k in sorted(known, key=lambda k: (k.namespace, k.name)):
        if k.scales_from_zero:
            out.setdefault(k.model, k)
    return out


def parse_kv_events_annotation(value: str) -> KvEventsEndpoint:
    """The operator's ``fleetgate.dev/kv-events`` JSON -> where the pod publishes.

    ``{"transport": "zmq", "format", "port", "replayPort"?, "topic"?}`` or
    ``{"transport": "http-drain", "format", "path"}`` (``manifests.kv_events_annotation``).
    Raises ``ValueError`` with one line saying what is wrong.
    """
    try:
        data = json.loads(value)
    except ValueError:
        raise ValueError(f"{ANNOTATION_KV_EVENTS} is not JSON: {value[:80]!r}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{ANNOTATION_KV_EVENTS} must be a JSON object")
    known = {"transport", "format", "port", "replayPort", "topic", "path"}
    if unknown := sorted(set(data) - known):
        raise ValueError(f"{ANNOTATION_KV_EVENTS}: unknown field(s) {', '.join(unknown)}")
    transport = data.get("transport")
    fmt = data.get("format")
    if not isinstance(fmt, str) or not fmt:
        raise ValueError(f"{ANNOTATION_KV_EVENTS}: format must be a non-empty string")

    def port(name: str) -> int | None:
        v = data.get(name)
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 65535:
            raise ValueError(f"{ANNOTATION_KV_EVENTS}: {name} must be a port 1-65535, not {v!r}")
        return v

    topic = data.get("topic", "")
    if not isinstance(topic, str):
        raise ValueError(f"{ANNOTATION_KV_EVENTS}: topic must be a string")
    if transport == "zmq":
        pub = port("port")
        if pub is None:
            raise ValueError(f"{ANNOTATION_KV_EVENTS}: transport zmq needs port")
        return KvEventsEndpoint("zmq", fmt, port=pub, replay_port=port("replayPort"), topic=topic)
    if transport == "http-drain":
        path = data.get("path")
        if not isinstance(path, str) or not path.startswith("/"):
            raise ValueError(f"{ANNOTATION_KV_EVENTS}: transport http-drain needs a /path")
        return KvEventsEndpoint("http-drain", fmt, path=path)
    raise ValueError(f"{ANNOTATION_KV_EVENTS}: unknown transport {transport!r}")


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
        engine = get_adapter(str(engine_spec.get("type", ""))).name
    except UnknownEngineError:
        return None
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
        capacity=_capacity(engine_spec),
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


class Gone(Exception):
    """The watched resourceVersion is too old (HTTP 410): list again."""


class WatchError(Exception):
    """The API server sent an ERROR event other than 410, or garbage."""


class WatchCache:
    """Objects of one LIST+WATCH, keyed by (namespace, name), and the last version."""

    def __init__(self) -> None:
        self.objects: dict[ObjKey, dict[str, Any]] = {}
        self.resource_version: str | None = None

    @staticmethod
    def key(obj: Mapping[str, Any]) -> ObjKey:
        meta = obj.get("metadata") or {}
        return (str(meta.get("namespace", "")), str(meta.get("name", "")))

    def replace(self, items: Iterable[dict[str, Any]], resource_version: str) -> None:
        """A complete LIST result: the new truth, swapped in at once."""
        self.objects = {self.key(o): o for o in items}
        self.resource_version = resource_version

    def apply(self, event: Mapping[str, Any]) -> bool:
        """Apply one watch event; True when the object set changed."""
        kind = event.get("type")
        obj = event.get("object")
        if not isinstance(obj, dict):
            raise WatchError(f"watch event without an object: {str(event)[:200]}")
        if kind == "ERROR":
            if obj.get("code") == 410 or obj.get("reason") in ("Expired", "Gone"):
                raise Gone(str(obj.get("message", "resource version too old")))
            raise WatchError(f"watch error: {str(obj.get('message', obj))[:200]}")
        rv = (obj.get("metadata") or {}).get("resourceVersion")
        if rv:
            self.resource_version = str(rv)
        if kind == "BOOKMARK":
            return False
        if kind in ("ADDED", "MODIFIED"):
            self.objects[self.key(obj)] = obj
            return True
        if kind == "DELETED":
            return self.objects.pop(self.key(obj), None) is not None
        raise WatchError(f"unknown watch event type {kind!r}")
