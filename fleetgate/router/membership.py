"""Discovered endpoints in and out of the fleet, each with its scrape and health loops.

:class:`FleetMembership` is the only code that mutates the fleet for discovery,
and it removes only endpoints it added, so static ``pools`` keep working
alongside. It takes :class:`~fleetgate.router.k8s_targets.Target` s (what
:mod:`fleetgate.router.discovery_k8s` wants the fleet to hold) and knows nothing
of the Kubernetes API.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from fleetgate.engines import get_adapter
from fleetgate.router.k8s_targets import Target
from fleetgate.router.scheduling.types import EndpointId
from fleetgate.router.served import EngineVersionError, adapter_for
from fleetgate.router.state import Endpoint, Fleet, Standby

if TYPE_CHECKING:
    from fleetgate.router.kvfeed import KvFeeds
    from fleetgate.router.poller import Poller

log = logging.getLogger("fleetgate.router.discovery")


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
            schedulers=t.schedulers,
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
        """Make the discovered autoscaled models ``wanted``; the router YAML's own
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
                log.info("model %s held for while no replica serves (%s, pool %s, "
                         "minReplicas %s)", model, sb.source, sb.pool,
                         sb.min_replicas)  # fmt: skip
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
