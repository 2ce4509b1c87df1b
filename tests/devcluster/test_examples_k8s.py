"""The examples schedule on the dev cluster as written: no toleration added by hand.

``fleetgate dev-cluster operator`` runs the operator with the toleration of the fake
GPU nodes' kwok taint (:func:`fleetgate_tools.devcluster.manifests.operator_command`),
so ``kubectl apply -f examples/...`` is all a user types. This runs that exact
operator command line against the real test control plane and applies the examples
unchanged.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from fleetgate.api.crd import CRD_FILE_NAME, crd_name
from fleetgate_tools.devcluster import FAKE_NODE_TOLERATION, DevCluster
from fleetgate_tools.devcluster.manifests import operator_command

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))

pytestmark = pytest.mark.k8s


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_examples_schedule_on_the_fake_gpu_nodes_without_a_hand_added_toleration(
    k8s_cluster: DevCluster, k8s_namespace: str
) -> None:
    assert len(EXAMPLES) >= 2
    for path in EXAMPLES:
        assert "toleration" not in path.read_text(), f"{path.name} must not need one"
    ns = k8s_namespace
    k8s_cluster.kubectl("apply", "--server-side", "-f", str(ROOT / "crds" / CRD_FILE_NAME))
    k8s_cluster.kubectl("wait", "--for=condition=Established", f"crd/{crd_name()}", "--timeout=60s")
    argv = operator_command(
        sys.executable,
        k8s_cluster.kubeconfig,
        [f"--namespace={ns}", "--metrics-host=127.0.0.1", f"--metrics-port={_free_port()}",
         "--interval=1"],
    )  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        args = ["apply", "-n", ns] + [a for p in EXAMPLES for a in ("-f", str(p))]
        k8s_cluster.kubectl(*args)
        # vLLM example: 2 replicas; TensorRT-LLM example: 1 replica of 2 GPUs
        want = 3
        pods: list[dict[str, Any]] = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            pods = k8s_cluster.kubectl_json("-n", ns, "get", "pods")["items"]
            scheduled = [p for p in pods if p["spec"].get("nodeName")]
            if len(scheduled) >= want:
                break
            assert proc.poll() is None, "the operator exited"
            time.sleep(0.5)
        else:
            conditions = [p.get("status", {}).get("conditions") for p in pods]
            pytest.fail(f"{len(pods)} pods, not {want} scheduled; conditions: {conditions}")
        for p in pods:
            assert p["spec"]["nodeName"].startswith("gpu-")
            tolerations = p["spec"].get("tolerations", [])
            assert any(t.get("key") == FAKE_NODE_TOLERATION["key"] for t in tolerations)
    finally:
        proc.terminate()
        try:
            proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate(timeout=30)
    assert proc.returncode == 0


def test_operator_command_adds_the_fake_node_toleration() -> None:
    argv = operator_command("/py", Path("/k"), ["--namespace=x"])
    assert argv == [
        "/py", "-m", "fleetgate", "operator", "--kubeconfig=/k",
        "--extra-toleration=kwok.x-k8s.io/node=fake:NoSchedule", "--namespace=x",
    ]  # fmt: skip
