"""The real Kubernetes test control plane ("dev cluster"): no Docker, no VMs.

etcd, kube-apiserver, kube-controller-manager and kube-scheduler built from Go modules
by ``hack/build-k8s-bins.sh``, plus kwok faking the nodes and pods, all bound to
127.0.0.1 on free ports. Four fake GPU nodes (2 x 8 H100, 2 x 4 A100) are tainted
``kwok.x-k8s.io/node=fake:NoSchedule``; pods need :data:`FAKE_NODE_TOLERATION`. kwok
gives pods IPs from 127.0.1.0/24 so an emulated engine can actually listen on a pod's
IP. See docs/dev-cluster.md.

Modules:

* :mod:`~fleetgate_tools.devcluster.bins`: locate/build binaries (``ensure_binaries``);
* :mod:`~fleetgate_tools.devcluster.manifests`: pure builders (argv, kubeconfig, nodes);
* :mod:`~fleetgate_tools.procs`: spawn/stop by PID, socket inspection;
* :mod:`~fleetgate_tools.devcluster.cluster`: :class:`DevCluster` start/stop orchestration;
* :mod:`~fleetgate_tools.devcluster.state`: the ``up --detach`` state file;
* :mod:`~fleetgate_tools.devcluster.metricsstack`: Prometheus + prometheus-adapter for an
  HPA on engine metrics (needs ``ClusterConfig(aggregation=True)``);
* :mod:`~fleetgate_tools.devcluster.cli`: ``fleetgate dev-cluster up|down|which``.
"""

from __future__ import annotations

from fleetgate_tools.devcluster.bins import BinSet, Versions, ensure_binaries, expected_binset
from fleetgate_tools.devcluster.cluster import ClusterConfig, DevCluster, running_cluster
from fleetgate_tools.devcluster.errors import (
    BuildError,
    DevClusterError,
    StartError,
    StateError,
    StopError,
)
from fleetgate_tools.devcluster.manifests import (
    DEFAULT_POOLS,
    FAKE_NODE_TOLERATION,
    GPU_PRODUCT_LABEL,
    GPU_RESOURCE,
    POD_CIDR,
    GpuNodePool,
)

__all__ = [
    "DEFAULT_POOLS",
    "FAKE_NODE_TOLERATION",
    "GPU_PRODUCT_LABEL",
    "GPU_RESOURCE",
    "POD_CIDR",
    "BinSet",
    "BuildError",
    "ClusterConfig",
    "DevCluster",
    "DevClusterError",
    "GpuNodePool",
    "StartError",
    "StateError",
    "StopError",
    "Versions",
    "ensure_binaries",
    "expected_binset",
    "running_cluster",
]
