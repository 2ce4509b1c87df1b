"""Pure builders for the dev cluster: command lines, kubeconfig, fake GPU nodes.

Nothing here starts a process or touches the network;
:mod:`fleetgate_tools.devcluster.cluster` feeds these builders ports and paths and does
the I/O.

Loopback network design (every address below is in 127.0.0.0/8, nothing binds 0.0.0.0):

* etcd client/peer, kube-apiserver (secure port only), kube-controller-manager and
  kube-scheduler (secure ports for /healthz) each get a free port on 127.0.0.1.
* kwok serves nothing (no ``--server-address``); it only talks to the API server.
* kwok hands pods IPs from ``--cidr`` = :data:`POD_CIDR` (127.0.1.0/24) and gives
  nodes the InternalIP :data:`NODE_IP` (127.0.0.1). Nothing listens on a pod IP by
  itself; a test that wants a pod to "serve" starts e.g. ``fleetgate sim`` bound to that
  pod's 127.0.1.x address, which Linux routes to ``lo`` with no configuration.
* ``--service-cluster-ip-range`` is 10.96.0.0/24: Service IPs are allocated but never
  dialled (there is no kube-proxy), so they cannot leak traffic.

Flags follow the defaults of controller-runtime's envtest (etcd, kube-apiserver) and of
``kwokctl`` (controller manager, scheduler, kwok), with every bind address forced to
127.0.0.1.

Fake GPU nodes follow kwok's ``virtual-gpu-node.yaml`` example: annotation
``kwok.x-k8s.io/node: fake`` (kwok manages only those), taint
``kwok.x-k8s.io/node=fake:NoSchedule`` and ``nvidia.com/gpu`` in capacity and allocatable.
They are created *without* a Ready condition: kwok's ``node-initialize`` stage selects
nodes whose Ready is not True, keeps our capacity/allocatable and marks them Ready.
"""

from __future__ import annotations

import base64
import dataclasses
from pathlib import Path
from typing import Any

LOOPBACK = "127.0.0.1"
POD_CIDR = "127.0.1.0/24"
NODE_IP = "127.0.0.1"
SERVICE_CIDR = "10.96.0.0/24"

KWOK_NODE_ANNOTATION = "kwok.x-k8s.io/node"
KWOK_NODE_VALUE = "fake"
GPU_RESOURCE = "nvidia.com/gpu"
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
GPU_COUNT_LABEL = "nvidia.com/gpu.count"
GPU_MEMORY_LABEL = "nvidia.com/gpu.memory"

#: what a pod must carry to be scheduled onto a fake node
FAKE_NODE_TOLERATION: dict[str, str] = {
    "key": KWOK_NODE_ANNOTATION,
    "operator": "Equal",
    "value": KWOK_NODE_VALUE,
    "effect": "NoSchedule",
}


def fake_node_toleration_flag() -> str:
    """:data:`FAKE_NODE_TOLERATION` as the operator's ``--extra-toleration`` value."""
    t = FAKE_NODE_TOLERATION
    return f"{t['key']}={t['value']}:{t['effect']}"


def operator_command(python: str, kubeconfig: Path, extra_args: list[str]) -> list[str]:
    """``fleetgate operator`` against the dev cluster: every engine pod it makes
    tolerates the fake nodes' taint, so InferenceServices as users write them (the
    ``examples/``) schedule with no toleration of their own."""
    return [
        python,
        "-m",
        "fleetgate",
        "operator",
        f"--kubeconfig={kubeconfig}",
        f"--extra-toleration={fake_node_toleration_flag()}",
        *extra_args,
    ]


@dataclasses.dataclass(frozen=True)
class GpuNodePool:
    """``count`` identical fake nodes named ``{prefix}-{i}``."""

    prefix: str
    count: int
    gpus: int
    product: str
    gpu_memory_mib: int
    cpu: str = "96"
    memory: str = "1024Gi"
    pods: int = 110

    def names(self) -> list[str]:
        return [f"{self.prefix}-{i}" for i in range(self.count)]


DEFAULT_POOLS: tuple[GpuNodePool, ...] = (
    GpuNodePool("gpu-h100", 2, 8, "NVIDIA-H100-80GB-HBM3", 81559, cpu="192", memory="2048Gi"),
    GpuNodePool("gpu-a100", 2, 4, "NVIDIA-A100-SXM4-80GB", 81920, cpu="96", memory="1024Gi"),
)


