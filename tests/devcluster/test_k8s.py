"""The dev cluster is a real, working Kubernetes control plane on loopback.

We test these aspects, against the shared session cluster:

* the API server answers authenticated requests and reports v1.36.3;
* the four fake GPU nodes are Ready with the right GPU capacity, allocatable and labels;
* the scheduler places a GPU pod onto a matching node, kwok gives it a 127.0.1.x IP and
  marks it Ready;
* a pod asking for more GPUs than any node has stays Pending/Unschedulable, and so does
  a pod without the fake-node toleration;
* a process can serve on a pod's 127.0.1.x IP and be reached there (the loopback design);
* a Deployment becomes Available (KCM's deployment + replicaset controllers run);
* every listening socket of every component is on 127.0.0.0/8;
* deleting a Deployment garbage-collects its pods;
* the kubernetes Python client and the built helm (``install --wait``) both work.
"""

from __future__ import annotations

import base64
import http.server
import ipaddress
import json
import ssl
import stat
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from fleetgate_tools.devcluster import (
    FAKE_NODE_TOLERATION,
    GPU_PRODUCT_LABEL,
    GPU_RESOURCE,
    DevCluster,
)
from fleetgate_tools.procs import listening_addresses

pytestmark = pytest.mark.k8s

H100 = "NVIDIA-H100-80GB-HBM3"
A100 = "NVIDIA-A100-SXM4-80GB"


