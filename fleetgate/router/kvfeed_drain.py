"""TensorRT-LLM's buffered KV events (``http-drain``): ``POST`` the engine's path every
``kv_events.drain_interval_s``; reading removes the events, so there is no replay (see
:mod:`fleetgate.router.kvfeed`)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import httpx

from fleetgate.engines.base import KvEventsDecodeError
from fleetgate.router.config import KvEventsSection
from fleetgate.router.kvfeed_base import Broken, Feed
from fleetgate.router.metrics import RouterMetrics
from fleetgate.router.scheduling.kvindex import KvIndex
from fleetgate.router.state import Endpoint

log = logging.getLogger("fleetgate.router.kvfeed")


class DrainFeed(Feed):
    """TensorRT-LLM's ``POST /kv_cache_events`` (reading drains the engine's buffer)."""

    def __init__(
        self,
        e: Endpoint,
        index: KvIndex,
        metrics: RouterMetrics,
        clock: Callable[[], float],
        config: KvEventsSection,
        client: httpx.AsyncClient,
    ) -> None:
        super().__init__(e, index, metrics, clock, config)
        kv = e.kv_events
        assert kv is not None and kv.transport == "http-drain" and kv.path is not None
        self.client = client
        self.url = e.url + kv.path

    async def run(self) -> None:
        self.state("syncing", "first drain")
        delay = self.config.drain_interval_s
        while True:
            try:
                await self.drain()
                delay = self.config.drain_interval_s
            except Broken as err:
                self.state("broken", str(err))
                delay = min(max(delay * 2, 0.25), self.config.retry_max_s)
            await asyncio.sleep(delay)

    async def drain(self) -> None:
        """One ``POST``: apply what it returns."""
        try:
            resp = await self.client.post(self.url, timeout=self.config.replay_timeout_s)
        except httpx.HTTPError as err:
            # the engine may have answered (and dropped its events) before the error
            self._lost(f"drain failed: {err!r}")
            raise Broken(f"POST {self.url}: {err!r}") from None
        if resp.status_code != 200:
            raise Broken(f"POST {self.url}: HTTP {resp.status_code}")
        try:
            batches = self.decode([resp.content])
        except KvEventsDecodeError:
            self._lost("undecodable drain")
            self.in_sync()
            return
        for batch in batches:
            self.offer(batch, replayed=False, replayable=False)
        self.e.kv_feed.verified_at = self.clock()
        if self.seq.last is None and self.seq.complete:
            # nothing seen yet: a fresh engine's first event is its "created"; an empty
            # drain may also mean another reader took them
            self.state("syncing", "no event yet")
        else:
            self.in_sync()

    def _lost(self, why: str) -> None:
        """Drained events are gone for good: the entries can no longer be trusted."""
        self.index.clear(self.e.id)
        self.seq.accept_gap(self.seq.needed)
        log.warning("endpoint %s: %s: KV entries cleared, view partial", self.e.id, why)