@dataclasses.dataclass(frozen=True)
class Ports:
    etcd_client: int
    etcd_peer: int
    apiserver: int
    controller_manager: int
    scheduler: int


@dataclasses.dataclass(frozen=True)
class Layout:
    """Files of one cluster, all under ``work_dir``."""

    work_dir: Path

    @property
    def etcd_data(self) -> Path:
        return self.work_dir / "etcd"

    @property
    def cert_dir(self) -> Path:
        return self.work_dir / "pki"

    @property
    def sa_key(self) -> Path:
        return self.work_dir / "pki" / "sa.key"

    @property
    def tokens_csv(self) -> Path:
        return self.work_dir / "pki" / "tokens.csv"

    @property
    def front_proxy_ca(self) -> Path:
        """CA of the aggregator's client certificate (``ClusterConfig.aggregation``)."""
        return self.work_dir / "pki" / "front-proxy-ca.crt"

    @property
    def front_proxy_client_cert(self) -> Path:
        return self.work_dir / "pki" / "front-proxy-client.crt"

    @property
    def front_proxy_client_key(self) -> Path:
        return self.work_dir / "pki" / "front-proxy-client.key"

    @property
    def internal_kubeconfig(self) -> Path:
        """Kubeconfig used by KCM, scheduler and kwok (the user's may live elsewhere)."""
        return self.work_dir / "kubeconfig"

    @property
    def log_dir(self) -> Path:
        return self.work_dir / "logs"

    def log(self, component: str) -> Path:
        return self.log_dir / f"{component}.log"


def etcd_argv(binary: Path, layout: Layout, ports: Ports) -> list[str]:
    client = f"http://{LOOPBACK}:{ports.etcd_client}"
    peer = f"http://{LOOPBACK}:{ports.etcd_peer}"
    return [
        str(binary),
        "--name=default",
        f"--data-dir={layout.etcd_data}",
        f"--listen-client-urls={client}",
        f"--advertise-client-urls={client}",
        f"--listen-peer-urls={peer}",
        f"--initial-advertise-peer-urls={peer}",
        f"--initial-cluster=default={peer}",
        "--unsafe-no-fsync",
        "--log-level=warn",
    ]


def apiserver_argv(
    binary: Path, layout: Layout, ports: Ports, aggregation: bool = False
) -> list[str]:
    extra = aggregation_flags(layout) if aggregation else []
    return [
        str(binary),
        f"--etcd-servers=http://{LOOPBACK}:{ports.etcd_client}",
        f"--bind-address={LOOPBACK}",
        f"--advertise-address={LOOPBACK}",
        f"--secure-port={ports.apiserver}",
        f"--cert-dir={layout.cert_dir}",
        f"--token-auth-file={layout.tokens_csv}",
        "--authorization-mode=RBAC",
        "--allow-privileged=true",
        f"--service-cluster-ip-range={SERVICE_CIDR}",
        "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
        f"--service-account-key-file={layout.sa_key}",
        f"--service-account-signing-key-file={layout.sa_key}",
        # a tiny single-user cluster: no request throttling (kwokctl does the same)
        "--enable-priority-and-fairness=false",
        "--max-requests-inflight=0",
        "--max-mutating-requests-inflight=0",
        "--profiling=false",
        "--v=1",
        *extra,
    ]


#: the CN of the certificate the API server presents to aggregated API servers
FRONT_PROXY_CLIENT_CN = "front-proxy-client"


