"""``InferenceService`` (``fleetgate.dev/v1alpha1``): the one source of the CRD.

These pydantic models are the API. ``fleetgate crds`` renders them into the
structural OpenAPI schema in ``crds/`` (see :mod:`fleetgate.api.crd`), and the
operator parses every object it reconciles with them, so the schema the API
server enforces and the types the operator reads can never drift apart
(``tests/api/test_crd.py`` fails when ``crds/`` is stale).

Design rules (docs/operator.md explains the why):

* camelCase on the wire, snake_case in Python; frozen; unknown keys rejected.
* Every field has a description: it becomes ``kubectl explain`` text.
* Defaults live here and are applied by the API server (structural defaulting),
  so what a user reads back with ``kubectl get -o yaml`` is what runs.
* Cross-field rules are CEL (``x-kubernetes-validations``) attached with
  :func:`cel`, with messages a person understands; the same rules are mirrored
  in pydantic validators so that unit tests and the operator reject what the
  API server rejects. Engine settings blocks are the engines' own models
  (``fleetgate/engines/vllm.py`` ``VllmSettings``, ``trtllm.py``
  ``TrtllmSettings``), embedded unchanged.
* GPU-safe rollout defaults (maxSurge 0, maxUnavailable 1) follow
  kserve/kserve#5916: with a surge, the new pod stays Pending while the old pod
  holds the GPUs, and the rollout deadlocks.

Pure: no I/O, no Kubernetes client imports.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel

from fleetgate.engines.trtllm import TrtllmSettings
from fleetgate.engines.vllm import VllmSettings

__all__ = [
    "GROUP",
    "KIND",
    "PLURAL",
    "SHORT_NAMES",
    "SINGULAR",
    "VERSION",
    "AutoscalingSpec",
    "AutoscalingStatus",
    "Condition",
    "DrainingReplica",
    "EmptyDirCache",
    "EngineSpec",
    "EnvVar",
    "GpuSpec",
    "InferenceService",
    "InferenceServiceSpec",
    "InferenceServiceStatus",
    "MetricsSpec",
    "ModelCacheSpec",
    "ModelSpec",
    "ParallelismSpec",
    "PvcCache",
    "Recommendation",
    "RolloutStrategy",
    "RoutingSpec",
    "SchedulingSpec",
    "SecretKeyRef",
    "StorageSpec",
    "Toleration",
    "TtftObjective",
    "cel",
    "check_name",
]

GROUP = "fleetgate.dev"
VERSION = "v1alpha1"
KIND = "InferenceService"
PLURAL = "inferenceservices"
SINGULAR = "inferenceservice"
#: KServe owns ``isvc``; ours must not clash with it (both CRDs may be installed).
SHORT_NAMES = ("fgis",)

#: Engine names as written in the CRD (``engine.type``).
EngineType = Literal["vllm", "tensorrt-llm"]

MODEL_URI_PATTERN = r"^(hf|pvc|s3)://[^\s]+$"
_QUANTITY_PATTERN = r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$"
_INT_OR_PERCENT = re.compile(r"^(100|[1-9]?[0-9])%$")


def cel(*rules: tuple[str, str]) -> dict[str, Any]:
    """JSON-schema extra carrying CEL rules as ``(rule, message)`` pairs."""
    return {"x-kubernetes-validations": [{"rule": r, "message": m} for r, m in rules]}


# Kubernetes' own name formats, for every field the operator copies into a child
# object (docs/operator.md "Names and limits"). Written without backslashes so the
# same text is a valid CEL string literal, an RE2 (API server) and a Rust regex
# (pydantic). The API server would refuse a child carrying a value outside these
# formats at apply time (ApplyFailed); these rules refuse the InferenceService instead.
_DNS_LABEL_PART = "[a-z0-9]([-a-z0-9]*[a-z0-9])?"
#: RFC 1035 label: Service names on Kubernetes < 1.36 (and so metadata.name).
DNS1035_LABEL = "^[a-z]([-a-z0-9]*[a-z0-9])?$"
#: RFC 1123 subdomain: Secret, PVC, PriorityClass, RuntimeClass names.
DNS1123_SUBDOMAIN = f"^{_DNS_LABEL_PART}([.]{_DNS_LABEL_PART})*$"
#: A label value (also a node-affinity value and a toleration value); <= 63 chars.
LABEL_VALUE = "^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"
#: A label key / qualified name: optional DNS-subdomain prefix, then <= 63 chars.
QUALIFIED_NAME = (
    f"^({_DNS_LABEL_PART}([.]{_DNS_LABEL_PART})*/)?[A-Za-z0-9]([-A-Za-z0-9_.]{{0,61}}[A-Za-z0-9])?$"
)
#: An extended resource such as ``nvidia.com/gpu``: a domain is required.
EXTENDED_RESOURCE = (
    f"^{_DNS_LABEL_PART}([.]{_DNS_LABEL_PART})*/[A-Za-z0-9]([-A-Za-z0-9_.]{{0,61}}[A-Za-z0-9])?$"
)
#: A Secret or ConfigMap key.
CONFIG_KEY = "^[-._a-zA-Z0-9]+$"
#: metadata.name: it names the Service (RFC 1035 label before Kubernetes 1.36) and is
#: the ``app.kubernetes.io/instance`` label value (<= 63 chars).
NAME_MAX_LENGTH = 63
NAME_MESSAGE = (
    "metadata.name must be at most 63 characters of a-z, 0-9 and '-', start with a "
    "letter and end with a letter or digit: it names the engines' Service and is a "
    "label value"
)
NAME_RULE = (
    f"size(self.metadata.name) <= {NAME_MAX_LENGTH} && "
    f"self.metadata.name.matches('{DNS1035_LABEL}')"
)

_SUBDOMAIN_MESSAGE = (
    "must be a Kubernetes object name: lowercase a-z, 0-9, '-' and '.', starting and "
    "ending with a letter or digit, at most 253 characters"
)
_LABEL_VALUE_MESSAGE = (
    "must be a Kubernetes label value: at most 63 characters of A-Z, a-z, 0-9, '-', "
    "'_' and '.', starting and ending with a letter or digit"
)


def _matching(regex: str, message: str) -> Callable[[str], str]:
    compiled = re.compile(regex)

    def check(value: str) -> str:
        if not compiled.match(value):
            raise ValueError(message)
        return value

    return check


def check_name(name: str) -> str | None:
    """Why ``name`` cannot be an InferenceService's metadata.name, or None if it can.

    The pydantic mirror of the CRD's root rule (:data:`NAME_RULE`), for objects
    created before that rule existed.
    """
    if len(name) > NAME_MAX_LENGTH or not re.match(DNS1035_LABEL, name):
        return f"{NAME_MESSAGE} (got {len(name)} characters: {name[:80]!r})"
    return None


#: The name of an object in the namespace (Secret, PVC) or cluster (classes).
ObjectName = Annotated[
    str,
    Field(
        min_length=1,
        max_length=253,
        json_schema_extra=cel((f"self.matches('{DNS1123_SUBDOMAIN}')", _SUBDOMAIN_MESSAGE)),
    ),
    AfterValidator(_matching(DNS1123_SUBDOMAIN, _SUBDOMAIN_MESSAGE)),
]
#: A label value (non-empty here).
LabelValue = Annotated[
    str,
    Field(
        min_length=1,
        max_length=63,
        json_schema_extra=cel((f"self.matches('{LABEL_VALUE}')", _LABEL_VALUE_MESSAGE)),
    ),
    AfterValidator(_matching(LABEL_VALUE, _LABEL_VALUE_MESSAGE)),
]


class _Model(BaseModel):
    model_config = ConfigDict(
        frozen=True,
        extra="forbid",
        populate_by_name=True,
        alias_generator=to_camel,
        use_attribute_docstrings=True,
    )


def _default_of(model: type[_Model]) -> dict[str, Any]:
    """Schema extra: the fully defaulted sub-object as the schema default.

    The API server validates a default against the schema and its CEL rules as is,
    without applying the nested properties' own defaults first, so ``default: {}``
    would fail a rule such as ``self.maxSurge == 0`` ("no such key").
    """
    return {"default": model().model_dump(mode="json", by_alias=True, exclude_none=True)}


_KEY_MESSAGE = "must be a Secret key: a-z, A-Z, 0-9, '-', '_' and '.'"
_PVC_URI = f"^pvc://{DNS1123_SUBDOMAIN.strip('^$')}(/|$)"
_PVC_URI_MESSAGE = (
    "model.uri pvc://CLAIM/PATH: CLAIM must be a PersistentVolumeClaim name (lowercase "
    "a-z, 0-9, '-' and '.', starting and ending with a letter or digit)"
)
_IMAGE_MESSAGE = "engine.image must not start or end with whitespace"
_RESOURCE_MESSAGE = (
    "gpu.resourceName must be an extended resource such as nvidia.com/gpu: a DNS "
    "domain (not kubernetes.io), '/', then at most 63 characters of A-Z, a-z, 0-9, "
    "'-', '_' and '.'"
)
_SUB_PATH_MESSAGE = "storage.modelCache.pvc.subPath must be a relative path without '..'"
_NODE_SELECTOR_MESSAGE = (
    "scheduling.nodeSelector: every key must be a label key (optional DNS prefix and "
    "'/', then at most 63 characters of A-Z, a-z, 0-9, '-', '_' and '.')"
)


class SecretKeyRef(_Model):
    """A key in a Secret in the InferenceService's namespace."""

    name: ObjectName
    """Secret name."""
    key: Annotated[
        str,
        Field(
            min_length=1,
            max_length=253,
            json_schema_extra=cel((f"self.matches('{CONFIG_KEY}')", _KEY_MESSAGE)),
        ),
        AfterValidator(_matching(CONFIG_KEY, _KEY_MESSAGE)),
    ] = "token"
    """Key inside the Secret whose value is the credential."""


