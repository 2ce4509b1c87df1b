"""Kubernetes discovery: the router's fleet follows the engines the operator runs.

What is watched. For every ``InferenceService`` NAME the operator creates a Service
NAME and pods labelled ``fleetgate.dev/{pool,model,engine,role}`` and
``app.kubernetes.io/instance: NAME`` (``fleetgate/operator/manifests.py``). The
EndpointSlice controller copies the Service's labels onto its slices and adds
``kubernetes.io/service-name``. The router LISTs and WATCHes

* the addresses, from one ``source``: EndpointSlices selected by ``fleetgate.dev/pool``
  (default; per endpoint ``conditions.ready``, unset meaning ready as the API
  defines) or the pods with that label (Ready condition, not terminating). Pods are
  for clusters whose slices cannot hold the pod IPs: the API server refuses loopback
  addresses in EndpointSlices, so the kwok dev cluster (pod IPs 127.0.1.x) uses them;
* the InferenceServices: engine type, pool, role, served model, weight (0 drains)
  and concurrency limit, joined to the addresses by namespace and name.

Ready addresses of an existing InferenceService that pass the pool/role filters join
the router's :class:`~fleetgate.router.state.Fleet`; the rest leave it.

How: an httpx streaming watch on the router's event loop, not the ``kubernetes``
client's watch in a worker thread. The router is asyncio + httpx already, a watch
task is cancelled like every other background task (a thread blocked in urllib3
could only be abandoned), and nothing crosses threads into the fleet, which the
loop owns without locks. Only the credentials come from the official client's
loaders (kubeconfig with any auth plugin, or the in-cluster ServiceAccount, whose
token is re-read per request since bound tokens rotate).

Watch protocol (:class:`Reflector`, as client-go's): a paged LIST gives the objects
and a resourceVersion; WATCH from it with bookmarks; a watch that ends resumes from
the last version seen; errors back off and keep the cache; 410 Gone (HTTP status or
an ``ERROR`` event) means the version was compacted, so it LISTs again and replaces
its cache in one step. The fleet is recomputed from the caches, never from events,
so a relist or an outage never removes an endpoint that still exists (tested
against the real API server).

Pure parts (``addresses_from_*``, ``desired_targets``, ``plan``, ``WatchCache``) take
plain dicts. :class:`FleetMembership` is the only code that mutates the fleet and it
removes only endpoints it added, so static ``pools`` keep working alongside.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import ssl
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, Literal

import httpx
from pydantic import BaseModel, ConfigDict, Field

from fleetgate.engines import UnknownEngineError, get_adapter
from fleetgate.router.config import ConfigError
from fleetgate.router.scheduling.types import EndpointId
from fleetgate.router.state import Endpoint, Fleet

if TYPE_CHECKING:
    from starlette.applications import Starlette

    from fleetgate.router.poller import Poller

log = logging.getLogger("fleetgate.router.discovery")

# The operator's discovery labels (fleetgate/operator/manifests.py). Copied, not
# imported: router and operator are independent packages (import-linter contract);
# tests/router/test_discovery_k8s.py checks that both sides agree.
LABEL_POOL = "fleetgate.dev/pool"
LABEL_MODEL = "fleetgate.dev/model"
LABEL_ENGINE = "fleetgate.dev/engine"
LABEL_ROLE = "fleetgate.dev/role"
LABEL_SERVICE_NAME = "kubernetes.io/service-name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
ISVC_GROUP_VERSION = "fleetgate.dev/v1alpha1"
ISVC_PLURAL = "inferenceservices"

ObjKey = tuple[str, str]
"""(namespace, name)"""


class KubernetesDiscoveryConfig(BaseModel):
    """``discovery.kubernetes`` in the router's YAML."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    source: Literal["endpointslices", "pods"] = "endpointslices"
    """Where addresses come from. ``endpointslices`` (production; least data) or
    ``pods`` (same labels, read from the pods; needed where the API server refuses the
    addresses in slices, e.g. the loopback pod IPs of the kwok test cluster)."""
    namespaces: tuple[str, ...] = ()
    """Namespaces to watch; empty watches all (needs the chart's ClusterRole)."""
    pools: tuple[str, ...] = ()
    """Only InferenceServices of these ``routing.pool`` values; empty takes every pool."""
    roles: tuple[Literal["latency", "throughput"], ...] = ()
    """Only these ``routing.role`` values; empty takes both."""
    kubeconfig: str | None = None
    """Kubeconfig file; default: in-cluster ServiceAccount, else KUBECONFIG/~/.kube/config."""
    port_name: str = "http"
    """EndpointSlice port carrying the engine's OpenAI API (the operator names it http)."""
    watch_timeout_s: int = Field(240, ge=1, le=3600)
    """Server-side timeout of one WATCH request; it then resumes from its version."""
    retry_max_s: float = Field(10.0, gt=0)
    """Longest wait between retries after an API error (doubling from 0.25 s)."""
    initial_sync_s: float = Field(10.0, gt=0)
    """How long start-up waits for the first LIST before serving anyway."""


