"""What every KV-event subscriber shares, whatever its transport: the sequencer, the
index, feed status and metrics (:class:`Feed`); the transports are
:mod:`fleetgate.router.kvfeed` (ZeroMQ, and the task manager) and
:mod:`fleetgate.router.kvfeed_drain` (HTTP drain)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from fleetgate.engines.base import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEventBatch,
    KvEventsDecodeError,
)
from fleetgate.router.config import KvEventsSection
from fleetgate.router.metrics import RouterMetrics
from fleetgate.router.scheduling.kvindex import KvIndex
from fleetgate.router.scheduling.kvsync import FeedSequencer, FeedState, KvFeedStatus, Step
from fleetgate.router.state import Endpoint

log = logging.getLogger("fleetgate.router.kvfeed")

_KINDS = {BlockStored: "stored", BlockRemoved: "removed", AllBlocksCleared: "cleared"}


class Gap(Exception):
    """Batches are missing (or a message did not decode): replay from ``needed``."""


class Broken(Exception):
    """The stream cannot be read right now (one line why)."""


_USABLE: dict[FeedState, int] = {"broken": 0, "off": 1, "syncing": 2, "partial": 3, "live": 4}


class RankGroup:
    """The feeds of an endpoint's attention-DP ranks (one stream and one KV cache each).

    Each rank's feed keeps its own status; the endpoint's, which the scorer and the
    metrics read, is the least usable rank's (``live`` only when every rank is), its
    heartbeat the oldest rank's."""

    def __init__(self, e: Endpoint, ranks: int) -> None:
        self.e = e
        self.statuses = [KvFeedStatus() for _ in range(ranks)]
        e.kv_rank_feeds = tuple(self.statuses)

    def merge(self, now: float) -> None:
        worst = min(range(len(self.statuses)), key=lambda r: _USABLE[self.statuses[r].state])
        w = self.statuses[worst]
        out = self.e.kv_feed
        out.set(w.state, now, None if w.reason is None else f"rank {worst}: {w.reason}")
        seen = [s.last_event_at for s in self.statuses if s.last_event_at is not None]
        out.last_event_at = max(seen) if seen else None
        verified = [s.verified_at for s in self.statuses]
        out.verified_at = None if None in verified else min(v for v in verified if v is not None)
        out.last_seq = self.statuses[0].last_seq


class Feed:
    """What both transports share: the sequencer, the index, status and metrics. One
    feed reads one stream: an endpoint's, or one attention-DP rank's (``group``)."""

    def __init__(
        self,
        e: Endpoint,
        index: KvIndex,
        metrics: RouterMetrics,
        clock: Callable[[], float],
        config: KvEventsSection,
        rank: int = 0,
        group: RankGroup | None = None,
    ) -> None:
        self.e = e
        self.index = index
        self.metrics = metrics
        self.clock = clock
        self.config = config
        self.seq = FeedSequencer()
        self.lv = (e.id, e.engine)
        self.rank = rank
        self.group = group
        self.status = e.kv_feed if group is None else group.statuses[rank]
        self.name = f"{e.id} rank {rank}" if group is not None else str(e.id)

    def _merge(self) -> None:
        if self.group is not None:
            self.group.merge(self.clock())

    def state(self, state: FeedState, reason: str | None = None) -> None:
        if self.status.set(state, self.clock(), reason):
            if state in ("live", "syncing"):
                log.info(
                    "endpoint %s: KV feed %s%s", self.name, state, f" ({reason})" * bool(reason)
                )
            else:
                log.warning("endpoint %s: KV feed %s: %s", self.name, state, reason)
        self._merge()

    def verified(self) -> None:
        """The feed has everything the engine published (a replay ended, a drain answered)."""
        self.status.verified_at = self.clock()
        self._merge()

    def in_sync(self) -> None:
        if self.seq.complete:
            self.state("live")
        else:
            self.state("partial", "batches from before the feed started (or lost) are missing")

    def decode(self, frames: Sequence[bytes]) -> tuple[KvEventBatch, ...]:
        try:
            return self.e.adapter.decode_kv_events(frames)
        except KvEventsDecodeError as err:
            self.metrics.child(self.metrics.kv_decode_errors, *self.lv).inc()
            log.warning("endpoint %s: undecodable KV event message: %s", self.name, err)
            raise

    def forget(self) -> None:
        """What this stream reported can no longer be trusted: drop its entries."""
        self.index.clear(self.e.id, self.rank)

    def restart(self) -> None:
        """The engine (or this rank's publisher) restarted: forget its blocks, expect a
        stream from 0."""
        log.info(
            "endpoint %s: KV event stream restarted (engine restart): entries cleared", self.name
        )
        self.forget()
        self.seq.restart()
        self.metrics.child(self.metrics.kv_restarts, *self.lv).inc()

    def apply(self, batch: KvEventBatch) -> None:
        self.index.apply(self.e.id, batch, self.rank)
        self.seq.applied(batch.seq, batch.ts)
        status = self.status
        status.last_event_at = status.verified_at = self.clock()
        if batch.seq is not None:
            status.last_seq = batch.seq
        for event in batch.events:
            self.metrics.child(self.metrics.kv_events, *self.lv, _KINDS[type(event)]).inc()
            if isinstance(event, AllBlocksCleared) and event.medium in (None, "GPU", "gpu"):
                self.seq.cleared()
        self._merge()

    def offer(self, batch: KvEventBatch, *, replayed: bool, replayable: bool) -> None:
        """One batch from the stream: apply, skip, or raise :class:`Gap`."""
        step = self.seq.classify(batch.seq, batch.ts)
        if step is Step.RESTART:
            self.restart()
            step = self.seq.classify(batch.seq, batch.ts)
        if step is Step.DUPLICATE:
            return
        if step is Step.GAP:
            if replayable and not replayed:
                raise Gap(f"seq {batch.seq} after {self.seq.last}")
            # a replay that starts later than asked, or a stream without replay
            assert batch.seq is not None
            log.warning("endpoint %s: KV batches %d..%d lost for good; view partial",
                        self.name, self.seq.needed, batch.seq - 1)  # fmt: skip
            self.seq.accept_gap(batch.seq)
        self.apply(batch)