class ModelSpec(_Model):
    """Which weights to serve and under which name."""

    uri: str = Field(
        pattern=MODEL_URI_PATTERN,
        max_length=1024,
        json_schema_extra=cel(
            (f"!self.startsWith('pvc://') || self.matches('{_PVC_URI}')", _PVC_URI_MESSAGE)
        ),
    )
    """Where the weights come from. ``hf://ORG/NAME`` (Hugging Face hub id, downloaded
    into the model cache), ``pvc://CLAIM/PATH`` (a PersistentVolumeClaim already holding
    the weights, mounted read-only) or ``s3://BUCKET/PATH`` (handed to the engine as is;
    the engine streams it, e.g. vLLM with ``--load-format runai_streamer`` in extraArgs)."""
    name: str | None = Field(default=None, min_length=1, max_length=253)
    """Name clients send as ``model`` in OpenAI requests. Default: metadata.name."""
    revision: str | None = Field(default=None, min_length=1, max_length=253)
    """Hub revision (branch, tag or commit) for ``hf://`` models."""
    auth_secret_ref: SecretKeyRef | None = None
    """Credential for a gated or private model, exposed to the engine as ``HF_TOKEN``."""

    @model_validator(mode="after")
    def _pvc_claim_is_a_name(self) -> ModelSpec:
        if self.uri.startswith("pvc://") and not re.match(_PVC_URI, self.uri):
            raise ValueError(_PVC_URI_MESSAGE)
        return self


