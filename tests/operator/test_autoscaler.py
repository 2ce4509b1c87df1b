"""The autoscaling loop against the in-memory API (tests/operator/conftest.py ``FakeKube``).

What the control-plane test (test_autoscale_k8s.py) cannot time cheaply: the drain
timeout, demand coming back during a drain, routers that do not answer, a restart
that resumes from status, and the test-mode refusal to scrape off loopback.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
from conftest import FakeKube
from routerdemand import RouterDemand

from fleetgate.operator import manifests
from fleetgate.operator.autoscaler import ANNOTATION_DRAIN, Autoscaler
from fleetgate.operator.metrics import OperatorMetrics
from fleetgate.operator.options import OperatorOptions
from fleetgate.operator.reconcile import Reconciler

URL = "http://127.0.0.1:9/metrics"


class Clock:
    def __init__(self) -> None:
        self.now = 1_796_000_000.0

    def __call__(self) -> float:
        return self.now


def _setup(
    kube: FakeKube, replicas: int, **autoscaling: Any
) -> tuple[Autoscaler, RouterDemand, Clock]:
    auto = {"maxReplicas": 4, "targetInFlightPerReplica": 2, "scaleDownStabilizationSeconds": 0}
    auto.update(autoscaling)
    kube.put(
        {
            "apiVersion": "fleetgate.dev/v1alpha1",
            "kind": "InferenceService",
            "metadata": {"name": "svc", "namespace": "ns", "generation": 1},
            "spec": {
                "model": {"uri": "hf://org/model"},
                "engine": {"type": "vllm", "image": "img:1.0.0"},
                "replicas": replicas,
                "autoscaling": auto,
            },
        }
    )
    for i in range(replicas):
        kube.put(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {
                    "name": f"svc-{i}",
                    "namespace": "ns",
                    "labels": manifests.selector_labels("svc"),
                    "creationTimestamp": "2026-11-29T12:00:00Z",
                },
                "status": {
                    "conditions": [
                        {
                            "type": "Ready",
                            "status": "True",
                            "lastTransitionTime": "2026-11-29T12:00:42Z",
                        }
                    ]
                },
            }
        )
    router, clock = RouterDemand(), Clock()
    options = OperatorOptions(router_metrics_urls=(URL,))
    metrics = OperatorMetrics()
    reconciler = Reconciler(kube, options, metrics)
    scaler = Autoscaler(
        kube,
        reconciler,
        options,
        metrics,
        ("ns",),
        stop=threading.Event(),
        fetch=lambda url: router.text(),
        clock=clock,
    )
    return scaler, router, clock


def _svc(kube: FakeKube) -> dict[str, Any]:
    return kube.objects[("InferenceService", "ns", "svc")]


def _annotations(kube: FakeKube, pod: str) -> dict[str, str]:
    return kube.objects[("Pod", "ns", pod)]["metadata"].get("annotations") or {}


def test_drain_times_out_then_scales_down(kube: FakeKube) -> None:
    scaler, router, clock = _setup(kube, 2, drainTimeoutSeconds=30)
    router.set_in_flight({"ns/svc-0": 1, "ns/svc-1": 0})  # load 1 -> 1 replica
    scaler.run_once()
    assert _annotations(kube, "svc-1")[ANNOTATION_DRAIN] == "true"  # least in flight
    router.set_in_flight({"ns/svc-1": 1})  # a request lands before the router saw the drain
    clock.now += 10
    scaler.run_once()
    assert _svc(kube)["spec"]["replicas"] == 2
    assert _svc(kube)["status"]["autoscaling"]["reason"].startswith("Draining: pod svc-1 (1 in")
    clock.now += 25  # 35 s since the drain began
    scaler.run_once()
    assert _svc(kube)["spec"]["replicas"] == 1
    assert "(pod svc-1 drain timeout, 1 in flight)" in _svc(kube)["status"]["autoscaling"]["reason"]
    events = [o for o in kube.of_kind("Event") if o["reason"] == "ScaledDown"]
    assert [e["message"] for e in events] == [
        "2 -> 1 replicas; in-flight 1/replica < target 2 (pod svc-1 drain timeout, 1 in flight)"
    ]


def test_demand_back_during_a_drain_keeps_the_pod(kube: FakeKube) -> None:
    scaler, router, clock = _setup(kube, 2)
    router.set_in_flight({"ns/svc-0": 2, "ns/svc-1": 1})  # 3 / 2 -> 2: steady
    scaler.run_once()
    assert ANNOTATION_DRAIN not in _annotations(kube, "svc-1")
    router.set_in_flight({"ns/svc-0": 1, "ns/svc-1": 1})  # 2 / 2 -> 1: drain
    clock.now += 1
    scaler.run_once()
    assert _annotations(kube, "svc-0")[ANNOTATION_DRAIN] == "true"
    router.set_queue("svc", 3)  # 5 / 2 -> 3: back up
    clock.now += 1
    scaler.run_once()
    assert _annotations(kube, "svc-0") == {}  # both annotations removed
    assert _svc(kube)["spec"]["replicas"] == 3
    assert _svc(kube)["status"]["autoscaling"].get("draining") is None


def test_no_router_answering_is_not_zero_demand(kube: FakeKube) -> None:
    scaler, router, clock = _setup(kube, 2, minReplicas=0, scaleToZeroAfterSeconds=1)

    def down(url: str) -> str:
        raise OSError("connection refused")

    scaler._fetch = down
    for _ in range(3):
        clock.now += 5
        scaler.run_once()
    assert _svc(kube)["spec"]["replicas"] == 2
    cond = [c for c in _svc(kube)["status"]["conditions"] if c["type"] == "Autoscaling"]
    assert cond and cond[0]["status"] == "False" and cond[0]["reason"] == "NoMetrics"


def test_a_restart_resumes_the_drain_from_status(kube: FakeKube) -> None:
    scaler, router, clock = _setup(kube, 2)
    router.set_in_flight({"ns/svc-0": 0, "ns/svc-1": 1})
    scaler.run_once()
    assert _svc(kube)["status"]["autoscaling"]["draining"]["pod"] == "svc-0"
    fresh, router2, _ = _restart(kube, scaler, clock)
    router2.set_in_flight({"ns/svc-0": 0, "ns/svc-1": 1})
    clock.now += 1
    fresh.run_once()
    assert _svc(kube)["spec"]["replicas"] == 1  # the same victim, not a second one
    assert _annotations(kube, "svc-1") == {}
    assert "(pod svc-0 drained)" in _svc(kube)["status"]["autoscaling"]["reason"]


def _restart(
    kube: FakeKube, old: Autoscaler, clock: Clock
) -> tuple[Autoscaler, RouterDemand, Clock]:
    router = RouterDemand()
    options = OperatorOptions(router_metrics_urls=(URL,))
    metrics = OperatorMetrics()
    scaler = Autoscaler(
        kube,
        Reconciler(kube, options, metrics),
        options,
        metrics,
        ("ns",),
        stop=threading.Event(),
        fetch=lambda url: router.text(),
        clock=clock,
    )
    return scaler, router, clock


def test_measured_cold_start_is_used_without_a_spec_value(kube: FakeKube) -> None:
    scaler, router, _ = _setup(kube, 1)
    router.set_in_flight({"ns/svc-0": 1})
    scaler.run_once()
    auto = _svc(kube)["status"]["autoscaling"]
    assert auto["measuredColdStartSeconds"] == 42.0
    assert auto["coldStartSeconds"] == 42.0


def test_test_mode_never_scrapes_off_loopback(
    kube: FakeKube, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FLEETGATE_TEST_MODE", "1")
    seen: list[str] = []
    scaler, _, _ = _setup(kube, 1)
    scaler._options = OperatorOptions(router_metrics_urls=("http://10.0.0.7:8080/metrics", URL))
    scaler._test_mode = True
    scaler._fetch = lambda url: seen.append(url) or ""
    scaler.scrape()
    assert seen == [URL]


def test_switching_autoscaling_off_mid_drain_undrains_and_drops_the_condition(
    kube: FakeKube,
) -> None:
    scaler, router, clock = _setup(kube, 2)
    router.set_in_flight({"ns/svc-0": 0, "ns/svc-1": 1})
    scaler.run_once()
    assert _annotations(kube, "svc-0")[ANNOTATION_DRAIN] == "true"
    assert any(c["type"] == "Autoscaling" for c in _svc(kube)["status"]["conditions"])
    del _svc(kube)["spec"]["autoscaling"]
    clock.now += 1
    scaler.run_once()
    assert _annotations(kube, "svc-0") == {}
    assert _svc(kube)["spec"]["replicas"] == 2
    assert not _svc(kube)["status"].get("autoscaling")
    scaler._reconciler.reconcile_by_name("ns", "svc")
    assert [c["type"] for c in _svc(kube)["status"]["conditions"]] == [
        "Ready",
        "Progressing",
        "Degraded",
    ]


def test_no_autoscaled_service_means_no_scraping(kube: FakeKube) -> None:
    scaler, _, _ = _setup(kube, 1)
    del _svc(kube)["spec"]["autoscaling"]
    seen: list[str] = []
    scaler._fetch = lambda url: seen.append(url) or ""
    assert scaler.run_once() == 0
    assert seen == []
