"""Kubernetes objects -> engine addresses (pure: plain dicts in and out).

The labels and annotations the operator puts on what it creates
(``fleetgate/operator/manifests.py``), and what the router reads from one object:
the addresses of an EndpointSlice (:func:`addresses_from_slice`) or a pod
(:func:`addresses_from_pod`, with the pod's discovery annotations), the pods
marked for removal (``fleetgate.dev/drain: "true"``: :func:`draining_pods`) and
where a pod publishes its KV-cache events (:func:`parse_kv_events_annotation`).
The join of addresses with their InferenceServices is
:mod:`fleetgate.router.k8s_targets`; why and how the objects are watched,
:mod:`fleetgate.router.discovery_k8s`.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping
from typing import Any

from fleetgate.engines.base import MAX_KV_RANKS, KvEventsEndpoint

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
    known = {"transport", "format", "port", "replayPort", "topic", "path", "ranks", "rankChoice"}
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
    ranks = data.get("ranks", 1)
    if isinstance(ranks, bool) or not isinstance(ranks, int) or not 1 <= ranks <= MAX_KV_RANKS:
        raise ValueError(f"{ANNOTATION_KV_EVENTS}: ranks must be 1-{MAX_KV_RANKS}, not {ranks!r}")
    choice = data.get("rankChoice", "load")
    if choice not in ("load", "cache"):
        raise ValueError(f"{ANNOTATION_KV_EVENTS}: rankChoice must be load or cache")
    if transport == "zmq":
        pub = port("port")
        if pub is None:
            raise ValueError(f"{ANNOTATION_KV_EVENTS}: transport zmq needs port")
        replay = port("replayPort")
        if max(pub, replay or 0) + ranks - 1 > 65535:
            raise ValueError(f"{ANNOTATION_KV_EVENTS}: {ranks} ranks run past port 65535")
        if replay is not None and abs(replay - pub) < ranks:
            raise ValueError(
                f"{ANNOTATION_KV_EVENTS}: {ranks} ranks from port {pub} and replayPort "
                f"{replay} overlap"
            )
        return KvEventsEndpoint(
            "zmq", fmt, port=pub, replay_port=replay, topic=topic, ranks=ranks, rank_choice=choice
        )
    if transport == "http-drain":
        path = data.get("path")
        if not isinstance(path, str) or not path.startswith("/"):
            raise ValueError(f"{ANNOTATION_KV_EVENTS}: transport http-drain needs a /path")
        return KvEventsEndpoint("http-drain", fmt, path=path, ranks=ranks, rank_choice=choice)
    raise ValueError(f"{ANNOTATION_KV_EVENTS}: unknown transport {transport!r}")