class EnvVar(_Model):
    """An environment variable for the engine container."""

    name: str = Field(min_length=1, max_length=256, pattern=r"^[A-Za-z_][A-Za-z0-9_.-]*$")
    """Variable name."""
    value: str | None = None
    """Literal value."""
    value_from: dict[str, Any] | None = None
    """A Kubernetes ``EnvVarSource`` (secretKeyRef, configMapKeyRef, fieldRef, ...)."""


class EngineSpec(_Model):
    """The inference engine, its image and its typed settings."""

    model_config = ConfigDict(
        json_schema_extra=cel(
            (
                "!has(self.vllm) || self.type == 'vllm'",
                "engine.vllm settings are set but engine.type is not 'vllm'; "
                "use engine.tensorrtLlm for a TensorRT-LLM engine",
            ),
            (
                "!has(self.tensorrtLlm) || self.type == 'tensorrt-llm'",
                "engine.tensorrtLlm settings are set but engine.type is not "
                "'tensorrt-llm'; use engine.vllm for a vLLM engine",
            ),
        )
    )

    type: EngineType
    """Which engine serves the model: ``vllm`` or ``tensorrt-llm`` (trtllm-serve)."""
    image: str = Field(
        min_length=1,
        max_length=1024,
        json_schema_extra=cel(("self == self.trim()", _IMAGE_MESSAGE)),
    )
    """Engine container image, e.g. ``vllm/vllm-openai:v0.32.0``."""
    version: str | None = Field(
        default=None, min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9._+-]*$"
    )
    """The engine release the image runs (TensorRT-LLM: ``1.0.0``, ``1.2.0rc3``, ``main``).
    Default: read from the image tag. fleetgate writes only the flags and options that
    release accepts; when neither this nor the tag names a supported release the service
    is ``Degraded`` with reason ``UnknownEngineVersion``."""
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    """When the kubelet pulls the image."""
    image_pull_secrets: list[str] = Field(default_factory=list, max_length=16)
    """Names of Secrets used to pull the image."""
    vllm: VllmSettings | None = None
    """vLLM settings; only with ``type: vllm``."""
    tensorrt_llm: TrtllmSettings | None = None
    """TensorRT-LLM settings; only with ``type: tensorrt-llm``."""
    extra_args: list[str] = Field(default_factory=list, max_length=128)
    """Extra engine command-line arguments, appended after the generated ones."""
    env: list[EnvVar] = Field(default_factory=list, max_length=128)
    """Extra environment variables for the engine container."""

    def settings_for(self, key: str) -> BaseModel | None:
        """The typed settings section stored under ``key`` (an engine adapter's
        ``spec_key``, e.g. ``tensorrtLlm``); None when it is not set or not a section."""
        for field, info in type(self).model_fields.items():
            if info.alias == key:
                value = getattr(self, field)
                return value if isinstance(value, BaseModel) else None
        return None

    @model_validator(mode="after")
    def _settings_match_engine(self) -> EngineSpec:
        if self.image != self.image.strip():
            raise ValueError(_IMAGE_MESSAGE)
        if self.vllm is not None and self.type != "vllm":
            raise ValueError("engine.vllm settings are set but engine.type is not 'vllm'")
        if self.tensorrt_llm is not None and self.type != "tensorrt-llm":
            raise ValueError(
                "engine.tensorrtLlm settings are set but engine.type is not 'tensorrt-llm'"
            )
        return self


