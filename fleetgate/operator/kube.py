"""The operator's one door to the Kubernetes API.

:class:`KubeApi` is the seam (kopf's habit: "we mock on the level of our own K8s
API wrappers, not the HTTP client"): the reconciler only
sees this Protocol, tests pass an in-memory fake, production passes
:class:`DynamicKubeApi` over the official client's ``DynamicClient``.

Error translation happens here and only here: client
exceptions become :class:`KubeError` (``status``, one-line ``message`` cut to
300 characters from the API server's JSON ``message``), with :class:`NotFound`
and :class:`Conflict` as the subclasses callers branch on.

Writes are server-side apply (``application/apply-patch+yaml``) with one field
manager and ``force=true``: the operator owns the fields it sets and takes them
back after a manual edit (drift), while fields set by others stay theirs.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping
from typing import Any, Protocol

from kubernetes import client as k8s_client
from kubernetes.client.exceptions import ApiException
from kubernetes.dynamic import DynamicClient
from kubernetes.dynamic.exceptions import ResourceNotFoundError

__all__ = ["Conflict", "DynamicKubeApi", "KubeApi", "KubeError", "NotFound", "translate"]

_MAX_MESSAGE = 300


class KubeError(Exception):
    """An API call failed; ``status`` is the HTTP status (0 when none)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}" if status else message)
        self.status = status
        self.message = message


class NotFound(KubeError):
    """404."""


class Conflict(KubeError):
    """409."""


def translate(exc: ApiException) -> KubeError:
    """A client exception as a :class:`KubeError` with the server's own message."""
    status = int(getattr(exc, "status", 0) or 0)
    body = getattr(exc, "body", None)
    message = str(getattr(exc, "reason", "") or exc)
    if body:
        try:
            text = body.decode() if isinstance(body, bytes) else str(body)
            message = str(json.loads(text).get("message", message))
        except (ValueError, AttributeError):
            message = str(body)
    message = " ".join(message.split())
    if len(message) > _MAX_MESSAGE:
        message = message[: _MAX_MESSAGE - 3] + "..."
    cls = NotFound if status == 404 else Conflict if status == 409 else KubeError
    return cls(status, message)


