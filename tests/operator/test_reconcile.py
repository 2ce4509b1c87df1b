"""The reconciler against an in-memory API (tests/operator/conftest.py ``FakeKube``).

We test these aspects: first reconcile creates every child and a status; an unchanged
spec writes nothing (level-based loop is quiet); drift (deleted or edited child) is
restored; a spec change re-applies; engine switch prunes the TensorRT-LLM ConfigMap;
a restarted operator (fresh Reconciler) writes nothing; invalid input and API refusals
become Degraded conditions with readable messages instead of exceptions.
"""

from __future__ import annotations

import copy
import datetime as dt
from typing import Any

import pytest
from conftest import FakeKube

from fleetgate.operator.kube import KubeError
from fleetgate.operator.metrics import OperatorMetrics
from fleetgate.operator.options import OperatorOptions
from fleetgate.operator.reconcile import Reconciler

NOW = dt.datetime(2026, 11, 29, 12, 0, tzinfo=dt.UTC)


def _reconciler(kube: FakeKube, metrics: OperatorMetrics | None = None) -> Reconciler:
    ticks = iter(range(10_000))
    return Reconciler(
        kube,
        OperatorOptions(),
        metrics or OperatorMetrics(),
        clock=lambda: NOW,
        monotonic=lambda: float(next(ticks)),
    )


def _isvc(kube: FakeKube, engine: str = "vllm", **spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "apiVersion": "fleetgate.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "svc", "namespace": "ns", "generation": 1},
        "spec": {
            "model": {"uri": "hf://org/model"},
            "engine": {"type": engine, "image": "img:1.0.0"},
            **spec,
        },
    }
    return kube.put(body)


def _current(kube: FakeKube) -> dict[str, Any]:
    return copy.deepcopy(kube.objects[("InferenceService", "ns", "svc")])


def _edit_spec(kube: FakeKube, **spec: Any) -> None:
    obj = kube.objects[("InferenceService", "ns", "svc")]
    obj["spec"].update(spec)
    obj["metadata"]["generation"] += 1


def test_first_reconcile_creates_children_and_status(kube: FakeKube) -> None:
    rec = _reconciler(kube)
    outcome = rec.reconcile(_isvc(kube, "tensorrt-llm"))
    assert outcome is not None
    assert sorted(outcome.writes) == [
        "ConfigMap/svc-engine-config",
        "Deployment/svc",
        "PodDisruptionBudget/svc",
        "Service/svc",
    ]
    assert outcome.status_written
    st = _current(kube)["status"]
    assert st["observedGeneration"] == 1
    assert st["url"] == "http://svc.ns.svc.cluster.local:8000"
    assert st["servedModel"] == "svc" and st["engine"] == "tensorrt-llm"
    ready = st["conditions"][0]
    assert (ready["type"], ready["status"]) == ("Ready", "False")
    events = kube.of_kind("Event")
    assert len(events) == 1 and events[0]["involvedObject"]["name"] == "svc"
    for child in ("Deployment", "Service", "PodDisruptionBudget", "ConfigMap"):
        (obj,) = kube.of_kind(child)
        assert obj["metadata"]["ownerReferences"][0]["uid"] == _current(kube)["metadata"]["uid"]


def test_unchanged_spec_causes_no_writes(kube: FakeKube) -> None:
    rec = _reconciler(kube)
    rec.reconcile(_isvc(kube))
    kube.calls.clear()
    for _ in range(3):
        outcome = rec.reconcile(_current(kube))
        assert outcome is not None and outcome.writes == () and not outcome.status_written
    assert kube.writes() == []


def test_restarted_operator_writes_nothing(kube: FakeKube) -> None:
    _reconciler(kube).reconcile(_isvc(kube))
    kube.calls.clear()
    fresh = _reconciler(kube)  # a new process: no memory of what it did
    outcome = fresh.reconcile(_current(kube))
    assert outcome is not None and outcome.writes == ()
    assert kube.writes() == []
    assert len(kube.of_kind("Deployment")) == 1