# --------------------------------------------------------------------------- pure


@dataclasses.dataclass(frozen=True, slots=True)
class Target:
    """One engine endpoint the fleet should contain."""

    id: EndpointId
    pool: str
    engine: str
    url: str
    capacity: int | None
    namespace: str
    service: str
    model: str


@dataclasses.dataclass(frozen=True, slots=True)
class Plan:
    """What to change in the fleet: removals first, then additions."""

    add: tuple[Target, ...]
    remove: tuple[EndpointId, ...]


def _capacity(engine_spec: Mapping[str, Any]) -> int | None:
    """Concurrency limit from the InferenceService (vLLM metrics do not carry it)."""
    for section, field in (("vllm", "maxNumSeqs"), ("tensorrtLlm", "maxBatchSize")):
        value = (engine_spec.get(section) or {}).get(field)
        if isinstance(value, int) and value > 0:
            return value
    return None


@dataclasses.dataclass(frozen=True, slots=True)
class Address:
    """One engine address seen by either source, before the InferenceService join."""

    namespace: str
    service: str
    pod: str | None
    address: str
    ipv6: bool
    port: int
    ready: bool


def addresses_from_slice(eps: Mapping[str, Any], port_name: str) -> list[Address]:
    """EndpointSlice -> addresses (``conditions.ready`` unset counts as ready)."""
    meta = eps.get("metadata") or {}
    service = (meta.get("labels") or {}).get(LABEL_SERVICE_NAME)
    kind = eps.get("addressType")
    ports = [p for p in eps.get("ports") or [] if isinstance(p.get("port"), int)]
    chosen = [p for p in ports if p.get("name") == port_name] or (ports if len(ports) == 1 else [])
    if not service or kind not in ("IPv4", "IPv6") or not chosen:
        return []
    out = []
    for ep in eps.get("endpoints") or []:
        ref = ep.get("targetRef") or {}
        for address in (ep.get("addresses") or [])[:1]:
            out.append(
                Address(
                    namespace=str(meta.get("namespace", "")),
                    service=str(service),
                    pod=ref.get("name") if ref.get("kind") == "Pod" else None,
                    address=str(address),
                    ipv6=kind == "IPv6",
                    port=int(chosen[0]["port"]),
                    ready=(ep.get("conditions") or {}).get("ready") is not False,
                )
            )
    return out


def addresses_from_pod(pod: Mapping[str, Any], port_name: str) -> list[Address]:
    """Pod -> its address: ready when the Ready condition is True and it is not terminating.

    The operator's pods carry ``app.kubernetes.io/instance: NAME`` (the Service's
    selector), which names the InferenceService.
    """
    meta = pod.get("metadata") or {}
    service = (meta.get("labels") or {}).get(LABEL_INSTANCE)
    status = pod.get("status") or {}
    ip = status.get("podIP")
    ports = [
        p
        for c in (pod.get("spec") or {}).get("containers") or []
        for p in c.get("ports") or []
        if p.get("name") == port_name and isinstance(p.get("containerPort"), int)
    ]
    if not service or not ip or not ports:
        return []
    ready = any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in status.get("conditions") or []
    )
    return [
        Address(
            namespace=str(meta.get("namespace", "")),
            service=str(service),
            pod=str(meta.get("name", "")),
            address=str(ip),
            ipv6=":" in str(ip),
            port=int(ports[0]["containerPort"]),
            ready=ready and not meta.get("deletionTimestamp"),
        )
    ]


