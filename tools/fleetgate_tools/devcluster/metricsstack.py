"""HPA on engine queue metrics through Prometheus, on the dev cluster (issue 15).

The setup the ecosystem documents for autoscaling LLM engines without fleetgate's own
autoscaler: Prometheus scrapes the engines' ``/metrics``, prometheus-adapter serves
them as per-pod custom metrics (``custom.metrics.k8s.io``, an aggregated API), and an
``autoscaling/v2`` HorizontalPodAutoscaler in kube-controller-manager scales the
target on them. Here every piece is a real process on loopback:

* Prometheus is Debian's ``prometheus`` (``hack/install-prometheus.sh``) scraping each
  engine pod's ``http`` port on its kwok IP (127.0.1.x), where the pod-engine launcher
  runs an emulated engine, at the path the operator wrote on the pod
  (``fleetgate.dev/metrics-path``: vLLM's ``/metrics``, TensorRT-LLM's
  ``/prometheus/metrics`` from 1.3); the pod's namespace and name become the
  ``namespace`` and ``pod`` labels the adapter maps to resources. Debian builds Prometheus without
  the Kubernetes discovery, so a thread here lists the pods every second and writes a
  ``file_sd`` file (:func:`pod_targets`);
* prometheus-adapter is built from its Go module (``hack/build-prometheus-adapter.sh``,
  cached like the control plane) and runs on 127.0.0.1 with a self-signed serving
  certificate;
* the API server reaches it through an APIService whose Service is ``ExternalName:
  127.0.0.1`` (loopback Endpoints are refused; see
  :func:`fleetgate_tools.devcluster.manifests.aggregation_flags`), so the cluster must
  be started with ``ClusterConfig(aggregation=True)`` and, for a short reaction time,
  ``hpa_sync_period_s``.

Custom metrics served per pod (:func:`adapter_config`), for each engine kind
``E`` (``vllm``, ``trtllm``): ``E_num_requests_waiting`` (the engine's queue),
``E_num_requests_running`` (its batch) and ``E_num_requests_in_flight`` (their sum).
TensorRT-LLM publishes its two gauges on ``/prometheus/metrics`` from 1.3 on
(``trtllm_num_requests_{running,waiting}``); an HPA per InferenceService names its
engine's metric.

The builders are pure; :class:`MetricsStack` starts and stops the two processes (by
PID, see :mod:`fleetgate_tools.procs`) and registers the APIService.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import yaml

from fleetgate_tools import procs
from fleetgate_tools.devcluster.bins import cache_dir, repo_root
from fleetgate_tools.devcluster.cluster import DevCluster
from fleetgate_tools.devcluster.errors import BuildError, DevClusterError, StartError
from fleetgate_tools.devcluster.manifests import LOOPBACK
from fleetgate_tools.devcluster.podengines import LABEL_ENGINE

ADAPTER_VERSION = "v0.12.0"
ENV_ADAPTER_BIN = "FLEETGATE_PROMETHEUS_ADAPTER_BIN"
CUSTOM_METRICS_GROUP = "custom.metrics.k8s.io"
#: the APIService versions prometheus-adapter v0.12 serves
CUSTOM_METRICS_VERSIONS = ("v1beta1", "v1beta2")
ADAPTER_NAMESPACE = "custom-metrics"
ADAPTER_SERVICE = "prometheus-adapter"

#: engine kind -> its (running, waiting) gauges as each engine names them
ENGINE_GAUGES: dict[str, tuple[str, str]] = {
    "vllm": ("vllm:num_requests_running", "vllm:num_requests_waiting"),
    "trtllm": ("trtllm_num_requests_running", "trtllm_num_requests_waiting"),
}
#: where a pod without the ``fleetgate.dev/metrics-path`` annotation is scraped
DEFAULT_METRICS_PATH = "/metrics"
ANNOTATION_METRICS_PATH = "fleetgate.dev/metrics-path"


def _engine_metrics() -> dict[str, tuple[str, str]]:
    out: dict[str, tuple[str, str]] = {}
    for kind, (running, waiting) in ENGINE_GAUGES.items():
        m = "{<<.LabelMatchers>>}"
        out[f"{kind}_num_requests_waiting"] = (waiting, f"sum({waiting}{m}) by (<<.GroupBy>>)")
        out[f"{kind}_num_requests_running"] = (running, f"sum({running}{m}) by (<<.GroupBy>>)")
        out[f"{kind}_num_requests_in_flight"] = (
            running,
            f"sum({running}{m} + {waiting}{m}) by (<<.GroupBy>>)",
        )
    return out


#: custom metric name -> (the series it is discovered by, the PromQL that computes it
#: per pod in the adapter's template syntax)
ENGINE_METRICS: dict[str, tuple[str, str]] = _engine_metrics()


# ---- building the adapter ----------------------------------------------------------------
def adapter_binary_path(env: Mapping[str, str] | None = None) -> Path:
    env = os.environ if env is None else env
    override = env.get(ENV_ADAPTER_BIN)
    if override:
        return Path(override)
    return cache_dir(env) / "prometheus-adapter" / ADAPTER_VERSION / "bin" / "prometheus-adapter"


def ensure_adapter(
    *,
    env: Mapping[str, str] | None = None,
    build_script: Path | None = None,
    timeout_s: float = 3600,
) -> Path:
    """The adapter binary, built by ``hack/build-prometheus-adapter.sh`` if missing.

    Raises :class:`BuildError` with the build log's tail when the build fails."""
    env = dict(os.environ if env is None else env)
    binary = adapter_binary_path(env)
    if os.access(binary, os.X_OK):
        return binary
    if env.get(ENV_ADAPTER_BIN):
        raise BuildError(f"{ENV_ADAPTER_BIN}={binary} is not an executable file")
    script = build_script or repo_root() / "hack" / "build-prometheus-adapter.sh"
    cache = cache_dir(env)
    cache.mkdir(parents=True, exist_ok=True)
    log_path = cache / "prometheus-adapter-build.log"
    with open(cache / "prometheus-adapter-build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.access(binary, os.X_OK):
            return binary
        with open(log_path, "w") as log:
            proc = subprocess.run(
                ["bash", str(script)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**env, "ADAPTER_VERSION": ADAPTER_VERSION},
                timeout=timeout_s,
                check=False,
            )
    if proc.returncode != 0 or not os.access(binary, os.X_OK):
        raise BuildError(
            f"{script} failed (exit {proc.returncode}) or left no {binary}; log {log_path}:\n"
            + procs.tail(log_path, 40)
        )
    return binary


def prometheus_binary() -> str:
    """Debian's prometheus, installed by ``hack/install-prometheus.sh`` if missing."""
    path = shutil.which("prometheus")
    if path is None:
        script = repo_root() / "hack" / "install-prometheus.sh"
        subprocess.run(["bash", str(script)], check=True, stdin=subprocess.DEVNULL)
        path = shutil.which("prometheus")
    if path is None:
        raise DevClusterError("Debian's prometheus is required (hack/install-prometheus.sh)")
    return path


# ---- pure builders -------------------------------------------------------------------
def prometheus_config(targets_file: Path, scrape_interval_s: float = 1.0) -> dict[str, Any]:
    """Scrape the engine pods listed in ``targets_file`` (:func:`pod_targets`).

    File discovery, not ``kubernetes_sd_configs``: Debian's Prometheus 2.42 is built
    without the Kubernetes discovery ("field kubernetes_sd_configs not found in type
    config.ScrapeConfig"), so :class:`MetricsStack` lists the pods itself and rewrites
    the file, which Prometheus watches."""
    if scrape_interval_s <= 0:
        raise ValueError(f"scrape_interval_s must be > 0, got {scrape_interval_s}")
    every = f"{scrape_interval_s:g}s"
    return {
        "global": {"scrape_interval": every, "evaluation_interval": every},
        "scrape_configs": [
            {
                "job_name": "engines",
                "scrape_interval": every,
                "scrape_timeout": every,
                "file_sd_configs": [{"files": [str(targets_file)], "refresh_interval": "5s"}],
            }
        ],
    }


def pod_targets(pods: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """file_sd target groups for the engine pods among ``pods`` (a pod list's items):
    the pod IP and its ``http`` container port, labelled ``namespace`` and ``pod`` (the
    labels the adapter maps to resources) and ``__metrics_path__`` from the pod's
    ``fleetgate.dev/metrics-path`` annotation (Prometheus scrapes that path). Pods of
    no known engine kind, without an IP or being deleted are left out, as Prometheus'
    Kubernetes discovery would."""
    groups = []
    for p in pods:
        meta, status = p.get("metadata", {}), p.get("status", {})
        kind = meta.get("labels", {}).get(LABEL_ENGINE)
        if kind not in ENGINE_GAUGES or meta.get("deletionTimestamp"):
            continue
        path = (meta.get("annotations") or {}).get(ANNOTATION_METRICS_PATH, DEFAULT_METRICS_PATH)
        ip = status.get("podIP")
        ports = [
            cp["containerPort"]
            for c in p.get("spec", {}).get("containers", [])
            for cp in c.get("ports", [])
            if cp.get("name") == "http"
        ]
        if not ip or not ports:
            continue
        groups.append(
            {
                "targets": [f"{ip}:{ports[0]}"],
                "labels": {
                    "namespace": meta["namespace"],
                    "pod": meta["name"],
                    "__metrics_path__": path,
                },
            }
        )
    return sorted(groups, key=lambda g: g["labels"]["pod"])


def adapter_config() -> dict[str, Any]:
    """prometheus-adapter rules: each of :data:`ENGINE_METRICS` as a per-pod metric."""
    rules = []
    for name, (series, query) in ENGINE_METRICS.items():
        rules.append(
            {
                "seriesQuery": f'{series}{{namespace!="",pod!=""}}',
                "resources": {
                    "overrides": {
                        "namespace": {"resource": "namespace"},
                        "pod": {"resource": "pod"},
                    }
                },
                "name": {"matches": f"^{series}$", "as": name},
                "metricsQuery": query,
            }
        )
    return {"rules": rules}


def adapter_argv(
    binary: Path,
    *,
    port: int,
    kubeconfig: Path,
    prometheus_url: str,
    config: Path,
    cert_dir: Path,
    relist_interval_s: float = 2.0,
) -> list[str]:
    return [
        str(binary),
        f"--bind-address={LOOPBACK}",
        f"--secure-port={port}",
        f"--cert-dir={cert_dir}",
        f"--lister-kubeconfig={kubeconfig}",
        f"--authentication-kubeconfig={kubeconfig}",
        f"--authorization-kubeconfig={kubeconfig}",
        f"--prometheus-url={prometheus_url}",
        f"--config={config}",
        # a new engine's series must be known within seconds, not the default minutes
        f"--metrics-relist-interval={relist_interval_s:g}s",
        f"--metrics-max-age={max(30.0, 4 * relist_interval_s):g}s",
        "--v=1",
    ]


def apiservice_objects(port: int) -> list[dict[str, Any]]:
    """Namespace, ``ExternalName`` Service at 127.0.0.1 and the custom-metrics APIServices."""
    objs: list[dict[str, Any]] = [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ADAPTER_NAMESPACE}},
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": ADAPTER_SERVICE, "namespace": ADAPTER_NAMESPACE},
            "spec": {"type": "ExternalName", "externalName": LOOPBACK},
        },
    ]
    for version in CUSTOM_METRICS_VERSIONS:
        objs.append(
            {
                "apiVersion": "apiregistration.k8s.io/v1",
                "kind": "APIService",
                "metadata": {"name": f"{version}.{CUSTOM_METRICS_GROUP}"},
                "spec": {
                    "group": CUSTOM_METRICS_GROUP,
                    "version": version,
                    "service": {
                        "name": ADAPTER_SERVICE,
                        "namespace": ADAPTER_NAMESPACE,
                        "port": port,
                    },
                    # the adapter's certificate is self-signed for its bind address
                    "insecureSkipTLSVerify": True,
                    "groupPriorityMinimum": 100,
                    "versionPriority": 200 if version == "v1beta2" else 100,
                },
            }
        )
    return objs


