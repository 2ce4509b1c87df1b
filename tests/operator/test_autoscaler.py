"""The autoscaling loop against the in-memory API (tests/operator/conftest.py ``FakeKube``).

What the control-plane test (test_autoscale_k8s.py) cannot time cheaply: the drain
timeout, demand coming back during a drain, routers that do not answer, a restart
that resumes from status, and the test-mode refusal to scrape off loopback.
"""

from __future__ import annotations

import re
import threading
import time
from typing import Any

import pytest
from conftest import FakeKube
from routerdemand import RouterDemand

from fleetgate.api.v1alpha1 import InferenceService
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


def test_every_replica_to_remove_drains_at_once_and_they_go_together(kube: FakeKube) -> None:
    """4 -> 1: three victims drain in parallel (one at a time made a big scale-down
    with long requests a drain per replica in a row); the scale-down waits for all of
    them, since the victims share the lowest deletion cost and removing one while
    another still drains could take the busy one."""
    scaler, router, clock = _setup(kube, 4)
    router.set_in_flight({"ns/svc-0": 0, "ns/svc-1": 1, "ns/svc-2": 0, "ns/svc-3": 1})
    scaler.run_once()  # 2 in flight / target 2 -> 1 replica
    auto = _svc(kube)["status"]["autoscaling"]
    assert sorted(d["pod"] for d in auto["draining"]) == ["svc-0", "svc-1", "svc-2"]
    for pod in ("svc-0", "svc-1", "svc-2"):
        assert _annotations(kube, pod)[ANNOTATION_DRAIN] == "true"
    assert _annotations(kube, "svc-3") == {}
    assert _svc(kube)["spec"]["replicas"] == 4
    drains = [o["message"] for o in kube.of_kind("Event") if o["reason"] == "Draining"]
    assert len(drains) == 3
    clock.now += 1
    scaler.run_once()  # svc-1 still has its request: nothing goes yet
    assert _svc(kube)["spec"]["replicas"] == 4
    reason = _svc(kube)["status"]["autoscaling"]["reason"]
    assert reason.startswith("Draining: pod svc-1 (1 in flight) before ScaledDown"), reason
    router.set_in_flight({"ns/svc-0": 0, "ns/svc-1": 0, "ns/svc-2": 0, "ns/svc-3": 1})
    clock.now += 1
    scaler.run_once()
    assert _svc(kube)["spec"]["replicas"] == 1
    assert _svc(kube)["status"]["autoscaling"].get("draining") is None
    downs = [o["message"] for o in kube.of_kind("Event") if o["reason"] == "ScaledDown"]
    assert len(downs) == 1 and downs[0].startswith("4 -> 1 replicas"), downs
    assert "(pod svc-0 drained, pod svc-1 drained, pod svc-2 drained)" in downs[0]


def test_demand_partly_back_keeps_the_busiest_of_the_draining(kube: FakeKube) -> None:
    scaler, router, clock = _setup(kube, 4)
    router.set_in_flight({"ns/svc-0": 0, "ns/svc-1": 1, "ns/svc-2": 0, "ns/svc-3": 1})
    scaler.run_once()  # 3 draining for 4 -> 1
    router.set_in_flight({"ns/svc-0": 0, "ns/svc-1": 1, "ns/svc-2": 0, "ns/svc-3": 5})
    clock.now += 1
    scaler.run_once()  # 6 in flight / 2 -> 3: one replica to remove, not three
    # the least loaded of the three stays drained (and, idle, goes at once); the other
    # two are given back to the router
    assert _svc(kube)["spec"]["replicas"] == 3
    assert "(pod svc-0 drained)" in _svc(kube)["status"]["autoscaling"]["reason"]
    assert _annotations(kube, "svc-1") == {} and _annotations(kube, "svc-2") == {}
    assert _annotations(kube, "svc-0")[ANNOTATION_DRAIN] == "true"


