"""The chart against the real API server of the dev cluster: every rendered object
validated by ``kubectl apply --dry-run=server``, then ``helm install`` with all
workloads Available (kwok nodes: the kwok taint tolerated through values), and
``helm uninstall`` keeping the CRD."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator

import pytest
from chartkit import CHART, KWOK_TOLERATION, helm, render_text

from fleetgate.api import crd
from fleetgate_tools.devcluster import DevCluster

pytestmark = pytest.mark.k8s

SERVICE_MONITOR_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "servicemonitors.monitoring.coreos.com"},
    "spec": {
        "group": "monitoring.coreos.com",
        "scope": "Namespaced",
        "names": {"kind": "ServiceMonitor", "plural": "servicemonitors",
                  "singular": "servicemonitor", "listKind": "ServiceMonitorList"},
        "versions": [{"name": "v1", "served": True, "storage": True, "schema": {"openAPIV3Schema": {
            "type": "object", "x-kubernetes-preserve-unknown-fields": True}}}],
    },
}  # fmt: skip


def kubeconfig_args(cluster: DevCluster) -> list[str]:
    return ["--kubeconfig", str(cluster.kubeconfig)]


def adopt_crd(cluster: DevCluster, release: str, namespace: str) -> None:
    """Let this release take over a CRD another test applied with kubectl (the way a
    user moves from ``kubectl apply -f crds/`` to the chart, see docs/deploy.md)."""
    name = crd.crd_name()
    if cluster.kubectl("get", "crd", name, check=False).returncode != 0:
        return
    cluster.kubectl("label", "crd", name, "app.kubernetes.io/managed-by=Helm", "--overwrite")
    cluster.kubectl(
        "annotate", "crd", name, f"meta.helm.sh/release-name={release}",
        f"meta.helm.sh/release-namespace={namespace}", "--overwrite",
    )  # fmt: skip


@pytest.fixture
def service_monitor_crd(k8s_cluster: DevCluster) -> Iterator[None]:
    k8s_cluster.apply(SERVICE_MONITOR_CRD)
    k8s_cluster.kubectl(
        "wait", "--for=condition=Established", "crd/servicemonitors.monitoring.coreos.com",
        "--timeout=60s",
    )  # fmt: skip
    yield
    k8s_cluster.kubectl(
        "delete", "crd", "servicemonitors.monitoring.coreos.com", "--wait=true", check=False
    )


@pytest.mark.parametrize(
    "values",
    [
        pytest.param([], id="defaults"),
        pytest.param(
            ["--set", "serviceMonitor.enabled=true",
             "--set", "router.config.discovery.kubernetes.source=pods",
             "--set-json", f"operator.engineTolerations={json.dumps([KWOK_TOLERATION])}",
             "--set-json", 'imagePullSecrets=[{"name":"regcred"}]', "--set", "crds.keep=false"],
            id="everything-on",
        ),
        pytest.param(["--set", "crds.enabled=false", "--set", "router.config.discovery.kind=static",
                      "--set", "dashboards.enabled=false"], id="minimal"),
    ],
)  # fmt: skip
def test_rendered_manifests_pass_server_side_validation(
    k8s_cluster: DevCluster, k8s_namespace: str, service_monitor_crd: None, values: list[str]
) -> None:
    text = render_text(*values, "--kube-version", "1.36.3", namespace=k8s_namespace)
    res = k8s_cluster.kubectl(
        "apply", "--dry-run=server", "--validate=strict", "-n", k8s_namespace, "-f", "-",
        input=text, check=False,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    lines = [line for line in res.stdout.splitlines() if line.strip()]
    assert lines and all("(server dry run)" in line for line in lines), res.stdout
    assert any(line.startswith("deployment.apps/") for line in lines)


def _available(cluster: DevCluster, namespace: str, release: str) -> dict[str, bool]:
    deps = cluster.kubectl_json(
        "-n", namespace, "get", "deployments", "-l", f"app.kubernetes.io/instance={release}"
    )["items"]
    return {
        d["metadata"]["name"]: any(
            c["type"] == "Available" and c["status"] == "True"
            for c in d.get("status", {}).get("conditions", [])
        )
        for d in deps
    }


def test_helm_install_makes_every_workload_available_and_uninstall_keeps_the_crd(
    k8s_cluster: DevCluster, k8s_namespace: str
) -> None:
    release = f"fg-{uuid.uuid4().hex[:6]}"
    adopt_crd(k8s_cluster, release, k8s_namespace)
    tol = json.dumps([KWOK_TOLERATION])
    started = time.monotonic()
    helm(
        *kubeconfig_args(k8s_cluster), "install", release, str(CHART), "-n", k8s_namespace,
        "--set-json", f"operator.tolerations={tol}", "--set-json", f"router.tolerations={tol}",
        "--wait", "--timeout", "180s", timeout_s=240,
    )  # fmt: skip
    try:
        took = time.monotonic() - started
        available = _available(k8s_cluster, k8s_namespace, release)
        assert available == {
            f"{release}-fleetgate-operator": True,
            f"{release}-fleetgate-router": True,
        }
        router = k8s_cluster.kubectl_json(
            "-n", k8s_namespace, "get", "deployment", f"{release}-fleetgate-router"
        )
        assert router["status"]["availableReplicas"] == 2, took
        got = k8s_cluster.kubectl_json("get", "crd", crd.crd_name())
        assert got["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
        assert got["metadata"]["annotations"]["meta.helm.sh/release-name"] == release
        assert (
            got["spec"]["versions"][0]["schema"]
            == crd.render_crd()["spec"]["versions"][0]["schema"]
        )
        status = json.loads(
            helm(
                *kubeconfig_args(k8s_cluster), "status", release, "-n", k8s_namespace, "-o", "json"
            ).stdout
        )
        assert status["info"]["status"] == "deployed"
    finally:
        helm(*kubeconfig_args(k8s_cluster), "uninstall", release, "-n", k8s_namespace, "--wait")
    assert _available(k8s_cluster, k8s_namespace, release) == {}
    assert k8s_cluster.kubectl("get", "crd", crd.crd_name(), check=False).returncode == 0
    roles = k8s_cluster.kubectl_json(
        "get", "clusterroles", "-l", f"app.kubernetes.io/instance={release}"
    )
    assert roles["items"] == []


def test_router_rbac_grants_reads_only_in_the_watched_namespaces(
    k8s_cluster: DevCluster, k8s_namespace: str
) -> None:
    """The real RBAC authorizer on the chart's router ServiceAccount, ClusterRole and
    per-namespace RoleBinding (``discovery.kubernetes.namespaces`` set)."""
    release = f"fg-{uuid.uuid4().hex[:6]}"
    if k8s_cluster.kubectl("get", "crd", crd.crd_name(), check=False).returncode != 0:
        # can-i on a resource the API server does not serve says no: install the CRD
        # when no earlier test of this session did
        k8s_cluster.apply(crd.render_crd())
        k8s_cluster.kubectl("wait", "--for=condition=Established", f"crd/{crd.crd_name()}")
    text = render_text(
        "--set-json", f'router.config.discovery.kubernetes.namespaces=["{k8s_namespace}"]',
        "--show-only", "templates/router.yaml", release=release, namespace=k8s_namespace,
    )  # fmt: skip
    k8s_cluster.kubectl("apply", "-n", k8s_namespace, "-f", "-", input=text)
    sa = f"system:serviceaccount:{k8s_namespace}:{release}-fleetgate-router"
    try:

        def can(verb: str, resource: str, namespace: str) -> bool:
            res = k8s_cluster.kubectl(
                "auth", "can-i", verb, resource, "-n", namespace, "--as", sa, check=False
            )
            return res.stdout.strip() == "yes"

        assert can("watch", "endpointslices.discovery.k8s.io", k8s_namespace)
        assert can("list", "inferenceservices.fleetgate.dev", k8s_namespace)
        assert not can("list", "endpointslices.discovery.k8s.io", "default")
        assert not can("list", "inferenceservices.fleetgate.dev", "kube-system")
        assert can("watch", "pods", k8s_namespace)  # the scale-down drain annotation
        assert not can("list", "pods", "default")
        assert not can("patch", "inferenceservices.fleetgate.dev", k8s_namespace)
        assert not can("get", "secrets", k8s_namespace)
    finally:
        k8s_cluster.kubectl("delete", "clusterrole", f"{release}-fleetgate-router", check=False)
