"""Pure status computation: live Deployment + pods in, ``InferenceService.status`` out.

Users must be able to tell "no GPU for the pod" from "image does not exist" from
"engine crashes" from "still loading the model" (users of operators that report
only "not ready" cannot: ai-dynamo/dynamo#8170, #11131). So every engine pod is
diagnosed (:func:`diagnose_pod`) and the most important problem names the reason:

=========================  ========================================================
reason                     when
=========================  ========================================================
InvalidSpec                the spec or the engine adapter refused it (never retried)
UnknownEngineVersion       the engine release is neither in spec.engine.version nor
                           in the image tag, or is not supported (never retried)
ApplyFailed                the API server refused a child (message has its answer)
NameConflict               a child's name is taken by an object we do not own
InsufficientGPU            a pod is unschedulable for lack of the GPU resource
Unschedulable              a pod is unschedulable for another reason (affinity, ...)
ImagePullFailed            ErrImagePull / ImagePullBackOff / InvalidImageName
ContainerConfigError       e.g. the model auth Secret does not exist
PodCreationFailed          the API server refuses the pods (missing PriorityClass,
                           RuntimeClass, quota, admission policy)
CrashLoop                  the engine keeps exiting (CrashLoopBackOff, restarts)
ProgressDeadlineExceeded   the Deployment gave up waiting
RolloutInProgress          pods of an older spec still run, or the new spec is unseen
ModelLoading               pods run but are not ready yet (download, load, warm-up)
ScaledToZero               replicas is 0
AllReplicasReady           every desired replica is updated and ready
=========================  ========================================================

Conditions: ``Ready`` (True only when every desired replica runs the current spec
and is ready: no "successful" during a rollout, dynamo#3567), ``Progressing``
(True while the Deployment is converging without a blocking fault) and
``Degraded`` (True for the fault reasons). ``lastTransitionTime`` only moves when
a condition's status changes. Every change of Ready's (status, reason) pair, which
names the service's one current state, is a :class:`Transition` the reconciler
posts as a Kubernetes Event (Warning for the Degraded reasons).

Pure: the clock is an argument.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Mapping, Sequence
from typing import Any, Literal

__all__ = [
    "DEGRADED_REASONS",
    "Observation",
    "PodIssue",
    "StatusReport",
    "Transition",
    "compute_status",
    "diagnose_pod",
    "format_time",
]

DEGRADED_REASONS = (
    "InvalidSpec",
    "UnknownEngineVersion",
    "ApplyFailed",
    "NameConflict",
    "InsufficientGPU",
    "Unschedulable",
    "ImagePullFailed",
    "ContainerConfigError",
    "PodCreationFailed",
    "CrashLoop",
    "ProgressDeadlineExceeded",
)
_PROGRESS_REASONS = ("RolloutInProgress", "ModelLoading")
_PRIORITY = (*DEGRADED_REASONS, *_PROGRESS_REASONS)

_IMAGE_PULL = {"ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull"}
_CONFIG = {"CreateContainerConfigError", "CreateContainerError", "RunContainerError"}
_MAX_MESSAGE = 480


@dataclasses.dataclass(frozen=True, slots=True)
class PodIssue:
    """What is wrong with one pod (or ``ModelLoading`` when it is merely not ready)."""

    pod: str
    reason: str
    message: str


@dataclasses.dataclass(frozen=True, slots=True)
class Observation:
    """Everything the status is computed from."""

    name: str
    generation: int
    desired_replicas: int
    deployment: Mapping[str, Any] | None = None
    pods: Sequence[Mapping[str, Any]] = ()
    failure_reason: str | None = None
    """Set when reconcile could not get as far as the pods (InvalidSpec, ApplyFailed)."""
    failure_message: str = ""
    gpu_resource: str = "nvidia.com/gpu"
    url: str | None = None
    selector: str | None = None
    served_model: str | None = None
    engine: str | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class Transition:
    """A condition changed (status or reason): worth a Kubernetes Event."""

    type: Literal["Normal", "Warning"]
    reason: str
    message: str


@dataclasses.dataclass(frozen=True, slots=True)
class StatusReport:
    status: dict[str, Any]
    transitions: tuple[Transition, ...]
    reason: str


def format_time(now: dt.datetime) -> str:
    """RFC 3339 in UTC with second precision, as Kubernetes writes it."""
    return now.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _clip(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= _MAX_MESSAGE else text[: _MAX_MESSAGE - 3] + "..."


def _condition(pod: Mapping[str, Any], kind: str) -> Mapping[str, Any] | None:
    for cond in pod.get("status", {}).get("conditions") or ():
        if cond.get("type") == kind:
            return dict(cond)
    return None


def diagnose_pod(pod: Mapping[str, Any], gpu_resource: str = "nvidia.com/gpu") -> PodIssue | None:
    """The problem of one engine pod, or None when it is ready (or terminating)."""
    meta = pod.get("metadata", {})
    name = str(meta.get("name", "?"))
    if meta.get("deletionTimestamp"):
        return None
    scheduled = _condition(pod, "PodScheduled")
    if scheduled is not None and scheduled.get("status") == "False":
        message = str(scheduled.get("message", ""))
        reason = "InsufficientGPU" if f"Insufficient {gpu_resource}" in message else "Unschedulable"
        return PodIssue(name, reason, message or "pod cannot be scheduled")
    status = pod.get("status", {})
    for cs in status.get("containerStatuses") or ():
        waiting = (cs.get("state") or {}).get("waiting") or {}
        why = waiting.get("reason", "")
        if why in _IMAGE_PULL:
            return PodIssue(name, "ImagePullFailed", f"{why}: {waiting.get('message', '')}")
        if why in _CONFIG:
            return PodIssue(name, "ContainerConfigError", f"{why}: {waiting.get('message', '')}")
        last = (cs.get("lastState") or {}).get("terminated") or {}
        if why == "CrashLoopBackOff" or (cs.get("restartCount", 0) > 0 and last):
            detail = f"exit code {last.get('exitCode', '?')}"
            if last.get("reason"):
                detail += f" ({last['reason']})"
            return PodIssue(
                name,
                "CrashLoop",
                f"engine restarted {cs.get('restartCount', 0)} times, last {detail}",
            )
    ready = _condition(pod, "Ready")
    if ready is not None and ready.get("status") == "True":
        return None
    phase = status.get("phase", "Pending")
    return PodIssue(name, "ModelLoading", f"pod {phase.lower()}, engine not ready yet")


def _deployment_state(obs: Observation) -> tuple[dict[str, int], str | None, str]:
    """Replica counts and, when the Deployment itself explains a problem, a reason."""
    dep = obs.deployment or {}
    st = dep.get("status", {}) or {}
    counts = {
        "replicas": int(st.get("replicas", 0) or 0),
        "readyReplicas": int(st.get("readyReplicas", 0) or 0),
        "updatedReplicas": int(st.get("updatedReplicas", 0) or 0),
        "availableReplicas": int(st.get("availableReplicas", 0) or 0),
    }
    for cond in st.get("conditions") or ():
        if cond.get("type") == "ReplicaFailure" and cond.get("status") == "True":
            return counts, "PodCreationFailed", str(cond.get("message", ""))
    for cond in st.get("conditions") or ():
        if cond.get("type") == "Progressing" and cond.get("reason") == "ProgressDeadlineExceeded":
            return counts, "ProgressDeadlineExceeded", str(cond.get("message", ""))
    generation = int(dep.get("metadata", {}).get("generation", 0) or 0)
    seen = int(st.get("observedGeneration", 0) or 0)
    want = obs.desired_replicas
    if (
        not dep
        or seen < generation
        or counts["updatedReplicas"] < want
        or counts["replicas"] > counts["updatedReplicas"]
    ):
        return counts, "RolloutInProgress", ""
    return counts, None, ""


def _pick(obs: Observation) -> tuple[str, str, dict[str, int]]:
    """(reason, message, counts) for the whole service."""
    if obs.failure_reason is not None:
        return obs.failure_reason, obs.failure_message, {}
    counts, dep_reason, dep_message = _deployment_state(obs)
    want = obs.desired_replicas
    issues = [i for i in (diagnose_pod(p, obs.gpu_resource) for p in obs.pods) if i is not None]
    prefix = f"{counts['readyReplicas']}/{want} replicas ready"
    candidates: list[tuple[str, str]] = [(i.reason, f"pod {i.pod}: {i.message}") for i in issues]
    if dep_reason is not None:
        detail = dep_message or f"{counts['updatedReplicas']}/{want} replicas on the current spec"
        candidates.append((dep_reason, detail))
    if candidates:
        reason, detail = min(candidates, key=lambda c: _PRIORITY.index(c[0]))
        return reason, f"{prefix}; {detail}", counts
    if want == 0:
        return "ScaledToZero", "replicas is 0: no engine is running", counts
    if counts["readyReplicas"] < want:
        return "ModelLoading", f"{prefix}; waiting for engines to pass readiness", counts
    return "AllReplicasReady", f"{prefix}", counts


def _cond(
    kind: str,
    value: bool,
    reason: str,
    message: str,
    obs: Observation,
    previous: Mapping[str, Mapping[str, Any]],
    now: str,
) -> dict[str, Any]:
    status = "True" if value else "False"
    old = previous.get(kind)
    since = now
    if old is not None and old.get("status") == status and old.get("lastTransitionTime"):
        since = str(old["lastTransitionTime"])
    return {
        "type": kind,
        "status": status,
        "reason": reason,
        "message": _clip(message),
        "lastTransitionTime": since,
        "observedGeneration": obs.generation,
    }


def compute_status(
    obs: Observation,
    previous_status: Mapping[str, Any] | None,
    now: dt.datetime,
    extra_conditions: Sequence[Mapping[str, Any]] | None = None,
) -> StatusReport:
    """The new status and the condition transitions since ``previous_status``.

    ``extra_conditions`` (the autoscaler's ``Autoscaling``) follow the three owned
    here; None keeps the conditions of other types that ``previous_status`` has.
    """
    reason, message, counts = _pick(obs)
    previous = {str(c.get("type")): c for c in (previous_status or {}).get("conditions") or () if c}
    stamp = format_time(now)
    ready = reason == "AllReplicasReady"
    degraded = reason in DEGRADED_REASONS
    progressing = reason in _PROGRESS_REASONS
    conditions = [
        _cond("Ready", ready, reason, message, obs, previous, stamp),
        _cond(
            "Progressing",
            progressing,
            reason if (progressing or degraded) else "Complete",
            message,
            obs,
            previous,
            stamp,
        ),
        _cond(
            "Degraded",
            degraded,
            reason if degraded else "AsExpected",
            message if degraded else "",
            obs,
            previous,
            stamp,
        ),
    ]
    owned = {"Ready", "Progressing", "Degraded"}
    extra = (
        [dict(c) for c in extra_conditions]
        if extra_conditions is not None
        else [dict(c) for t, c in previous.items() if t not in owned]
    )
    status: dict[str, Any] = {
        "observedGeneration": obs.generation,
        "conditions": [*conditions, *extra],
        **counts,
    }
    for key, value in (
        ("selector", obs.selector),
        ("url", obs.url),
        ("servedModel", obs.served_model),
        ("engine", obs.engine),
    ):
        if value is not None:
            status[key] = value
    transitions: tuple[Transition, ...] = ()
    old_ready = previous.get("Ready")
    new_ready = conditions[0]
    if old_ready is None or (old_ready.get("status"), old_ready.get("reason")) != (
        new_ready["status"],
        new_ready["reason"],
    ):
        transitions = (
            Transition(
                type="Warning" if degraded else "Normal",
                reason=reason,
                message=_clip(f"Ready={new_ready['status']}: {message}"),
            ),
        )
    return StatusReport(status=status, transitions=transitions, reason=reason)