def hpa(
    name: str,
    namespace: str,
    target: Mapping[str, str],
    *,
    metric: str,
    average_value: float,
    min_replicas: int,
    max_replicas: int,
    scale_down_stabilization_s: int | None = None,
) -> dict[str, Any]:
    """An ``autoscaling/v2`` HPA on one per-pod custom metric (type ``Pods``).

    ``target`` is the ``scaleTargetRef`` (apiVersion, kind, name): a Deployment, or an
    InferenceService through its scale subresource. ``min_replicas`` must be >= 1: the
    HPA scales to zero only with the alpha ``HPAScaleToZero`` feature gate."""
    if metric not in ENGINE_METRICS:
        raise ValueError(f"unknown metric {metric!r}; known: {', '.join(ENGINE_METRICS)}")
    if min_replicas < 1 or max_replicas < min_replicas:
        raise ValueError(
            f"want 1 <= min_replicas <= max_replicas, got {min_replicas}, {max_replicas}"
        )
    if average_value <= 0:
        raise ValueError(f"average_value must be > 0, got {average_value}")
    spec: dict[str, Any] = {
        "scaleTargetRef": dict(target),
        "minReplicas": min_replicas,
        "maxReplicas": max_replicas,
        "metrics": [
            {
                "type": "Pods",
                "pods": {
                    "metric": {"name": metric},
                    "target": {"type": "AverageValue", "averageValue": f"{average_value:g}"},
                },
            }
        ],
    }
    if scale_down_stabilization_s is not None:
        spec["behavior"] = {"scaleDown": {"stabilizationWindowSeconds": scale_down_stabilization_s}}
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": name, "namespace": namespace},
        "spec": spec,
    }