@pytest.mark.parametrize(
    "drift",
    [
        pytest.param(lambda k: k.objects.pop(("Deployment", "ns", "svc")), id="deployment-deleted"),
        pytest.param(lambda k: k.objects.pop(("Service", "ns", "svc")), id="service-deleted"),
        pytest.param(
            lambda k: k.objects[("Deployment", "ns", "svc")]["spec"]["template"]["spec"][
                "containers"
            ][0].update(image="evil:1"),
            id="image-edited",
        ),
        pytest.param(
            lambda k: k.objects[("Service", "ns", "svc")]["metadata"]["labels"].pop(
                "fleetgate.dev/pool"
            ),
            id="label-removed",
        ),
    ],
)
def test_drift_is_restored(kube: FakeKube, drift: Any) -> None:
    rec = _reconciler(kube)
    rec.reconcile(_isvc(kube))
    want_dep = copy.deepcopy(kube.objects[("Deployment", "ns", "svc")]["spec"])
    want_svc_labels = copy.deepcopy(kube.objects[("Service", "ns", "svc")]["metadata"]["labels"])
    drift(kube)
    outcome = rec.reconcile(_current(kube))
    assert outcome is not None and len(outcome.writes) == 1
    assert kube.objects[("Deployment", "ns", "svc")]["spec"] == want_dep
    assert kube.objects[("Service", "ns", "svc")]["metadata"]["labels"] == want_svc_labels


def test_spec_change_reapplies_and_removed_field_goes(kube: FakeKube) -> None:
    rec = _reconciler(kube)
    rec.reconcile(_isvc(kube, scheduling={"nodeSelector": {"pool": "a"}}))
    _edit_spec(kube, scheduling={}, replicas=3)
    outcome = rec.reconcile(_current(kube))
    assert outcome is not None and "Deployment/svc" in outcome.writes
    dep = kube.objects[("Deployment", "ns", "svc")]
    assert dep["spec"]["replicas"] == 3
    assert "nodeSelector" not in dep["spec"]["template"]["spec"]
    assert _current(kube)["status"]["observedGeneration"] == 2


def test_engine_switch_prunes_config_map(kube: FakeKube) -> None:
    rec = _reconciler(kube)
    rec.reconcile(_isvc(kube, "tensorrt-llm"))
    assert kube.of_kind("ConfigMap")
    _edit_spec(kube, engine={"type": "vllm", "image": "img:2"})
    outcome = rec.reconcile(_current(kube))
    assert outcome is not None and "-ConfigMap/svc-engine-config" in outcome.writes
    assert kube.of_kind("ConfigMap") == []
    labels = kube.objects[("Deployment", "ns", "svc")]["spec"]["template"]["metadata"]["labels"]
    assert labels["fleetgate.dev/engine"] == "vllm"


def test_service_monitor_only_when_the_crd_exists(kube: FakeKube) -> None:
    _reconciler(kube).reconcile(_isvc(kube))
    assert kube.of_kind("ServiceMonitor") == []
    kube.served_kinds.add("ServiceMonitor")
    _reconciler(kube).reconcile(_current(kube))
    (monitor,) = kube.of_kind("ServiceMonitor")
    assert monitor["spec"]["endpoints"][0]["path"] == "/metrics"


def test_invalid_spec_becomes_degraded_not_an_exception(kube: FakeKube) -> None:
    metrics = OperatorMetrics()
    rec = _reconciler(kube, metrics)
    body = _isvc(kube, parallelism={"tensor": 2}, gpu={"count": 1})
    outcome = rec.reconcile(body)
    assert outcome is not None and outcome.reason == "InvalidSpec" and outcome.writes == ()
    st = _current(kube)["status"]
    degraded = {c["type"]: c for c in st["conditions"]}["Degraded"]
    assert degraded["status"] == "True" and degraded["reason"] == "InvalidSpec"
    assert "parallelism.tensor x parallelism.pipeline must equal gpu.count" in degraded["message"]
    assert kube.of_kind("Deployment") == []
    assert metrics.reconciles.labels(result="invalid")._value.get() == 1
    (event,) = kube.of_kind("Event")
    assert event["type"] == "Warning" and event["reason"] == "InvalidSpec"
    kube.calls.clear()
    rec.reconcile(_current(kube))
    assert kube.writes() == [], "the same invalid spec is reported once, not retried in a loop"


