"""Status diagnosis: pod and Deployment states -> Ready / Progressing / Degraded.

We test these aspects: each reason from a realistic object (shapes as the kubelet and
scheduler write them), the precedence between reasons, lastTransitionTime stability,
and which changes become Events.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest

from fleetgate.operator import status

T0 = dt.datetime(2026, 11, 29, 12, 0, 0, tzinfo=dt.UTC)
T1 = T0 + dt.timedelta(minutes=5)


def pod(name: str = "p", **st: Any) -> dict[str, Any]:
    return {"metadata": {"name": name}, "status": st}


def unschedulable(message: str) -> dict[str, Any]:
    return pod(
        phase="Pending",
        conditions=[
            {
                "type": "PodScheduled",
                "status": "False",
                "reason": "Unschedulable",
                "message": message,
            }
        ],
    )


def waiting(reason: str, message: str = "", **extra: Any) -> dict[str, Any]:
    return pod(
        phase="Pending",
        conditions=[{"type": "PodScheduled", "status": "True"}],
        containerStatuses=[
            {
                "name": "engine",
                "ready": False,
                "state": {"waiting": {"reason": reason, "message": message}},
                **extra,
            }
        ],
    )


def running(ready: bool, restarts: int = 0, last: dict[str, Any] | None = None) -> dict[str, Any]:
    cs: dict[str, Any] = {
        "name": "engine",
        "ready": ready,
        "restartCount": restarts,
        "state": {"running": {"startedAt": "x"}},
    }
    if last:
        cs["lastState"] = {"terminated": last}
    return pod(
        phase="Running",
        conditions=[
            {"type": "PodScheduled", "status": "True"},
            {"type": "Ready", "status": "True" if ready else "False"},
        ],
        containerStatuses=[cs],
    )


def deployment(
    replicas: int, ready: int, updated: int, generation: int = 1, observed: int = 1, **more: Any
) -> dict[str, Any]:
    return {
        "metadata": {"generation": generation},
        "status": {
            "observedGeneration": observed,
            "replicas": replicas,
            "readyReplicas": ready,
            "updatedReplicas": updated,
            "availableReplicas": ready,
            **more,
        },
    }


GPU_MSG = (
    "0/4 nodes are available: 4 Insufficient nvidia.com/gpu. preemption: 0/4 nodes are available"
)


@pytest.mark.parametrize(
    ("p", "reason", "fragment"),
    [
        pytest.param(
            unschedulable(GPU_MSG), "InsufficientGPU", "Insufficient nvidia.com/gpu", id="gpu"
        ),
        pytest.param(
            unschedulable(
                "0/4 nodes are available: 4 node(s) didn't match Pod's node affinity/selector."
            ),
            "Unschedulable",
            "affinity",
            id="affinity",
        ),
        pytest.param(
            waiting("ErrImagePull", "manifest unknown"),
            "ImagePullFailed",
            "manifest unknown",
            id="pull",
        ),
        pytest.param(
            waiting("ImagePullBackOff", "Back-off pulling"),
            "ImagePullFailed",
            "Back-off",
            id="backoff",
        ),
        pytest.param(
            waiting("InvalidImageName"), "ImagePullFailed", "InvalidImageName", id="bad-name"
        ),
        pytest.param(
            waiting("CreateContainerConfigError", 'secret "hf" not found'),
            "ContainerConfigError",
            'secret "hf" not found',
            id="missing-secret",
        ),
        pytest.param(
            waiting(
                "CrashLoopBackOff",
                restartCount=4,
                lastState={"terminated": {"exitCode": 1, "reason": "Error"}},
            ),
            "CrashLoop",
            "exit code 1 (Error)",
            id="crashloop",
        ),
        pytest.param(
            running(False, restarts=2, last={"exitCode": 137, "reason": "OOMKilled"}),
            "CrashLoop",
            "137 (OOMKilled)",
            id="restarting-oom",
        ),
        pytest.param(running(False), "ModelLoading", "not ready", id="loading"),
        pytest.param(waiting("ContainerCreating"), "ModelLoading", "pending", id="creating"),
    ],
)
def test_diagnose_pod(p: dict[str, Any], reason: str, fragment: str) -> None:
    issue = status.diagnose_pod(p)
    assert issue is not None
    assert issue.reason == reason
    assert fragment in issue.message


@pytest.mark.parametrize(
    "p",
    [
        pytest.param(running(True), id="ready"),
        pytest.param(
            {**unschedulable(GPU_MSG), "metadata": {"name": "p", "deletionTimestamp": "x"}},
            id="terminating",
        ),
    ],
)
def test_diagnose_pod_healthy(p: dict[str, Any]) -> None:
    assert status.diagnose_pod(p) is None


def obs(**kw: Any) -> status.Observation:
    kw.setdefault("name", "svc")
    kw.setdefault("generation", 3)
    kw.setdefault("desired_replicas", 2)
    return status.Observation(**kw)


def conds(report: status.StatusReport) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in report.status["conditions"]}


@pytest.mark.parametrize(
    ("observation", "ready", "progressing", "degraded"),
    [
        pytest.param(
            obs(deployment=deployment(2, 2, 2), pods=[running(True), running(True)]),
            ("True", "AllReplicasReady"),
            ("False", "Complete"),
            ("False", "AsExpected"),
            id="all-ready",
        ),
        pytest.param(
            obs(deployment=deployment(2, 0, 2), pods=[unschedulable(GPU_MSG), running(False)]),
            ("False", "InsufficientGPU"),
            ("False", "InsufficientGPU"),
            ("True", "InsufficientGPU"),
            id="gpu-beats-loading",
        ),
        pytest.param(
            obs(deployment=deployment(2, 1, 2), pods=[running(True), running(False)]),
            ("False", "ModelLoading"),
            ("True", "ModelLoading"),
            ("False", "AsExpected"),
            id="loading",
        ),
        pytest.param(
            obs(deployment=deployment(2, 2, 1), pods=[running(True), running(True)]),
            ("False", "RolloutInProgress"),
            ("True", "RolloutInProgress"),
            ("False", "AsExpected"),
            id="rollout-old-pod-still-ready",
        ),
        pytest.param(
            obs(deployment=deployment(2, 2, 2, generation=2, observed=1), pods=[running(True)] * 2),
            ("False", "RolloutInProgress"),
            ("True", "RolloutInProgress"),
            ("False", "AsExpected"),
            id="new-generation-unseen",
        ),
        pytest.param(
            obs(
                deployment=deployment(
                    2,
                    1,
                    2,
                    conditions=[
                        {
                            "type": "Progressing",
                            "status": "False",
                            "reason": "ProgressDeadlineExceeded",
                            "message": "too slow",
                        }
                    ],
                ),
                pods=[running(True), running(False)],
            ),
            ("False", "ProgressDeadlineExceeded"),
            ("False", "ProgressDeadlineExceeded"),
            ("True", "ProgressDeadlineExceeded"),
            id="deadline",
        ),
        pytest.param(
            obs(
                deployment=deployment(
                    0,
                    0,
                    0,
                    conditions=[
                        {
                            "type": "ReplicaFailure",
                            "status": "True",
                            "reason": "FailedCreate",
                            "message": 'pods "svc-x" is forbidden: no PriorityClass "nope"',
                        }
                    ],
                ),
                pods=[],
            ),
            ("False", "PodCreationFailed"),
            ("False", "PodCreationFailed"),
            ("True", "PodCreationFailed"),
            id="pods-refused",
        ),
        pytest.param(
            obs(desired_replicas=0, deployment=deployment(0, 0, 0), pods=[]),
            ("False", "ScaledToZero"),
            ("False", "Complete"),
            ("False", "AsExpected"),
            id="zero",
        ),
        pytest.param(
            obs(failure_reason="InvalidSpec", failure_message="spec.x: bad"),
            ("False", "InvalidSpec"),
            ("False", "InvalidSpec"),
            ("True", "InvalidSpec"),
            id="invalid",
        ),
        pytest.param(
            obs(deployment=None, pods=[]),
            ("False", "RolloutInProgress"),
            ("True", "RolloutInProgress"),
            ("False", "AsExpected"),
            id="no-deployment-yet",
        ),
    ],
)
def test_conditions(
    observation: status.Observation,
    ready: tuple[str, str],
    progressing: tuple[str, str],
    degraded: tuple[str, str],
) -> None:
    report = status.compute_status(observation, None, T0)
    assert conds(report) == {"Ready": ready, "Progressing": progressing, "Degraded": degraded}
    assert report.status["observedGeneration"] == 3
    for c in report.status["conditions"]:
        assert c["observedGeneration"] == 3
        assert c["lastTransitionTime"] == "2026-11-29T12:00:00Z"


def test_message_names_pod_and_cause() -> None:
    p = unschedulable(GPU_MSG)
    p["metadata"]["name"] = "svc-abc"
    report = status.compute_status(
        obs(deployment=deployment(1, 0, 1), desired_replicas=1, pods=[p]), None, T0
    )
    ready = report.status["conditions"][0]
    assert ready["message"].startswith("0/1 replicas ready; pod svc-abc: 0/4 nodes are available")


def test_counts_and_fields() -> None:
    report = status.compute_status(
        obs(
            deployment=deployment(2, 1, 2),
            pods=[running(True), running(False)],
            url="http://svc.ns.svc.cluster.local:8000",
            selector="a=b",
            served_model="m",
            engine="vllm",
        ),
        None,
        T0,
    )
    st = report.status
    assert (
        st["replicas"],
        st["readyReplicas"],
        st["updatedReplicas"],
        st["availableReplicas"],
    ) == (2, 1, 2, 1)
    assert st["url"] == "http://svc.ns.svc.cluster.local:8000"
    assert (st["selector"], st["servedModel"], st["engine"]) == ("a=b", "m", "vllm")


def test_transition_time_moves_only_on_status_change_and_events_on_change() -> None:
    loading = obs(deployment=deployment(2, 1, 2), pods=[running(True), running(False)])
    first = status.compute_status(loading, None, T0)
    assert [t.reason for t in first.transitions] == ["ModelLoading"]
    assert first.transitions[0].type == "Normal"

    same = status.compute_status(loading, first.status, T1)
    assert same.transitions == ()
    assert same.status == first.status, "an unchanged world yields an identical status"

    gpu = obs(deployment=deployment(2, 1, 2), pods=[running(True), unschedulable(GPU_MSG)])
    worse = status.compute_status(gpu, first.status, T1)
    assert [(t.type, t.reason) for t in worse.transitions] == [("Warning", "InsufficientGPU")]
    by_type = {c["type"]: c for c in worse.status["conditions"]}
    assert by_type["Ready"]["lastTransitionTime"] == "2026-11-29T12:00:00Z"  # still False
    assert by_type["Degraded"]["lastTransitionTime"] == "2026-11-29T12:05:00Z"  # False -> True

    healthy = obs(deployment=deployment(2, 2, 2), pods=[running(True), running(True)])
    ok = status.compute_status(healthy, worse.status, T1 + dt.timedelta(minutes=1))
    assert [(t.type, t.reason) for t in ok.transitions] == [("Normal", "AllReplicasReady")]
    assert ok.transitions[0].message.startswith("Ready=True")


def test_long_messages_are_clipped() -> None:
    report = status.compute_status(
        obs(failure_reason="ApplyFailed", failure_message="x " * 1000), None, T0
    )
    assert len(report.status["conditions"][0]["message"]) <= 480
