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
* the InferenceServices: engine type, pool, role, served model, weight (0 drains),
  concurrency limit and engine release (``spec.engine.version`` or the image tag),
  joined to the addresses by namespace and name. Pods also carry the operator's
  ``fleetgate.dev/served-model`` and ``fleetgate.dev/engine-version`` annotations,
  which win (per pod, so right mid-rollout); slices carry no annotations.

Each endpoint gets its engine's adapter bound to that release (the request fields
it accepts, the metrics source it publishes load on first) and its served name
(:mod:`fleetgate.router.served`).

Ready addresses of an existing InferenceService that pass the pool/role filters join
the router's :class:`~fleetgate.router.state.Fleet`; the rest leave it.

Scale-down drain: a pod annotated ``fleetgate.dev/drain: "true"`` (the autoscaler
chose it for removal) stays in the fleet flagged ``draining``; the pipeline's
``not-draining`` filter sends it no new request, retry or resume, and what runs there
finishes. The flag changes in place, so the endpoint keeps its in-flight count
(``fleetgate_endpoint_in_flight``, which tells the operator when it is idle). The
``pods`` source reads the annotation from its pods; the ``endpointslices`` source
also watches the pods (``drain_from_pods``) and joins by the slices' ``targetRef``.

Scale from zero: an InferenceService with ``spec.autoscaling.minReplicas: 0`` is a
:class:`~fleetgate.router.state.Standby` model of the fleet (served name, pool, cold
start) even with no pod, so its requests are held, not refused, while it scales up.

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

The pure parts (addresses, the join into targets, plans, the watch cache) are in
:mod:`fleetgate.router.k8s_targets` and take plain dicts. :class:`FleetMembership`
is the only code that mutates the fleet and it removes only endpoints it added, so
static ``pools`` keep working alongside.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import ssl
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, Literal

import httpx

from fleetgate.engines import get_adapter
from fleetgate.router.config import ConfigError
from fleetgate.router.k8s_targets import (
    ISVC_GROUP_VERSION,
    LABEL_POOL,
    Gone,
    KubernetesDiscoveryConfig,
    ObjKey,
    Plan,
    Target,
    WatchCache,
    WatchError,
    addresses_from_pod,
    addresses_from_slice,
    desired_targets,
    draining_pods,
    plan,
    scale_from_zero,
)
from fleetgate.router.scheduling.types import EndpointId
from fleetgate.router.served import EngineVersionError, adapter_for
from fleetgate.router.state import Endpoint, Fleet, Standby

if TYPE_CHECKING:
    from starlette.applications import Starlette

    from fleetgate.router.kvfeed import KvFeeds
    from fleetgate.router.poller import Poller

