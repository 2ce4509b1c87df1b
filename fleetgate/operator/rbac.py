"""The operator's least-privilege ClusterRole, as data.

The Helm chart's operator ClusterRole must list exactly these rules (a chart test
can compare them). Each rule says why it exists; nothing is granted "just in case":

* no ``delete`` on Deployments, Services or PDBs: children are garbage-collected
  through their owner references when the InferenceService goes;
* ``create`` + ``patch`` on every child kind: server-side apply of an absent object
  is a create;
* ``inferenceservices/finalizers`` ``update``: setting ``blockOwnerDeletion`` on an
  owner reference requires it where OwnerReferencesPermissionEnforcement is on;
* no CRD or namespace access: ServiceMonitor support is found through API
  discovery, and the operator runs kopf ``--standalone`` (no peering objects).

Pure data.
"""

from __future__ import annotations

from typing import Any

from fleetgate.api.v1alpha1 import GROUP, PLURAL

__all__ = ["CLUSTER_ROLE_RULES", "cluster_role"]

CLUSTER_ROLE_RULES: tuple[dict[str, Any], ...] = (
    # watch the InferenceServices, write their status
    {"apiGroups": [GROUP], "resources": [PLURAL], "verbs": ["get", "list", "watch"]},
    {"apiGroups": [GROUP], "resources": [f"{PLURAL}/status"], "verbs": ["get", "patch"]},
    {"apiGroups": [GROUP], "resources": [f"{PLURAL}/finalizers"], "verbs": ["update"]},
    # autoscaling: the decision is written to spec.replicas the way an HPA writes it
    {"apiGroups": [GROUP], "resources": [f"{PLURAL}/scale"], "verbs": ["patch"]},
    # children: watched (drift) and server-side applied
    {
        "apiGroups": ["apps"],
        "resources": ["deployments"],
        "verbs": ["get", "list", "watch", "create", "patch"],
    },
    {
        "apiGroups": [""],
        "resources": ["services"],
        "verbs": ["get", "list", "watch", "create", "patch"],
    },
    {
        "apiGroups": ["policy"],
        "resources": ["poddisruptionbudgets"],
        "verbs": ["get", "create", "patch"],
    },
    # TensorRT-LLM config; deleted when the engine switches away from TensorRT-LLM
    {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get", "create", "patch", "delete"]},
    # only when the Prometheus Operator CRD exists; deleted when metrics are turned off
    {
        "apiGroups": ["monitoring.coreos.com"],
        "resources": ["servicemonitors"],
        "verbs": ["get", "create", "patch", "delete"],
    },
    # status: diagnose engine pods (unschedulable, image pull, crash loop); autoscaling:
    # find router pods, annotate the replica to drain (fleetgate.dev/drain and
    # controller.kubernetes.io/pod-deletion-cost) before a scale-down
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "patch"]},
    # one Event per status transition
    {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]},
)


def cluster_role(name: str = "fleetgate-operator") -> dict[str, Any]:
    """The ClusterRole object."""
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": {"name": name, "labels": {"app.kubernetes.io/part-of": "fleetgate"}},
        "rules": [dict(rule) for rule in CLUSTER_ROLE_RULES],
    }