class ParallelismSpec(_Model):
    """How one replica splits the model over its GPUs."""

    tensor: int = Field(default=1, ge=1, le=64)
    """Tensor-parallel degree (GPUs sharing each layer)."""
    pipeline: int = Field(default=1, ge=1, le=64)
    """Pipeline-parallel degree (stages of layers)."""


class GpuSpec(_Model):
    """GPUs for each replica."""

    count: int = Field(default=1, ge=0, le=64)
    """GPUs per replica; must equal parallelism.tensor x parallelism.pipeline. 0 runs the
    engine on CPU (tests, CPU builds of vLLM)."""
    product: LabelValue | None = None
    """Required GPU model, matched against the node label ``nvidia.com/gpu.product``
    (e.g. ``NVIDIA-H100-80GB-HBM3``). Unset: any GPU node."""
    resource_name: str = Field(
        default="nvidia.com/gpu",
        min_length=1,
        max_length=128,
        json_schema_extra=cel(
            (
                f"self.matches('{EXTENDED_RESOURCE}') && !self.contains('kubernetes.io/')",
                _RESOURCE_MESSAGE,
            )
        ),
    )
    """Extended resource that counts GPUs on nodes."""

    @model_validator(mode="after")
    def _extended_resource(self) -> GpuSpec:
        name = self.resource_name
        if not re.match(EXTENDED_RESOURCE, name) or "kubernetes.io/" in name:
            raise ValueError(_RESOURCE_MESSAGE)
        return self


_TOLERATION_RULES: tuple[tuple[str, str], ...] = (
    (
        f"!has(self.key) || self.key == '' || self.key.matches('{QUALIFIED_NAME}')",
        "toleration key must be a label key (optional DNS prefix and '/', then at most "
        "63 characters of A-Z, a-z, 0-9, '-', '_' and '.')",
    ),
    (
        "(has(self.key) && self.key != '') || self.operator == 'Exists'",
        "a toleration without a key must have operator Exists (it then tolerates every taint)",
    ),
    (
        "self.operator != 'Exists' || !has(self.value) || self.value == ''",
        "a toleration with operator Exists must not have a value",
    ),
    (
        "!has(self.tolerationSeconds) || (has(self.effect) && self.effect == 'NoExecute')",
        "toleration tolerationSeconds is only allowed with effect NoExecute",
    ),
)


class Toleration(_Model):
    """A Kubernetes toleration."""

    model_config = ConfigDict(json_schema_extra=cel(*_TOLERATION_RULES))

    key: str | None = Field(default=None, max_length=317)
    """Taint key; empty with operator Exists matches every taint."""
    operator: Literal["Exists", "Equal"] = "Equal"
    """``Exists`` ignores value; ``Equal`` compares it."""
    value: (
        Annotated[
            str,
            Field(
                max_length=63,
                json_schema_extra=cel((f"self.matches('{LABEL_VALUE}')", _LABEL_VALUE_MESSAGE)),
            ),
            AfterValidator(_matching(LABEL_VALUE, _LABEL_VALUE_MESSAGE)),
        ]
        | None
    ) = None
    """Taint value for ``Equal``."""
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    """Taint effect to tolerate; empty means all effects."""
    toleration_seconds: int | None = Field(default=None, ge=0)
    """How long a NoExecute taint is tolerated."""

    @model_validator(mode="after")
    def _valid_for_kubernetes(self) -> Toleration:
        if self.key and not re.match(QUALIFIED_NAME, self.key):
            raise ValueError(_TOLERATION_RULES[0][1])
        if not self.key and self.operator != "Exists":
            raise ValueError(_TOLERATION_RULES[1][1])
        if self.operator == "Exists" and self.value:
            raise ValueError(_TOLERATION_RULES[2][1])
        if self.toleration_seconds is not None and self.effect != "NoExecute":
            raise ValueError(_TOLERATION_RULES[3][1])
        return self