class KubeApi(Protocol):
    """What the reconciler needs from the API server."""

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        """The object, or None when it does not exist."""
        ...

    def list(
        self, api_version: str, kind: str, namespace: str, selector: str
    ) -> list[dict[str, Any]]:
        """Objects matching a label selector ("" = all); namespace "" = every namespace."""
        ...

    def apply(self, obj: Mapping[str, Any], field_manager: str) -> dict[str, Any]:
        """Server-side apply with ``force`` and this field manager."""
        ...

    def delete(self, api_version: str, kind: str, namespace: str, name: str) -> None:
        """Delete (background propagation); absent is fine."""
        ...

    def patch_status(
        self, api_version: str, kind: str, namespace: str, name: str, status: Mapping[str, Any]
    ) -> None:
        """JSON merge patch of the status subresource."""
        ...

    def create(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        """Create (used for Events, whose names are generated)."""
        ...

    def patch(
        self,
        api_version: str,
        kind: str,
        namespace: str,
        name: str,
        body: Mapping[str, Any],
        subresource: str | None = None,
    ) -> None:
        """JSON merge patch of an object or one of its subresources (e.g. ``scale``)."""
        ...

    def kind_exists(self, api_version: str, kind: str) -> bool:
        """True when the API server serves this kind (e.g. ServiceMonitor)."""
        ...


class DynamicKubeApi:
    """:class:`KubeApi` over ``kubernetes.dynamic.DynamicClient`` (thread-safe use)."""

    def __init__(self, api_client: k8s_client.ApiClient) -> None:
        self._api_client = api_client
        self._dynamic: Any = None  # DynamicClient; the client library is untyped
        self._lock = threading.Lock()

    def _client(self) -> Any:
        with self._lock:
            if self._dynamic is None:
                try:
                    self._dynamic = DynamicClient(self._api_client)  # type: ignore[no-untyped-call]
                except ApiException as e:
                    raise translate(e) from e
            return self._dynamic

    def _resource(self, api_version: str, kind: str) -> Any:
        dyn = self._client()
        # The client's discovery cache is not thread-safe: two handlers looking kinds up
        # at once raised KeyError('resources') inside it (seen in every e2e run), so the
        # whole lookup, including a cache refresh, happens under the lock.
        with self._lock:
            try:
                return dyn.resources.get(api_version=api_version, kind=kind)
            except ResourceNotFoundError:
                dyn.resources.invalidate_cache()
                try:
                    return dyn.resources.get(api_version=api_version, kind=kind)
                except ResourceNotFoundError as e:
                    raise NotFound(404, f"the server does not serve {kind} ({api_version})") from e

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        resource = self._resource(api_version, kind)
        try:
            found = self._client().get(resource, name=name, namespace=namespace)
        except ApiException as e:
            err = translate(e)
            if isinstance(err, NotFound):
                return None
            raise err from e
        return dict(found.to_dict())

    def list(
        self, api_version: str, kind: str, namespace: str, selector: str
    ) -> list[dict[str, Any]]:
        resource = self._resource(api_version, kind)
        try:
            found = self._client().get(
                resource, namespace=namespace or None, label_selector=selector or None
            )
        except ApiException as e:
            raise translate(e) from e
        return [dict(item) for item in found.to_dict().get("items", [])]

    def apply(self, obj: Mapping[str, Any], field_manager: str) -> dict[str, Any]:
        resource = self._resource(obj["apiVersion"], obj["kind"])
        meta = obj["metadata"]
        try:
            applied = self._client().server_side_apply(
                resource,
                body=dict(obj),
                name=meta["name"],
                namespace=meta.get("namespace"),
                field_manager=field_manager,
                force_conflicts=True,
            )
        except ApiException as e:
            err = translate(e)
            if isinstance(err, NotFound):
                # apply creates, so 404 means the kind (or namespace) is gone: forget
                # what discovery said, the next kind_exists asks the server again
                dyn = self._client()
                with self._lock:
                    dyn.resources.invalidate_cache()
            raise err from e
        return dict(applied.to_dict())

    def delete(self, api_version: str, kind: str, namespace: str, name: str) -> None:
        resource = self._resource(api_version, kind)
        try:
            self._client().delete(
                resource,
                name=name,
                namespace=namespace,
                body={"propagationPolicy": "Background"},
            )
        except ApiException as e:
            err = translate(e)
            if not isinstance(err, NotFound):
                raise err from e

    def patch_status(
        self, api_version: str, kind: str, namespace: str, name: str, status: Mapping[str, Any]
    ) -> None:
        resource = self._resource(api_version, kind)
        try:
            self._client().patch(
                resource.subresources["status"],
                body={"status": dict(status)},
                name=name,
                namespace=namespace,
                content_type="application/merge-patch+json",
            )
        except ApiException as e:
            raise translate(e) from e

    def create(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        resource = self._resource(obj["apiVersion"], obj["kind"])
        try:
            created = self._client().create(
                resource, body=dict(obj), namespace=obj["metadata"].get("namespace")
            )
        except ApiException as e:
            raise translate(e) from e
        return dict(created.to_dict())

    def patch(
        self,
        api_version: str,
        kind: str,
        namespace: str,
        name: str,
        body: Mapping[str, Any],
        subresource: str | None = None,
    ) -> None:
        resource = self._resource(api_version, kind)
        target = resource.subresources[subresource] if subresource else resource
        try:
            self._client().patch(
                target,
                body=dict(body),
                name=name,
                namespace=namespace,
                content_type="application/merge-patch+json",
            )
        except ApiException as e:
            raise translate(e) from e

    def kind_exists(self, api_version: str, kind: str) -> bool:
        try:
            self._resource(api_version, kind)
        except NotFound:
            return False
        return True