def wait_for(what: str, probe: Callable[[], Any], timeout_s: float = 60.0) -> Any:
    """Poll ``probe`` until it returns something truthy; fail with ``what`` on timeout."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(0.25)
    pytest.fail(f"timed out after {timeout_s}s waiting for {what}; last probe: {last!r}")


def gpu_pod(name: str, ns: str, gpus: int, product: str | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "containers": [
            {
                "name": "engine",
                "image": "fleetgate.invalid/engine:test",
                "resources": {"limits": {GPU_RESOURCE: str(gpus)}},
            }
        ],
        "tolerations": [FAKE_NODE_TOLERATION],
    }
    if product is not None:
        spec["nodeSelector"] = {GPU_PRODUCT_LABEL: product}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": ns},
        "spec": spec,
    }


def condition(obj: dict[str, Any], kind: str) -> dict[str, Any] | None:
    for c in obj.get("status", {}).get("conditions", []) or []:
        if c.get("type") == kind:
            return dict(c)
    return None


def test_api_server_answers(k8s_cluster: DevCluster) -> None:
    status, body = k8s_cluster.api().get("/version")
    assert status == 200
    assert body["gitVersion"] == "v1.36.3"
    assert k8s_cluster.api_url.startswith("https://127.0.0.1:")
    out = k8s_cluster.kubectl("get", "--raw", "/readyz").stdout
    assert out.strip() == "ok"


def test_four_gpu_nodes_ready_with_capacity_and_labels(k8s_cluster: DevCluster) -> None:
    nodes = {n["metadata"]["name"]: n for n in k8s_cluster.kubectl_json("get", "nodes")["items"]}
    assert sorted(nodes) == ["gpu-a100-0", "gpu-a100-1", "gpu-h100-0", "gpu-h100-1"]
    want = {"gpu-h100": (H100, "8"), "gpu-a100": (A100, "4")}
    for name, node in nodes.items():
        product, gpus = want[name.rsplit("-", 1)[0]]
        assert condition(node, "Ready") is not None
        assert condition(node, "Ready")["status"] == "True"  # type: ignore[index]
        assert node["metadata"]["labels"][GPU_PRODUCT_LABEL] == product
        assert node["status"]["capacity"][GPU_RESOURCE] == gpus
        assert node["status"]["allocatable"][GPU_RESOURCE] == gpus
        assert node["spec"]["taints"] == [
            {"key": "kwok.x-k8s.io/node", "value": "fake", "effect": "NoSchedule"}
        ]
        addresses = {a["type"]: a["address"] for a in node["status"]["addresses"]}
        assert addresses["InternalIP"] == "127.0.0.1"


def test_gpu_pod_lands_on_matching_node_with_loopback_ip(
    k8s_cluster: DevCluster, k8s_namespace: str
) -> None:
    ns = k8s_namespace
    k8s_cluster.apply(gpu_pod("a100-pod", ns, 2, A100))
    k8s_cluster.apply(gpu_pod("big-pod", ns, 8))

    def ready(name: str) -> dict[str, Any] | None:
        pod: dict[str, Any] = k8s_cluster.kubectl_json("-n", ns, "get", "pod", name)
        c = condition(pod, "Ready")
        return pod if c is not None and c["status"] == "True" else None

    a100 = wait_for("a100-pod Ready", lambda: ready("a100-pod"))
    big = wait_for("big-pod Ready", lambda: ready("big-pod"))
    assert a100["spec"]["nodeName"] in {"gpu-a100-0", "gpu-a100-1"}
    # 8 GPUs only fit an H100 node: the scheduler counts the extended resource
    assert big["spec"]["nodeName"] in {"gpu-h100-0", "gpu-h100-1"}
    for pod in (a100, big):
        ip = ipaddress.ip_address(pod["status"]["podIP"])
        assert ip in ipaddress.ip_network("127.0.1.0/24"), pod["status"]["podIP"]
        assert pod["status"]["phase"] == "Running"
        assert pod["status"]["hostIP"] == "127.0.0.1"
    assert a100["status"]["podIP"] != big["status"]["podIP"]


def test_pod_needing_too_many_gpus_is_unschedulable(
    k8s_cluster: DevCluster, k8s_namespace: str
) -> None:
    ns = k8s_namespace
    k8s_cluster.apply(gpu_pod("huge", ns, 16))

    def scheduled_condition() -> dict[str, Any] | None:
        return condition(k8s_cluster.kubectl_json("-n", ns, "get", "pod", "huge"), "PodScheduled")

    c = wait_for("PodScheduled condition on huge", scheduled_condition)
    assert c["status"] == "False"
    assert c["reason"] == "Unschedulable"
    assert "nvidia.com/gpu" in c["message"]
    pod = k8s_cluster.kubectl_json("-n", ns, "get", "pod", "huge")
    assert pod["status"]["phase"] == "Pending"
    assert "nodeName" not in pod["spec"]


def test_deployment_becomes_available(k8s_cluster: DevCluster, k8s_namespace: str) -> None:
    ns = k8s_namespace
    template = gpu_pod("x", ns, 1, H100)
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "engine", "namespace": ns},
        "spec": {
            "replicas": 3,
            "selector": {"matchLabels": {"app": "engine"}},
            "template": {"metadata": {"labels": {"app": "engine"}}, "spec": template["spec"]},
        },
    }
    k8s_cluster.apply(deployment)

    def available() -> dict[str, Any] | None:
        d: dict[str, Any] = k8s_cluster.kubectl_json("-n", ns, "get", "deployment", "engine")
        c = condition(d, "Available")
        ok = c is not None and c["status"] == "True" and d["status"].get("readyReplicas") == 3
        return d if ok else None

    wait_for("Deployment Available with 3 ready replicas", available, timeout_s=90)
    pods = k8s_cluster.kubectl_json("-n", ns, "get", "pods", "-l", "app=engine")["items"]
    assert len(pods) == 3
    assert {p["spec"]["nodeName"] for p in pods} <= {"gpu-h100-0", "gpu-h100-1"}
    # the pods belong to a ReplicaSet the controller manager created
    assert {p["metadata"]["ownerReferences"][0]["kind"] for p in pods} == {"ReplicaSet"}


def test_every_component_listens_on_loopback_only(k8s_cluster: DevCluster) -> None:
    seen = {}
    for ref in k8s_cluster.refs:
        addrs = listening_addresses(ref.pid)
        seen[ref.name] = addrs
        for host, port in addrs:
            assert ipaddress.ip_address(host).is_loopback, f"{ref.name} listens on {host}:{port}"
    assert k8s_cluster.ports is not None
    assert ("127.0.0.1", k8s_cluster.ports.apiserver) in seen["kube-apiserver"]
    assert ("127.0.0.1", k8s_cluster.ports.etcd_client) in seen["etcd"]
    assert ("127.0.0.1", k8s_cluster.ports.scheduler) in seen["kube-scheduler"]


def test_pod_without_the_fake_node_toleration_is_unschedulable(
    k8s_cluster: DevCluster, k8s_namespace: str
) -> None:
    pod = gpu_pod("untolerated", k8s_namespace, 1)
    del pod["spec"]["tolerations"]
    k8s_cluster.apply(pod)

    def scheduled_condition() -> dict[str, Any] | None:
        got = k8s_cluster.kubectl_json("-n", k8s_namespace, "get", "pod", "untolerated")
        return condition(got, "PodScheduled")

    c = wait_for("PodScheduled condition on untolerated", scheduled_condition)
    assert (c["status"], c["reason"]) == ("False", "Unschedulable")
    assert "untolerated taint" in c["message"]


class _Hello(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = b"served on the pod IP"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


def test_a_server_bound_to_the_pod_ip_is_reachable(
    k8s_cluster: DevCluster, k8s_namespace: str
) -> None:
    """What the router relies on: an emulated engine listens on the pod's own IP."""
    k8s_cluster.apply(gpu_pod("engine-0", k8s_namespace, 1, A100))

    def pod_ip() -> str | None:
        pod = k8s_cluster.kubectl_json("-n", k8s_namespace, "get", "pod", "engine-0")
        ip: str | None = pod.get("status", {}).get("podIP")
        return ip

    ip = wait_for("engine-0 podIP", pod_ip)
    assert ipaddress.ip_address(ip) in ipaddress.ip_network("127.0.1.0/24")
    server = http.server.ThreadingHTTPServer((ip, 0), _Hello)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://{ip}:{server.server_address[1]}/"
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(url, timeout=5) as resp:
            assert resp.read() == b"served on the pod IP"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def test_deleting_a_deployment_garbage_collects_its_pods(
    k8s_cluster: DevCluster, k8s_namespace: str
) -> None:
    """ownerReference GC (KCM) plus kwok's pod-delete stage: what operator cleanup relies on."""
    ns = k8s_namespace
    template = gpu_pod("x", ns, 1, A100)
    k8s_cluster.apply(
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": "doomed", "namespace": ns},
            "spec": {
                "replicas": 2,
                "selector": {"matchLabels": {"app": "doomed"}},
                "template": {"metadata": {"labels": {"app": "doomed"}}, "spec": template["spec"]},
            },
        }
    )

    def pods() -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = k8s_cluster.kubectl_json(
            "-n", ns, "get", "pods", "-l", "app=doomed"
        )["items"]
        return items

    wait_for("2 doomed pods", lambda: len(pods()) == 2)
    k8s_cluster.kubectl("-n", ns, "delete", "deployment", "doomed", "--wait=false")
    wait_for("doomed pods garbage-collected", lambda: pods() == [], timeout_s=60)
    rs = k8s_cluster.kubectl_json("-n", ns, "get", "replicasets")["items"]
    assert rs == []


