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

How: :class:`~fleetgate.router.k8s_watch.Reflector` s (LIST+WATCH over httpx on the
router's event loop, the official client only for credentials) keep one cache per
collection and namespace; the fleet is recomputed from the caches, never from
events, so a relist or an outage never removes an endpoint that still exists
(tested against the real API server).

The pure parts take plain dicts: addresses in :mod:`fleetgate.router.k8s_addresses`,
the join into targets and plans in :mod:`fleetgate.router.k8s_targets`, the watch
cache in :mod:`fleetgate.router.k8s_watchcache`.
:class:`~fleetgate.router.membership.FleetMembership` is the only code that mutates
the fleet and it removes only endpoints it added, so static ``pools`` keep working
alongside.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import httpx

from fleetgate.router.config import ConfigError
from fleetgate.router.k8s_addresses import (
    LABEL_POOL,
    ObjKey,
    addresses_from_pod,
    addresses_from_slice,
    draining_pods,
)
from fleetgate.router.k8s_targets import (
    KubernetesDiscoveryConfig,
    Plan,
    Target,
    desired_targets,
    plan,
    standby_services,
)
from fleetgate.router.k8s_watch import ApiAccess, Reflector, load_access, resource_path
from fleetgate.router.membership import FleetMembership
from fleetgate.router.scheduling.types import EndpointId
from fleetgate.router.state import Standby

if TYPE_CHECKING:
    from starlette.applications import Starlette

log = logging.getLogger("fleetgate.router.discovery")


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
        """The autoscaled InferenceServices, as the fleet's standby models."""
        known = standby_services(
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
