"""Pure builders: an ``InferenceService`` spec in, the child objects (plain dicts) out.

Builders here never touch a client (the split of Crate's operator);
:mod:`fleetgate.operator.reconcile` applies what they return. Everything
engine-specific (command, args, probe paths, metrics path, shared memory, config
files) comes from the engine adapter's :meth:`~fleetgate.engines.base.EngineAdapter.container`
(``fleetgate/engines/``); this module only turns that plan into Kubernetes objects.

Children of ``InferenceService`` NAME, all in its namespace, all with a controller
owner reference to it (so the garbage collector deletes them with it):

* Deployment NAME: the engine pods.
* Service NAME: ClusterIP on the engine port (the router and status.url use it).
* PodDisruptionBudget NAME: at most one engine pod evicted at a time.
* ConfigMap NAME-engine-config: only when the engine needs config files
  (TensorRT-LLM's YAML); its content hash is a pod annotation so edits roll pods.
* ServiceMonitor NAME: only when asked for *and* the CRD exists (the caller says).

Invariants:

* Deterministic: the same input yields equal dicts, so the reconciler can compare
  desired with live and skip writes when nothing changed.
* The Deployment selector (:func:`selector_labels`) never depends on mutable spec
  fields, because a Deployment's selector is immutable.
* Pods and the Service carry the labels the router discovers by
  (``fleetgate.dev/{pool,model,engine,role}``, weight as an annotation) plus the
  ``app.kubernetes.io/*`` recommended labels.
* Probes: a startup probe sized by the startup budget guards the slow model
  load (fixed initial delays sent big models into CrashLoopBackOff:
  kserve/kserve#5062); readiness and liveness only start once it has passed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
from collections.abc import Mapping
from typing import Any

from fleetgate.api.v1alpha1 import GROUP, KIND, VERSION, InferenceServiceSpec
from fleetgate.engines import get_adapter
from fleetgate.engines.base import (
    ContainerPlan,
    EngineAdapter,
    KvEventsEndpoint,
    LaunchSpec,
    Probe,
)
from fleetgate.operator.options import OperatorOptions

__all__ = [
    "ENGINE_PORT",
    "LABEL_ENGINE",
    "LABEL_MODEL",
    "LABEL_POOL",
    "LABEL_ROLE",
    "ANNOTATION_ENGINE_VERSION",
    "ANNOTATION_KV_EVENTS",
    "ANNOTATION_WEIGHT",
    "Children",
    "Owner",
    "build_children",
    "common_labels",
    "label_value",
    "model_location",
    "selector_labels",
    "selector_string",
    "service_url",
]

ENGINE_PORT = 8000
CONTAINER_NAME = "engine"
MODEL_CACHE_PATH = "/models"
MODEL_SOURCE_PATH = "/mnt/models"

LABEL_POOL = "fleetgate.dev/pool"
LABEL_MODEL = "fleetgate.dev/model"
LABEL_ENGINE = "fleetgate.dev/engine"
LABEL_ROLE = "fleetgate.dev/role"
ANNOTATION_WEIGHT = "fleetgate.dev/weight"
ANNOTATION_SERVED_MODEL = "fleetgate.dev/served-model"
ANNOTATION_METRICS_PATH = "fleetgate.dev/metrics-path"
ANNOTATION_CONFIG_HASH = "fleetgate.dev/config-hash"
#: The engine release line the arguments were written for (only for engines whose
#: flags and request fields differ by release, e.g. TensorRT-LLM ``1.0``).
ANNOTATION_ENGINE_VERSION = "fleetgate.dev/engine-version"
#: Where each replica publishes KV-cache events (absent: events off), as compact JSON
#: ``{"transport", "format", "port"?, "replayPort"?, "topic"?, "path"?, "ranks"?,
#: "rankChoice"?}``: ``zmq`` sockets on the pod IP (also the named container ports
#: ``kv-events`` and ``kv-replay``; attention-DP rank r > 0: ``kv-events-r`` and
#: ``kv-replay-r`` on the base ports + r), or ``http-drain`` = ``POST path`` on the
#: engine's HTTP port. ``format`` names the decoder (the engine adapter's
#: ``decode_kv_events``); ``ranks`` and ``rankChoice`` only when there are several ranks.
ANNOTATION_KV_EVENTS = "fleetgate.dev/kv-events"
PORT_KV_EVENTS = "kv-events"
PORT_KV_REPLAY = "kv-replay"
MANAGED_BY = "fleetgate-operator"
PART_OF = "fleetgate"
COMPONENT = "engine"

_LABEL_BAD = re.compile(r"[^A-Za-z0-9._-]+")
_LABEL_MAX = 63
_LABEL_HASH = 8


@dataclasses.dataclass(frozen=True, slots=True)
class Owner:
    """The InferenceService the children belong to."""

    name: str
    namespace: str
    uid: str

    def reference(self) -> dict[str, Any]:
        return {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": KIND,
            "name": self.name,
            "uid": self.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }


@dataclasses.dataclass(frozen=True, slots=True)
class ModelLocation:
    """Where the engine finds the weights, and what the pod needs for that."""

    model_path: str
    volumes: tuple[dict[str, Any], ...] = ()
    mounts: tuple[dict[str, Any], ...] = ()


@dataclasses.dataclass(frozen=True, slots=True)
class Children:
    """Everything one InferenceService should own, in apply order."""

    objects: tuple[dict[str, Any], ...]
    plan: ContainerPlan
    served_model: str
    engine: str
    """Adapter name (``vllm`` / ``trtllm``)."""

    def by_kind(self, kind: str) -> dict[str, Any] | None:
        return next((o for o in self.objects if o["kind"] == kind), None)


def label_value(text: str) -> str:
    """``text`` made into a valid label value (<= 63 chars, [A-Za-z0-9._-], alnum ends).

    Served names like ``meta-llama/Llama-3.1-8B`` are not valid label values: each run
    of other characters becomes ``_``. A result longer than 63 characters keeps its
    first 54 and ends in ``-`` + 8 hex digits of the SHA-256 of ``text``, so two long
    names that share a prefix still get different labels, and the same name always
    gets the same one. The exact name is kept in the ``fleetgate.dev/served-model``
    annotation.
    """
    value = _LABEL_BAD.sub("_", text).strip("._-")
    if len(value) <= _LABEL_MAX:
        return value
    digest = hashlib.sha256(text.encode()).hexdigest()[:_LABEL_HASH]
    return f"{value[: _LABEL_MAX - _LABEL_HASH - 1].rstrip('._-')}-{digest}"


def selector_labels(name: str) -> dict[str, str]:
    """Immutable pod selector of one InferenceService's engines."""
    return {
        "app.kubernetes.io/instance": name,
        "app.kubernetes.io/component": COMPONENT,
        "app.kubernetes.io/part-of": PART_OF,
    }


