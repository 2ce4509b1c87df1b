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
from fleetgate.router.kvfeed_base import Broken, Feed, RankGroup
from fleetgate.router.metrics import RouterMetrics
from fleetgate.router.scheduling.kvindex import KvIndex
from fleetgate.router.scheduling.kvsync import FeedState
from fleetgate.router.state import Endpoint

log = logging.getLogger("fleetgate.router.kvfeed")


class DrainFeed(Feed):
    """TensorRT-LLM's ``POST /kv_cache_events`` (reading drains the engine's buffer).

    With attention DP (``kv_events.ranks`` > 1) rank 0 gathers every rank's events into
    its buffer, each tagged with its rank and numbered by its rank's own counter: one
    drain is shared out to one :class:`Feed` per rank (own sequencer, own KV cache in
    the index), as if each rank had a stream of its own."""

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
        self.parts: list[Feed] = [self]
        self._told_rank = False
        if kv.ranks > 1:
            group = RankGroup(e, kv.ranks)
            self.parts = [
                Feed(e, index, metrics, clock, config, rank=r, group=group) for r in range(kv.ranks)
            ]

    async def run(self) -> None:
        self._each("syncing", "first drain")
        delay = self.config.drain_interval_s
        while True:
            try:
                await self.drain()
                delay = self.config.drain_interval_s
            except Broken as err:
                self._each("broken", str(err))
                delay = min(max(delay * 2, 0.25), self.config.retry_max_s)
            await asyncio.sleep(delay)

    def _each(self, state: FeedState, reason: str) -> None:
        for part in self.parts:
            part.state(state, reason)

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
            for part in self.parts:
                part.in_sync()
            return
        for batch in batches:
            rank = batch.data_parallel_rank or 0
            if rank >= len(self.parts):
                # more ranks than configured: theirs stay unknown (under-reported, never
                # over); said once, counted always
                self.metrics.child(self.metrics.kv_decode_errors, *self.lv).inc()
                if not self._told_rank:
                    self._told_rank = True
                    log.warning("endpoint %s: KV events of rank %d, but kv_events.ranks is %d: "
                                "ignored", self.e.id, rank, len(self.parts))  # fmt: skip
                continue
            self.parts[rank].offer(batch, replayed=False, replayable=False)
        for part in self.parts:
            part.verified()
            if part.seq.last is None and part.seq.complete:
                # nothing seen yet: a fresh engine's first event is its "created"; an
                # empty drain may also mean another reader took them
                part.state("syncing", "no event yet")
            else:
                part.in_sync()

    def _lost(self, why: str) -> None:
        """Drained events are gone for good: the entries can no longer be trusted."""
        for part in self.parts:
            part.forget()
            part.seq.accept_gap(part.seq.needed)
        log.warning("endpoint %s: %s: KV entries cleared, view partial", self.e.id, why)