class SchedulingSpec(_Model):
    """Where engine pods may run."""

    node_selector: dict[
        str,
        Annotated[
            str,
            Field(
                max_length=63,
                json_schema_extra=cel((f"self.matches('{LABEL_VALUE}')", _LABEL_VALUE_MESSAGE)),
            ),
            AfterValidator(_matching(LABEL_VALUE, _LABEL_VALUE_MESSAGE)),
        ],
    ] = Field(default_factory=dict, max_length=64)
    """Node labels a node must carry. Values are checked at admission; keys (label keys)
    by the operator, because CEL cannot read map keys within the API server's cost
    budget (a bad key shows as ``InvalidSpec``)."""
    tolerations: list[Toleration] = Field(default_factory=list, max_length=64)
    """Taints the pods tolerate (a toleration for the GPU resource taint is always added
    when GPUs are requested)."""
    affinity: dict[str, Any] | None = None
    """A Kubernetes ``Affinity``; the GPU product rule is ANDed into its node affinity."""
    priority_class_name: ObjectName | None = None
    """PriorityClass of the engine pods."""
    runtime_class_name: ObjectName | None = None
    """RuntimeClass of the engine pods (e.g. ``nvidia``)."""

    @model_validator(mode="after")
    def _node_selector_is_labels(self) -> SchedulingSpec:
        for key in self.node_selector:
            if len(key) > 317 or not re.match(QUALIFIED_NAME, key):
                raise ValueError(f"{_NODE_SELECTOR_MESSAGE}: {key[:80]!r}")
        return self


class PvcCache(_Model):
    """Keep downloaded weights on a PersistentVolumeClaim shared by all replicas."""

    claim_name: ObjectName
    """An existing PVC (ReadWriteMany when replicas > 1)."""
    sub_path: str | None = Field(
        default=None,
        max_length=1024,
        json_schema_extra=cel(
            (
                "!self.startsWith('/') && !self.split('/').exists(p, p == '..')",
                _SUB_PATH_MESSAGE,
            )
        ),
    )
    """Directory inside the volume (relative, without '..')."""

    @model_validator(mode="after")
    def _relative_sub_path(self) -> PvcCache:
        sub = self.sub_path
        if sub is not None and (sub.startswith("/") or ".." in sub.split("/")):
            raise ValueError(_SUB_PATH_MESSAGE)
        return self


class EmptyDirCache(_Model):
    """Download weights into a per-pod emptyDir (lost when the pod goes)."""

    size_limit: str | None = Field(default=None, pattern=_QUANTITY_PATTERN)
    """Size limit, e.g. ``100Gi``."""


class ModelCacheSpec(_Model):
    """Where ``hf://`` weights are cached; set exactly one of pvc or emptyDir."""

    model_config = ConfigDict(
        json_schema_extra=cel(
            (
                "!(has(self.pvc) && has(self.emptyDir))",
                "storage.modelCache: set either pvc or emptyDir, not both",
            )
        )
    )

    pvc: PvcCache | None = None
    """Cache on a PVC: replicas and restarts reuse the download."""
    empty_dir: EmptyDirCache | None = None
    """Cache in an emptyDir (the default when neither is set)."""

    @model_validator(mode="after")
    def _one_of(self) -> ModelCacheSpec:
        if self.pvc is not None and self.empty_dir is not None:
            raise ValueError("storage.modelCache: set either pvc or emptyDir, not both")
        return self


class StorageSpec(_Model):
    """Volumes of the engine pod."""

    model_cache: ModelCacheSpec = Field(
        default_factory=ModelCacheSpec, json_schema_extra=_default_of(ModelCacheSpec)
    )
    """Model cache volume, mounted at ``/models``."""
    shared_memory_size: str = Field(default="2Gi", pattern=_QUANTITY_PATTERN)
    """Size of ``/dev/shm`` (memory-backed) used by NCCL and tensor-parallel workers."""