def selector_string(name: str) -> str:
    """:func:`selector_labels` as a label-selector string (status.selector)."""
    return ",".join(f"{k}={v}" for k, v in sorted(selector_labels(name).items()))


def common_labels(name: str, spec: InferenceServiceSpec, engine: str) -> dict[str, str]:
    """Recommended + router-discovery labels for every child and the pods."""
    served = spec.model.name or name
    return {
        **selector_labels(name),
        "app.kubernetes.io/name": engine,
        "app.kubernetes.io/managed-by": MANAGED_BY,
        LABEL_POOL: spec.routing.pool,
        LABEL_MODEL: label_value(served),
        LABEL_ENGINE: engine,
        LABEL_ROLE: spec.routing.role,
    }


def service_url(name: str, namespace: str, port: int, cluster_domain: str) -> str:
    """In-cluster base URL of the engines' OpenAI API."""
    return f"http://{name}.{namespace}.svc.{cluster_domain}:{port}"


def model_location(spec: InferenceServiceSpec) -> ModelLocation:
    """Map ``spec.model.uri`` onto a path inside the container.

    * ``hf://ORG/NAME``: the hub id; the engine downloads into the model cache
      (``HF_HOME`` points there, see :func:`_env`).
    * ``pvc://CLAIM[/PATH]``: the claim mounted read-only at /mnt/models.
    * ``s3://...``: passed through; the engine streams it itself.
    """
    scheme, _, rest = spec.model.uri.partition("://")
    if scheme == "hf":
        return ModelLocation(model_path=rest.strip("/"))
    if scheme == "pvc":
        claim, _, sub = rest.partition("/")
        path = f"{MODEL_SOURCE_PATH}/{sub.strip('/')}" if sub.strip("/") else MODEL_SOURCE_PATH
        volume = {
            "name": "model-source",
            "persistentVolumeClaim": {"claimName": claim, "readOnly": True},
        }
        mount = {"name": "model-source", "mountPath": MODEL_SOURCE_PATH, "readOnly": True}
        return ModelLocation(model_path=path, volumes=(volume,), mounts=(mount,))
    return ModelLocation(model_path=spec.model.uri)