def target_for(
    a: Address, isvc: Mapping[str, Any], config: KubernetesDiscoveryConfig
) -> Target | None:
    """The fleet entry for a ready address of InferenceService ``isvc``, or None."""
    spec = isvc.get("spec") or {}
    routing = spec.get("routing") or {}
    pool = str(routing.get("pool", "default"))
    role = str(routing.get("role", "latency"))
    if not a.ready or routing.get("weight", 100) == 0:
        return None
    if (config.pools and pool not in config.pools) or (config.roles and role not in config.roles):
        return None
    engine_spec = spec.get("engine") or {}
    try:
        engine = get_adapter(str(engine_spec.get("type", ""))).name
    except UnknownEngineError:
        return None
    who = a.pod or f"{a.service}/{a.address}:{a.port}"
    host = f"[{a.address}]" if a.ipv6 else a.address
    return Target(
        id=EndpointId(f"{a.namespace}/{who}"),
        pool=pool,
        engine=engine,
        url=f"http://{host}:{a.port}",
        capacity=_capacity(engine_spec),
        namespace=a.namespace,
        service=a.service,
        model=str((spec.get("model") or {}).get("name") or a.service),
    )


def desired_targets(
    addresses: Iterable[Address],
    services: Mapping[ObjKey, Mapping[str, Any]],
    config: KubernetesDiscoveryConfig,
) -> dict[EndpointId, Target]:
    """Join addresses to the InferenceService of the same namespace and name."""
    out: dict[EndpointId, Target] = {}
    for a in addresses:
        isvc = services.get((a.namespace, a.service))
        if isvc is None or (isvc.get("metadata") or {}).get("deletionTimestamp"):
            continue
        t = target_for(a, isvc, config)
        if t is not None:
            out.setdefault(t.id, t)  # listed by two slices mid-update: one entry
    return out


def plan(current: Mapping[EndpointId, Target], desired: Mapping[EndpointId, Target]) -> Plan:
    """Changed targets (new IP, engine, pool...) are removed and added again."""
    remove = tuple(sorted(eid for eid, t in current.items() if desired.get(eid) != t))
    add = tuple(t for eid, t in sorted(desired.items()) if current.get(eid) != t)
    return Plan(add=add, remove=remove)


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


# --------------------------------------------------------------------------- API I/O


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


# --------------------------------------------------------------------------- fleet


class FleetMembership:
    """Adds and removes discovered endpoints, each with its scrape and health loops.

    The loops call the poller's public ``refresh``/``probe``/``load_models``/``scrape``,
    so a discovered endpoint is polled exactly like a static one (one scraper per
    engine). A new endpoint is unhealthy until its first probe answers, so the
    scheduler never picks it before the engine serves.
    """

    def __init__(
        self, fleet: Fleet, poller: Poller, *, allow_url: Callable[[str], bool] | None = None
    ) -> None:
        self.fleet = fleet
        self.poller = poller
        self.allow_url = allow_url or (lambda url: True)
        self.targets: dict[EndpointId, Target] = {}
        self.refused: set[Target] = set()
        self._tasks: dict[EndpointId, list[asyncio.Task[None]]] = {}

    def add(self, t: Target) -> bool:
        """Add a discovered endpoint; False (logged once) if its id or URL is refused."""
        if t.id in self.fleet.endpoints or not self.allow_url(t.url):
            if t not in self.refused:
                self.refused.add(t)
                log.warning("endpoint %s (%s) refused: id in use or URL not allowed", t.id, t.url)
            return False
        adapter = get_adapter(t.engine)
        e = Endpoint(
            id=t.id,
            pool=t.pool,
            engine=adapter.name,
            url=t.url,
            adapter=adapter,
            metrics_source=adapter.metrics_sources[0],
            capacity_hint=t.capacity,
        )
        self.fleet.endpoints[t.id] = e
        self.targets[t.id] = t
        loop = asyncio.get_running_loop()
        self._tasks[t.id] = [loop.create_task(self._poll(e), name=f"discovered:{t.id}")]
        log.info("endpoint %s joined (%s %s, pool %s)", t.id, t.engine, t.url, t.pool)
        return True

    async def remove(self, eid: EndpointId) -> None:
        tasks = self._tasks.pop(eid, [])
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self.targets.pop(eid, None)
        if self.fleet.endpoints.pop(eid, None) is not None:
            self.fleet.index.forget(eid)
            log.info("endpoint %s left", eid)

    async def close(self) -> None:
        for eid in list(self._tasks):
            await self.remove(eid)

    async def _poll(self, e: Endpoint) -> None:
        p = self.poller
        await p.refresh(e)
        scrape_every = p.config.scrape.interval_s
        health = p.config.health
        loop = asyncio.get_running_loop()
        next_probe = loop.time() + health.interval_s
        models_at = loop.time()
        while True:
            await asyncio.sleep(min(scrape_every, max(0.0, next_probe - loop.time())))
            now = loop.time()
            if now >= next_probe:
                was = e.healthy
                await p.probe(e)
                next_probe = now + health.interval_s
                stale = now - models_at >= health.models_refresh_s
                if e.healthy and (not was or stale or not e.models):
                    await p.load_models(e)
                    models_at = now
            elif e.healthy:
                await p.scrape(e)


