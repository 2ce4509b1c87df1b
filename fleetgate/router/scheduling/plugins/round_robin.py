"""The ``round-robin`` picker: takes turns over the candidates and ignores the scores
(the baseline that prefix- and load-aware scheduling is measured against)."""

from __future__ import annotations

import random
from collections.abc import Sequence

from fleetgate.router.scheduling.types import EndpointId, ScoredEndpoint


class RoundRobinPicker:
    """Takes turns over the endpoints that survived the filters, ignoring scores.

    The cursor is "when was each endpoint last picked": a counter stamp per
    endpoint id, kept in this instance (one picker per router app, so one
    cursor per app; no globals). Each ``order`` call is one pick: the
    candidates are ranked by last-pick stamp, oldest first, never-picked
    endpoints before all others and ties broken by endpoint id; the first is
    the pick and gets the next stamp. The rest of the ranking (the retry
    order) is the same turn order, so a retry goes to whoever is next in line.

    Invariants:

    * A fixed candidate set is cycled in endpoint-id order: from a fresh
      picker over ``{a, b, c}`` the picks are ``a b c a b c ...``, and over any
      window of picks two candidates' pick counts differ by at most one.
    * An endpoint that leaves the set (ejected, unhealthy, filtered out, gone
      from discovery) simply is not a candidate; the others keep their turn
      order, nothing is skipped twice and nothing is indexed out of range.
    * An endpoint that (re)joins has the oldest stamp (or none), so it gets
      the very next pick, once, and then queues behind the others: it catches
      up by one turn, never by a burst of the turns it missed.
    * Requests with different candidate sets (models served by different
      endpoints, the admission path's "endpoints with a free slot" subset)
      share the stamps, yet each set still rotates fairly. A single position
      index into "the sorted list" would not give this: with models A on
      {a1, a2} and B on {b1, b2} alternating, "next after the last pick"
      would send every A request to a1 and every B request to b1.
    * Memory is bounded: at most ``max_remembered`` stamps are kept; when
      more endpoint ids have been seen, the oldest stamps are dropped, and a
      dropped endpoint counts as never picked (it was the oldest anyway).

    The router is a single asyncio thread and ``Pipeline.schedule`` is
    synchronous, so picks never interleave.
    """

    __slots__ = ("_last", "_picks", "max_remembered")

    def __init__(self, max_remembered: int = 4096) -> None:
        if max_remembered < 1:
            raise ValueError("max_remembered must be >= 1")
        self.max_remembered = max_remembered
        self._last: dict[EndpointId, int] = {}
        self._picks = 0

    @property
    def name(self) -> str:
        return "round-robin"

    @property
    def decided_by(self) -> str:
        return "picker:round-robin"

    def last_picked(self) -> dict[EndpointId, int]:
        """A copy of the cursor: endpoint id -> pick number of its latest pick (1-based)."""
        return dict(self._last)

    def order(
        self, scored: Sequence[ScoredEndpoint], rng: random.Random
    ) -> tuple[list[ScoredEndpoint], bool]:
        if not scored:
            return [], False
        items = sorted(scored, key=lambda s: (self._last.get(s.id, 0), s.id))
        self._picks += 1
        self._last[items[0].id] = self._picks
        if len(self._last) > self.max_remembered:
            keep = sorted(self._last.items(), key=lambda kv: kv[1])[-self.max_remembered :]
            self._last = dict(keep)
        return items, len(items) > 1