def _settings(spec: InferenceServiceSpec) -> Any:
    return spec.engine.settings_for(get_adapter(spec.engine.type).spec_key)


def _http_probe(probe: Probe, period: int, timeout: int, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": probe.path, "port": probe.port_name},
        "periodSeconds": period,
        "timeoutSeconds": timeout,
        "failureThreshold": failures,
        "successThreshold": 1,
    }


def _probes(plan: ContainerPlan, budget_seconds: int) -> dict[str, Any]:
    startup_period = 10
    return {
        "startupProbe": _http_probe(
            plan.startup_probe, startup_period, 5, math.ceil(budget_seconds / startup_period)
        ),
        "readinessProbe": _http_probe(plan.readiness_probe, 5, 3, 3),
        "livenessProbe": _http_probe(plan.liveness_probe, 15, 5, 4),
    }


def _env(spec: InferenceServiceSpec, plan: ContainerPlan) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [{"name": k, "value": v} for k, v in sorted(plan.env.items())]
    env.append({"name": "HF_HOME", "value": f"{MODEL_CACHE_PATH}/huggingface"})
    secret = spec.model.auth_secret_ref
    if secret is not None:
        env.append(
            {
                "name": "HF_TOKEN",
                "valueFrom": {"secretKeyRef": {"name": secret.name, "key": secret.key}},
            }
        )
    for var in spec.engine.env:
        item: dict[str, Any] = {"name": var.name}
        if var.value is not None:
            item["value"] = var.value
        if var.value_from is not None:
            item["valueFrom"] = dict(var.value_from)
        env.append(item)
    return env


def _config_map_name(name: str) -> str:
    return f"{name}-engine-config"


