"""Autoscaling on the real test control plane (API server, controller manager, kwok).

A loopback HTTP server stands in for a router: it serves /metrics rendered by the
router's own metric classes (tests/operator/routerdemand.py). The operator runs in a
thread with short modelled windows; the real Deployment and ReplicaSet controllers
create and delete the kwok pods. We check:

* demand above the target scales the Deployment up, with an Event and an
  ``Autoscaling`` condition carrying the reason;
* demand gone scales down after draining first, every replica to remove at once:
  the annotated pods are the ones the ReplicaSet removes (together, by their
  deletion cost), and none is removed while the router still reports a request in
  flight on one of them;
* idle scales to zero, and a held request at zero replicas brings one back;
* all of it as a ServiceAccount bound to exactly the operator's ClusterRole
  (fleetgate/operator/rbac.py), so the role has what autoscaling needs.
"""

from __future__ import annotations

import http.server
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from routerdemand import RouterDemand
from test_k8s import condition, crd, get, isvc, operator, restricted_kubeconfig, wait_for

from fleetgate_tools.devcluster import DevCluster

pytestmark = [pytest.mark.k8s, pytest.mark.slow]
__all__ = ["crd"]  # the CRD fixture, shared with test_k8s.py

DRAIN = "fleetgate.dev/drain"
COST = "controller.kubernetes.io/pod-deletion-cost"


class FakeRouter:
    """A router's /metrics on 127.0.0.1, rendered from :class:`RouterDemand`."""

    def __init__(self) -> None:
        self.demand = RouterDemand()
        self.lock = threading.Lock()
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                with outer.lock:
                    body = outer.demand.text().encode()
                self.send_response(200 if self.path == "/metrics" else 404)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                return

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/metrics"


@pytest.fixture
def router() -> Iterator[FakeRouter]:
    fake = FakeRouter()
    fake.thread.start()
    try:
        yield fake
    finally:
        fake.server.shutdown()
        fake.server.server_close()
        fake.thread.join(5)


def pods(cluster: DevCluster, ns: str, name: str) -> dict[str, dict[str, Any]]:
    """Live (not terminating) engine pods by name."""
    found = get(cluster, ns, "pods", "-l", f"app.kubernetes.io/instance={name}") or {}
    return {
        p["metadata"]["name"]: p
        for p in found.get("items", [])
        if not p["metadata"].get("deletionTimestamp")
    }


def replicas(cluster: DevCluster, ns: str, name: str) -> int:
    obj = get(cluster, ns, "inferenceservice", name) or {}
    return int(obj.get("spec", {}).get("replicas", -1))


def events(cluster: DevCluster, ns: str, reason: str) -> list[str]:
    found = get(cluster, ns, "events", "--field-selector", f"reason={reason}") or {}
    return [e["message"] for e in found.get("items", [])]


