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
from fleetgate.router.scheduling.kvsync import FeedSequencer, FeedState, Step
from fleetgate.router.state import Endpoint

log = logging.getLogger("fleetgate.router.kvfeed")

_KINDS = {BlockStored: "stored", BlockRemoved: "removed", AllBlocksCleared: "cleared"}


class Gap(Exception):
    """Batches are missing (or a message did not decode): replay from ``needed``."""


class Broken(Exception):
    """The stream cannot be read right now (one line why)."""


class Feed:
    """What both transports share: the sequencer, the index, status and metrics."""

    def __init__(
        self,
        e: Endpoint,
        index: KvIndex,
        metrics: RouterMetrics,
        clock: Callable[[], float],
        config: KvEventsSection,
    ) -> None:
        self.e = e
        self.index = index
        self.metrics = metrics
        self.clock = clock
        self.config = config
        self.seq = FeedSequencer()
        self.lv = (e.id, e.engine)

    def state(self, state: FeedState, reason: str | None = None) -> None:
        if self.e.kv_feed.set(state, self.clock(), reason):
            if state in ("live", "syncing"):
                log.info(
                    "endpoint %s: KV feed %s%s", self.e.id, state, f" ({reason})" * bool(reason)
                )
            else:
                log.warning("endpoint %s: KV feed %s: %s", self.e.id, state, reason)

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
            log.warning("endpoint %s: undecodable KV event message: %s", self.e.id, err)
            raise

    def restart(self) -> None:
        """The engine restarted: forget its blocks, expect a stream from 0."""
        log.info(
            "endpoint %s: KV event stream restarted (engine restart): entries cleared", self.e.id
        )
        self.index.clear(self.e.id)
        self.seq.restart()
        self.metrics.child(self.metrics.kv_restarts, *self.lv).inc()

    def apply(self, batch: KvEventBatch) -> None:
        self.index.apply(self.e.id, batch)
        self.seq.applied(batch.seq, batch.ts)
        status = self.e.kv_feed
        status.last_event_at = status.verified_at = self.clock()
        if batch.seq is not None:
            status.last_seq = batch.seq
        for event in batch.events:
            self.metrics.child(self.metrics.kv_events, *self.lv, _KINDS[type(event)]).inc()
            if isinstance(event, AllBlocksCleared) and event.medium in (None, "GPU", "gpu"):
                self.seq.cleared()

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
                        self.e.id, self.seq.needed, batch.seq - 1)  # fmt: skip
            self.seq.accept_gap(batch.seq)
        self.apply(batch)
