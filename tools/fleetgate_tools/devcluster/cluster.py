"""Start and stop a real Kubernetes control plane on loopback: the dev cluster.

Start order (each step waits for the previous one, every wait is bounded by
``ClusterConfig.start_timeout_s`` overall and fails fast if a component exits):

1. work dir (a fresh temp dir unless given), free loopback ports, ``sa.key`` via
   ``openssl genrsa``, static token file (and, with ``aggregation``, the front-proxy
   CA and client certificate);
2. etcd (``--unsafe-no-fsync``, data in the work dir) until ``/health`` says true;
3. kube-apiserver until ``/readyz`` is 200, then the ``preload`` manifests (CRDs
   Established);
4. kube-controller-manager, kube-scheduler and kwok together;
5. the fake GPU nodes (:mod:`fleetgate_tools.devcluster.manifests`);
6. until every fake node is Ready with no ``node.kubernetes.io/*`` taint, the default
   ServiceAccount exists and KCM/scheduler answer ``/healthz``.

Nodes are created with the taint ``node.kubernetes.io/not-ready:NoSchedule`` (as a
kubelet registers itself). Only the node-lifecycle controller in KCM removes it, and it
does so only after it has *seen* kwok's Ready condition, so "no system taint" proves the
scheduler can place pods right now, not merely that kwok has written a condition.

Stopping goes in reverse order by PID (SIGTERM, then SIGKILL, see
:mod:`fleetgate_tools.procs`) and removes the work dir unless ``keep_work_dir``.
On a failed start everything already started is stopped and :class:`StartError`
carries the tail of every component log; the work dir is kept so the logs survive.

Time is injected (``clock``/``sleep``); the API token comes from ``token_factory``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import secrets
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx
import yaml

from fleetgate_tools import procs
from fleetgate_tools.devcluster import manifests
from fleetgate_tools.devcluster.apiclient import ApiClient
from fleetgate_tools.devcluster.bins import BinSet
from fleetgate_tools.devcluster.errors import DevClusterError, StartError

#: components in start order; stop runs the reverse
COMPONENTS: tuple[str, ...] = (
    "etcd",
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kwok",
)
NOT_READY_TAINT = {"key": "node.kubernetes.io/not-ready", "effect": "NoSchedule"}


@dataclasses.dataclass(frozen=True)
class ClusterConfig:
    pools: tuple[manifests.GpuNodePool, ...] = manifests.DEFAULT_POOLS
    #: also write the admin kubeconfig here (the work dir always has one)
    kubeconfig_path: Path | None = None
    #: None: a fresh ``tempfile.mkdtemp``; an explicit dir is created, never reused dirty
    work_dir: Path | None = None
    keep_work_dir: bool = False
    #: SIGKILL the components if this Python process dies (off for ``up --detach``)
    die_with_parent: bool = True
    #: kubeconfig carries the API server's self-signed CA (False: insecure-skip-tls-verify)
    verify_tls: bool = True
    start_timeout_s: float = 120.0
    #: serve aggregated APIs (front-proxy certificates and the API server's
    #: requestheader flags, :func:`manifests.aggregation_flags`); off by default, the
    #: HPA-on-Prometheus test and benchmark turn it on
    aggregation: bool = False
    #: kube-controller-manager ``--horizontal-pod-autoscaler-sync-period`` (None: its
    #: default, 15 s)
    hpa_sync_period_s: float | None = None
    #: manifests (files or directories, e.g. ``crds/``) applied server-side once the API
    #: server is ready and before the controller manager starts, so CRDs among them are
    #: in its first API discovery: an HPA can then target a custom resource's scale
    #: subresource at once (the controller manager refreshes its REST mapping only every
    #: 30 s, and until then says ``no matches for kind``)
    preload: tuple[Path, ...] = ()


@dataclasses.dataclass
class _Running:
    ref: procs.ProcRef
    proc: subprocess.Popen[bytes] | None


def _tail(path: str | Path, lines: int = 25) -> str:
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


class DevCluster:
    """One dev cluster. Use as a context manager, or call :meth:`start`/:meth:`stop`."""

    def __init__(
        self,
        bins: BinSet,
        config: ClusterConfig = ClusterConfig(),
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        token_factory: Callable[[], str] = lambda: secrets.token_hex(16),
    ) -> None:
        self.bins = bins
        self.config = config
        self._clock = clock
        self._sleep = sleep
        self.token = token_factory()
        self.layout: manifests.Layout | None = None
        self.ports: manifests.Ports | None = None
        self._running: dict[str, _Running] = {}
        self._owns_work_dir = False
        #: seconds from start() to each milestone, filled while starting
        self.timings: dict[str, float] = {}

    # ---- accessors ---------------------------------------------------------------
    @property
    def api_url(self) -> str:
        if self.ports is None:
            raise DevClusterError("cluster not started")
        return f"https://{manifests.LOOPBACK}:{self.ports.apiserver}"

    @property
    def kubeconfig(self) -> Path:
        if self.layout is None:
            raise DevClusterError("cluster not started")
        return self.config.kubeconfig_path or self.layout.internal_kubeconfig

    @property
    def work_dir(self) -> Path:
        if self.layout is None:
            raise DevClusterError("cluster not started")
        return self.layout.work_dir

    @property
    def bin_dir(self) -> Path:
        return self.bins.bin_dir

    @property
    def refs(self) -> list[procs.ProcRef]:
        return [r.ref for r in self._running.values()]

    def api(self) -> ApiClient:
        return ApiClient(self.api_url, self.token)

    def node_names(self) -> list[str]:
        return [n for pool in self.config.pools for n in pool.names()]

    # ---- kubectl -----------------------------------------------------------------
    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True, timeout_s: float = 60.0
    ) -> subprocess.CompletedProcess[str]:
        """Run the built kubectl against this cluster; raises DevClusterError on failure."""
        argv = [str(self.bins.path("kubectl")), f"--kubeconfig={self.kubeconfig}", *args]
        res = subprocess.run(
            argv, input=input, capture_output=True, text=True, timeout=timeout_s, check=False
        )
        if check and res.returncode != 0:
            raise DevClusterError(
                f"kubectl {' '.join(args)} failed ({res.returncode}): {res.stderr.strip()}"
            )
        return res

    def kubectl_json(self, *args: str) -> Any:
        return json.loads(self.kubectl(*args, "-o", "json").stdout)

    def apply(self, *objects: dict[str, Any]) -> str:
        """``kubectl apply`` the given objects (as a v1 List); returns kubectl's output."""
        body = {"apiVersion": "v1", "kind": "List", "items": list(objects)}
        return self.kubectl("apply", "-f", "-", input=json.dumps(body)).stdout

    # ---- lifecycle ---------------------------------------------------------------
    def __enter__(self) -> DevCluster:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def start(self) -> DevCluster:
        """Start everything; retried once if a component lost its port to a race.

        Ports are picked free by the kernel and handed to the component a moment later;
        on a busy machine another process can take one in between. Only that failure
        ("address already in use" in a log, temp work dir) is retried, with new ports.
        """
        if self._running:
            raise DevClusterError("cluster already started")
        try:
            return self._start_once()
        except StartError as e:
            if "address already in use" not in str(e) or self.config.work_dir is not None:
                raise
            if self.layout is not None:
                shutil.rmtree(self.layout.work_dir, ignore_errors=True)
            self.layout, self.ports, self.timings = None, None, {}
            return self._start_once()

    def _start_once(self) -> DevCluster:
        t0 = self._clock()
        deadline = t0 + self.config.start_timeout_s
        try:
            self._prepare()
            self._spawn("etcd")
            self._wait("etcd /health", deadline, self._etcd_healthy)
            self.timings["etcd"] = self._clock() - t0
            self._spawn("kube-apiserver")
            self._wait("kube-apiserver /readyz", deadline, self._api_ready)
            self.timings["kube-apiserver"] = self._clock() - t0
            self._write_kubeconfigs()
            self._preload()
            for name in ("kube-controller-manager", "kube-scheduler", "kwok"):
                self._spawn(name)
            self._create_nodes()
            self._wait("fake nodes Ready and untainted", deadline, self._nodes_ready)
            self.timings["nodes"] = self._clock() - t0
            self._wait("default ServiceAccount", deadline, self._default_sa)
            self._wait("KCM and scheduler /healthz", deadline, self._components_healthy)
            self.timings["total"] = self._clock() - t0
        except BaseException as e:
            logs = self.log_tails()
            self.stop(remove_work_dir=False)
            if isinstance(e, StartError):
                raise StartError(f"{e}\n{logs}") from e
            expected = (
                DevClusterError,
                procs.ProcessError,
                OSError,
                ValueError,
                subprocess.SubprocessError,
            )
            if isinstance(e, expected):
                raise StartError(f"dev cluster failed to start: {e}\n{logs}") from e
            raise
        return self

    def stop(self, remove_work_dir: bool | None = None) -> dict[str, str]:
        """Stop every component (reverse start order). Returns name -> how it ended."""
        outcome: dict[str, str] = {}
        for name in reversed(list(self._running)):
            r = self._running[name]
            outcome[name] = procs.stop(r.ref, r.proc, clock=self._clock, sleep=self._sleep)
        self._running.clear()
        remove = self._owns_work_dir if remove_work_dir is None else remove_work_dir
        if remove and not self.config.keep_work_dir and self.layout is not None:
            shutil.rmtree(self.layout.work_dir, ignore_errors=True)
        return outcome

    def detach(self) -> None:
        """Forget the children without stopping them (``up --detach``)."""
        self._running.clear()

    def log_tails(self, lines: int = 25) -> str:
        parts = []
        for name, r in self._running.items():
            parts.append(
                f"----- {name} (pid {r.ref.pid}) {r.ref.log} -----\n{_tail(r.ref.log, lines)}"
            )
        return "\n".join(parts)

    def dead_components(self) -> list[str]:
        return [name for name, r in self._running.items() if not procs.is_running(r.ref)]

    # ---- steps -------------------------------------------------------------------
    def _prepare(self) -> None:
        if self.config.work_dir is None:
            work = Path(tempfile.mkdtemp(prefix="fleetgate-devcluster-"))
            self._owns_work_dir = True
        else:
            work = self.config.work_dir
            if work.exists() and any(work.iterdir()):
                raise StartError(f"work dir {work} is not empty")
            work.mkdir(parents=True, exist_ok=True)
            self._owns_work_dir = True
        self.layout = layout = manifests.Layout(work)
        layout.cert_dir.mkdir(parents=True)
        layout.log_dir.mkdir(parents=True)
        ports: list[int] = []
        while len(ports) < 5:  # distinct even if the kernel hands one out twice
            p = procs.free_loopback_port()
            if p not in ports:
                ports.append(p)
        self.ports = manifests.Ports(*ports)
        openssl = shutil.which("openssl")
        if openssl is None:
            raise StartError("openssl not found on PATH (needed to create the service-account key)")
        subprocess.run(
            [openssl, "genrsa", "-out", str(layout.sa_key), "2048"],
            check=True,
            capture_output=True,
        )
        layout.tokens_csv.write_text(manifests.tokens_csv(self.token))
        if self.config.aggregation:
            for argv in manifests.front_proxy_openssl_steps(openssl, layout):
                res = subprocess.run(argv, capture_output=True, text=True, check=False)
                if res.returncode != 0:
                    raise StartError(
                        f"front-proxy certificates: {' '.join(argv[:3])} failed: {res.stderr}"
                    )

    def _write_kubeconfigs(self) -> None:
        """After the API server is up: its self-signed CA exists only from then on."""
        assert self.layout is not None
        ca = None
        if self.config.verify_tls:
            bundle = (self.layout.cert_dir / "apiserver.crt").read_text()
            ca = manifests.ca_from_cert_bundle(bundle)
        text = yaml.safe_dump(manifests.kubeconfig(self.api_url, self.token, ca), sort_keys=False)
        paths = [self.layout.internal_kubeconfig]
        if self.config.kubeconfig_path is not None:
            self.config.kubeconfig_path.parent.mkdir(parents=True, exist_ok=True)
            paths.append(self.config.kubeconfig_path)
        for path in paths:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(text)
            path.chmod(0o600)  # an existing file keeps its old mode through O_CREAT

    def _preload(self) -> None:
        for path in self.config.preload:
            self.kubectl("apply", "--server-side", "-f", str(path))
        if self.config.preload:
            self.kubectl("wait", "--for=condition=Established", "crd", "--all", "--timeout=30s")

    def _argv(self, name: str) -> list[str]:
        assert self.layout is not None and self.ports is not None
        b, lay, ports = self.bins, self.layout, self.ports
        if name == "etcd":
            return manifests.etcd_argv(b.path("etcd"), lay, ports)
        if name == "kube-apiserver":
            return manifests.apiserver_argv(
                b.path("kube-apiserver"), lay, ports, aggregation=self.config.aggregation
            )
        if name == "kube-controller-manager":
            return manifests.controller_manager_argv(
                b.path("kube-controller-manager"),
                lay,
                ports,
                hpa_sync_period_s=self.config.hpa_sync_period_s,
            )
        if name == "kube-scheduler":
            return manifests.scheduler_argv(b.path("kube-scheduler"), lay, ports)
        if name == "kwok":
            return manifests.kwok_argv(b.path("kwok"), lay, b.stage_files)
        raise KeyError(name)

    def _spawn(self, name: str) -> None:
        assert self.layout is not None
        child = procs.spawn(
            name,
            self._argv(name),
            self.layout.log(name),
            die_with_parent=self.config.die_with_parent,
        )
        self._running[name] = _Running(child.ref, child.popen)

    def _wait(self, what: str, deadline: float, ready: Callable[[], bool]) -> None:
        while True:
            for name, r in self._running.items():
                if r.proc is not None and r.proc.poll() is not None:
                    raise StartError(
                        f"{name} exited with code {r.proc.returncode} while waiting for {what}"
                    )
            try:
                if ready():
                    return
            except (OSError, ValueError):
                pass  # not listening yet, or a half-started server's garbage
            if self._clock() >= deadline:
                raise StartError(
                    f"timed out after {self.config.start_timeout_s:.0f}s waiting for {what}"
                )
            self._sleep(0.1)

    def _etcd_healthy(self) -> bool:
        assert self.ports is not None
        url = f"http://{manifests.LOOPBACK}:{self.ports.etcd_client}/health"
        try:
            resp = httpx.get(url, timeout=2, trust_env=False)
        except httpx.TransportError as e:
            raise OSError(f"etcd /health: {e}") from e
        return bool(resp.json().get("health") == "true")

    def _api_ready(self) -> bool:
        status, _ = self.api().get("/readyz")
        return status == 200

    def _create_nodes(self) -> None:
        api = self.api()
        for node in manifests.gpu_nodes(self.config.pools):
            node["spec"]["taints"].append(dict(NOT_READY_TAINT))
            status, body = api.post("/api/v1/nodes", node)
            if status != 201:
                raise StartError(
                    f"creating node {node['metadata']['name']} failed: {status} {body}"
                )
            capacity = body.get("status", {}).get("capacity", {}) if isinstance(body, dict) else {}
            if manifests.GPU_RESOURCE not in capacity:  # status dropped on create: set it
                name = node["metadata"]["name"]
                status, body = api.merge_patch(
                    f"/api/v1/nodes/{name}/status", {"status": node["status"]}
                )
                if status != 200:
                    raise StartError(f"setting status of node {name} failed: {status} {body}")

    def _nodes_ready(self) -> bool:
        status, body = self.api().get("/api/v1/nodes")
        if status != 200:
            return False
        ready = {n["metadata"]["name"] for n in body.get("items", []) if manifests.node_is_ready(n)}
        return ready >= set(self.node_names())

    def _default_sa(self) -> bool:
        status, _ = self.api().get("/api/v1/namespaces/default/serviceaccounts/default")
        return status == 200

    def _components_healthy(self) -> bool:
        assert self.ports is not None
        for port in (self.ports.controller_manager, self.ports.scheduler):
            api = ApiClient(f"https://{manifests.LOOPBACK}:{port}", self.token)
            status, _ = api.get("/healthz")
            if status != 200:
                return False
        return True


@contextlib.contextmanager
def running_cluster(bins: BinSet, config: ClusterConfig = ClusterConfig()) -> Iterator[DevCluster]:
    """``with running_cluster(bins) as c:`` starts a cluster and always stops it."""
    cluster = DevCluster(bins, config)
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()
