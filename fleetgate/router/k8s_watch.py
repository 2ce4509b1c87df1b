"""LIST+WATCH of one Kubernetes collection, on the router's event loop.

How: an httpx streaming watch on the router's event loop, not the ``kubernetes``
client's watch in a worker thread. The router is asyncio + httpx already, a watch
task is cancelled like every other background task (a thread blocked in urllib3
could only be abandoned), and nothing crosses threads into the fleet, which the
loop owns without locks. Only the credentials come from the official client's
loaders (:func:`load_access`: kubeconfig with any auth plugin, or the in-cluster
ServiceAccount, whose token is re-read per request since bound tokens rotate).

Watch protocol (:class:`Reflector`, as client-go's): a paged LIST gives the objects
and a resourceVersion; WATCH from it with bookmarks; a watch that ends resumes from
the last version seen; errors back off and keep the cache; 410 Gone (HTTP status or
an ``ERROR`` event) means the version was compacted, so it LISTs again and replaces
its cache (:class:`~fleetgate.router.k8s_watchcache.WatchCache`) in one step. What
is watched, and what becomes of it, is :mod:`fleetgate.router.discovery_k8s`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import ssl
from collections.abc import AsyncGenerator, Callable
from typing import Any, Literal

import httpx

from fleetgate.router.k8s_addresses import ISVC_GROUP_VERSION
from fleetgate.router.k8s_targets import KubernetesDiscoveryConfig
from fleetgate.router.k8s_watchcache import Gone, WatchCache, WatchError

log = logging.getLogger("fleetgate.router.discovery")


@dataclasses.dataclass(frozen=True)
class ApiAccess:
    """Where the API server is and how to authenticate; token read per request."""

    host: str
    verify: ssl.SSLContext | bool
    token: Callable[[], str | None]


def load_access(kubeconfig: str | None) -> ApiAccess:
    """Credentials via the official client's loaders (blocking file reads, at start-up)."""
    from kubernetes import config as kconfig
    from kubernetes.client import Configuration

    cfg = Configuration()
    if kubeconfig:
        kconfig.load_kube_config(config_file=kubeconfig, client_configuration=cfg)  # type: ignore[no-untyped-call]
    else:
        try:
            kconfig.load_incluster_config(client_configuration=cfg)  # type: ignore[no-untyped-call]
        except kconfig.ConfigException:
            kconfig.load_kube_config(client_configuration=cfg)  # type: ignore[no-untyped-call]
    verify: ssl.SSLContext | bool = False
    if cfg.verify_ssl:
        context = ssl.create_default_context(cafile=cfg.ssl_ca_cert or None)
        if cfg.cert_file:
            context.load_cert_chain(cfg.cert_file, cfg.key_file or None)
        verify = context
    elif cfg.cert_file:
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        context.load_cert_chain(cfg.cert_file, cfg.key_file or None)
        verify = context

    def token() -> str | None:
        value = cfg.get_api_key_with_prefix("BearerToken", alias="authorization")
        return str(value) if value else None

    return ApiAccess(host=str(cfg.host).rstrip("/"), verify=verify, token=token)


def resource_path(
    kind: Literal["endpointslices", "pods", "inferenceservices"], namespace: str
) -> str:
    group = {"endpointslices": "apis/discovery.k8s.io/v1", "pods": "api/v1"}.get(
        kind, f"apis/{ISVC_GROUP_VERSION}"
    )
    where = f"/namespaces/{namespace}" if namespace else ""
    return f"/{group}{where}/{kind}"


class Reflector:
    """LIST+WATCH one collection into a :class:`WatchCache`; ``on_change`` on changes."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        access: ApiAccess,
        path: str,
        label_selector: str | None,
        config: KubernetesDiscoveryConfig,
        on_change: Callable[[], None],
        sleep: Callable[[float], Any] = asyncio.sleep,
    ) -> None:
        self.client = client
        self.access = access
        self.path = path
        self.selector = label_selector
        self.config = config
        self.on_change = on_change
        self.sleep = sleep
        self.cache = WatchCache()
        self.synced = asyncio.Event()
        self.lists = 0
        """LIST round trips done (1 at start, +1 per 410 Gone): tests read it."""

    def _headers(self) -> dict[str, str]:
        token = self.access.token()
        return {"Authorization": token} if token else {}

    def _params(self, **extra: str) -> dict[str, str]:
        params = dict(extra)
        if self.selector:
            params["labelSelector"] = self.selector
        return params

    async def list(self) -> None:
        items: list[dict[str, Any]] = []
        cont = ""
        while True:
            params = self._params(limit="500", **({"continue": cont} if cont else {}))
            resp = await self.client.get(
                self.access.host + self.path, params=params, headers=self._headers()
            )
            if resp.status_code == 410:
                raise Gone("list continue token expired")
            resp.raise_for_status()
            body = resp.json()
            items.extend(body.get("items") or [])
            meta = body.get("metadata") or {}
            cont = meta.get("continue") or ""
            if not cont:
                break
        self.lists += 1
        self.cache.replace(items, str(meta.get("resourceVersion", "")))
        self.on_change()
        self.synced.set()

    async def events(self) -> AsyncGenerator[dict[str, Any], None]:
        params = self._params(
            watch="1",
            allowWatchBookmarks="true",
            resourceVersion=self.cache.resource_version or "",
            timeoutSeconds=str(self.config.watch_timeout_s),
        )
        url = self.access.host + self.path
        async with self.client.stream("GET", url, params=params, headers=self._headers()) as r:
            if r.status_code == 410:
                raise Gone("watch: resource version too old")
            r.raise_for_status()
            async for line in r.aiter_lines():
                if line.strip():
                    try:
                        yield json.loads(line)
                    except json.JSONDecodeError as e:
                        raise WatchError(f"undecodable watch line: {line[:200]!r}") from e

    async def run(self) -> None:
        """Forever: list when needed, watch, resume; back off on errors (cache kept)."""
        need_list = True
        delay = 0.25
        while True:
            try:
                if need_list:
                    await self.list()
                    need_list = False
                async with contextlib.aclosing(self.events()) as events:
                    async for event in events:
                        if self.cache.apply(event):
                            self.on_change()
                delay = 0.25  # a clean end (server timeout): resume at once
            except Gone as e:
                log.info("%s: %s; listing again", self.path, e)
                need_list = True
            except (httpx.HTTPError, WatchError, ValueError) as e:
                log.warning("%s: %s; retrying in %.2fs", self.path, e, delay)
                await self.sleep(delay)
                delay = min(delay * 2, self.config.retry_max_s)