def test_name_the_children_cannot_carry_is_invalid_spec_not_apply_failed(kube: FakeKube) -> None:
    # Created before the CRD refused such names (70 characters would fail at apply,
    # "labels must be no more than 63 bytes"): say why once, write no child.
    long_name = "a" * 70
    body = _isvc(kube)
    del kube.objects[("InferenceService", "ns", "svc")]
    body["metadata"]["name"] = long_name
    outcome = _reconciler(kube).reconcile(kube.put(body))
    assert outcome is not None and outcome.reason == "InvalidSpec" and outcome.writes == ()
    st = kube.objects[("InferenceService", "ns", long_name)]["status"]
    degraded = {c["type"]: c for c in st["conditions"]}["Degraded"]
    assert degraded["reason"] == "InvalidSpec"
    assert "metadata.name must be at most 63 characters" in degraded["message"]
    assert "got 70 characters" in degraded["message"]
    assert kube.of_kind("Deployment") == [] and kube.of_kind("Service") == []


def test_node_selector_key_kubernetes_refuses_is_invalid_spec(kube: FakeKube) -> None:
    # The one name rule CEL cannot afford (map keys): caught here, before any apply.
    outcome = _reconciler(kube).reconcile(_isvc(kube, scheduling={"nodeSelector": {"a b": "c"}}))
    assert outcome is not None and outcome.reason == "InvalidSpec" and outcome.writes == ()
    degraded = {c["type"]: c for c in _current(kube)["status"]["conditions"]}["Degraded"]
    assert "nodeSelector: every key must be a label key" in degraded["message"]


def test_api_refusal_becomes_apply_failed(kube: FakeKube) -> None:
    kube.refuse["Deployment"] = KubeError(422, 'Deployment.apps "svc" is invalid: bad quantity')
    outcome = _reconciler(kube).reconcile(_isvc(kube))
    assert outcome is not None and outcome.reason == "ApplyFailed"
    ready = _current(kube)["status"]["conditions"][0]
    assert ready["reason"] == "ApplyFailed"
    assert "Deployment svc was refused: Deployment.apps" in ready["message"]
    assert ready["message"].endswith("bad quantity (HTTP 422)")


def test_name_taken_by_someone_else(kube: FakeKube) -> None:
    kube.put(
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "svc", "namespace": "ns"},
            "spec": {},
        }
    )
    outcome = _reconciler(kube).reconcile(_isvc(kube))
    assert outcome is not None and outcome.reason == "NameConflict"
    assert (
        "Service svc already exists and is not owned"
        in _current(kube)["status"]["conditions"][0]["message"]
    )
    (svc,) = kube.of_kind("Service")
    assert "ownerReferences" not in svc["metadata"], "a foreign object is never adopted"


def test_status_follows_pods(kube: FakeKube) -> None:
    rec = _reconciler(kube)
    rec.reconcile(_isvc(kube))
    dep = kube.objects[("Deployment", "ns", "svc")]
    dep["status"] = {
        "observedGeneration": 1,
        "replicas": 1,
        "updatedReplicas": 1,
        "readyReplicas": 0,
    }
    labels = dep["spec"]["template"]["metadata"]["labels"]
    kube.put(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "svc-1", "namespace": "ns", "labels": labels},
            "status": {
                "phase": "Pending",
                "conditions": [
                    {
                        "type": "PodScheduled",
                        "status": "False",
                        "reason": "Unschedulable",
                        "message": "0/4 nodes are available: 4 Insufficient nvidia.com/gpu.",
                    }
                ],
            },
        }
    )
    outcome = rec.reconcile(_current(kube))
    assert outcome is not None and outcome.reason == "InsufficientGPU"
    assert outcome.writes == ()
    kube.objects[("Pod", "ns", "svc-1")]["status"] = {
        "phase": "Running",
        "conditions": [
            {"type": "PodScheduled", "status": "True"},
            {"type": "Ready", "status": "True"},
        ],
        "containerStatuses": [
            {"name": "engine", "ready": True, "restartCount": 0, "state": {"running": {}}}
        ],
    }
    dep["status"].update(readyReplicas=1, availableReplicas=1)
    metrics = OperatorMetrics()
    outcome = _reconciler(kube, metrics).reconcile(_current(kube))
    assert outcome is not None and outcome.reason == "AllReplicasReady"
    assert _current(kube)["status"]["conditions"][0]["status"] == "True"
    assert metrics.replicas_ready.labels(namespace="ns", name="svc")._value.get() == 1
    reasons = [e["reason"] for e in kube.of_kind("Event")]
    assert reasons[-2:] == ["InsufficientGPU", "AllReplicasReady"]


