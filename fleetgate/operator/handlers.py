"""kopf handlers: decorators only, every body is one call into the reconciler.

Registered on a registry passed in (never kopf's default one), so tests and the
CLI build independent operators.

* ``on.event`` of InferenceServices: every add/modify (spec changes, the operator's
  own status patches, which converge because an unchanged status is not written).
* ``on.event`` of the Deployments and Services we manage: a child edited or
  deleted by someone is restored at once, and Deployment status changes refresh
  the service's status promptly.

The periodic level-based re-check (pods that became unschedulable, drift of
children we do not watch, lost events) is *not* a kopf timer: kopf puts a
finalizer on every object that has a timer or daemon, so deleting an
InferenceService would hang while the operator is down. It is
:class:`fleetgate.operator.reconcile.Resync`, a plain loop started by
:mod:`fleetgate.operator.app`.

Nothing is stored in the object by kopf: there are no create/update/delete
handlers (no progress annotations) and no timers or daemons (no finalizer); the
status is written by the reconciler itself through the status subresource
(kopf#527: a structural schema would prune kopf's own status fields anyway).
"""

from __future__ import annotations

import logging
from typing import Any

import kopf

from fleetgate.api.v1alpha1 import GROUP, PLURAL, VERSION
from fleetgate.operator import manifests
from fleetgate.operator.reconcile import Reconciler

__all__ = ["register"]

log = logging.getLogger(__name__)

_MANAGED = {"app.kubernetes.io/managed-by": manifests.MANAGED_BY}


def _owner_name(body: kopf.Body) -> str | None:
    for ref in body.get("metadata", {}).get("ownerReferences") or []:
        if ref.get("kind") == "InferenceService" and ref.get("controller"):
            return str(ref.get("name"))
    return None


def register(
    registry: kopf.OperatorRegistry,
    reconciler: Reconciler,
    *,
    connection: kopf.ConnectionInfo,
) -> None:
    """Attach the operator's handlers to ``registry``."""

    @kopf.on.login(registry=registry)
    def login(**_: Any) -> kopf.ConnectionInfo:
        return connection

    @kopf.on.startup(registry=registry)
    def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        settings.posting.enabled = False  # events are posted by the reconciler
        # No CRD watching (kopf would need list/watch on customresourcedefinitions):
        # the handled resources are fixed and checked at start-up.
        settings.scanning.disabled = True
        settings.watching.server_timeout = 60
        settings.watching.client_timeout = 90

    @kopf.on.event(GROUP, VERSION, PLURAL, registry=registry)
    def on_service(event: kopf.RawEvent, body: kopf.Body, **_: Any) -> None:
        if event.get("type") == "DELETED":
            reconciler.forget(body["metadata"]["namespace"], body["metadata"]["name"])
            return
        reconciler.reconcile(body)

    @kopf.on.event("apps", "v1", "deployments", labels=_MANAGED, registry=registry)
    def on_deployment(body: kopf.Body, **_: Any) -> None:
        _reconcile_owner(reconciler, body)

    @kopf.on.event("v1", "services", labels=_MANAGED, registry=registry)
    def on_service_child(body: kopf.Body, **_: Any) -> None:
        _reconcile_owner(reconciler, body)

    @kopf.on.probe(id="reconciler", registry=registry)
    def probe(**_: Any) -> str:
        return "ok"


def _reconcile_owner(reconciler: Reconciler, child: kopf.Body) -> None:
    owner = _owner_name(child)
    if owner is None:
        return
    reconciler.reconcile_by_name(child["metadata"]["namespace"], owner)
