"""Operator options: one frozen value built once from CLI flags / environment.

Everything that differs between production and tests is an option, never a
global: the reconcile interval (level-based timer), the extra tolerations test
clusters need (kwok's ``kwok.x-k8s.io/node=fake:NoSchedule`` taint) and the
addresses the metrics and health endpoints bind to. Production pods carry no
extra toleration unless ``--extra-toleration`` / ``FLEETGATE_EXTRA_TOLERATIONS``
asks for one.

Pure: parsing only.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

from fleetgate.operator.pools import ClassRoles

__all__ = [
    "ENV_EXTRA_TOLERATIONS",
    "FIELD_MANAGER",
    "OperatorOptions",
    "OptionsError",
    "parse_tolerations",
]

#: The one field manager every server-side apply uses, so ownership is stable.
FIELD_MANAGER = "fleetgate-operator"
ENV_EXTRA_TOLERATIONS = "FLEETGATE_EXTRA_TOLERATIONS"

_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")


class OptionsError(ValueError):
    """An option could not be parsed; the message says which and why."""


@dataclasses.dataclass(frozen=True, slots=True)
class OperatorOptions:
    """How this operator instance behaves."""

    extra_tolerations: tuple[Mapping[str, Any], ...] = ()
    """Added to every engine pod (test clusters only)."""
    reconcile_interval: float = 30.0
    """Seconds between level-based re-checks of every InferenceService (drift, status)."""
    cluster_domain: str = "cluster.local"
    """DNS suffix used in status.url."""
    field_manager: str = FIELD_MANAGER
    autoscale_interval: float = 15.0
    """Seconds between autoscaling decisions (one scrape of every router per tick)."""
    router_selector: str = "app.kubernetes.io/component=router"
    """Label selector of the router pods whose /metrics carry the demand."""
    router_namespace: str | None = None
    """Namespace of the router pods (None: the namespaces the operator watches)."""
    router_metrics_port: int = 8080
    """Port of the routers' /metrics (the router serves it on its API port)."""
    router_metrics_urls: tuple[str, ...] = ()
    """Fixed router /metrics URLs instead of finding router pods (tests, or routers
    outside the cluster)."""
    class_roles: ClassRoles = dataclasses.field(default_factory=ClassRoles)
    """Which role's services take each priority class's demand when a model is served
    by both roles in a pool (``--class-role``)."""
    pool_gpu_budgets: Mapping[str, int] = dataclasses.field(default_factory=dict)
    """routing.pool -> most GPUs its autoscaled services may hold (``--pool-gpu-budget``;
    a pool not listed has no budget)."""
    pool_consolidation: bool = False
    """The roles of a pool share their replicas (``--pool-consolidation``): the
    throughput role's need less the latency role's room
    (:func:`fleetgate.operator.pools.spare_room`), and one role serving both while
    demand is low (:func:`fleetgate.operator.pools.consolidate`)."""


def _one_toleration(text: str) -> dict[str, Any]:
    """``key[=value][:Effect]`` -> a toleration dict (``Exists`` when no value)."""
    body, _, effect = text.partition(":")
    key, eq, value = body.partition("=")
    key = key.strip()
    if not key:
        raise OptionsError(f"toleration {text!r}: empty key (want key[=value][:Effect])")
    tol: dict[str, Any] = {"key": key}
    if eq:
        tol.update(operator="Equal", value=value.strip())
    else:
        tol["operator"] = "Exists"
    if effect:
        effect = effect.strip()
        if effect not in _EFFECTS:
            raise OptionsError(f"toleration {text!r}: effect must be one of {', '.join(_EFFECTS)}")
        tol["effect"] = effect
    return tol


def parse_tolerations(text: str) -> tuple[dict[str, Any], ...]:
    """Parse ``FLEETGATE_EXTRA_TOLERATIONS``.

    Either a JSON list of Kubernetes toleration objects, or a comma-separated list
    of ``key[=value][:Effect]`` (e.g. ``kwok.x-k8s.io/node=fake:NoSchedule``).
    """
    text = text.strip()
    if not text:
        return ()
    if text.startswith("{"):
        raise OptionsError("tolerations: JSON must be a list of objects, e.g. [{...}]")
    if text.startswith("["):
        try:
            loaded = json.loads(text)
        except json.JSONDecodeError as e:
            raise OptionsError(f"tolerations: invalid JSON: {e}") from e
        if not isinstance(loaded, list) or not all(isinstance(t, dict) for t in loaded):
            raise OptionsError("tolerations: JSON must be a list of objects")
        return tuple(loaded)
    return tuple(_one_toleration(part) for part in text.split(",") if part.strip())