log = logging.getLogger("fleetgate.router.discovery")

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
        self,
        fleet: Fleet,
        poller: Poller,
        *,
        allow_url: Callable[[str], bool] | None = None,
        kv_feeds: KvFeeds | None = None,
    ) -> None:
        self.fleet = fleet
        self.poller = poller
        self.kv_feeds = kv_feeds
        """Subscribers to the endpoints' KV events (None: no exact view)."""
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
        try:
            adapter = adapter_for(t.engine, t.engine_version)
        except EngineVersionError as err:
            # The operator refuses such services, so only a hand-made pod gets here: the
            # registry's adapter (the newest release's request fields and metrics).
            log.warning("endpoint %s: %s; using the %s defaults", t.id, err, t.engine)
            adapter = get_adapter(t.engine)
        e = Endpoint(
            id=t.id,
            pool=t.pool,
            engine=adapter.name,
            url=t.url,
            adapter=adapter,
            metrics_source=adapter.metrics_sources[0],
            capacity_hint=t.capacity,
            served_model=t.model,
            draining=t.draining,
            kv_events=t.kv_events,
        )
        if t.kv_events_error:
            log.warning("endpoint %s: %s; no exact prefix view of it", t.id, t.kv_events_error)
        self.fleet.endpoints[t.id] = e
        self.targets[t.id] = t
        loop = asyncio.get_running_loop()
        self._tasks[t.id] = [loop.create_task(self._poll(e), name=f"discovered:{t.id}")]
        if self.kv_feeds is not None:
            self.kv_feeds.add(e)
        release = f" {t.engine_version}" if t.engine_version else ""
        log.info("endpoint %s joined (%s%s %s, pool %s, model %s)",
                 t.id, t.engine, release, t.url, t.pool, t.model)  # fmt: skip
        return True

    def set_draining(self, eid: EndpointId, draining: bool) -> None:
        """Flag an endpoint of ours in place (it keeps its in-flight requests and counts)."""
        t = self.targets.get(eid)
        e = self.fleet.endpoints.get(eid)
        if t is None or e is None:
            return
        self.targets[eid] = dataclasses.replace(t, draining=draining)
        e.draining = draining
        log.info("endpoint %s %s", eid, "draining: no new work" if draining else "undrained")

    def set_standby(self, wanted: dict[str, Standby]) -> bool:
        """Make the discovered scale-from-zero models ``wanted``; the router YAML's own
        (``source == "config"``) are never touched. True when something changed."""
        standby = self.fleet.standby
        changed = False
        for model, sb in list(standby.items()):
            if sb.source != "config" and wanted.get(model) != sb:
                del standby[model]
                changed = True
        for model, sb in wanted.items():
            if model not in standby:
                standby[model] = sb
                changed = True
                log.info("model %s known at zero replicas (%s, pool %s)",
                         model, sb.source, sb.pool)  # fmt: skip
        return changed

    async def remove(self, eid: EndpointId) -> None:
        tasks = self._tasks.pop(eid, [])
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self.targets.pop(eid, None)
        if self.kv_feeds is not None:
            await self.kv_feeds.remove(eid)
        if self.fleet.endpoints.pop(eid, None) is not None:
            self.fleet.index.forget(eid)
            self.fleet.kv_index.clear(eid)
            log.info("endpoint %s left", eid)

    def changed(self) -> None:
        """Tell admission the fleet changed outside the poller (the poller's hook)."""
        if self.poller.on_change is not None:
            self.poller.on_change()

    async def close(self) -> None:
        for eid in list(self._tasks):
            await self.remove(eid)

    async def _poll(self, e: Endpoint) -> None:
        p = self.poller
        await p.refresh(e)
        scrape_every = p.config.scrape.interval_s
        health = p.config.health
        loop = asyncio.get_running_loop()
        next_probe = loop.time() + p.probe_interval(e)
        models_at = loop.time()
        while True:
            await asyncio.sleep(min(scrape_every, max(0.0, next_probe - loop.time())))
            now = loop.time()
            if now >= next_probe:
                was = e.healthy
                await p.probe(e)
                next_probe = now + p.probe_interval(e)
                stale = now - models_at >= health.models_refresh_s
                if e.healthy and (not was or stale or not e.models):
                    await p.load_models(e)
                    models_at = now
            elif e.healthy and p.scrape_due(e):
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
        self.drains = (
            [reflector("pods", LABEL_POOL, ns) for ns in namespaces]
            if config.source == "endpointslices" and config.drain_from_pods
            else []
        )
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
        draining = draining_pods(o for r in self.drains for o in r.cache.objects.values())
        return desired_targets(found, services, self.config, draining)

    def standby(self) -> dict[str, Standby]:
        """The InferenceServices that scale from zero, as the fleet's standby models."""
        known = scale_from_zero(
            (o for r in self.services for o in r.cache.objects.values()), self.config
        )
        return {
            model: Standby(
                model=model,
                pool=k.pool,
                cold_start_s=k.cold_start_s,
                min_replicas=k.min_replicas,
                source=f"{k.namespace}/{k.name}",
            )
            for model, k in known.items()
        }

    def _reflectors(self) -> tuple[Reflector, ...]:
        return (*self.addresses, *self.services, *self.drains)

    def synced(self) -> bool:
        return all(r.synced.is_set() for r in self._reflectors())

    async def reconcile(self) -> Plan:
        """Bring the fleet to the desired set; nothing happens before every cache synced."""
        if not self.synced():
            return Plan(add=(), remove=())
        p = plan(self.membership.targets, self.desired())
        for eid in p.remove:
            await self.membership.remove(eid)
        for t in p.add:
            self.membership.add(t)
        for eid, flag in p.drain:
            self.membership.set_draining(eid, flag)
        changed = self.membership.set_standby(self.standby())
        if changed or p.drain or p.remove:
            self.membership.changed()  # admission re-decides what it holds or queues
        return p

    async def _reconcile_loop(self) -> None:
        while True:
            await self._changed.wait()
            self._changed.clear()
            await self.reconcile()

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        for r in self._reflectors():
            name = f"reflector:{r.path}" + (":drain" if r in self.drains else "")
            self._tasks.append(loop.create_task(r.run(), name=name))
        waits = [r.synced.wait() for r in self._reflectors()]
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
            membership = FleetMembership(
                a.state.router.fleet,
                a.state.poller,
                allow_url=allow_url,
                kv_feeds=getattr(a.state, "kv_feeds", None),
            )
            discovery = KubernetesDiscovery(membership, config, access)
            a.state.discovery = discovery
            await discovery.start()
            try:
                yield state
            finally:
                await discovery.stop()

    app.router.lifespan_context = lifespan
