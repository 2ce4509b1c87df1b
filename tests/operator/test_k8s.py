"""The operator on the real Kubernetes test control plane (tests/k8s_fixtures.py).

We test these aspects, each against the real API server, controller manager,
scheduler and kwok fake GPU nodes:

* the CRD installs and the API server enforces its schema and CEL rules;
* a vLLM and a TensorRT-LLM service (the examples, applied as they are) get
  Deployments with the right args, probes, resources, affinity; pods land on fake
  GPU nodes; status turns Ready;
* more GPUs than any node has gives Ready=False, reason InsufficientGPU;
* a spec change rolls out; drift is restored; deletion garbage-collects;
* a restarted operator creates no duplicates and writes nothing.

The operator runs in a thread of the test process (fleetgate.operator.app.run),
watching only the test's namespace, with the kwok toleration passed as an option
exactly as ``FLEETGATE_EXTRA_TOLERATIONS`` would.
"""

from __future__ import annotations

import contextlib
import copy
import json
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml

from fleetgate.api.crd import CRD_FILE_NAME, crd_name
from fleetgate.operator import app, rbac
from fleetgate.operator.options import OperatorOptions
from fleetgate_tools.devcluster import FAKE_NODE_TOLERATION, DevCluster

pytestmark = [pytest.mark.k8s, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
T = TypeVar("T")


def wait_for(what: str, probe: Callable[[], T | None], timeout: float = 60.0) -> T:
    """Poll ``probe`` until it returns something truthy; fail with ``what`` otherwise."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(0.5)
    pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}; last: {last!r}")


@pytest.fixture(scope="module")
def crd(k8s_cluster: DevCluster) -> str:
    k8s_cluster.kubectl("apply", "--server-side", "-f", str(ROOT / "crds" / CRD_FILE_NAME))
    k8s_cluster.kubectl("wait", "--for=condition=Established", f"crd/{crd_name()}", "--timeout=60s")
    return crd_name()


@contextlib.contextmanager
def operator(
    cluster: DevCluster,
    namespace: str,
    interval: float = 1.0,
    kubeconfig: Path | None = None,
    **more_options: Any,
) -> Iterator[int]:
    """Run the operator in a thread; yields its metrics/health port; stops it."""
    stop, ready = threading.Event(), threading.Event()
    ports: list[int] = []
    errors: list[BaseException] = []
    options = OperatorOptions(
        extra_tolerations=(FAKE_NODE_TOLERATION,), reconcile_interval=interval, **more_options
    )

    def target() -> None:
        try:
            app.run(
                options,
                kubeconfig=str(kubeconfig or cluster.kubeconfig),
                namespaces=[namespace],
                endpoints=app.Endpoints(host="127.0.0.1", port=0),
                stop_flag=stop,
                ready_flag=ready,
                bound=ports,
            )
        except BaseException as e:  # reported by the test, not lost in a thread
            errors.append(e)

    thread = threading.Thread(target=target, name="operator-under-test")
    thread.start()
    try:
        if not ready.wait(60):
            pytest.fail(f"operator did not start: {errors!r}")
        yield ports[0]
    finally:
        stop.set()
        thread.join(60)
    assert not thread.is_alive(), "operator thread did not stop"
    assert errors == [], errors


def isvc(name: str, namespace: str, **spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": {"uri": "hf://org/tiny"},
        "engine": {"type": "vllm", "image": "vllm/vllm-openai:v0.32.0"},
    }
    body.update(spec)
    return {
        "apiVersion": "fleetgate.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": name, "namespace": namespace},
        "spec": body,
    }


def get(cluster: DevCluster, ns: str, *what: str) -> dict[str, Any] | None:
    res = cluster.kubectl("-n", ns, "get", *what, "-o", "json", check=False)
    if res.returncode != 0:
        return None
    loaded: dict[str, Any] = json.loads(res.stdout)
    return loaded


def condition(obj: dict[str, Any] | None, kind: str) -> dict[str, Any]:
    for cond in ((obj or {}).get("status") or {}).get("conditions") or []:
        if cond["type"] == kind:
            result: dict[str, Any] = cond
            return result
    return {}


def ready_with(cluster: DevCluster, ns: str, name: str, reason: str, status: str) -> Any:
    def probe() -> dict[str, Any] | None:
        obj = get(cluster, ns, "inferenceservice", name)
        cond = condition(obj, "Ready")
        if cond.get("reason") == reason and cond.get("status") == status:
            return obj
        return None

    return probe


def example(path: str, namespace: str) -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((ROOT / "examples" / path).read_text())
    doc["metadata"]["namespace"] = namespace
    return doc


# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        pytest.param(
            {"parallelism": {"tensor": 2}, "gpu": {"count": 1}},
            "parallelism.tensor x parallelism.pipeline must equal gpu.count",
            id="tp-not-gpus",
        ),
        pytest.param(
            {"engine": {"type": "vllm", "image": "i", "tensorrtLlm": {"maxBatchSize": 4}}},
            "engine.tensorrtLlm settings are set but engine.type is not 'tensorrt-llm'",
            id="settings-mismatch",
        ),
        pytest.param(
            {"rollout": {"maxSurge": 0, "maxUnavailable": 0}},
            "rollout.maxSurge and rollout.maxUnavailable cannot both be 0",
            id="stuck-rollout",
        ),
        pytest.param(
            {"storage": {"modelCache": {"pvc": {"claimName": "c"}, "emptyDir": {}}}},
            "set either pvc or emptyDir, not both",
            id="two-caches",
        ),
        pytest.param({"model": {"uri": "ftp://x"}}, "spec.model.uri", id="uri-pattern"),
        pytest.param({"engine": {"type": "sglang", "image": "i"}}, "Unsupported value", id="enum"),
        pytest.param(
            {"autoscaling": {"minReplicas": 3, "maxReplicas": 2, "targetInFlightPerReplica": 4}},
            "autoscaling.minReplicas must not be greater than autoscaling.maxReplicas",
            id="autoscaling-min-above-max",
        ),
        pytest.param(
            {"autoscaling": {"minReplicas": 0, "maxReplicas": 0, "targetInFlightPerReplica": 4}},
            "autoscaling.maxReplicas must be at least 1",
            id="autoscaling-max-zero",
        ),
        pytest.param(
            {
                "autoscaling": {
                    "maxReplicas": 2,
                    "targetInFlightPerReplica": 4,
                    "scaleToZeroAfterSeconds": 60,
                }
            },
            "autoscaling.scaleToZeroAfterSeconds needs minReplicas: 0",
            id="autoscaling-zero-window-without-min-zero",
        ),
        pytest.param(
            {"autoscaling": {"maxReplicas": 2}},
            "autoscaling needs at least one target",
            id="autoscaling-no-target",
        ),
    ],
)
def test_api_server_rejects_invalid_specs_with_cel_message(
    k8s_cluster: DevCluster,
    k8s_namespace: str,
    crd: str,
    spec: dict[str, Any],
    message: str,
) -> None:
    body = isvc("bad", k8s_namespace, **spec)
    res = k8s_cluster.kubectl("apply", "-f", "-", input=json.dumps(body), check=False)
    assert res.returncode != 0, res.stdout
    assert message in res.stderr, res.stderr
    assert get(k8s_cluster, k8s_namespace, "inferenceservice", "bad") is None


def test_defaults_are_applied_by_the_api_server(
    k8s_cluster: DevCluster,
    k8s_namespace: str,
    crd: str,
) -> None:
    k8s_cluster.apply(isvc("defaults", k8s_namespace))
    obj = get(k8s_cluster, k8s_namespace, "inferenceservice", "defaults")
    assert obj is not None
    spec = obj["spec"]
    assert spec["replicas"] == 1
    assert spec["rollout"] == {"maxSurge": 0, "maxUnavailable": 1}
    assert spec["parallelism"] == {"tensor": 1, "pipeline": 1}
    assert spec["gpu"]["count"] == 1 and spec["startupBudgetSeconds"] == 1800
    assert "vllm" not in spec["engine"]
    fgis = k8s_cluster.kubectl("-n", k8s_namespace, "get", "fgis").stdout
    assert fgis.split()[:6] == ["NAME", "ENGINE", "MODEL", "REPLICAS", "READY", "REASON"]


def test_examples_become_ready_on_fake_gpus(
    k8s_cluster: DevCluster,
    k8s_namespace: str,
    crd: str,
) -> None:
    ns = k8s_namespace
    k8s_cluster.kubectl(
        "-n", ns, "create", "secret", "generic", "hf-token", "--from-literal=token=x"
    )
    vllm = example("vllm-llama-3.1-8b.yaml", ns)  # applied as they are (plus namespace)
    trt = example("trtllm-qwen2.5-7b.yaml", ns)
    with operator(k8s_cluster, ns):
        k8s_cluster.apply(vllm, trt)
        for name in ("llama-8b", "qwen-7b"):
            wait_for(
                f"{name} Ready",
                ready_with(k8s_cluster, ns, name, "AllReplicasReady", "True"),
                timeout=120,
            )
        dep = get(k8s_cluster, ns, "deployment", "llama-8b")
        assert dep is not None
        pod_spec = dep["spec"]["template"]["spec"]
        (container,) = pod_spec["containers"]
        args = container["args"]
        for flag in (
            "--enable-prompt-tokens-details",
            "--enable-prefix-caching",
            "--served-model-name",
        ):
            assert flag in args, args
        assert args[args.index("--max-model-len") + 1] == "8192"
        assert container["startupProbe"]["failureThreshold"] == 120  # 1200 s / 10 s
        assert container["resources"]["limits"] == {"nvidia.com/gpu": "1"}
        assert pod_spec["enableServiceLinks"] is False
        pods = k8s_cluster.kubectl_json(
            "-n", ns, "get", "pods", "-l", "app.kubernetes.io/instance=llama-8b"
        )["items"]
        assert len(pods) == 2
        assert all(p["spec"]["nodeName"].startswith("gpu-") for p in pods)
        trt_dep = get(k8s_cluster, ns, "deployment", "qwen-7b")
        assert trt_dep is not None
        (trt_container,) = trt_dep["spec"]["template"]["spec"]["containers"]
        assert trt_container["command"] == ["trtllm-serve"]
        assert trt_container["resources"]["limits"] == {"nvidia.com/gpu": "2"}
        assert get(k8s_cluster, ns, "configmap", "qwen-7b-engine-config") is not None
        for kind in ("service", "poddisruptionbudget"):
            assert get(k8s_cluster, ns, kind, "qwen-7b") is not None
        status = get(k8s_cluster, ns, "inferenceservice", "llama-8b")
        assert status is not None
        st = status["status"]
        assert st["readyReplicas"] == 2 and st["servedModel"] == "llama-3.1-8b"
        assert st["url"] == f"http://llama-8b.{ns}.svc.cluster.local:8000"
        assert st["observedGeneration"] == status["metadata"]["generation"]
        events = k8s_cluster.kubectl_json(
            "-n", ns, "get", "events", "--field-selector", "involvedObject.name=llama-8b"
        )["items"]
        assert "AllReplicasReady" in {e["reason"] for e in events}


def test_too_many_gpus_is_insufficient_gpu(
    k8s_cluster: DevCluster,
    k8s_namespace: str,
    crd: str,
) -> None:
    ns = k8s_namespace
    with operator(k8s_cluster, ns) as port:
        k8s_cluster.apply(isvc("huge", ns, parallelism={"tensor": 16}, gpu={"count": 16}))
        obj = wait_for(
            "Ready=False InsufficientGPU",
            ready_with(k8s_cluster, ns, "huge", "InsufficientGPU", "False"),
            timeout=90,
        )
        assert condition(obj, "Degraded")["status"] == "True"
        assert "Insufficient nvidia.com/gpu" in condition(obj, "Ready")["message"]
        # pods the API server refuses (no such PriorityClass): Degraded with its message
        k8s_cluster.apply(isvc("refused", ns, scheduling={"priorityClassName": "no-such-class"}))
        refused = wait_for(
            "Ready=False PodCreationFailed",
            ready_with(k8s_cluster, ns, "refused", "PodCreationFailed", "False"),
            timeout=90,
        )
        assert "no-such-class" in condition(refused, "Degraded")["message"]

        # a child name taken by someone else's object: Degraded, never adopted
        k8s_cluster.kubectl("-n", ns, "create", "service", "clusterip", "taken", "--tcp=80:80")
        k8s_cluster.apply(isvc("taken", ns))
        taken = wait_for(
            "Ready=False NameConflict",
            ready_with(k8s_cluster, ns, "taken", "NameConflict", "False"),
            timeout=60,
        )
        assert "Service taken already exists" in condition(taken, "Degraded")["message"]
        foreign = get(k8s_cluster, ns, "service", "taken")
        assert foreign is not None and "ownerReferences" not in foreign["metadata"]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            text = resp.read().decode()
        assert 'fleetgate_operator_reconcile_errors_total{reason="InsufficientGPU"}' in text
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as resp:
            assert resp.status == 200


def _deployment_uid(cluster: DevCluster, ns: str, name: str) -> str | None:
    dep = get(cluster, ns, "deployment", name)
    return None if dep is None else str(dep["metadata"]["uid"])


def test_rollout_drift_restart_and_deletion(
    k8s_cluster: DevCluster,
    k8s_namespace: str,
    crd: str,
) -> None:
    ns = k8s_namespace
    body = isvc(
        "svc",
        ns,
        engine={"type": "vllm", "image": "v:1", "vllm": {"maxNumSeqs": 8}},
        gpu={"count": 1, "product": "NVIDIA-A100-SXM4-80GB"},
    )
    with operator(k8s_cluster, ns):
        k8s_cluster.apply(body)
        wait_for("Ready", ready_with(k8s_cluster, ns, "svc", "AllReplicasReady", "True"), 90)

        # a spec change rolls out
        changed = copy.deepcopy(body)
        changed["spec"]["engine"]["vllm"]["maxNumSeqs"] = 16
        k8s_cluster.apply(changed)

        def rolled() -> dict[str, Any] | None:
            obj = ready_with(k8s_cluster, ns, "svc", "AllReplicasReady", "True")()
            if obj and obj["status"]["observedGeneration"] == obj["metadata"]["generation"] == 2:
                return obj
            return None

        wait_for("rollout of generation 2", rolled, 90)
        dep = get(k8s_cluster, ns, "deployment", "svc")
        assert dep is not None
        args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
        assert args[args.index("--max-num-seqs") + 1] == "16"
        assert dep["metadata"]["generation"] >= 2
        terms = dep["spec"]["template"]["spec"]["affinity"]["nodeAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"
        ]["nodeSelectorTerms"]
        assert terms[0]["matchExpressions"][0]["values"] == ["NVIDIA-A100-SXM4-80GB"]
        pods = k8s_cluster.kubectl_json(
            "-n", ns, "get", "pods", "-l", "app.kubernetes.io/instance=svc"
        )["items"]
        assert pods and all(p["spec"]["nodeName"].startswith("gpu-a100-") for p in pods)
        rs = k8s_cluster.kubectl_json("-n", ns, "get", "replicasets")["items"]
        assert len(rs) == 2, "a new ReplicaSet for the new template"

        # the scale subresource drives spec.replicas (HPA / kubectl scale)
        k8s_cluster.kubectl("-n", ns, "scale", "inferenceservice", "svc", "--replicas=2")
        wait_for(
            "2 ready replicas after scale",
            lambda: (
                (get(k8s_cluster, ns, "inferenceservice", "svc") or {})
                .get("status", {})
                .get("readyReplicas")
                == 2
            ),
            90,
        )
        scale_path = f"/apis/fleetgate.dev/v1alpha1/namespaces/{ns}/inferenceservices/svc/scale"
        scale = json.loads(k8s_cluster.kubectl("get", "--raw", scale_path).stdout)
        assert scale["status"]["replicas"] == 2
        assert "app.kubernetes.io/instance=svc" in scale["status"]["selector"]

        # drift: an edited field comes back, a deleted child comes back
        image_path = "/spec/template/spec/containers/0/image"
        patch = json.dumps([{"op": "replace", "path": image_path, "value": "evil:1"}])
        k8s_cluster.kubectl("-n", ns, "patch", "deployment", "svc", "--type=json", "-p", patch)
        wait_for(
            "image restored",
            lambda: (
                (get(k8s_cluster, ns, "deployment", "svc") or {})
                .get("spec", {})
                .get("template", {})
                .get("spec", {})
                .get("containers", [{}])[0]
                .get("image")
                == "v:1"
            ),
            30,
        )
        old_uid = _deployment_uid(k8s_cluster, ns, "svc")
        k8s_cluster.kubectl("-n", ns, "delete", "service", "svc")
        k8s_cluster.kubectl("-n", ns, "delete", "deployment", "svc", "--wait=false")
        wait_for(
            "deployment recreated",
            lambda: _deployment_uid(k8s_cluster, ns, "svc") not in (None, old_uid),
            60,
        )
        wait_for("service recreated", lambda: get(k8s_cluster, ns, "service", "svc"), 30)
        wait_for("Ready again", ready_with(k8s_cluster, ns, "svc", "AllReplicasReady", "True"), 90)

    # restart: a fresh operator finds everything in place and writes nothing
    before = get(k8s_cluster, ns, "deployment", "svc")
    isvc_before = get(k8s_cluster, ns, "inferenceservice", "svc")
    assert before is not None and isvc_before is not None
    with operator(k8s_cluster, ns, interval=0.5):
        time.sleep(4)  # several timer ticks and the initial listing
        after = get(k8s_cluster, ns, "deployment", "svc")
        isvc_after = get(k8s_cluster, ns, "inferenceservice", "svc")
    assert after is not None and isvc_after is not None
    assert after["metadata"]["uid"] == before["metadata"]["uid"]
    assert after["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"]
    assert isvc_after["metadata"]["resourceVersion"] == isvc_before["metadata"]["resourceVersion"]
    deployments = k8s_cluster.kubectl_json("-n", ns, "get", "deployments")["items"]
    assert [d["metadata"]["name"] for d in deployments] == ["svc"]

    # deletion garbage-collects every child (no operator needed: owner references)
    k8s_cluster.kubectl("-n", ns, "delete", "inferenceservice", "svc")
    for kind in ("deployment", "service", "poddisruptionbudget"):
        wait_for(
            f"{kind} collected", lambda kind=kind: get(k8s_cluster, ns, kind, "svc") is None, 60
        )


@contextlib.contextmanager
def restricted_kubeconfig(cluster: DevCluster, ns: str, tmp_path: Path) -> Iterator[Path]:
    """A kubeconfig whose user is a ServiceAccount bound to exactly rbac.CLUSTER_ROLE_RULES."""
    role_name = f"fleetgate-operator-{ns}"
    cluster.kubectl("-n", ns, "create", "serviceaccount", "fleetgate-operator")
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRoleBinding",
        "metadata": {"name": role_name},
        "roleRef": {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "ClusterRole",
            "name": role_name,
        },
        "subjects": [{"kind": "ServiceAccount", "name": "fleetgate-operator", "namespace": ns}],
    }
    cluster.apply(rbac.cluster_role(role_name), binding)
    try:
        token = cluster.kubectl(
            "-n", ns, "create", "token", "fleetgate-operator", "--duration=1h"
        ).stdout.strip()
        config = yaml.safe_load(cluster.kubeconfig.read_text())
        for user in config["users"]:
            user["user"] = {"token": token}
        restricted = tmp_path / "operator.kubeconfig"
        restricted.write_text(yaml.safe_dump(config))
        denied = cluster.kubectl(
            f"--kubeconfig={restricted}", "-n", ns, "get", "secrets", check=False
        )
        assert denied.returncode != 0 and "forbidden" in denied.stderr, "the token is restricted"
        yield restricted
    finally:
        cluster.kubectl("delete", "clusterrolebinding", role_name, check=False)
        cluster.kubectl("delete", "clusterrole", role_name, check=False)


def test_operator_works_with_exactly_its_cluster_role(
    k8s_cluster: DevCluster,
    k8s_namespace: str,
    crd: str,
    tmp_path: Path,
) -> None:
    """Least privilege, checked: run as a ServiceAccount bound to rbac.CLUSTER_ROLE_RULES."""
    ns = k8s_namespace
    with restricted_kubeconfig(k8s_cluster, ns, tmp_path) as restricted:
        trt = isvc("trt", ns, engine={"type": "tensorrt-llm", "image": "t:1.0.0"})
        with operator(k8s_cluster, ns, kubeconfig=restricted):
            k8s_cluster.apply(trt)
            wait_for("Ready", ready_with(k8s_cluster, ns, "trt", "AllReplicasReady", "True"), 90)
            assert get(k8s_cluster, ns, "configmap", "trt-engine-config") is not None
            k8s_cluster.kubectl("-n", ns, "delete", "deployment", "trt", "--wait=false")
            wait_for("deployment restored", lambda: get(k8s_cluster, ns, "deployment", "trt"), 60)
            switched = copy.deepcopy(trt)
            switched["spec"]["engine"] = {"type": "vllm", "image": "v:1"}
            k8s_cluster.apply(switched)
            wait_for(
                "TensorRT-LLM ConfigMap pruned",
                lambda: get(k8s_cluster, ns, "configmap", "trt-engine-config") is None,
                60,
            )
            events = k8s_cluster.kubectl_json(
                "-n", ns, "get", "events", "--field-selector", "involvedObject.name=trt"
            )["items"]
            assert events, "Events are posted with the role's create permission"


SERVICE_MONITOR_CRD: dict[str, Any] = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "servicemonitors.monitoring.coreos.com"},
    "spec": {
        "group": "monitoring.coreos.com",
        "scope": "Namespaced",
        "names": {
            "kind": "ServiceMonitor",
            "plural": "servicemonitors",
            "singular": "servicemonitor",
        },
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "x-kubernetes-preserve-unknown-fields": True,
                    }
                },
            }
        ],
    },
}


def test_service_monitor_follows_the_crd_and_the_switch(
    k8s_cluster: DevCluster,
    k8s_namespace: str,
    crd: str,
) -> None:
    """A stand-in Prometheus Operator CRD (schema-less) makes ServiceMonitors appear."""
    ns = k8s_namespace
    k8s_cluster.apply(SERVICE_MONITOR_CRD)
    try:
        k8s_cluster.kubectl(
            "wait", "--for=condition=Established",
            "crd/servicemonitors.monitoring.coreos.com", "--timeout=60s",
        )  # fmt: skip
        body = isvc("mon", ns)
        with operator(k8s_cluster, ns):
            k8s_cluster.apply(body)
            monitor = wait_for(
                "ServiceMonitor", lambda: get(k8s_cluster, ns, "servicemonitor", "mon"), 60
            )
            assert monitor["spec"]["endpoints"] == [
                {"port": "http", "path": "/metrics", "interval": "15s"}
            ]
            assert monitor["metadata"]["ownerReferences"][0]["kind"] == "InferenceService"
            off = copy.deepcopy(body)
            off["spec"]["metrics"] = {"serviceMonitor": False}
            k8s_cluster.apply(off)
            wait_for(
                "ServiceMonitor removed",
                lambda: get(k8s_cluster, ns, "servicemonitor", "mon") is None,
                60,
            )
    finally:
        k8s_cluster.kubectl(
            "delete", "crd", "servicemonitors.monitoring.coreos.com", "--wait=true", check=False
        )


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_cli_runs_and_stops_on_sigterm_then_refuses_without_crd(
    k8s_cluster: DevCluster,
    k8s_namespace: str,
    crd: str,
) -> None:
    """The real ``fleetgate operator`` process: starts, reconciles, stops on SIGTERM."""
    import os
    import signal
    import subprocess
    import sys

    ns = k8s_namespace
    port = _free_port()
    env = {**os.environ, "FLEETGATE_EXTRA_TOLERATIONS": "kwok.x-k8s.io/node=fake:NoSchedule"}
    argv = [
        sys.executable, "-m", "fleetgate", "operator",
        f"--kubeconfig={k8s_cluster.kubeconfig}", f"--namespace={ns}",
        "--metrics-host=127.0.0.1", f"--metrics-port={port}", "--interval=1",
    ]  # fmt: skip
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:

        def healthy() -> bool:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as r:
                    return bool(r.status == 200)
            except OSError:
                return False

        wait_for("operator /healthz", healthy, 60)
        k8s_cluster.apply(isvc("cli", ns))
        wait_for("Ready", ready_with(k8s_cluster, ns, "cli", "AllReplicasReady", "True"), 90)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, out.decode(errors="replace")[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)

    # without the CRD the operator refuses to start, in one line
    k8s_cluster.kubectl("delete", "crd", crd, "--wait=true", timeout_s=120)
    try:
        res = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
        assert res.returncode == 2
        assert res.stderr.strip().splitlines() == [
            f"fleetgate operator: error: CRD {crd} is not installed in the cluster at "
            f"{k8s_cluster.api_url}: run `kubectl apply -f crds/` (or install the Helm "
            "chart's CRDs) first"
        ]
    finally:
        k8s_cluster.kubectl("apply", "--server-side", "-f", str(ROOT / "crds" / CRD_FILE_NAME))
        k8s_cluster.kubectl("wait", "--for=condition=Established", f"crd/{crd}", "--timeout=60s")