def test_kubeconfig_verifies_tls_against_the_api_server_ca(k8s_cluster: DevCluster) -> None:
    kc = yaml.safe_load(k8s_cluster.kubeconfig.read_text())
    cluster = kc["clusters"][0]["cluster"]
    assert "insecure-skip-tls-verify" not in cluster
    ca = base64.b64decode(cluster["certificate-authority-data"]).decode()
    ctx = ssl.create_default_context(cadata=ca)  # hostname check on: the cert has IP SAN
    opener = urllib.request.build_opener(
        urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=ctx)
    )
    req = urllib.request.Request(k8s_cluster.api_url + "/version")
    req.add_header("Authorization", f"Bearer {kc['users'][0]['user']['token']}")
    with opener.open(req, timeout=10) as resp:
        assert json.loads(resp.read())["gitVersion"] == "v1.36.3"
    assert stat.S_IMODE(k8s_cluster.kubeconfig.stat().st_mode) == 0o600


def test_python_kubernetes_client_reads_the_kubeconfig(k8s_cluster: DevCluster) -> None:
    """The operator's client (and kopf, which reads the same fields) can log in.

    Also proves TLS is verified: an unverified request would raise urllib3's
    InsecureRequestWarning, which this project's pytest turns into an error.
    """
    from kubernetes import client, config

    api_client = config.new_client_from_config(config_file=str(k8s_cluster.kubeconfig))  # type: ignore[no-untyped-call]
    try:
        nodes: Any = client.CoreV1Api(api_client).list_node()
        names = sorted(n.metadata.name for n in nodes.items)
        assert names == ["gpu-a100-0", "gpu-a100-1", "gpu-h100-0", "gpu-h100-1"]
        assert nodes.items[0].status.capacity[GPU_RESOURCE] in {"4", "8"}
    finally:
        api_client.close()


CHART_DEPLOYMENT = """\
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ .Release.Name }}
spec:
  replicas: 2
  selector:
    matchLabels: {app: {{ .Release.Name }}}
  template:
    metadata:
      labels: {app: {{ .Release.Name }}}
    spec:
      tolerations:
      - {key: kwok.x-k8s.io/node, operator: Exists, effect: NoSchedule}
      nodeSelector: {nvidia.com/gpu.product: NVIDIA-H100-80GB-HBM3}
      containers:
      - name: engine
        image: fleetgate.invalid/engine:test
        resources: {limits: {nvidia.com/gpu: "1"}}
"""


def test_helm_install_wait_succeeds(
    k8s_cluster: DevCluster, k8s_namespace: str, tmp_path: Path
) -> None:
    """The built helm talks to the cluster and ``--wait`` sees Deployments go Available."""
    chart = tmp_path / "mini"
    (chart / "templates").mkdir(parents=True)
    (chart / "Chart.yaml").write_text("apiVersion: v2\nname: mini\nversion: 0.1.0\n")
    (chart / "templates" / "deployment.yaml").write_text(CHART_DEPLOYMENT)
    helm = [str(k8s_cluster.bin_dir / "helm"), f"--kubeconfig={k8s_cluster.kubeconfig}"]
    env = {"HOME": str(tmp_path), "PATH": "/usr/bin:/bin"}  # no user helm config leaks in
    run = subprocess.run(
        [*helm, "install", "mini", str(chart), "-n", k8s_namespace, "--wait", "--timeout=90s"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    assert "STATUS: deployed" in run.stdout
    d = k8s_cluster.kubectl_json("-n", k8s_namespace, "get", "deployment", "mini")
    assert d["status"]["availableReplicas"] == 2
    listed = subprocess.run(
        [*helm, "list", "-n", k8s_namespace, "-o", "json"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=True,
    )
    assert [r["name"] for r in json.loads(listed.stdout)] == ["mini"]