def test_autoscaling_up_drain_down_to_zero_and_back(
    k8s_cluster: DevCluster, k8s_namespace: str, crd: str, router: FakeRouter, tmp_path: Path
) -> None:
    ns, name = k8s_namespace, "auto"
    spec = isvc(
        name,
        ns,
        replicas=1,
        autoscaling={
            "minReplicas": 0,
            "maxReplicas": 4,
            "targetInFlightPerReplica": 2,
            "scaleDownStabilizationSeconds": 1,
            "scaleToZeroAfterSeconds": 2,
            "coldStartSeconds": 5,
            "drainTimeoutSeconds": 120,
        },
    )
    with (
        restricted_kubeconfig(k8s_cluster, ns, tmp_path) as kubeconfig,
        operator(
            k8s_cluster,
            ns,
            kubeconfig=kubeconfig,
            autoscale_interval=0.5,
            router_metrics_urls=(router.url,),
        ),
    ):
        k8s_cluster.apply(spec)
        wait_for("1 pod", lambda: len(pods(k8s_cluster, ns, name)) == 1)

        # -- demand above the target: 7 queued / 2 per replica -> 4
        with router.lock:
            router.demand.set_queue(name, 7, "critical")
        wait_for("4 ready replicas", lambda: len(pods(k8s_cluster, ns, name)) == 4, 90)
        assert replicas(k8s_cluster, ns, name) == 4
        up = wait_for("a ScaledUp event", lambda: events(k8s_cluster, ns, "ScaledUp"))
        assert "1 -> 4 replicas; in-flight 7/replica > target 2" in up, up
        cond = condition(get(k8s_cluster, ns, "inferenceservice", name), "Autoscaling")
        assert cond["status"] == "True" and cond["reason"] in {"ScaledUp", "Steady"}, cond

        # -- demand falls to one request in flight on each pod: 4 / 2 -> 2 replicas,
        # but the victim (least in flight, here a tie) still has its request
        live = pods(k8s_cluster, ns, name)
        with router.lock:
            router.demand.set_queue(name, 0, "critical")
            router.demand.set_in_flight({f"{ns}/{p}": 1 for p in live})

        def annotated() -> list[str]:
            return sorted(
                pod_name
                for pod_name, pod in pods(k8s_cluster, ns, name).items()
                if (pod["metadata"].get("annotations") or {}).get(DRAIN) == "true"
            )

        wait_for("two pods annotated for draining", lambda: len(annotated()) == 2, 30)
        victims = annotated()
        assert victims == sorted(live)[:2]  # least in flight: a tie, so by name
        for v in victims:
            assert pods(k8s_cluster, ns, name)[v]["metadata"]["annotations"][COST] == "-1000"
        time.sleep(3)  # six decisions: requests are in flight, nothing is removed
        assert replicas(k8s_cluster, ns, name) == 4
        assert set(victims) <= set(pods(k8s_cluster, ns, name))
        obj = get(k8s_cluster, ns, "inferenceservice", name)
        assert condition(obj, "Autoscaling")["reason"] == "Draining", condition(obj, "Autoscaling")
        draining = (obj or {})["status"]["autoscaling"]["draining"]
        assert sorted(d["pod"] for d in draining) == victims

        # -- the requests finish: exactly the drained pods go (both at once), then the
        # rest, every one drained before it goes, to 0
        with router.lock:
            router.demand.set_in_flight({f"{ns}/{p}": 0 for p in live})
        removed: list[str] = []
        seen_draining = set(victims)
        deadline = time.monotonic() + 120
        while True:
            now_pods = set(pods(k8s_cluster, ns, name))
            seen_draining |= set(annotated())
            gone = set(live) - now_pods - set(removed)
            assert gone <= seen_draining, (gone, seen_draining)  # drained before it went
            removed += sorted(gone)
            if not now_pods:
                break
            assert time.monotonic() < deadline, (removed, now_pods)
            time.sleep(0.2)
        assert set(removed[:2]) == set(victims), removed
        assert len(removed) == 4
        wait_for("replicas 0", lambda: replicas(k8s_cluster, ns, name) == 0, 30)
        down = events(k8s_cluster, ns, "ScaledDown")
        assert any(" -> 0 replicas; idle" in m for m in down), down
        together = f"(pod {victims[0]} drained, pod {victims[1]} drained)"
        assert any(m.startswith("4 -> 2 replicas") and together in m for m in down), down
        assert len(events(k8s_cluster, ns, "Draining")) == 4  # each pod drained once

        # -- a request held at zero replicas brings one back at once
        with router.lock:
            router.demand.set_held(name, 1)
        wait_for("1 pod again", lambda: len(pods(k8s_cluster, ns, name)) == 1, 30)
        woke = wait_for(
            "a ScaledUp event from zero",
            lambda: [m for m in events(k8s_cluster, ns, "ScaledUp") if m.startswith("0 -> 1")],
        )
        assert "1 requests held at 0 replicas" in woke[0], woke
        status = (get(k8s_cluster, ns, "inferenceservice", name) or {})["status"]
        assert status["autoscaling"]["demand"]["held"] == 1
        assert status["autoscaling"]["coldStartSeconds"] == 5