class RolloutStrategy(_Model):
    """How a spec change replaces pods. Defaults are GPU-safe: never ask for extra GPUs."""

    model_config = ConfigDict(
        json_schema_extra=cel(
            (
                "!((self.maxSurge == 0 || self.maxSurge == '0%') && "
                "(self.maxUnavailable == 0 || self.maxUnavailable == '0%'))",
                "rollout.maxSurge and rollout.maxUnavailable cannot both be 0: the "
                "rollout could never make progress",
            )
        )
    )

    max_surge: int | str = Field(default=0, json_schema_extra={"x-fleetgate-int-or-string": True})
    """Extra pods above replicas during a rollout (count or percent). 0 because a surge
    pod needs GPUs that the old pods still hold."""
    max_unavailable: int | str = Field(
        default=1, json_schema_extra={"x-fleetgate-int-or-string": True}
    )
    """Pods that may be down during a rollout (count or percent)."""

    @model_validator(mode="after")
    def _progress_possible(self) -> RolloutStrategy:
        for name, value in (("maxSurge", self.max_surge), ("maxUnavailable", self.max_unavailable)):
            if isinstance(value, int) and value < 0:
                raise ValueError(f"rollout.{name} must be >= 0")
            if isinstance(value, str) and not _INT_OR_PERCENT.match(value):
                raise ValueError(f"rollout.{name} must be a count or a percent like '25%'")
        if self.max_surge in (0, "0%") and self.max_unavailable in (0, "0%"):
            raise ValueError(
                "rollout.maxSurge and rollout.maxUnavailable cannot both be 0: the "
                "rollout could never make progress"
            )
        return self


class RoutingSpec(_Model):
    """How the fleetgate router uses these engines (labels it discovers by)."""

    pool: str = Field(
        default="default", min_length=1, max_length=63, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
    )
    """Router pool the engines join (label ``fleetgate.dev/pool``)."""
    role: Literal["latency", "throughput"] = "latency"
    """``latency``: interactive traffic first; ``throughput``: batch traffic
    (label ``fleetgate.dev/role``)."""
    weight: int = Field(default=100, ge=0, le=10_000)
    """Relative share of traffic among equal candidates; 0 drains the service
    (annotation ``fleetgate.dev/weight``)."""


class MetricsSpec(_Model):
    """Prometheus scraping of the engines."""

    service_monitor: bool = True
    """Create a ServiceMonitor (only when the monitoring.coreos.com CRD exists)."""
    interval: str = Field(default="15s", pattern=r"^[0-9]+(ms|s|m)$")
    """Scrape interval."""


_AUTOSCALING_RULES: tuple[tuple[str, str], ...] = (
    (
        "self.maxReplicas >= 1",
        "autoscaling.maxReplicas must be at least 1: a service that may never run a "
        "replica cannot serve (delete it, or set replicas: 0 without autoscaling)",
    ),
    (
        "self.minReplicas <= self.maxReplicas",
        "autoscaling.minReplicas must not be greater than autoscaling.maxReplicas",
    ),
    (
        "!has(self.scaleToZeroAfterSeconds) || self.minReplicas == 0",
        "autoscaling.scaleToZeroAfterSeconds needs minReplicas: 0 (with minReplicas >= 1 "
        "the service never scales to zero)",
    ),
    (
        "has(self.targetInFlightPerReplica) || has(self.targetKvCacheUtilization) || "
        "has(self.ttftObjective)",
        "autoscaling needs at least one target: targetInFlightPerReplica, "
        "targetKvCacheUtilization or ttftObjective",
    ),
)


class TtftObjective(_Model):
    """Hold a priority class's TTFT-objective attainment (the router's per-class
    ``ttftObjectiveMs``): scale up one replica at a time while the share of requests
    that got their first token within the objective is below ``attainment``."""

    priority_class: LabelValue
    """The router priority class (e.g. ``critical``) whose attainment is held."""
    attainment: float = Field(default=0.99, gt=0, lt=1)
    """Wanted fraction of the class's requests meeting its TTFT objective (0.99 = 99%)."""
    min_requests: int = Field(default=20, ge=1, le=100_000)
    """Requests of the class needed in one decision window before attainment counts
    (a handful of requests is no evidence)."""


