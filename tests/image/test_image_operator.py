"""The operator image reconciles an InferenceService with the chart's RBAC only.

The operator runs from the image (read-only root, no capabilities, uid 65532, host
network) against the test control plane (tests/k8s_fixtures.py) the way it runs in
a pod: the API server from ``KUBERNETES_SERVICE_HOST``/``_PORT`` and the
service-account mount (token, ca.crt, namespace) at
/var/run/secrets/kubernetes.io/serviceaccount, read-only. The token is a
ServiceAccount's, bound to exactly the chart's ClusterRole
(``fleetgate.operator.rbac``, which hack/gen_chart_templates.py renders into the
chart). It must report the example vLLM service Ready and exit 0 on ``podman stop``.
"""

from __future__ import annotations

import base64
import contextlib
import json
import re
import socket
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
import yaml
from imagekit import container

from fleetgate.api.crd import CRD_FILE_NAME, crd_name
from fleetgate.operator import rbac
from fleetgate_tools.devcluster import DevCluster

pytestmark = [pytest.mark.image, pytest.mark.k8s, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def ready(cluster: DevCluster, ns: str, name: str) -> dict[str, Any] | None:
    res = cluster.kubectl("-n", ns, "get", "inferenceservice", name, "-o", "json", check=False)
    if res.returncode != 0:
        return None
    obj: dict[str, Any] = json.loads(res.stdout)
    for cond in (obj.get("status") or {}).get("conditions") or []:
        if cond["type"] == "Ready" and cond["status"] == "True":
            return obj
    return None


def test_operator_image_reports_the_example_ready_with_the_charts_role(
    images: dict[str, str], k8s_cluster: DevCluster, k8s_namespace: str, tmp_path: Path
) -> None:
    ns = k8s_namespace
    k8s_cluster.kubectl("apply", "--server-side", "-f", str(ROOT / "crds" / CRD_FILE_NAME))
    k8s_cluster.kubectl("wait", "--for=condition=Established", f"crd/{crd_name()}", "--timeout=60s")
    role = f"fleetgate-operator-{ns}"
    k8s_cluster.kubectl("-n", ns, "create", "serviceaccount", "fleetgate-operator")
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRoleBinding",
        "metadata": {"name": role},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role},
        "subjects": [{"kind": "ServiceAccount", "name": "fleetgate-operator", "namespace": ns}],
    }
    k8s_cluster.apply(rbac.cluster_role(role), binding)
    try:
        token = k8s_cluster.kubectl(
            "-n", ns, "create", "token", "fleetgate-operator", "--duration=1h"
        ).stdout.strip()
        kubeconfig = yaml.safe_load(k8s_cluster.kubeconfig.read_text())
        cluster = kubeconfig["clusters"][0]["cluster"]
        server = urlsplit(cluster["server"])
        assert server.hostname == "127.0.0.1", server
        sa = tmp_path / "serviceaccount"
        sa.mkdir()
        sa.chmod(0o755)
        (sa / "token").write_text(token)
        (sa / "ca.crt").write_bytes(base64.b64decode(cluster["certificate-authority-data"]))
        (sa / "namespace").write_text(ns)
        example = yaml.safe_load((ROOT / "examples" / "vllm-llama-3.1-8b.yaml").read_text())
        name = example["metadata"]["name"]
        example["metadata"]["namespace"] = ns
        port = free_port()
        args = ["operator", "--namespace", ns, "--metrics-host", "127.0.0.1",
                "--metrics-port", str(port), "--interval", "2",
                "--extra-toleration", "kwok.x-k8s.io/node=fake:NoSchedule"]  # fmt: skip
        env = {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": str(server.port)}
        with container(
            images["runtime"], args, env=env, volumes=[f"{sa}:{SA_DIR}:ro"], name="fg-operator"
        ) as c:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).is_success:
                        break
                assert c.running(), c.logs()
                time.sleep(0.3)
            else:
                raise AssertionError(f"operator /healthz never answered:\n{c.logs()}")
            k8s_cluster.apply(example)
            deadline = time.monotonic() + 120
            while not ready(k8s_cluster, ns, name):
                assert time.monotonic() < deadline, f"not Ready in 120 s:\n{c.logs()}"
                assert c.running(), c.logs()
                time.sleep(0.5)
            deployment = k8s_cluster.kubectl_json("-n", ns, "get", "deployment", name)
            assert deployment["spec"]["template"]["spec"]["containers"][0]["command"]
            metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
            assert "fleetgate_" in metrics
            code, took = c.stop(grace_s=30)
            logs = c.logs()
        assert code == 0, logs
        assert took < 30, f"stop took {took:.1f} s"
        assert not _denied(logs), logs[-3000:]
    finally:
        k8s_cluster.kubectl("delete", "clusterrolebinding", role, check=False)
        k8s_cluster.kubectl("delete", "clusterrole", role, check=False)


#: A log line's leading timestamp (``2026-12-06 01:44:03,403``): its milliseconds are
#: no HTTP status (a CI run failed on ``03,403``).
_STAMP = re.compile(r"^\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2},\d{3} ", re.MULTILINE)


def _denied(logs: str) -> bool:
    """The operator's log shows the API server refusing it: ``Forbidden`` or a 403
    status anywhere but in the lines' timestamps."""
    text = _STAMP.sub("", logs)
    return "Forbidden" in text or re.search(r"\b403\b", text) is not None
