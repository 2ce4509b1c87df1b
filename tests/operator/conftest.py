"""An in-memory :class:`fleetgate.operator.kube.KubeApi` for reconcile tests.

It keeps objects by (kind, namespace, name), records every call, and applies the way
server-side apply looks from outside for our purposes: the applied fields replace
ours, ``status`` and server-added ``metadata`` (uid, resourceVersion) survive.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Mapping
from typing import Any

import pytest

from fleetgate.operator.kube import KubeError


class FakeKube:
    def __init__(self) -> None:
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}
        self.calls: list[tuple[str, str, str]] = []
        self.served_kinds: set[str] = {
            "InferenceService",
            "Deployment",
            "Service",
            "ConfigMap",
            "PodDisruptionBudget",
            "Pod",
            "Event",
        }
        self.refuse: dict[str, KubeError] = {}
        self._rv = itertools.count(1)
        self._uid = itertools.count(1)

    # helpers for tests -------------------------------------------------------------
    def put(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        stored = copy.deepcopy(dict(obj))
        meta = stored.setdefault("metadata", {})
        meta.setdefault("uid", f"uid-{next(self._uid)}")
        meta["resourceVersion"] = str(next(self._rv))
        self.objects[(stored["kind"], meta.get("namespace", ""), meta["name"])] = stored
        return copy.deepcopy(stored)

    def writes(self) -> list[tuple[str, str, str]]:
        return [
            c for c in self.calls if c[0] in {"apply", "delete", "patch_status", "create", "patch"}
        ]

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [o for (k, _, _), o in self.objects.items() if k == kind]

    # KubeApi -------------------------------------------------------------------------
    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        self.calls.append(("get", kind, name))
        found = self.objects.get((kind, namespace, name))
        return copy.deepcopy(found) if found is not None else None

    def list(
        self, api_version: str, kind: str, namespace: str, selector: str
    ) -> list[dict[str, Any]]:
        self.calls.append(("list", kind, selector))
        want = dict(part.split("=", 1) for part in selector.split(",") if part)
        return [
            copy.deepcopy(o)
            for (k, ns, _), o in self.objects.items()
            if k == kind
            and ns == namespace
            and all(o["metadata"].get("labels", {}).get(a) == b for a, b in want.items())
        ]

    def apply(self, obj: Mapping[str, Any], field_manager: str) -> dict[str, Any]:
        kind, name = obj["kind"], obj["metadata"]["name"]
        self.calls.append(("apply", kind, name))
        if kind in self.refuse:
            raise self.refuse[kind]
        assert field_manager == "fleetgate-operator"
        key = (kind, obj["metadata"]["namespace"], name)
        old = self.objects.get(key)
        new = copy.deepcopy(dict(obj))
        if old is not None:
            new["metadata"]["uid"] = old["metadata"]["uid"]
            if "status" in old:
                new["status"] = old["status"]
            if kind == "Deployment" and old["spec"] != new["spec"]:
                new["metadata"]["generation"] = old["metadata"].get("generation", 1) + 1
            else:
                new["metadata"]["generation"] = old["metadata"].get("generation", 1)
        else:
            new["metadata"]["generation"] = 1
        return self.put(new)

    def delete(self, api_version: str, kind: str, namespace: str, name: str) -> None:
        self.calls.append(("delete", kind, name))
        self.objects.pop((kind, namespace, name), None)

    def patch_status(
        self, api_version: str, kind: str, namespace: str, name: str, status: Mapping[str, Any]
    ) -> None:
        self.calls.append(("patch_status", kind, name))
        obj = self.objects[(kind, namespace, name)]
        obj.setdefault("status", {}).update(copy.deepcopy(dict(status)))

    def create(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        self.calls.append(("create", obj["kind"], obj["metadata"].get("generateName", "")))
        new = copy.deepcopy(dict(obj))
        new["metadata"]["name"] = new["metadata"].pop("generateName", "") + str(next(self._rv))
        return self.put(new)

    def patch(
        self,
        api_version: str,
        kind: str,
        namespace: str,
        name: str,
        body: Mapping[str, Any],
        subresource: str | None = None,
    ) -> None:
        self.calls.append(("patch", f"{kind}/{subresource}" if subresource else kind, name))
        obj = self.objects[(kind, namespace, name)]

        def merge(into: dict[str, Any], patch: Mapping[str, Any]) -> None:
            for key, value in patch.items():
                if value is None:
                    into.pop(key, None)
                elif isinstance(value, Mapping) and isinstance(into.get(key), dict):
                    merge(into[key], value)
                else:
                    into[key] = copy.deepcopy(value)

        merge(obj, body)

    def kind_exists(self, api_version: str, kind: str) -> bool:
        self.calls.append(("kind_exists", kind, ""))
        return kind in self.served_kinds


@pytest.fixture
def kube() -> FakeKube:
    return FakeKube()