class AutoscalingSpec(_Model):
    """Scale the replicas on the demand the fleetgate routers see (docs/deploy.md
    "Autoscaling"). While set, the operator owns ``spec.replicas`` (it writes it through
    the scale subresource, like an HPA does); leave it unset to scale by hand or with
    an HPA/KEDA on the scale subresource instead."""

    model_config = ConfigDict(json_schema_extra=cel(*_AUTOSCALING_RULES))

    min_replicas: int = Field(default=1, ge=0, le=1000)
    """Fewest replicas. 0 allows scale to zero after ``scaleToZeroAfterSeconds`` idle;
    the routers hold requests meanwhile and the first one scales the service to 1."""
    max_replicas: int = Field(le=1000)
    """Most replicas (at least 1)."""
    target_in_flight_per_replica: float | None = Field(default=None, gt=0, le=100_000)
    """Requests per replica to hold: in flight on the engines plus queued and held in
    the routers for this model, divided by replicas. Size it from the concurrency at
    which one engine still meets your latency (e.g. its max batch for short chats)."""
    target_kv_cache_utilization: float | None = Field(default=None, gt=0, le=1)
    """Mean KV-cache fraction in use over the ready replicas to hold (e.g. 0.7): above
    it, engines start to queue and preempt."""
    ttft_objective: TtftObjective | None = None
    """Hold a priority class's TTFT-objective attainment (reacts after misses; pair it
    with one of the two targets above, which act before)."""
    scale_up_stabilization_seconds: int = Field(default=0, ge=0, le=3600)
    """Scale up only to the lowest recommendation of this window (0: at once)."""
    scale_down_stabilization_seconds: int = Field(default=300, ge=0, le=86_400)
    """Scale down only to the highest recommendation of this window, so a short lull
    does not remove a replica that the next burst needs (and pays a cold start for)."""
    scale_to_zero_after_seconds: int | None = Field(default=None, ge=1, le=604_800)
    """With ``minReplicas: 0``: scale to zero after this long without any request (none
    arriving, in flight, queued or held). Unset with ``minReplicas: 0``: 300."""
    cold_start_seconds: int | None = Field(default=None, ge=1, le=86_400)
    """How long a new replica takes to become Ready; scale-up plans this far ahead on
    the arrival trend. Unset: the longest start measured on this service's pods
    (``status.autoscaling.measuredColdStartSeconds``), else ``startupBudgetSeconds``."""
    drain_timeout_seconds: int = Field(default=600, ge=0, le=86_400)
    """Scale-down drains one replica first (routers send it no new work); it is removed
    when the routers report nothing in flight on it, or after this long."""

    @model_validator(mode="after")
    def _consistent(self) -> AutoscalingSpec:
        if self.max_replicas < 1:
            raise ValueError(_AUTOSCALING_RULES[0][1])
        if self.min_replicas > self.max_replicas:
            raise ValueError(
                f"{_AUTOSCALING_RULES[1][1]} ({self.min_replicas} > {self.max_replicas})"
            )
        if self.scale_to_zero_after_seconds is not None and self.min_replicas != 0:
            raise ValueError(_AUTOSCALING_RULES[2][1])
        if (
            self.target_in_flight_per_replica is None
            and self.target_kv_cache_utilization is None
            and self.ttft_objective is None
        ):
            raise ValueError(_AUTOSCALING_RULES[3][1])
        return self


class InferenceServiceSpec(_Model):
    """Desired state of one served model on one engine type."""

    model_config = ConfigDict(
        json_schema_extra=cel(
            (
                "self.gpu.count == 0 || "
                "self.parallelism.tensor * self.parallelism.pipeline == self.gpu.count",
                "parallelism.tensor x parallelism.pipeline must equal gpu.count "
                "(the GPUs each replica gets)",
            ),
            (
                "self.gpu.count > 0 || !has(self.gpu.product)",
                "gpu.product is set but gpu.count is 0: a CPU replica cannot require a GPU model",
            ),
        )
    )

    model: ModelSpec
    """The model to serve."""
    engine: EngineSpec
    """The engine that serves it."""
    parallelism: ParallelismSpec = Field(
        default_factory=ParallelismSpec, json_schema_extra=_default_of(ParallelismSpec)
    )
    """Tensor / pipeline parallelism inside one replica."""
    gpu: GpuSpec = Field(default_factory=GpuSpec, json_schema_extra=_default_of(GpuSpec))
    """GPUs per replica and which GPU model."""
    replicas: int = Field(default=1, ge=0, le=1000)
    """Number of engine replicas (also the scale subresource). With ``autoscaling`` set
    the operator writes it; a change by hand lasts until the next decision."""
    autoscaling: AutoscalingSpec | None = None
    """Scale ``replicas`` on the routers' demand (unset: replicas are fixed, or set by
    an HPA/KEDA through the scale subresource)."""
    scheduling: SchedulingSpec = Field(
        default_factory=SchedulingSpec, json_schema_extra=_default_of(SchedulingSpec)
    )
    """Node placement."""
    storage: StorageSpec = Field(
        default_factory=StorageSpec, json_schema_extra=_default_of(StorageSpec)
    )
    """Model cache and shared memory."""
    startup_budget_seconds: int = Field(default=1800, ge=60, le=86_400)
    """How long a replica may take to download and load the model before Kubernetes
    restarts it; sizes the startup probe (kserve/kserve#5062: big models need minutes)."""
    rollout: RolloutStrategy = Field(
        default_factory=RolloutStrategy, json_schema_extra=_default_of(RolloutStrategy)
    )
    """Rolling-update limits."""
    routing: RoutingSpec = Field(
        default_factory=RoutingSpec, json_schema_extra=_default_of(RoutingSpec)
    )
    """Router pool, role and weight."""
    metrics: MetricsSpec = Field(
        default_factory=MetricsSpec, json_schema_extra=_default_of(MetricsSpec)
    )
    """Prometheus scraping."""

    @model_validator(mode="after")
    def _gpus_match_parallelism(self) -> InferenceServiceSpec:
        want = self.parallelism.tensor * self.parallelism.pipeline
        if self.gpu.count != 0 and want != self.gpu.count:
            raise ValueError(
                "parallelism.tensor x parallelism.pipeline must equal gpu.count "
                f"(the GPUs each replica gets): {self.parallelism.tensor} x "
                f"{self.parallelism.pipeline} != {self.gpu.count}"
            )
        if self.gpu.count == 0 and self.gpu.product is not None:
            raise ValueError(
                "gpu.product is set but gpu.count is 0: a CPU replica cannot require a GPU model"
            )
        return self