def _config_hash(files: Mapping[str, str]) -> str:
    blob = json.dumps(dict(sorted(files.items())), sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def _volumes(
    name: str, spec: InferenceServiceSpec, plan: ContainerPlan, where: ModelLocation
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    volumes: list[dict[str, Any]] = []
    mounts: list[dict[str, Any]] = []
    cache = spec.storage.model_cache
    if cache.pvc is not None:
        volumes.append(
            {"name": "model-cache", "persistentVolumeClaim": {"claimName": cache.pvc.claim_name}}
        )
        mount: dict[str, Any] = {"name": "model-cache", "mountPath": MODEL_CACHE_PATH}
        if cache.pvc.sub_path:
            mount["subPath"] = cache.pvc.sub_path
        mounts.append(mount)
    else:
        empty: dict[str, Any] = {}
        if cache.empty_dir is not None and cache.empty_dir.size_limit:
            empty["sizeLimit"] = cache.empty_dir.size_limit
        volumes.append({"name": "model-cache", "emptyDir": empty})
        mounts.append({"name": "model-cache", "mountPath": MODEL_CACHE_PATH})
    volumes += where.volumes
    mounts += where.mounts
    if plan.needs_shared_memory:
        volumes.append(
            {
                "name": "dshm",
                "emptyDir": {"medium": "Memory", "sizeLimit": spec.storage.shared_memory_size},
            }
        )
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
    if plan.config_files:
        volumes.append({"name": "engine-config", "configMap": {"name": _config_map_name(name)}})
        mounts.append(
            {"name": "engine-config", "mountPath": plan.config_mount_path, "readOnly": True}
        )
    return volumes, mounts


def _affinity(spec: InferenceServiceSpec) -> dict[str, Any] | None:
    """The user's affinity with the GPU-product requirement ANDed into every node term."""
    affinity: dict[str, Any] = json.loads(json.dumps(spec.scheduling.affinity or {}))
    product = spec.gpu.product
    if product is None:
        return affinity or None
    expression = {"key": "nvidia.com/gpu.product", "operator": "In", "values": [product]}
    node = affinity.setdefault("nodeAffinity", {})
    required = node.setdefault("requiredDuringSchedulingIgnoredDuringExecution", {})
    terms = required.setdefault("nodeSelectorTerms", [])
    if not terms:
        terms.append({})
    for term in terms:
        term.setdefault("matchExpressions", []).append(expression)
    return affinity


def _tolerations(spec: InferenceServiceSpec, options: OperatorOptions) -> list[dict[str, Any]]:
    tolerations = [
        t.model_dump(by_alias=True, exclude_none=True) for t in spec.scheduling.tolerations
    ]
    if spec.gpu.count > 0:
        gpu_taint = {"key": spec.gpu.resource_name, "operator": "Exists", "effect": "NoSchedule"}
        if gpu_taint not in tolerations:
            tolerations.append(gpu_taint)
    for extra in options.extra_tolerations:
        if dict(extra) not in tolerations:
            tolerations.append(dict(extra))
    return tolerations


def _ports(plan: ContainerPlan) -> list[dict[str, Any]]:
    ports: list[dict[str, Any]] = [{"name": "http", "containerPort": plan.port, "protocol": "TCP"}]
    kv = plan.kv_events
    if kv is not None and kv.transport == "zmq":
        for rank in range(kv.ranks):
            suffix = f"-{rank}" if rank else ""
            pub, replay = kv.rank_ports(rank)
            for name, port in ((PORT_KV_EVENTS, pub), (PORT_KV_REPLAY, replay)):
                if port is not None:
                    ports.append({"name": name + suffix, "containerPort": port, "protocol": "TCP"})
    return ports


def kv_events_annotation(kv: KvEventsEndpoint) -> str:
    """The value of :data:`ANNOTATION_KV_EVENTS` for ``kv``."""
    data: dict[str, Any] = {"transport": kv.transport, "format": kv.format}
    if kv.port is not None:
        data["port"] = kv.port
    if kv.replay_port is not None:
        data["replayPort"] = kv.replay_port
    if kv.topic:
        data["topic"] = kv.topic
    if kv.path is not None:
        data["path"] = kv.path
    if kv.ranks > 1:
        data["ranks"] = kv.ranks
        data["rankChoice"] = kv.rank_choice
    return json.dumps(data, separators=(",", ":"), sort_keys=True)


def _container(
    spec: InferenceServiceSpec, plan: ContainerPlan, mounts: list[dict[str, Any]]
) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": CONTAINER_NAME,
        "image": spec.engine.image,
        "imagePullPolicy": spec.engine.image_pull_policy,
        "command": list(plan.command),
        "args": list(plan.args),
        "ports": _ports(plan),
        "env": _env(spec, plan),
        "volumeMounts": mounts,
        **_probes(plan, spec.startup_budget_seconds),
    }
    if spec.gpu.count > 0:
        gpus = {spec.gpu.resource_name: str(spec.gpu.count)}
        container["resources"] = {"limits": dict(gpus), "requests": dict(gpus)}
    return container


def _pod_spec(
    name: str, spec: InferenceServiceSpec, plan: ContainerPlan, options: OperatorOptions
) -> dict[str, Any]:
    volumes, mounts = _volumes(name, spec, plan, model_location(spec))
    pod: dict[str, Any] = {
        "containers": [_container(spec, plan, mounts)],
        "volumes": volumes,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": 60,
    }
    sched = spec.scheduling
    if sched.node_selector:
        pod["nodeSelector"] = dict(sorted(sched.node_selector.items()))
    tolerations = _tolerations(spec, options)
    if tolerations:
        pod["tolerations"] = tolerations
    affinity = _affinity(spec)
    if affinity:
        pod["affinity"] = affinity
    if sched.priority_class_name:
        pod["priorityClassName"] = sched.priority_class_name
    if sched.runtime_class_name:
        pod["runtimeClassName"] = sched.runtime_class_name
    if spec.engine.image_pull_secrets:
        pod["imagePullSecrets"] = [{"name": s} for s in spec.engine.image_pull_secrets]
    return pod


def _meta(
    owner: Owner,
    name: str,
    labels: Mapping[str, str],
    annotations: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": name,
        "namespace": owner.namespace,
        "labels": dict(labels),
        "ownerReferences": [owner.reference()],
    }
    if annotations:
        meta["annotations"] = dict(annotations)
    return meta


def launch_spec(name: str, spec: InferenceServiceSpec) -> LaunchSpec:
    """Engine-neutral launch facts handed to the adapter."""
    return LaunchSpec(
        model_path=model_location(spec).model_path,
        served_model_name=spec.model.name or name,
        port=ENGINE_PORT,
        tensor_parallel=spec.parallelism.tensor,
        pipeline_parallel=spec.parallelism.pipeline,
        settings=_settings(spec),
        extra_args=tuple(spec.engine.extra_args),
        revision=spec.model.revision,
        image=spec.engine.image,
        engine_version=spec.engine.version,
    )


def build_children(
    owner: Owner,
    spec: InferenceServiceSpec,
    options: OperatorOptions,
    *,
    service_monitor_supported: bool,
    adapter: EngineAdapter | None = None,
) -> Children:
    """All child objects of one InferenceService.

    Raises :class:`fleetgate.engines.base.EngineError` when the adapter refuses the
    launch spec; the reconciler turns that into a Degraded condition.
    """
    engine_adapter = adapter if adapter is not None else get_adapter(spec.engine.type)
    name = owner.name
    plan = engine_adapter.container(launch_spec(name, spec))
    served = spec.model.name or name
    labels = common_labels(name, spec, engine_adapter.name)
    discovery_annotations = {
        ANNOTATION_WEIGHT: str(spec.routing.weight),
        ANNOTATION_SERVED_MODEL: served,
        ANNOTATION_METRICS_PATH: plan.metrics_path,
    }
    if plan.engine_version is not None:
        discovery_annotations[ANNOTATION_ENGINE_VERSION] = plan.engine_version
    if plan.kv_events is not None:
        discovery_annotations[ANNOTATION_KV_EVENTS] = kv_events_annotation(plan.kv_events)
    objects: list[dict[str, Any]] = []
    pod_annotations = dict(discovery_annotations)
    if plan.config_files:
        objects.append(
            {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": _meta(owner, _config_map_name(name), labels),
                "data": dict(sorted(plan.config_files.items())),
            }
        )
        pod_annotations[ANNOTATION_CONFIG_HASH] = _config_hash(plan.config_files)
    budget = spec.startup_budget_seconds
    objects.append(
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": _meta(owner, name, labels),
            "spec": {
                "replicas": spec.replicas,
                "selector": {"matchLabels": selector_labels(name)},
                "strategy": {
                    "type": "RollingUpdate",
                    "rollingUpdate": {
                        "maxSurge": spec.rollout.max_surge,
                        "maxUnavailable": spec.rollout.max_unavailable,
                    },
                },
                "progressDeadlineSeconds": budget + 600,
                "revisionHistoryLimit": 3,
                "template": {
                    "metadata": {"labels": labels, "annotations": pod_annotations},
                    "spec": _pod_spec(name, spec, plan, options),
                },
            },
        }
    )
    objects.append(
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": _meta(owner, name, labels, discovery_annotations),
            "spec": {
                "type": "ClusterIP",
                "selector": selector_labels(name),
                "ports": [
                    {"name": "http", "port": plan.port, "targetPort": "http", "protocol": "TCP"}
                ],
            },
        }
    )
    objects.append(
        {
            "apiVersion": "policy/v1",
            "kind": "PodDisruptionBudget",
            "metadata": _meta(owner, name, labels),
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector_labels(name)}},
        }
    )
    if spec.metrics.service_monitor and service_monitor_supported:
        objects.append(
            {
                "apiVersion": "monitoring.coreos.com/v1",
                "kind": "ServiceMonitor",
                "metadata": _meta(owner, name, labels),
                "spec": {
                    "selector": {"matchLabels": selector_labels(name)},
                    "endpoints": [
                        {
                            "port": "http",
                            "path": plan.metrics_path,
                            "interval": spec.metrics.interval,
                        }
                    ],
                },
            }
        )
    return Children(
        objects=tuple(objects), plan=plan, served_model=served, engine=engine_adapter.name
    )