def test_mixed_pool_split_by_role_under_a_gpu_budget(
    k8s_cluster: DevCluster, k8s_namespace: str, crd: str, router: FakeRouter, tmp_path: Path
) -> None:
    """A TensorRT-LLM latency service and a vLLM throughput service of one model in one
    pool, 3 GPUs for both: critical demand grows the first, batch the second, the
    budget holds the sum, and GPUs the latency role gives back go to throughput after
    a drain (real Deployment/ReplicaSet controllers)."""
    from fleetgate.operator.pools import parse_pool_budgets

    ns = k8s_namespace
    auto = {
        "minReplicas": 1,
        "maxReplicas": 4,
        "targetInFlightPerReplica": 2,
        "scaleDownStabilizationSeconds": 1,
        "coldStartSeconds": 5,
        "drainTimeoutSeconds": 120,
    }
    lat = isvc(
        "lat",
        ns,
        model={"uri": "hf://org/tiny", "name": "tiny"},
        engine={"type": "tensorrt-llm", "image": "nvcr.io/nvidia/tensorrt-llm/release:1.0.0"},
        replicas=1,
        routing={"pool": "mixed", "role": "latency"},
        autoscaling=auto,
    )
    thr = isvc(
        "thr",
        ns,
        model={"uri": "hf://org/tiny", "name": "tiny"},
        replicas=1,
        routing={"pool": "mixed", "role": "throughput"},
        autoscaling=auto,
    )

    def both() -> tuple[int, int]:
        return len(pods(k8s_cluster, ns, "lat")), len(pods(k8s_cluster, ns, "thr"))

    with (
        restricted_kubeconfig(k8s_cluster, ns, tmp_path) as kubeconfig,
        operator(
            k8s_cluster,
            ns,
            kubeconfig=kubeconfig,
            autoscale_interval=0.5,
            router_metrics_urls=(router.url,),
            pool_gpu_budgets=parse_pool_budgets(["mixed=3"]),
        ),
    ):
        k8s_cluster.apply(lat)
        k8s_cluster.apply(thr)
        wait_for("1 pod each", lambda: both() == (1, 1))
        # critical wants 3 latency replicas, batch 2 throughput ones: 5 GPUs > 3
        with router.lock:
            router.demand.set_queue("tiny", 6, "critical")
            router.demand.set_queue("tiny", 4, "batch")
        wait_for("2 latency pods, 1 throughput pod", lambda: both() == (2, 1), 60)
        time.sleep(2)  # four more decisions: the budget holds
        assert both() == (2, 1)
        obj = get(k8s_cluster, ns, "inferenceservice", "lat") or {}
        assert obj["status"]["autoscaling"]["reason"].startswith(
            "ScaleUpLimited: pool mixed gpu budget 3 reached (3 wanted, 2 granted)"
        ), obj["status"]["autoscaling"]
        assert obj["status"]["autoscaling"]["demandClasses"] == (
            "critical, standard, any other class"
        )
        assert condition(obj, "Autoscaling")["reason"] == "ScaleUpLimited"
        obj = get(k8s_cluster, ns, "inferenceservice", "thr") or {}
        assert "(2 wanted, 1 granted)" in obj["status"]["autoscaling"]["reason"]

        # critical demand gone: a latency replica drains, its GPU goes to throughput
        with router.lock:
            router.demand.set_queue("tiny", 0, "critical")
        wait_for("1 latency pod, 2 throughput pods", lambda: both() == (1, 2), 60)
        assert replicas(k8s_cluster, ns, "lat") + replicas(k8s_cluster, ns, "thr") == 3
        assert any(
            "(pod lat-" in m and "drained)" in m for m in events(k8s_cluster, ns, "ScaledDown")
        )