class Condition(_Model):
    """A status condition in the ``metav1.Condition`` shape."""

    type: str
    """``Ready``, ``Progressing`` or ``Degraded``."""
    status: Literal["True", "False", "Unknown"]
    """Condition state."""
    reason: str
    """CamelCase cause, e.g. ``InsufficientGPU``."""
    message: str = ""
    """What a person should know."""
    last_transition_time: str | None = None
    """When ``status`` last changed (RFC 3339)."""
    observed_generation: int | None = None
    """metadata.generation this condition was computed for."""


class DrainingReplica(_Model):
    """The replica being drained before a scale-down removes it."""

    pod: str
    """Pod name (annotated ``fleetgate.dev/drain: "true"``)."""
    since: str
    """When draining started (RFC 3339)."""


class Recommendation(_Model):
    """A change point of the raw replica recommendation."""

    time: str
    """When the recommendation took this value (RFC 3339)."""
    replicas: int
    """Recommended replicas from then until the next entry."""


class AutoscalingStatus(_Model):
    """The autoscaler's memory: kept here so a restarted operator neither forgets its
    stabilisation windows nor flaps."""

    desired_replicas: int | None = None
    """Replicas the last decision asked for."""
    wanted_replicas: int | None = None
    """Replicas the demand alone asked for, before the pool's GPU budget (set only while
    the budget limits this service; ``desiredReplicas`` is what it granted)."""
    demand_classes: str | None = None
    """Whose demand this service takes: ``all classes``, or the priority classes of its
    ``routing.role`` when its model is served by both roles in its pool."""
    reason: str | None = None
    """Why (e.g. ``ScaledUp: in-flight 14.2/replica > target 4``)."""
    last_scale_time: str | None = None
    """When replicas last changed by a decision (RFC 3339)."""
    recommendations: list[Recommendation] = Field(default_factory=list)
    """Change points of the raw recommendation within the stabilisation windows."""
    idle_since: str | None = None
    """Since when no request arrived, ran, queued or was held (RFC 3339)."""
    draining: list[DrainingReplica] = Field(default_factory=list)
    """The replicas being drained for a scale-down, all at once: the scale-down removes
    them together once every one is idle (or past ``drainTimeoutSeconds``). Until
    2026-12-04 one replica (an object, still read) and one at a time."""
    cold_start_seconds: float | None = None
    """The cold start the decision plans with."""
    measured_cold_start_seconds: float | None = None
    """Longest creation-to-Ready time measured on this service's pods."""
    demand: dict[str, float] = Field(default_factory=dict)
    """The demand of the last decision (inFlight, queued, held, arrivalRate, ...)."""


class InferenceServiceStatus(_Model):
    """Observed state, written by the operator only."""

    observed_generation: int | None = None
    """metadata.generation the operator last reconciled."""
    conditions: list[Condition] = Field(default_factory=list)
    """Ready / Progressing / Degraded."""
    replicas: int | None = None
    """Engine pods that exist (scale subresource)."""
    ready_replicas: int | None = None
    """Engine pods that pass readiness."""
    updated_replicas: int | None = None
    """Engine pods running the current spec."""
    available_replicas: int | None = None
    """Engine pods available to serve."""
    selector: str | None = None
    """Label selector of the engine pods (scale subresource)."""
    url: str | None = None
    """In-cluster base URL of the OpenAI API."""
    served_model: str | None = None
    """The model name clients send."""
    engine: str | None = None
    """Engine type serving the model."""
    autoscaling: AutoscalingStatus | None = None
    """State of ``spec.autoscaling`` decisions."""


class InferenceService(_Model):
    """A model served by a fleet of identical engine replicas."""

    model_config = ConfigDict(extra="ignore")

    api_version: Literal["fleetgate.dev/v1alpha1"] = "fleetgate.dev/v1alpha1"
    kind: Literal["InferenceService"] = "InferenceService"
    metadata: dict[str, Any] = Field(default_factory=dict)
    spec: InferenceServiceSpec
    status: InferenceServiceStatus | None = None