# ---- running it ----------------------------------------------------------------------
class MetricsStack:
    """Prometheus + prometheus-adapter for ``namespaces`` of a dev cluster started with
    ``ClusterConfig(aggregation=True)``. Use as a context manager."""

    def __init__(
        self,
        cluster: DevCluster,
        namespaces: list[str],
        work_dir: Path,
        *,
        adapter: Path | None = None,
        scrape_interval_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if not cluster.config.aggregation:
            raise DevClusterError(
                "the cluster must be started with ClusterConfig(aggregation=True)"
            )
        self.cluster = cluster
        self.namespaces = namespaces
        self.work = work_dir
        self.adapter = adapter
        self.scrape_interval_s = scrape_interval_s
        self._clock = clock
        self._sleep = sleep
        self._procs: list[procs.Proc] = []
        self._stop_discovery = threading.Event()
        self._discovery: threading.Thread | None = None
        self.targets_file = work_dir / "targets.json"
        #: the last error of the pod listing (it retries every second), for logs
        self.discovery_error: str | None = None
        self.prometheus_url = ""
        self.adapter_port = 0

    def __enter__(self) -> MetricsStack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, timeout_s: float = 60.0) -> MetricsStack:
        adapter = self.adapter or ensure_adapter()
        self.work.mkdir(parents=True, exist_ok=True)
        prom_port, self.adapter_port = procs.free_ports(2)
        self.prometheus_url = f"http://{LOOPBACK}:{prom_port}"
        prom_cfg = self.work / "prometheus.yml"
        prom_cfg.write_text(
            yaml.safe_dump(prometheus_config(self.targets_file, self.scrape_interval_s))
        )
        self._write_targets()
        self._stop_discovery.clear()
        self._discovery = threading.Thread(target=self._discover, name="pod-targets", daemon=True)
        self._discovery.start()
        rules = self.work / "adapter.yaml"
        rules.write_text(yaml.safe_dump(adapter_config()))
        try:
            self._procs.append(procs.spawn(
                "prometheus",
                [prometheus_binary(), f"--config.file={prom_cfg}",
                 f"--storage.tsdb.path={self.work / 'tsdb'}",
                 f"--web.listen-address={LOOPBACK}:{prom_port}"],
                self.work / "prometheus.log",
            ))  # fmt: skip
            self._procs.append(procs.spawn(
                "prometheus-adapter",
                adapter_argv(adapter, port=self.adapter_port, kubeconfig=self.cluster.kubeconfig,
                             prometheus_url=self.prometheus_url + "/", config=rules,
                             cert_dir=self.work / "adapter-certs"),
                self.work / "prometheus-adapter.log",
            ))  # fmt: skip
            self.cluster.apply(*apiservice_objects(self.adapter_port))
            self._wait(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait(self, timeout_s: float) -> None:
        deadline = self._clock() + timeout_s
        api = self.cluster.api()
        path = f"/apis/{CUSTOM_METRICS_GROUP}/{CUSTOM_METRICS_VERSIONS[-1]}"
        last = ""
        while True:
            dead = [p.name for p in self._procs if not p.alive()]
            if dead:
                raise StartError(f"{', '.join(dead)} exited while starting\n{self.log_tails()}")
            try:
                status, body = api.get(path)
            except OSError as e:
                status, body = 0, str(e)
            if status == 200:
                return
            last = f"{status} {json.dumps(body)[:300]}"
            if self._clock() > deadline:
                raise StartError(
                    f"GET {path} through the API server: {last} after {timeout_s:.0f}s\n"
                    + self.log_tails()
                )
            self._sleep(0.5)

    def _write_targets(self) -> None:
        pods: list[dict[str, Any]] = []
        api = self.cluster.api()
        for ns in self.namespaces:
            status, body = api.get(f"/api/v1/namespaces/{ns}/pods")
            if status != 200:
                raise DevClusterError(f"listing pods in {ns}: {status} {body}")
            pods += body.get("items", [])
        text = json.dumps(pod_targets(pods), indent=1)
        if self.targets_file.exists() and self.targets_file.read_text() == text:
            return
        tmp = self.targets_file.with_suffix(".tmp")
        tmp.write_text(text)
        tmp.replace(self.targets_file)  # Prometheus never reads a half-written file

    def _discover(self) -> None:
        while not self._stop_discovery.wait(1.0):
            try:
                self._write_targets()
                self.discovery_error = None
            except (OSError, ValueError, DevClusterError) as e:
                self.discovery_error = str(e)

    def custom_metric(self, namespace: str, metric: str) -> tuple[int, Any]:
        """``GET /apis/custom.metrics.k8s.io/v1beta2/namespaces/NS/pods/*/METRIC``."""
        path = (
            f"/apis/{CUSTOM_METRICS_GROUP}/{CUSTOM_METRICS_VERSIONS[-1]}"
            f"/namespaces/{namespace}/pods/*/{metric}"
        )
        return self.cluster.api().get(path)

    def log_tails(self, lines: int = 20) -> str:
        return "\n".join(
            f"----- {p.name} {p.log} -----\n{procs.tail(p.log, lines)}" for p in self._procs
        )

    def stop(self) -> None:
        self._stop_discovery.set()
        if self._discovery is not None:
            self._discovery.join(timeout=10)
            self._discovery = None
        for kind_name in (
            f"apiservice/{v}.{CUSTOM_METRICS_GROUP}" for v in CUSTOM_METRICS_VERSIONS
        ):
            self.cluster.kubectl("delete", kind_name, "--ignore-not-found", check=False)
        for p in reversed(self._procs):
            p.stop()
        self._procs.clear()