def test_deleting_object_is_left_alone(kube: FakeKube) -> None:
    body = _isvc(kube)
    body["metadata"]["deletionTimestamp"] = "2026-11-29T12:00:00Z"
    assert _reconciler(kube).reconcile(body) is None
    assert kube.writes() == []


def test_reconcile_by_name_of_missing_service(kube: FakeKube) -> None:
    assert _reconciler(kube).reconcile_by_name("ns", "nope") is None


def test_resync_reconciles_every_service_and_survives_errors(kube: FakeKube) -> None:
    import threading

    from fleetgate.operator.reconcile import Resync

    _isvc(kube)
    other = _isvc(kube)
    other["metadata"]["name"] = "other"
    kube.put(other)
    kube.put({"apiVersion": "fleetgate.dev/v1alpha1", "kind": "InferenceService",
              "metadata": {"name": "broken", "namespace": "ns"}})  # fmt: skip
    stop = threading.Event()
    resync = Resync(kube, _reconciler(kube), ("ns",), 0.01, stop)
    assert resync.run_once() == 3
    assert sorted(d["metadata"]["name"] for d in kube.of_kind("Deployment")) == ["other", "svc"]
    broken = kube.objects[("InferenceService", "ns", "broken")]["status"]
    assert broken["conditions"][0]["reason"] == "InvalidSpec"
    stop.set()
    assert resync.run_once() == 0


def test_service_monitor_crd_removed_behind_stale_discovery(kube: FakeKube) -> None:
    from fleetgate.operator.kube import NotFound

    kube.served_kinds.add("ServiceMonitor")  # discovery still says it is there
    kube.refuse["ServiceMonitor"] = NotFound(404, "404 page not found")
    rec = _reconciler(kube)
    outcome = rec.reconcile(_isvc(kube))
    assert outcome is not None and outcome.reason != "ApplyFailed"
    assert "Deployment/svc" in outcome.writes and kube.of_kind("ServiceMonitor") == []
    kube.calls.clear()
    rec.reconcile(_current(kube))
    assert ("apply", "ServiceMonitor", "svc") not in kube.calls, "remembered until the recheck"


def test_unknown_trtllm_version_is_a_clear_condition(kube: FakeKube) -> None:
    """The release comes from spec.engine.version or the image tag, else a
    Degraded condition says how to fix it; nothing is applied meanwhile."""
    rec = _reconciler(kube)
    body = _isvc(kube, "tensorrt-llm")
    body["spec"]["engine"]["image"] = "registry.local/trt:latest"
    outcome = rec.reconcile(body)
    assert outcome is not None and outcome.reason == "UnknownEngineVersion"
    degraded = {c["type"]: c for c in _current(kube)["status"]["conditions"]}["Degraded"]
    assert degraded["status"] == "True" and degraded["reason"] == "UnknownEngineVersion"
    assert "spec.engine.version" in degraded["message"] and "'latest'" in degraded["message"]
    assert kube.of_kind("Deployment") == []
    _edit_spec(kube, engine={"type": "tensorrt-llm", "image": "trt:latest", "version": "1.0.0"})
    outcome = rec.reconcile(_current(kube))
    assert outcome is not None and outcome.reason != "UnknownEngineVersion"
    (svc,) = kube.of_kind("Service")
    assert svc["metadata"]["annotations"]["fleetgate.dev/engine-version"] == "1.0"
