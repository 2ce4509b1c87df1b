"""The cache one LIST+WATCH keeps (pure: plain dicts in, no I/O).

:class:`WatchCache` holds the objects of one collection keyed by (namespace,
name) and the last resourceVersion seen: a LIST result replaces it in one step,
a watch event updates it. A 410 Gone (or an ``ERROR`` event saying so) raises
:class:`Gone`, for the reflector (:mod:`fleetgate.router.k8s_watch`) to list
again; any other ``ERROR`` event or garbage raises :class:`WatchError`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from fleetgate.router.k8s_addresses import ObjKey


class Gone(Exception):
    """The watched resourceVersion is too old (HTTP 410): list again."""


class WatchError(Exception):
    """The API server sent an ERROR event other than 410, or garbage."""


class WatchCache:
    """Objects of one LIST+WATCH, keyed by (namespace, name), and the last version."""

    def __init__(self) -> None:
        self.objects: dict[ObjKey, dict[str, Any]] = {}
        self.resource_version: str | None = None

    @staticmethod
    def key(obj: Mapping[str, Any]) -> ObjKey:
        meta = obj.get("metadata") or {}
        return (str(meta.get("namespace", "")), str(meta.get("name", "")))

    def replace(self, items: Iterable[dict[str, Any]], resource_version: str) -> None:
        """A complete LIST result: the new truth, swapped in at once."""
        self.objects = {self.key(o): o for o in items}
        self.resource_version = resource_version

    def apply(self, event: Mapping[str, Any]) -> bool:
        """Apply one watch event; True when the object set changed."""
        kind = event.get("type")
        obj = event.get("object")
        if not isinstance(obj, dict):
            raise WatchError(f"watch event without an object: {str(event)[:200]}")
        if kind == "ERROR":
            if obj.get("code") == 410 or obj.get("reason") in ("Expired", "Gone"):
                raise Gone(str(obj.get("message", "resource version too old")))
            raise WatchError(f"watch error: {str(obj.get('message', obj))[:200]}")
        rv = (obj.get("metadata") or {}).get("resourceVersion")
        if rv:
            self.resource_version = str(rv)
        if kind == "BOOKMARK":
            return False
        if kind in ("ADDED", "MODIFIED"):
            self.objects[self.key(obj)] = obj
            return True
        if kind == "DELETED":
            return self.objects.pop(self.key(obj), None) is not None
        raise WatchError(f"unknown watch event type {kind!r}")
