"""Per-endpoint KV-event stream bookkeeping (pure): which batch to apply, skip or replay.

:class:`FeedSequencer` reads each batch's ``seq`` (and the engine's ``ts``) and says
what the subscriber (``fleetgate.router.kvfeed``) must do with it:

* ``APPLY``: the next batch (``last + 1``), or the first ``0`` of a fresh stream, or a
  batch without a ``seq`` (nothing to check);
* ``GAP``: batches are missing (``seq > last + 1``, or a first batch that is not 0):
  ask the replay socket from :attr:`FeedSequencer.needed`; an engine without replay
  (TensorRT-LLM's drain) cannot get them back: :meth:`FeedSequencer.accept_gap`;
* ``DUPLICATE``: a batch already applied (a replayed batch the live socket delivers
  again): same ``seq`` AND same engine timestamp as the one applied;
* ``RESTART``: the stream went backwards (``seq <= last`` that is not a duplicate):
  the engine restarted with a new, empty cache and counts from 0 again. The
  endpoint's entries are cleared before the batch is used.

A restart that does not go backwards (the new engine already counted past ``last``
when the router reconnects) is caught by :meth:`FeedSequencer.same_stream`: after a
reconnect the subscriber replays from ``last`` and compares that batch's timestamp
with the one it applied.

:class:`KvFeedStatus` is what the scorer reads per endpoint (``Endpoint.kv_feed``).
"""

from __future__ import annotations

import dataclasses
import enum
from collections import OrderedDict
from typing import Literal

FeedState = Literal["off", "syncing", "live", "partial", "broken"]
"""``off``: the engine publishes no events (or the feed is stopped). ``syncing``:
connecting, replaying, or a gap is pending. ``live``: every batch since the engine's
cache started is applied: the index holds exactly what the engine holds (up to the
index bound). ``partial``: in sync, but batches from before the router started (or
lost without replay) are missing, so blocks stored then and still resident are not
known: the view under-reports. It turns ``live`` at the next ``AllBlocksCleared``
or engine restart. ``broken``: the stream cannot be read (no connection, replay
unanswered, undecodable messages); retried with backoff."""

FEED_STATES: tuple[FeedState, ...] = ("off", "syncing", "live", "partial", "broken")


class Step(enum.Enum):
    APPLY = "apply"
    GAP = "gap"
    DUPLICATE = "duplicate"
    RESTART = "restart"


class FeedSequencer:
    """The last applied ``seq`` of one endpoint's stream, and the timestamps of recent ones."""

    def __init__(self, history: int = 4096) -> None:
        if history < 1:
            raise ValueError("history must be >= 1")
        self._history = history
        self._ts: OrderedDict[int, float | None] = OrderedDict()
        self.last: int | None = None
        """The last applied ``seq`` (None: nothing applied since start or restart)."""
        self.complete = True
        """Every batch of the engine's stream so far was applied (no gap accepted)."""

    @property
    def needed(self) -> int:
        """The first ``seq`` not applied yet (what a replay request asks for)."""
        return 0 if self.last is None else self.last + 1

    def classify(self, seq: int | None, ts: float | None) -> Step:
        if seq is None:
            return Step.APPLY
        if seq < 0:
            raise ValueError(f"seq must be >= 0, not {seq}")
        if seq == self.needed:
            return Step.APPLY
        if self.last is None or seq > self.last:
            return Step.GAP
        known = self._ts.get(seq, _MISSING)
        if ts is not None and known is not _MISSING and known == ts:
            return Step.DUPLICATE
        return Step.RESTART

    def applied(self, seq: int | None, ts: float | None) -> None:
        """Record that batch ``seq`` (classified ``APPLY``) was applied."""
        if seq is None:
            return
        self.last = seq
        self._ts[seq] = ts
        while len(self._ts) > self._history:
            self._ts.popitem(last=False)

    def restart(self) -> None:
        """The engine restarted: a new stream from 0, nothing of it applied yet."""
        self.last = None
        self._ts.clear()
        self.complete = True

    def accept_gap(self, seq: int) -> None:
        """Go on from ``seq`` without the missing batches (no replay could give them)."""
        self.last = seq - 1 if seq > 0 else None
        self.complete = False

    def cleared(self) -> None:
        """An ``AllBlocksCleared`` was applied: what came before no longer matters."""
        self.complete = True

    def same_stream(self, seq: int, ts: float | None) -> bool:
        """After a reconnect: is replayed batch ``seq`` (with ``ts``) one this feed applied?

        False means another publisher (a restarted engine) now owns the port.
        """
        known = self._ts.get(seq, _MISSING)
        return known is not _MISSING and ts is not None and known == ts


_MISSING = object()


@dataclasses.dataclass(slots=True)
class KvFeedStatus:
    """One endpoint's KV-event feed, as the scorer and the metrics read it."""

    state: FeedState = "off"
    since: float | None = None
    """When ``state`` last changed (router clock)."""
    last_event_at: float | None = None
    """When the last batch was applied (router clock); None before any."""
    verified_at: float | None = None
    """When the feed last confirmed it had everything the engine published: a batch
    applied, a replay ended (also the idle check's), a drain answered (router clock).
    vLLM sends nothing while idle, so this, not ``last_event_at``, is the heartbeat."""
    last_seq: int | None = None
    reason: str | None = None
    """Why the feed is not ``live`` (one line), for logs and debugging."""

    @property
    def exact(self) -> bool:
        """The scorer may use the exact view of this endpoint."""
        return self.state == "live"

    def set(self, state: FeedState, now: float, reason: str | None = None) -> bool:
        """Change state; True when it changed."""
        self.reason = reason
        if state == self.state:
            return False
        self.state = state
        self.since = now
        return True