class KubernetesDiscovery:
    """Reflectors for slices and InferenceServices, reconciled into the fleet."""

    def __init__(
        self, membership: FleetMembership, config: KubernetesDiscoveryConfig, access: ApiAccess
    ) -> None:
        self.membership = membership
        self.config = config
        self.client = httpx.AsyncClient(
            verify=access.verify,
            trust_env=False,
            timeout=httpx.Timeout(10.0, read=config.watch_timeout_s + 30.0),
        )
        self._changed = asyncio.Event()

        def reflector(kind: Any, selector: str | None, ns: str) -> Reflector:
            path = resource_path(kind, ns)
            return Reflector(self.client, access, path, selector, config, self._changed.set)

        namespaces = config.namespaces or ("",)  # "": all namespaces
        self.addresses = [reflector(config.source, LABEL_POOL, ns) for ns in namespaces]
        self.services = [reflector("inferenceservices", None, ns) for ns in namespaces]
        self._tasks: list[asyncio.Task[None]] = []

    def desired(self) -> dict[EndpointId, Target]:
        services: dict[ObjKey, dict[str, Any]] = {}
        for r in self.services:
            services.update(r.cache.objects)
        read = (
            addresses_from_slice if self.config.source == "endpointslices" else addresses_from_pod
        )
        found = [
            a
            for r in self.addresses
            for o in r.cache.objects.values()
            for a in read(o, self.config.port_name)
        ]
        return desired_targets(found, services, self.config)

    def synced(self) -> bool:
        return all(r.synced.is_set() for r in (*self.addresses, *self.services))

    async def reconcile(self) -> Plan:
        """Bring the fleet to the desired set; nothing happens before both caches synced."""
        if not self.synced():
            return Plan(add=(), remove=())
        p = plan(self.membership.targets, self.desired())
        for eid in p.remove:
            await self.membership.remove(eid)
        for t in p.add:
            self.membership.add(t)
        return p

    async def _reconcile_loop(self) -> None:
        while True:
            await self._changed.wait()
            self._changed.clear()
            await self.reconcile()

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        for r in (*self.addresses, *self.services):
            self._tasks.append(loop.create_task(r.run(), name=f"reflector:{r.path}"))
        waits = [r.synced.wait() for r in (*self.addresses, *self.services)]
        try:
            async with asyncio.timeout(self.config.initial_sync_s):
                await asyncio.gather(*waits)
        except TimeoutError:
            log.warning("kubernetes discovery: first LIST not done yet; serving anyway")
        await self.reconcile()
        self._tasks.append(loop.create_task(self._reconcile_loop(), name="discovery:reconcile"))

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self._tasks.clear()
        await self.membership.close()
        await self.client.aclose()


def attach(
    app: Starlette,
    config: KubernetesDiscoveryConfig,
    *,
    allow_url: Callable[[str], bool] | None = None,
) -> None:
    """Run Kubernetes discovery inside the app's lifespan, after the poller started.

    ``app`` is what :func:`fleetgate.router.app.build_router` returns (it exposes
    ``app.state.router.fleet`` and ``app.state.poller``). Credentials are loaded here,
    before serving, so a missing or broken kubeconfig is a one-line
    :class:`~fleetgate.router.config.ConfigError`, not a failed lifespan.
    """
    try:
        access = load_access(config.kubeconfig)
    except Exception as e:  # the loaders raise ConfigException, OSError, ValueError...
        where = config.kubeconfig or "in-cluster service account or KUBECONFIG/~/.kube/config"
        raise ConfigError(
            f"discovery.kubernetes: cannot load credentials from {where}: {e}"
        ) from None
    inner = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(a: Starlette) -> AsyncIterator[Any]:
        async with inner(a) as state:
            membership = FleetMembership(a.state.router.fleet, a.state.poller, allow_url=allow_url)
            discovery = KubernetesDiscovery(membership, config, access)
            a.state.discovery = discovery
            await discovery.start()
            try:
                yield state
            finally:
                await discovery.stop()

    app.router.lifespan_context = lifespan