def test_a_drain_recorded_by_an_older_operator_is_resumed(kube: FakeKube) -> None:
    """``status.autoscaling.draining`` was one object before 2026-12-04: an upgraded
    operator finishes that drain instead of choosing another victim."""
    scaler, router, clock = _setup(kube, 2)
    kube.objects[("Pod", "ns", "svc-1")]["metadata"]["annotations"] = {ANNOTATION_DRAIN: "true"}
    _svc(kube)["status"] = {
        "autoscaling": {"draining": {"pod": "svc-1", "since": "2026-11-29T12:01:00Z"}}
    }
    router.set_in_flight({"ns/svc-0": 0, "ns/svc-1": 0})
    scaler.run_once()
    assert _svc(kube)["spec"]["replicas"] == 1
    assert "(pod svc-1 drained)" in _svc(kube)["status"]["autoscaling"]["reason"]
    assert ANNOTATION_DRAIN not in _annotations(kube, "svc-0")


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
    assert _svc(kube)["status"]["autoscaling"]["draining"][0]["pod"] == "svc-0"
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


# -- mixed engines in one pool: the split by role and the GPU budget ---------------------


def _put(
    kube: FakeKube,
    name: str,
    *,
    role: str,
    replicas: int,
    gpus: int = 1,
    engine: str = "vllm",
    **autoscaling: Any,
) -> None:
    auto: dict[str, Any] = {
        "maxReplicas": 8,
        "targetInFlightPerReplica": 2,
        "scaleDownStabilizationSeconds": 0,
    }
    auto.update(autoscaling)
    kube.put(
        {
            "apiVersion": "fleetgate.dev/v1alpha1",
            "kind": "InferenceService",
            "metadata": {"name": name, "namespace": "ns", "generation": 1},
            "spec": {
                "model": {"uri": "hf://org/llama", "name": "llama"},
                "engine": {"type": engine, "image": "img:1.0.0"},
                "gpu": {"count": gpus},
                "parallelism": {"tensor": gpus or 1},
                "replicas": replicas,
                "routing": {"pool": "chat", "role": role},
                "autoscaling": auto,
            },
        }
    )
    _pods(kube, name, range(replicas))


