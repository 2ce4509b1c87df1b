"""Pure parts of the HPA-on-Prometheus stack: scrape targets, adapter rules, HPA, APIService.

The stack itself runs in tests/e2e/test_hpa_prometheus_e2e.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from fleetgate_tools.devcluster import metricsstack as ms
from fleetgate_tools.devcluster.errors import BuildError


def pod(name: str, ip: str | None, *, engine: str = "vllm", port_name: str = "http",
        deleting: bool = False, path: str | None = None) -> dict[str, Any]:  # fmt: skip
    meta: dict[str, Any] = {
        "name": name,
        "namespace": "ns",
        "labels": {"fleetgate.dev/engine": engine},
    }
    if path is not None:
        meta["annotations"] = {"fleetgate.dev/metrics-path": path}
    if deleting:
        meta["deletionTimestamp"] = "2026-12-02T00:00:00Z"
    return {
        "metadata": meta,
        "spec": {"containers": [{"ports": [{"name": port_name, "containerPort": 8000}]}]},
        "status": {"podIP": ip} if ip else {},
    }


def test_targets_are_running_engine_pods_with_their_identity_and_metrics_path() -> None:
    pods = [
        pod("b", "127.0.1.2", path="/metrics"),
        pod("a", "127.0.1.1"),
        pod("no-ip", None),
        pod("gone", "127.0.1.3", deleting=True),
        pod("trt", "127.0.1.4", engine="trtllm", path="/prometheus/metrics"),
        pod("other-port", "127.0.1.5", port_name="metrics"),
        pod("unknown-engine", "127.0.1.6", engine="sglang"),
    ]

    def group(ip: str, name: str, path: str) -> dict[str, Any]:
        labels = {"namespace": "ns", "pod": name, "__metrics_path__": path}
        return {"targets": [f"{ip}:8000"], "labels": labels}

    assert ms.pod_targets(pods) == [
        group("127.0.1.1", "a", "/metrics"),  # no annotation: Prometheus' default path
        group("127.0.1.2", "b", "/metrics"),
        group("127.0.1.4", "trt", "/prometheus/metrics"),
    ]


def test_prometheus_reads_the_targets_file() -> None:
    cfg = ms.prometheus_config(Path("/w/targets.json"), 0.5)
    job = cfg["scrape_configs"][0]
    assert job["file_sd_configs"][0]["files"] == ["/w/targets.json"]
    assert job["scrape_interval"] == "0.5s"
    with pytest.raises(ValueError):
        ms.prometheus_config(Path("/w/t.json"), 0)


def test_adapter_rules_map_namespace_and_pod_and_name_each_metric() -> None:
    rules = ms.adapter_config()["rules"]
    assert [r["name"]["as"] for r in rules] == list(ms.ENGINE_METRICS)
    for r in rules:
        assert r["resources"]["overrides"] == {
            "namespace": {"resource": "namespace"},
            "pod": {"resource": "pod"},
        }
        assert "<<.LabelMatchers>>" in r["metricsQuery"] and "<<.GroupBy>>" in r["metricsQuery"]
        # the series the rule discovers is the one its name is derived from
        assert r["seriesQuery"].split("{")[0] in r["name"]["matches"]
    _, in_flight = ms.ENGINE_METRICS["vllm_num_requests_in_flight"]
    assert "vllm:num_requests_running" in in_flight and "vllm:num_requests_waiting" in in_flight
    _, trt = ms.ENGINE_METRICS["trtllm_num_requests_in_flight"]
    assert "trtllm_num_requests_running{" in trt and "trtllm_num_requests_waiting{" in trt
    assert "vllm:" not in trt
    # one rule per engine kind and gauge: the HPA of a service names its engine's metric
    assert {n.split("_", 1)[0] for n in ms.ENGINE_METRICS} == {"vllm", "trtllm"}


def test_adapter_argv_binds_loopback() -> None:
    argv = ms.adapter_argv(Path("/a"), port=4443, kubeconfig=Path("/k"),
                           prometheus_url="http://127.0.0.1:9090/", config=Path("/c"),
                           cert_dir=Path("/d"))  # fmt: skip
    assert "--bind-address=127.0.0.1" in argv and "--secure-port=4443" in argv
    assert "--metrics-relist-interval=2s" in argv


def test_apiservices_point_at_an_external_name_service_on_loopback() -> None:
    objs = ms.apiservice_objects(4443)
    svc = next(o for o in objs if o["kind"] == "Service")
    assert svc["spec"] == {"type": "ExternalName", "externalName": "127.0.0.1"}
    apis = [o for o in objs if o["kind"] == "APIService"]
    assert {a["metadata"]["name"] for a in apis} == {
        "v1beta1.custom.metrics.k8s.io",
        "v1beta2.custom.metrics.k8s.io",
    }
    for a in apis:
        assert a["spec"]["service"]["port"] == 4443
        assert a["spec"]["service"]["name"] == svc["metadata"]["name"]


def test_hpa_on_a_pods_metric() -> None:
    target = {"apiVersion": "fleetgate.dev/v1alpha1", "kind": "InferenceService", "name": "x"}
    got = ms.hpa("x", "ns", target, metric="vllm_num_requests_waiting", average_value=5,
                 min_replicas=1, max_replicas=3, scale_down_stabilization_s=4)  # fmt: skip
    spec = got["spec"]
    assert spec["scaleTargetRef"] == target
    assert spec["metrics"] == [{"type": "Pods", "pods": {
        "metric": {"name": "vllm_num_requests_waiting"},
        "target": {"type": "AverageValue", "averageValue": "5"}}}]  # fmt: skip
    assert spec["behavior"] == {"scaleDown": {"stabilizationWindowSeconds": 4}}


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"metric": "cpu"}, "unknown metric"),
        ({"min_replicas": 0}, "min_replicas"),  # no scale to zero without the alpha gate
        ({"max_replicas": 0}, "min_replicas"),
        ({"average_value": 0}, "average_value"),
    ],
)
def test_hpa_rejects_bad_input(kw: dict[str, Any], match: str) -> None:
    args: dict[str, Any] = {"metric": "vllm_num_requests_waiting", "average_value": 1,
                            "min_replicas": 1, "max_replicas": 2} | kw  # fmt: skip
    with pytest.raises(ValueError, match=match):
        ms.hpa("x", "ns", {"kind": "Deployment", "name": "x"}, **args)


def test_adapter_binary_override(tmp_path: Path) -> None:
    fake = tmp_path / "adapter"
    assert ms.adapter_binary_path({"FLEETGATE_PROMETHEUS_ADAPTER_BIN": str(fake)}) == fake
    with pytest.raises(BuildError, match="not an executable"):
        ms.ensure_adapter(env={"FLEETGATE_PROMETHEUS_ADAPTER_BIN": str(fake)})
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    assert ms.ensure_adapter(env={"FLEETGATE_PROMETHEUS_ADAPTER_BIN": str(fake)}) == fake
    cached = ms.adapter_binary_path({"FLEETGATE_CACHE": str(tmp_path)})
    assert (
        cached
        == tmp_path / "prometheus-adapter" / ms.ADAPTER_VERSION / "bin" / "prometheus-adapter"
    )


def test_a_failed_build_reports_its_log(tmp_path: Path) -> None:
    script = tmp_path / "build.sh"
    script.write_text("echo 'go: module lookup disabled' >&2; exit 1\n")
    with pytest.raises(BuildError, match="module lookup disabled"):
        ms.ensure_adapter(env={"FLEETGATE_CACHE": str(tmp_path), "PATH": "/usr/bin:/bin"},
                          build_script=script)  # fmt: skip