def aggregation_flags(layout: Layout) -> list[str]:
    """kube-apiserver flags to serve aggregated APIs (an APIService backed by a process).

    The API server proxies ``/apis/<aggregated group>`` to the backing server with the
    front-proxy client certificate and the user in ``X-Remote-*`` headers; the backing
    server trusts those headers because the CA and the allowed names are published in
    ``kube-system/extension-apiserver-authentication``.

    How the API server reaches a backing server on loopback: not through
    ``--enable-aggregator-routing=true`` and an Endpoints/EndpointSlice at 127.0.0.1
    (both are refused: "may not be in the loopback range (127.0.0.0/8, ::1/128)"), and
    not through a cluster IP (no kube-proxy). With the default service routing the
    aggregator dials an ``ExternalName`` Service's name and the APIService's port, so
    the APIService names a Service ``externalName: 127.0.0.1``
    (:func:`fleetgate_tools.devcluster.metricsstack.apiservice_objects`).
    """
    return [
        f"--requestheader-client-ca-file={layout.front_proxy_ca}",
        f"--requestheader-allowed-names={FRONT_PROXY_CLIENT_CN}",
        "--requestheader-username-headers=X-Remote-User",
        "--requestheader-group-headers=X-Remote-Group",
        "--requestheader-extra-headers-prefix=X-Remote-Extra-",
        f"--proxy-client-cert-file={layout.front_proxy_client_cert}",
        f"--proxy-client-key-file={layout.front_proxy_client_key}",
    ]


def front_proxy_openssl_steps(openssl: str, layout: Layout) -> list[list[str]]:
    """openssl command lines that write the front-proxy CA and its client certificate
    (EC P-256 keys: generating them takes milliseconds, unlike RSA)."""
    ca_key = layout.cert_dir / "front-proxy-ca.key"
    csr = layout.cert_dir / "front-proxy-client.csr"
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    return [
        [openssl, "req", "-x509", *ec, "-keyout", str(ca_key), "-out", str(layout.front_proxy_ca),
         "-days", "2", "-subj", "/CN=fleetgate-dev-front-proxy-ca"],
        [openssl, "req", *ec, "-keyout", str(layout.front_proxy_client_key), "-out", str(csr),
         "-subj", f"/CN={FRONT_PROXY_CLIENT_CN}"],
        [openssl, "x509", "-req", "-in", str(csr), "-CA", str(layout.front_proxy_ca),
         "-CAkey", str(ca_key), "-CAcreateserial", "-days", "2",
         "-out", str(layout.front_proxy_client_cert)],
    ]  # fmt: skip


def controller_manager_argv(
    binary: Path, layout: Layout, ports: Ports, hpa_sync_period_s: float | None = None
) -> list[str]:
    extra = []
    if hpa_sync_period_s is not None:
        if hpa_sync_period_s <= 0:
            raise ValueError(f"hpa_sync_period_s must be > 0, got {hpa_sync_period_s}")
        extra.append(f"--horizontal-pod-autoscaler-sync-period={hpa_sync_period_s:g}s")
    return [
        str(binary),
        f"--kubeconfig={layout.internal_kubeconfig}",
        f"--authentication-kubeconfig={layout.internal_kubeconfig}",
        f"--authorization-kubeconfig={layout.internal_kubeconfig}",
        f"--bind-address={LOOPBACK}",
        f"--secure-port={ports.controller_manager}",
        f"--cert-dir={layout.cert_dir / 'kcm'}",
        "--leader-elect=false",
        f"--service-account-private-key-file={layout.sa_key}",
        f"--root-ca-file={layout.cert_dir / 'apiserver.crt'}",
        f"--service-cluster-ip-range={SERVICE_CIDR}",
        "--authorization-always-allow-paths=/healthz,/readyz,/livez,/metrics",
        "--profiling=false",
        "--v=1",
        *extra,
    ]


def scheduler_argv(binary: Path, layout: Layout, ports: Ports) -> list[str]:
    return [
        str(binary),
        f"--kubeconfig={layout.internal_kubeconfig}",
        f"--authentication-kubeconfig={layout.internal_kubeconfig}",
        f"--authorization-kubeconfig={layout.internal_kubeconfig}",
        f"--bind-address={LOOPBACK}",
        f"--secure-port={ports.scheduler}",
        f"--cert-dir={layout.cert_dir / 'scheduler'}",
        "--leader-elect=false",
        "--authorization-always-allow-paths=/healthz,/readyz,/livez,/metrics",
        "--profiling=false",
        "--v=1",
    ]


def kwok_argv(binary: Path, layout: Layout, stage_files: tuple[Path, ...]) -> list[str]:
    argv = [
        str(binary),
        f"--kubeconfig={layout.internal_kubeconfig}",
        "--manage-all-nodes=false",
        f"--manage-nodes-with-annotation-selector={KWOK_NODE_ANNOTATION}={KWOK_NODE_VALUE}",
        f"--cidr={POD_CIDR}",
        f"--node-ip={NODE_IP}",
        "--node-lease-duration-seconds=40",
        "--v=INFO",
    ]
    argv += [f"--config={path}" for path in stage_files]
    return argv