def _pods(kube: FakeKube, name: str, indexes: range) -> None:
    for i in indexes:
        kube.put(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {
                    "name": f"{name}-{i}",
                    "namespace": "ns",
                    "labels": manifests.selector_labels(name),
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


def _pool_scaler(kube: FakeKube, *flags: str) -> tuple[Autoscaler, RouterDemand, Clock]:
    from fleetgate.operator.pools import parse_class_roles, parse_pool_budgets

    budgets = [f.split("=", 1)[1] for f in flags if f.startswith("--pool-gpu-budget=")]
    roles = [f.split("=", 1)[1] for f in flags if f.startswith("--class-role=")]
    router, clock = RouterDemand(), Clock()
    options = OperatorOptions(
        router_metrics_urls=(URL,),
        pool_gpu_budgets=parse_pool_budgets(budgets),
        class_roles=parse_class_roles(roles),
        pool_consolidation="--pool-consolidation" in flags,
    )
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


def _mixed_pair(kube: FakeKube, *flags: str) -> tuple[Autoscaler, RouterDemand, Clock]:
    """TensorRT-LLM (latency) and vLLM (throughput), one replica each at minReplicas 0,
    with critical demand to the first and standard to the second."""
    for name, role in (("trt", "latency"), ("vllm", "throughput")):
        _put(kube, name, role=role, replicas=1, engine="tensorrt-llm" if name == "trt" else "vllm",
             minReplicas=0, targetInFlightPerReplica=4)  # fmt: skip
    return _pool_scaler(kube, "--class-role=standard=throughput", *flags)


def _both_serving(kube: FakeKube) -> tuple[Autoscaler, RouterDemand, Clock]:
    """:func:`_mixed_pair` with ``--pool-consolidation``, both replicas serving and
    one decision made (no arrival rate yet: nothing starts to drain)."""
    scaler, router, clock = _mixed_pair(kube, "--pool-consolidation")
    router.set_in_flight({"ns/trt-0": 0.5, "ns/vllm-0": 1.0})
    router.set_health({"ns/trt-0": True, "ns/vllm-0": True})
    scaler.run_once()
    return scaler, router, clock


def _quiet_second(scaler: Autoscaler, router: RouterDemand, clock: Clock) -> None:
    """One second of quiet traffic (critical 1/s, standard 4/s), then a decision."""
    clock.now += 1
    router.arrive("llama", 1, "critical")
    router.arrive("llama", 4, "standard")
    scaler.run_once()


def _obj(kube: FakeKube, name: str) -> dict[str, Any]:
    return kube.objects[("InferenceService", "ns", name)]


def test_latency_classes_grow_the_latency_role_and_batch_the_throughput_role(
    kube: FakeKube,
) -> None:
    _put(kube, "trt", role="latency", replicas=1, engine="tensorrt-llm")
    _put(kube, "vllm", role="throughput", replicas=1)
    scaler, router, _ = _pool_scaler(kube)
    router.set_queue("llama", 6, "critical")
    router.set_queue("llama", 2, "standard")
    router.set_queue("llama", 4, "batch")
    scaler.run_once()
    # latency: 8 queued / 2 -> 4; throughput: 4 / 2 -> 2 (not 12 / 2 = 6 each)
    assert _obj(kube, "trt")["spec"]["replicas"] == 4
    assert _obj(kube, "vllm")["spec"]["replicas"] == 2
    assert _obj(kube, "trt")["status"]["autoscaling"]["demand"]["queued"] == 8
    assert _obj(kube, "trt")["status"]["autoscaling"]["demandClasses"] == (
        "critical, standard, any other class"
    )
    assert _obj(kube, "vllm")["status"]["autoscaling"]["demandClasses"] == "batch, sheddable"


def test_one_role_in_the_pool_takes_all_the_demand(kube: FakeKube) -> None:
    _put(kube, "vllm", role="throughput", replicas=1)
    _put(kube, "vllm-b", role="throughput", replicas=1)
    scaler, router, _ = _pool_scaler(kube)
    router.set_queue("llama", 6, "critical")
    router.set_queue("llama", 2, "batch")
    scaler.run_once()
    # one replica each: each sizes for half of the 8 queued (8 / 2 = 4 each before,
    # 8 replicas for a queue that 4 serve at the target)
    for name in ("vllm", "vllm-b"):
        assert _obj(kube, name)["spec"]["replicas"] == 2
        assert _obj(kube, name)["status"]["autoscaling"]["demand"]["queued"] == 4
        assert _obj(kube, name)["status"]["autoscaling"]["demandClasses"] == (
            "all classes; 50% of it, shared by 2 services by replicas"
        )


def test_services_sharing_a_demand_at_zero_wake_one_of_them(kube: FakeKube) -> None:
    for name in ("vllm-a", "vllm-b"):
        _put(kube, name, role="throughput", replicas=0, minReplicas=0)
    scaler, router, _ = _pool_scaler(kube)
    router.arrive("llama", 1)
    router.set_held("llama", 1)
    scaler.run_once()
    assert _obj(kube, "vllm-a")["spec"]["replicas"] == 1
    assert _obj(kube, "vllm-b")["spec"]["replicas"] == 0  # woke both before
    assert _obj(kube, "vllm-b")["status"]["autoscaling"]["demand"]["held"] == 0


def test_the_class_mapping_is_configurable(kube: FakeKube) -> None:
    _put(kube, "trt", role="latency", replicas=1, engine="tensorrt-llm")
    _put(kube, "vllm", role="throughput", replicas=1)
    scaler, router, _ = _pool_scaler(kube, "--class-role=standard=throughput")
    router.set_queue("llama", 2, "critical")
    router.set_queue("llama", 6, "standard")
    scaler.run_once()
    assert _obj(kube, "trt")["spec"]["replicas"] == 1
    assert _obj(kube, "vllm")["spec"]["replicas"] == 3


def test_quiet_hours_run_one_replica_for_both_roles_and_the_other_comes_back_on_load(
    kube: FakeKube,
) -> None:
    scaler, router, clock = _both_serving(kube)
    assert _annotations(kube, "trt-0") == {}
    assert _obj(kube, "trt")["spec"]["replicas"] == 1
    # critical 1/s, standard 4/s; 1.5 in flight fills 38% of one vLLM replica's 4
    clock.now += 1
    router.arrive("llama", 1, "critical")
    router.arrive("llama", 4, "standard")
    scaler.run_once()
    assert _annotations(kube, "trt-0").get("fleetgate.dev/drain") == "true"
    reason = _obj(kube, "trt")["status"]["autoscaling"]["reason"]
    assert reason.startswith("Draining: pod trt-0 (0.5 in flight) before ScaledDown: the pool's "
                             "throughput-role replicas serve its classes (ns/vllm: ")  # fmt: skip
    assert _obj(kube, "vllm")["spec"]["replicas"] == 1
    assert _annotations(kube, "vllm-0") == {}
    # the drained replica goes; the Event says why
    clock.now += 1
    router.arrive("llama", 1, "critical")
    router.arrive("llama", 4, "standard")
    router.set_in_flight({"ns/trt-0": 0.0, "ns/vllm-0": 1.5})
    scaler.run_once()
    assert _obj(kube, "trt")["spec"]["replicas"] == 0
    # from the tick after it stood down, vLLM's decision takes every class's demand
    vllm = _obj(kube, "vllm")["status"]["autoscaling"]
    assert vllm["demandClasses"] == "all classes (the pool's other role stands down)"
    assert vllm["demand"]["arrivalRate"] == 5  # critical 1/s + standard 4/s
    downs = [e["message"] for e in kube.of_kind("Event") if e["reason"] == "ScaledDown"]
    assert len(downs) == 1 and downs[0].startswith("1 -> 0 replicas; the pool's throughput-role")
    del kube.objects[("Pod", "ns", "trt-0")]
    # at zero it stays while the load fills at most 75%: 2.5 of 4
    clock.now += 1
    router.arrive("llama", 1, "critical")
    router.arrive("llama", 6, "standard")
    router.set_in_flight({"ns/vllm-0": 2.5})
    scaler.run_once()
    trt = _obj(kube, "trt")
    assert trt["spec"]["replicas"] == 0
    assert trt["status"]["autoscaling"]["reason"].startswith("Consolidated: the pool's")
    cond = [c for c in trt["status"]["conditions"] if c["type"] == "Autoscaling"]
    assert cond[0]["reason"] == "Consolidated"
    # 3.5 of 4 for one second is a clump: the mean of the last 10 s stays below 75%
    clock.now += 1
    router.arrive("llama", 1, "critical")
    router.arrive("llama", 8, "standard")
    router.set_in_flight({"ns/vllm-0": 3.5})
    scaler.run_once()
    assert _obj(kube, "trt")["spec"]["replicas"] == 0
    # sustained, it is past 75%: the latency role takes its classes back
    clock.now += 10
    router.arrive("llama", 10, "critical")
    router.arrive("llama", 80, "standard")
    scaler.run_once()
    assert _obj(kube, "trt")["spec"]["replicas"] == 1
    assert _obj(kube, "trt")["status"]["autoscaling"]["reason"].startswith("ScaledUp")
    clock.now += 1
    scaler.run_once()  # back to its role's classes
    assert _obj(kube, "vllm")["status"]["autoscaling"]["demandClasses"] == (
        "batch, sheddable, standard"
    )


def test_a_role_coming_back_brings_replicas_the_serving_role_does_not_add_again(
    kube: FakeKube,
) -> None:
    scaler, router, clock = _both_serving(kube)
    router.set_in_flight({"ns/trt-0": 0.0, "ns/vllm-0": 1.5})
    for _ in range(2):  # TensorRT-LLM drains, then goes: vLLM serves both
        _quiet_second(scaler, router, clock)
    assert _obj(kube, "trt")["spec"]["replicas"] == 0
    del kube.objects[("Pod", "ns", "trt-0")]
    # a surge: past 75% of vLLM's one replica, so TensorRT-LLM comes back with 1, in
    # the tick where vLLM's decision still takes every class's demand
    clock.now += 10
    router.arrive("llama", 20, "critical")
    router.arrive("llama", 80, "standard")
    router.set_in_flight({"ns/vllm-0": 4.0})
    router.set_queue("llama", 8, "standard")
    scaler.run_once()
    assert _obj(kube, "trt")["spec"]["replicas"] == 1
    vllm = _obj(kube, "vllm")
    reason = vllm["status"]["autoscaling"]["reason"]
    m = re.search(r"; 1 of the (\d+) wanted come back on the latency role$", reason)
    assert m is not None, reason
    wanted = int(m.group(1))
    assert wanted >= 2  # 12 in flight and queued at 4 per replica: 3 in all
    assert vllm["spec"]["replicas"] == 1 + wanted - 1


def test_a_role_is_served_by_the_other_only_where_a_router_finds_it_serving(
    kube: FakeKube,
) -> None:
    # kwok's pods are Ready at once; the engine answers a cold start later
    scaler, router, clock = _mixed_pair(kube, "--pool-consolidation")
    router.set_health({"ns/trt-0": True, "ns/vllm-0": False})
    router.set_in_flight({"ns/trt-0": 0.5, "ns/vllm-0": 0.0})
    scaler.run_once()
    clock.now += 1
    router.arrive("llama", 1, "critical")
    router.arrive("llama", 4, "standard")
    scaler.run_once()
    # critical has fewer arrivals, but vLLM cannot serve it yet; nor is vLLM's replica
    # drained while it starts (it was asked for)
    assert _annotations(kube, "trt-0") == {} and _annotations(kube, "vllm-0") == {}
    # once it serves, the role with fewer arrivals stands down
    router.set_health({"ns/trt-0": True, "ns/vllm-0": True})
    _quiet_second(scaler, router, clock)
    assert _annotations(kube, "vllm-0") == {}
    assert _annotations(kube, "trt-0").get("fleetgate.dev/drain") == "true"


def test_without_the_option_every_role_with_demand_keeps_its_replicas(kube: FakeKube) -> None:
    scaler, router, clock = _mixed_pair(kube)
    router.set_in_flight({"ns/trt-0": 0.5, "ns/vllm-0": 1.0})
    router.set_health({"ns/trt-0": True, "ns/vllm-0": True})
    for _ in range(3):
        router.arrive("llama", 1, "critical")
        router.arrive("llama", 4, "standard")
        scaler.run_once()
        clock.now += 1
    assert _annotations(kube, "trt-0") == {} and _annotations(kube, "vllm-0") == {}
    assert _obj(kube, "vllm")["status"]["autoscaling"]["demandClasses"] == (
        "batch, sheddable, standard"
    )


@pytest.mark.parametrize("option", [True, False])
def test_the_latency_roles_room_runs_batch_class_load_before_the_throughput_role_grows(
    kube: FakeKube, option: bool
) -> None:
    scaler, router, _ = _mixed_pair(kube, *(["--pool-consolidation"] if option else []))
    router.set_health({"ns/trt-0": True, "ns/vllm-0": True})
    # TensorRT-LLM runs 1 of its critical requests (room for 3 more at 4 per replica);
    # vLLM runs 4 standard requests and 2 more wait: 6 > 4
    router.set_in_flight({"ns/trt-0": 1.0, "ns/vllm-0": 4.0})
    router.set_queue("llama", 2, "standard")
    scaler.run_once()
    assert _obj(kube, "trt")["spec"]["replicas"] == 1
    vllm = _obj(kube, "vllm")
    if option:  # 6 - 3 of room = 3 <= 4: the router sends the 2 waiting to TensorRT-LLM
        assert vllm["spec"]["replicas"] == 1
        assert "; 3 of it on the latency role's room" in vllm["status"]["autoscaling"]["reason"]
    else:  # each role sized on its own classes: 1 + 2
        assert vllm["spec"]["replicas"] == 2
        assert "latency role's room" not in vllm["status"]["autoscaling"]["reason"]


def test_a_pod_no_router_has_probed_serves_no_other_role(kube: FakeKube) -> None:
    scaler, router, clock = _mixed_pair(kube, "--pool-consolidation")
    router.set_in_flight({"ns/trt-0": 0.5, "ns/vllm-0": 0.5})  # no health series at all
    scaler.run_once()
    clock.now += 1
    router.arrive("llama", 1, "critical")
    router.arrive("llama", 4, "standard")
    scaler.run_once()
    assert _annotations(kube, "trt-0") == {} and _annotations(kube, "vllm-0") == {}
    assert _obj(kube, "trt")["spec"]["replicas"] == _obj(kube, "vllm")["spec"]["replicas"] == 1


def test_the_pool_gpu_budget_limits_the_scale_up_and_says_so(kube: FakeKube) -> None:
    _put(kube, "trt", role="latency", replicas=1, gpus=2, engine="tensorrt-llm")
    _put(kube, "vllm", role="throughput", replicas=1)
    scaler, router, clock = _pool_scaler(kube, "--pool-gpu-budget=chat=8")
    router.set_queue("llama", 10, "critical")  # latency wants 5 x 2 GPUs
    router.set_queue("llama", 6, "batch")  # throughput wants 3 x 1
    scaler.run_once()
    # floors 2 + 1; latency first: +2 (7 used), a third needs 2 more: throughput +1
    assert _obj(kube, "trt")["spec"]["replicas"] == 3
    assert _obj(kube, "vllm")["spec"]["replicas"] == 2
    trt = _obj(kube, "trt")["status"]["autoscaling"]
    assert trt["reason"] == (
        "ScaleUpLimited: pool chat gpu budget 8 reached (5 wanted, 3 granted); "
        "in-flight 10/replica > target 2"
    )
    assert (trt["desiredReplicas"], trt["wantedReplicas"]) == (3, 5)
    cond = [c for c in _obj(kube, "trt")["status"]["conditions"] if c["type"] == "Autoscaling"]
    assert cond[0]["reason"] == "ScaleUpLimited"
    ups = sorted(
        (e["involvedObject"]["name"], e["message"])
        for e in kube.of_kind("Event")
        if e["reason"] == "ScaledUp"
    )
    assert ups == [
        (
            "trt",
            "1 -> 3 replicas; pool chat gpu budget 8 reached (5 wanted, 3 granted); "
            "in-flight 10/replica > target 2",
        ),
        (
            "vllm",
            "1 -> 2 replicas; pool chat gpu budget 8 reached (3 wanted, 2 granted); "
            "in-flight 6/replica > target 2",
        ),
    ]
    # latency demand falls: its GPUs go to throughput, once a latency replica drained
    _pods(kube, "trt", range(1, 3))
    _pods(kube, "vllm", range(1, 2))
    router.set_queue("llama", 2, "critical")
    clock.now += 1
    scaler.run_once()
    assert _obj(kube, "trt")["status"]["autoscaling"]["draining"] is not None
    vllm = _obj(kube, "vllm")["status"]["autoscaling"]
    assert _obj(kube, "vllm")["spec"]["replicas"] == 2
    assert vllm["reason"].startswith(
        "ScaleUpLimited: pool chat gpu budget 8 reached "
        "(1 more once GPUs drain elsewhere in the pool)"
    )
    limited = [
        e["involvedObject"]["name"]
        for e in kube.of_kind("Event")
        if e["reason"] == "ScaleUpLimited"
    ]
    assert limited == []  # the ScaledUp event of the first tick already told of the budget
    clock.now += 1
    scaler.run_once()  # both drained latency replicas go together
    assert _obj(kube, "trt")["spec"]["replicas"] == 1
    clock.now += 1
    scaler.run_once()  # 2 GPUs free: throughput takes one of them
    assert _obj(kube, "vllm")["spec"]["replicas"] == 3
    assert _obj(kube, "vllm")["status"]["autoscaling"]["wantedReplicas"] is None


def test_latency_takes_gpus_from_throughput_after_its_drain(kube: FakeKube) -> None:
    _put(kube, "trt", role="latency", replicas=1, gpus=2, engine="tensorrt-llm")
    _put(kube, "vllm", role="throughput", replicas=6)
    scaler, router, clock = _pool_scaler(kube, "--pool-gpu-budget=chat=8")
    router.set_queue("llama", 12, "batch")  # throughput wants all 6 it has
    router.set_queue("llama", 4, "critical")  # latency wants 2 x 2 GPUs: 2 more than free
    scaler.run_once()
    assert _obj(kube, "trt")["spec"]["replicas"] == 1  # no GPU free yet
    assert (
        "1 more once GPUs drain elsewhere" in _obj(kube, "trt")["status"]["autoscaling"]["reason"]
    )
    limited = [e for e in kube.of_kind("Event") if e["reason"] == "ScaleUpLimited"]
    assert [(e["involvedObject"]["name"], e["message"]) for e in limited] == [
        (
            "trt",
            "stays at 1; pool chat gpu budget 8 reached (1 more once GPUs drain elsewhere "
            "in the pool); in-flight 4/replica > target 2",
        )
    ]
    vllm = _obj(kube, "vllm")["status"]["autoscaling"]
    # throughput gives back 2 GPUs: both replicas drain at once, then go together
    assert [d["pod"] for d in vllm["draining"]] == ["vllm-0", "vllm-1"]
    assert "(6 wanted, 4 granted)" in vllm["reason"]
    clock.now += 1
    scaler.run_once()
    assert _obj(kube, "vllm")["spec"]["replicas"] == 4
    assert _obj(kube, "trt")["spec"]["replicas"] == 1  # the GPUs are not free yet
    for pod in ("vllm-0", "vllm-1"):  # the ReplicaSet's part, by hand
        assert kube.objects.pop(("Pod", "ns", pod))
    clock.now += 1
    scaler.run_once()
    assert _obj(kube, "vllm")["spec"]["replicas"] == 4
    assert _obj(kube, "trt")["spec"]["replicas"] == 2


def test_the_worked_example_of_docs_deploy_md(kube: FakeKube) -> None:
    """The mixed-pool example of docs/deploy.md, read from the page, gives the numbers
    the page states."""
    import pathlib

    import yaml

    text = (pathlib.Path(__file__).parents[2] / "docs" / "deploy.md").read_text()
    block = text.split("<!-- worked-example: mixed-pool", 1)[1].split("```yaml\n", 1)[1]
    docs = list(yaml.safe_load_all(block.split("```", 1)[0]))
    assert [d["metadata"]["name"] for d in docs] == ["llama-8b-trt", "llama-8b-vllm"]
    for doc in docs:
        doc["metadata"]["generation"] = 1
        doc["spec"]["replicas"] = 1
        InferenceService.model_validate(doc)
        kube.put(doc)
        kube.put(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {
                    "name": f"{doc['metadata']['name']}-0",
                    "namespace": "llm",
                    "labels": manifests.selector_labels(doc["metadata"]["name"]),
                },
                "status": {"conditions": [{"type": "Ready", "status": "True"}]},
            }
        )
    scaler, router, _ = _pool_scaler(kube, "--pool-gpu-budget=chat=10")
    scaler._namespaces = ("llm",)
    router.set_in_flight({"llm/llama-8b-trt-0": 48, "llm/llama-8b-vllm-0": 160})
    router.set_queue("llama-3.1-8b", 20, "critical")
    router.set_queue("llama-3.1-8b", 12, "standard")
    router.set_queue("llama-3.1-8b", 80, "batch")
    scaler.run_once()
    trt = kube.objects[("InferenceService", "llm", "llama-8b-trt")]
    vllm = kube.objects[("InferenceService", "llm", "llama-8b-vllm")]
    assert (trt["spec"]["replicas"], vllm["spec"]["replicas"]) == (4, 2)
    assert trt["status"]["autoscaling"]["reason"] == (
        "ScaleUpLimited: pool chat gpu budget 10 reached (5 wanted, 4 granted); "
        "in-flight 80/replica > target 16"
    )
    assert vllm["status"]["autoscaling"]["reason"] == (
        "ScaleUpLimited: pool chat gpu budget 10 reached (5 wanted, 2 granted); "
        "in-flight 240/replica > target 48"
    )
    gpus = scaler._metrics.registry.get_sample_value
    assert [gpus("fleetgate_operator_pool_gpus", {"pool": "chat", "state": s}) for s in
            ("budget", "wanted", "granted")] == [10, 15, 10]  # fmt: skip


def test_the_worked_example_in_one_role_shares_the_queue_by_replicas(
    kube: FakeKube,
) -> None:
    """The page's example with both services in one role, no budget: before services
    of one role shared its demand, each counted the whole queue of 112 (the page's
    "before": 160 -> 6 capped and 272 -> 6, 18 GPUs); now 56 each at one replica each:
    48 + 56 = 104 -> 7, capped at 6, and 160 + 56 = 216 -> 5."""
    _put(kube, "trt", role="latency", replicas=1, gpus=2, maxReplicas=6,
         targetInFlightPerReplica=16)  # fmt: skip
    _put(kube, "vllm", role="latency", replicas=1, targetInFlightPerReplica=48)
    scaler, router, _ = _pool_scaler(kube)
    router.set_in_flight({"ns/trt-0": 48, "ns/vllm-0": 160})
    router.set_queue("llama", 20, "critical")
    router.set_queue("llama", 12, "standard")
    router.set_queue("llama", 80, "batch")
    scaler.run_once()
    assert (_obj(kube, "trt")["spec"]["replicas"], _obj(kube, "vllm")["spec"]["replicas"]) == (
        6,
        5,
    )
    assert _obj(kube, "vllm")["status"]["autoscaling"]["demand"]["queued"] == 56


def test_a_router_holding_a_first_request_wakes_the_loop_at_once(kube: FakeKube) -> None:
    """With a decision period of 60 s, a service at zero replicas scales to 1 as soon
    as the router's ``/held`` long poll answers with a new hold, not a period later;
    a poll that only times out (same generation) wakes nothing."""
    scaler, router, _ = _setup(kube, 0, minReplicas=0)
    polls: list[str] = []
    answers = iter(
        [
            '{"generation": 4, "held": {}}',  # the first poll (after=-1): learn where it is
            '{"generation": 4, "held": {}}',  # timed out with nothing new: no wake
            '{"generation": 5, "held": {"svc": 1}}',  # a first request held: wake
        ]
    )
    release, gate = threading.Event(), threading.Event()

    def long_poll(url: str, timeout: float) -> str:
        polls.append(url)
        answer = next(answers, None)
        if answer is None:  # then block like an idle router, until the test ends
            release.wait(timeout)
            raise OSError("stopped")
        if 'generation": 5' in answer:
            assert gate.wait(10)  # the hold happens once the loop runs
            router.set_held("svc", 1)  # what its /metrics shows from then on
        return answer

    stop = threading.Event()
    options = OperatorOptions(router_metrics_urls=(URL,), autoscale_interval=60.0)
    metrics = OperatorMetrics()
    scaler = Autoscaler(
        kube, Reconciler(kube, options, metrics), options, metrics, ("ns",), stop=stop,
        fetch=lambda url: router.text(), long_poll=long_poll,
    )  # fmt: skip
    scaler.run_once()  # the first pass starts the /held watcher (nothing held: stays 0)
    assert _svc(kube)["spec"]["replicas"] == 0
    loop = threading.Thread(target=scaler.run)
    loop.start()
    gate.set()
    try:
        deadline = time.monotonic() + 10
        while _svc(kube)["spec"]["replicas"] == 0:
            assert time.monotonic() < deadline, "not woken"
            time.sleep(0.02)
        assert scaler.wakeups == 1
        assert "held" in _svc(kube)["status"]["autoscaling"]["reason"]
    finally:
        stop.set()
        release.set()
        loop.join(10)
    assert not loop.is_alive()
    assert polls[0] == "http://127.0.0.1:9/held?after=-1&wait=30"
    assert polls[1].endswith("/held?after=4&wait=30")
    assert polls[2].endswith("/held?after=4&wait=30")
    assert polls[3].endswith("/held?after=5&wait=30")


def test_a_router_without_held_is_polled_on_the_period_only(kube: FakeKube) -> None:
    """An older router answers 404 to ``/held``: its watcher ends (no retry storm)."""
    import urllib.error

    calls: list[str] = []

    def long_poll(url: str, timeout: float) -> str:
        calls.append(url)
        raise urllib.error.HTTPError(url, 404, "Not Found", None, None)  # type: ignore[arg-type]

    scaler, router, _ = _setup(kube, 1, minReplicas=0)
    scaler._long_poll = long_poll
    scaler.run_once()
    for thread in list(scaler._watchers.values()):
        thread.join(5)
    assert calls == ["http://127.0.0.1:9/held?after=-1&wait=30"]
    scaler.run_once()  # a finished watcher is not restarted for a router that said 404
    time.sleep(0.1)
    assert len(calls) == 1


def test_the_measured_service_time_sizes_a_held_backlog_across_ticks(kube: FakeKube) -> None:
    """The loop keeps the service time it measured (Little's law on the router's
    completions) from tick to tick, and a later backlog held while the pod is not Ready
    counts by the batches one replica drains in a cold start: 200 held, 0.5 s each,
    30 s cold start -> 60 batches -> 3.3 in flight -> 2 replicas (not the 4 of
    ceil(200 / 2), capped; not the 1 of an unmeasured service time)."""
    scaler, router, clock = _setup(kube, 1, coldStartSeconds=30)
    router.set_in_flight({"ns/svc-0": 2})
    scaler.run_once()
    clock.now += 1
    router.complete("svc", "ns/svc-0", 4)  # 4/s with 2 in flight: 0.5 s each
    scaler.run_once()
    clock.now += 1
    router.complete("svc", "ns/svc-0", 4)  # 8 completions: not measured yet
    scaler.run_once()
    clock.now += 1
    router.complete("svc", "ns/svc-0", 4)  # 12: measured
    scaler.run_once()
    assert _svc(kube)["spec"]["replicas"] == 1
    pod = kube.objects[("Pod", "ns", "svc-0")]
    pod["status"]["conditions"][0]["status"] = "False"  # restarting: not Ready
    router.set_in_flight({"ns/svc-0": 0})
    router.set_held("svc", 200)
    clock.now += 1
    scaler.run_once()
    assert _svc(kube)["spec"]["replicas"] == 2
    reason = _svc(kube)["status"]["autoscaling"]["reason"]
    assert "200 held drain in 60 batches of 0.5s per cold start" in reason, reason
