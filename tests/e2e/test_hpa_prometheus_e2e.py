"""HPA on engine queue metrics through Prometheus and prometheus-adapter, end to end.

The setup the ecosystem documents for autoscaling vLLM (and the ``hpa-prometheus``
contender of bench/bench_autoscale.py), every part a real process on loopback: a dev
cluster serving aggregated APIs with the HPA controller syncing every second, the
operator (no ``spec.autoscaling``), the pod-engine launcher (an emulated vLLM on each
kwok pod's IP), Debian's Prometheus discovering and scraping those pods, and
prometheus-adapter built from its Go module (tools/fleetgate_tools/devcluster/
metricsstack.py). An ``autoscaling/v2`` HPA targets the InferenceService's scale
subresource on the per-pod custom metric ``vllm_num_requests_waiting``.

We test: with one replica and more concurrent streams than its batch holds,
(a) the API server serves the custom metric from the adapter for the engine pod, with
the queue the engine reports, and (b) the HPA raises the InferenceService's replicas
and the new pods are created.

Not tested here: scale-down (the HPA's default 5 min window; the benchmark sets its own).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from test_fleet_e2e import KWOK, REPO, Processes

from fleetgate_tools.devcluster import ClusterConfig, DevCluster, ensure_binaries
from fleetgate_tools.devcluster.metricsstack import MetricsStack, ensure_adapter, hpa
from fleetgate_tools.procs import listening_addresses

# a cold prometheus-adapter build (`make test` builds it first, hack/build-prometheus-adapter.sh)
# takes minutes; with the binary cached the test takes well under 90 s
pytestmark = [pytest.mark.k8s, pytest.mark.slow, pytest.mark.timeout(900)]

MODEL = "llama-3.1-8b"
NAME = "hpa"
MAX_NUM_SEQS = 2
STREAMS = 8


@pytest.fixture(scope="module")
def agg_cluster() -> Iterator[DevCluster]:
    """A cluster of its own: the shared one serves no aggregated API (opt-in)."""
    ensure_adapter()  # before the control plane starts: a build failure is the error shown
    config = ClusterConfig(aggregation=True, hpa_sync_period_s=1, preload=(REPO / "crds",))
    cluster = DevCluster(ensure_binaries(), config)
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


def inference_service(ns: str) -> dict[str, Any]:
    return {
        "apiVersion": "fleetgate.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": NAME, "namespace": ns},
        "spec": {
            "model": {"uri": "hf://test/hpa", "name": MODEL},
            "engine": {"type": "vllm", "image": "vllm/vllm-openai:v0.32.0",
                       "vllm": {"maxNumSeqs": MAX_NUM_SEQS}},
            "replicas": 1,
        },
    }  # fmt: skip


async def streams(client: httpx.AsyncClient, url: str, i: int) -> None:
    """One stream after another until cancelled: a steady load of one request."""
    body = {"model": MODEL, "stream": True, "max_tokens": 400, "ignore_eos": True,
            "messages": [{"role": "user", "content": f"request {i}"}]}  # fmt: skip
    while True:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
            assert r.status_code == 200, await r.aread()
            async for _ in r.aiter_lines():
                pass


def engine_url(cluster: DevCluster, ns: str, launcher_log: Path) -> tuple[str, str] | None:
    """(pod name, http://ip:port) of the first engine OUR launcher has bound, if any.

    Every dev cluster hands out pod IPs from the same 127.0.1.0/24, so on a shared
    machine another cluster's engine may answer on the same address: the socket must
    belong to the PID our launcher started for the pod."""
    pids: dict[str, int] = {}
    for line in launcher_log.read_text(errors="replace").splitlines():
        with contextlib.suppress(ValueError):
            event = json.loads(line)
            if isinstance(event, dict) and event.get("event") == "start":
                pids[event["pod"]] = int(event["pid"])
    pods = cluster.kubectl_json("-n", ns, "get", "pods", "-l", f"app.kubernetes.io/instance={NAME}")
    for p in pods["items"]:
        name, ip = p["metadata"]["name"], p.get("status", {}).get("podIP")
        ports = [
            cp["containerPort"]
            for c in p["spec"]["containers"]
            for cp in c.get("ports", [])
            if cp.get("name") == "http"
        ]
        if not ip or not ports or name not in pids:
            continue
        if (ip, ports[0]) not in listening_addresses(pids[name]):
            continue
        url = f"http://{ip}:{ports[0]}"
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=1, trust_env=False).status_code == 200:
                return name, url
    return None


async def until(probe: Any, within: float, what: str, tail: Any) -> Any:
    deadline = time.monotonic() + within
    while True:
        got = await asyncio.to_thread(probe)
        if got:
            return got
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {within:.0f}s\n{tail()}")
        await asyncio.sleep(0.5)


async def test_hpa_scales_an_inference_service_on_vllm_queue_through_prometheus(
    agg_cluster: DevCluster, tmp_path: Path
) -> None:
    cluster = agg_cluster
    t_start = time.monotonic()
    ns = f"hpa-{int(time.time())}"
    cluster.kubectl("create", "namespace", ns)
    procs = Processes(tmp_path)
    stack = MetricsStack(cluster, [ns], tmp_path / "metrics")

    def tail() -> str:
        hpas = cluster.kubectl("-n", ns, "describe", "hpa", check=False).stdout[-3000:]
        return f"{hpas}\n{stack.log_tails()}\n{procs.tail()}"

    try:
        procs.start(
            "operator",
            [str(Path(sys.executable).parent / "fleetgate"), "operator",
             "--kubeconfig", str(cluster.kubeconfig), "--namespace", ns,
             "--metrics-host", "127.0.0.1", "--metrics-port", "0", "--interval", "2"],
            env={"FLEETGATE_EXTRA_TOLERATIONS": json.dumps([KWOK])},
        )  # fmt: skip
        procs.start(
            "podengines",
            [sys.executable, "-m", "fleetgate_tools.devcluster.podengines",
             "--kubeconfig", str(cluster.kubeconfig), "--namespace", ns,
             "--selector", f"app.kubernetes.io/instance={NAME}",
             "--cold-start", "vllm=1", "--logs", str(tmp_path / "engines")],
        )  # fmt: skip
        stack.start()
        t_stack = time.monotonic() - t_start
        cluster.apply(inference_service(ns))
        target = {"apiVersion": "fleetgate.dev/v1alpha1", "kind": "InferenceService", "name": NAME}
        cluster.apply(
            hpa(NAME, ns, target, metric="vllm_num_requests_waiting", average_value=1,
                min_replicas=1, max_replicas=3)
        )  # fmt: skip
        pod, url = await until(
            lambda: engine_url(cluster, ns, tmp_path / "podengines.log"), 60, "engine up", tail
        )

        async with httpx.AsyncClient(timeout=120, trust_env=False) as client:
            load = [asyncio.create_task(streams(client, url, i)) for i in range(STREAMS)]
            try:
                # (a) the engine's queue, as a custom metric served through the API server
                def queue_seen() -> dict[str, Any] | None:
                    status, body = stack.custom_metric(ns, "vllm_num_requests_waiting")
                    if status != 200:
                        return None
                    mine = [i for i in body.get("items", [])
                            if i["describedObject"]["name"] == pod]  # fmt: skip
                    if mine and float(mine[0]["value"].rstrip("m") or 0) > 0:
                        return dict(mine[0])
                    return None

                item = await until(queue_seen, 30, "custom metric with a queue", tail)
                t_metric = time.monotonic() - t_start
                value = item["value"]
                waiting = float(value[:-1]) / 1000 if value.endswith("m") else float(value)
                assert item["describedObject"]["kind"] == "Pod"
                assert item["metric"]["name"] == "vllm_num_requests_waiting"
                # 8 streams, a batch of 2: the engine reports up to 6 waiting
                assert 0 < waiting <= STREAMS - MAX_NUM_SEQS

                # (b) the HPA scales the InferenceService up, and pods follow
                def scaled() -> tuple[int, int] | None:
                    isvc = cluster.kubectl_json("-n", ns, "get", "inferenceservice", NAME)
                    pods = cluster.kubectl_json(
                        "-n", ns, "get", "pods", "-l", f"app.kubernetes.io/instance={NAME}"
                    )["items"]
                    spec = int(isvc["spec"].get("replicas", 0))
                    return (spec, len(pods)) if spec > 1 and len(pods) > 1 else None

                spec, pods = await until(scaled, 30, "HPA scale-up", tail)
                t_scaled = time.monotonic() - t_start
            finally:
                for task in load:
                    task.cancel()
                await asyncio.gather(*load, return_exceptions=True)
        got = cluster.kubectl_json("-n", ns, "get", "hpa", NAME)
        status = got["status"]
        assert status["desiredReplicas"] > 1
        current = status["currentMetrics"][0]["pods"]
        assert current["metric"]["name"] == "vllm_num_requests_waiting"
        events = [e["message"] for e in cluster.kubectl_json("-n", ns, "get", "events")["items"]
                  if e.get("reason") == "SuccessfulRescale"]  # fmt: skip
        assert any("vllm_num_requests_waiting" in m for m in events), events
        print(f"figures: stack ready {t_stack:.1f}s, queue metric {t_metric:.1f}s "
              f"(waiting {waiting:g}), scaled to {spec} ({pods} pods) {t_scaled:.1f}s; "
              f"events {events}")  # fmt: skip
    finally:
        stack.stop()
        procs.stop_all()
        cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)