def tokens_csv(token: str) -> str:
    """Static token file: one admin in system:masters (apiserver ``--token-auth-file``)."""
    return f'{token},admin,admin,"system:masters"\n'


def ca_from_cert_bundle(pem: str) -> str:
    """The CA certificate of the API server's self-signed ``--cert-dir`` bundle.

    kube-apiserver writes ``apiserver.crt`` as the serving certificate followed by the
    self-signed CA that issued it (CN ``<host>-ca@<time>``); the CA is the last block.
    """
    end = "-----END CERTIFICATE-----"
    blocks = [b.strip() + "\n" + end + "\n" for b in pem.split(end) if "BEGIN CERTIFICATE" in b]
    if len(blocks) < 2:
        raise ValueError(f"expected serving cert + CA, found {len(blocks)} certificate(s)")
    return blocks[-1]


def kubeconfig(
    server: str, token: str, ca_pem: str | None = None, name: str = "fleetgate-dev"
) -> dict[str, Any]:
    """Admin-token kubeconfig, readable by kubectl, helm, kopf and the kubernetes client.

    With ``ca_pem`` TLS is verified (``certificate-authority-data``); without it the
    kubeconfig says ``insecure-skip-tls-verify: true``. Verified is the default in
    :class:`~fleetgate_tools.devcluster.cluster.DevCluster`: the kubernetes client (urllib3)
    emits ``InsecureRequestWarning`` on every unverified request, and this project's
    pytest turns warnings into errors.
    """
    tls: dict[str, Any]
    if ca_pem is None:
        tls = {"insecure-skip-tls-verify": True}
    else:
        tls = {"certificate-authority-data": base64.b64encode(ca_pem.encode()).decode()}
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": name, "cluster": {"server": server, **tls}}],
        "users": [{"name": "admin", "user": {"token": token}}],
        "contexts": [{"name": name, "context": {"cluster": name, "user": "admin"}}],
        "current-context": name,
    }


def gpu_node(pool: GpuNodePool, name: str) -> dict[str, Any]:
    """A fake Node for kwok to manage; status carries the GPU capacity, no conditions."""
    resources = {
        "cpu": pool.cpu,
        "memory": pool.memory,
        "pods": str(pool.pods),
        "ephemeral-storage": "1Ti",
        GPU_RESOURCE: str(pool.gpus),
    }
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "annotations": {
                KWOK_NODE_ANNOTATION: KWOK_NODE_VALUE,
                "node.alpha.kubernetes.io/ttl": "0",
            },
            "labels": {
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                "kubernetes.io/role": "agent",
                "node-role.kubernetes.io/agent": "",
                "type": "kwok",
                GPU_PRODUCT_LABEL: pool.product,
                GPU_COUNT_LABEL: str(pool.gpus),
                GPU_MEMORY_LABEL: str(pool.gpu_memory_mib),
            },
        },
        "spec": {
            "providerID": f"kwok://{name}",
            "taints": [
                {"key": KWOK_NODE_ANNOTATION, "value": KWOK_NODE_VALUE, "effect": "NoSchedule"}
            ],
        },
        "status": {
            "capacity": dict(resources),
            "allocatable": dict(resources),
            "nodeInfo": {"architecture": "amd64", "operatingSystem": "linux"},
        },
    }


def gpu_nodes(pools: tuple[GpuNodePool, ...]) -> list[dict[str, Any]]:
    names = [n for pool in pools for n in pool.names()]
    if len(names) != len(set(names)):
        raise ValueError(f"node names collide across pools: {names}")
    return [gpu_node(pool, name) for pool in pools for name in pool.names()]


def node_is_ready(node: dict[str, Any]) -> bool:
    """Ready=True and no ``node.kubernetes.io/*`` taint left (so the scheduler admits pods)."""
    status = node.get("status", {})
    ready = any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions", [])
    )
    taints = node.get("spec", {}).get("taints", []) or []
    system_taint = any(str(t.get("key", "")).startswith("node.kubernetes.io/") for t in taints)
    return ready and not system_taint
