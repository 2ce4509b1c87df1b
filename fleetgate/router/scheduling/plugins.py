"""The scheduling plugins: filters, scorers and the picker (GIE style).

Contracts (``style-anchors.md`` §5):

* A **filter** returns the endpoints it keeps. A *soft* filter that would keep
  none is skipped (its judgement rests on estimates, e.g. prompt length from
  characters), so the engine answers the request itself.
* A **scorer** returns a score in [0, 1] per endpoint; the pipeline clamps it
  and applies the weight, which lives outside the scorer (``WeightedScorer``).
* The **picker** orders the scored endpoints. ``max-score`` (the default)
  ranks by total and breaks equal totals with an injected, seeded
  ``random.Random``; ``round-robin`` ignores the scores and takes turns
  (:class:`RoundRobinPicker`, the "round robin" ablation of issue #7).

Every filter and scorer is small, synchronous and pure: it reads frozen views
only. The one stateful plugin is :class:`RoundRobinPicker`, whose cursor (a
pick counter per endpoint id) lives in the instance, so it is per router app;
it uses no clock, no randomness and no I/O.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Mapping, Sequence
from typing import Literal, Protocol

from fleetgate.router.scheduling.load import kv_tokens_needed
from fleetgate.router.scheduling.types import (
    EndpointId,
    EndpointView,
    RequestView,
    ScoredEndpoint,
)


class Filter(Protocol):
    @property
    def name(self) -> str: ...
    @property
    def soft(self) -> bool: ...

    def filter(
        self, request: RequestView, endpoints: Sequence[EndpointView]
    ) -> list[EndpointView]: ...


class Scorer(Protocol):
    @property
    def name(self) -> str: ...

    def score(
        self, request: RequestView, endpoints: Sequence[EndpointView]
    ) -> Mapping[EndpointId, float]: ...


class Picker(Protocol):
    @property
    def name(self) -> str: ...
    @property
    def decided_by(self) -> str:
        """``Decision.decided_by`` when ``order`` says the picker itself chose the first."""
        ...

    def order(
        self, scored: Sequence[ScoredEndpoint], rng: random.Random
    ) -> tuple[list[ScoredEndpoint], bool]:
        """Endpoints best first, and whether the picker (not the scores) decided the first.

        Called exactly once per scheduling cycle; a stateful picker may count it as a pick.
        """
        ...


#: The ``scheduling.picker`` values of the router config.
PickerName = Literal["max-score", "round-robin"]


@dataclasses.dataclass(frozen=True, slots=True)
class WeightedScorer:
    scorer: Scorer
    weight: float

    def __post_init__(self) -> None:
        if self.weight < 0:
            raise ValueError(f"scorer {self.scorer.name!r}: weight must be >= 0")


# --------------------------------------------------------------------- filters


@dataclasses.dataclass(frozen=True, slots=True)
class HealthyFilter:
    """Drops endpoints whose /health probe fails."""

    name: str = "healthy"
    soft: bool = False

    def filter(self, request: RequestView, endpoints: Sequence[EndpointView]) -> list[EndpointView]:
        return [e for e in endpoints if e.healthy]


@dataclasses.dataclass(frozen=True, slots=True)
class NotEjectedFilter:
    """Drops endpoints under passive outlier ejection."""

    name: str = "not-ejected"
    soft: bool = False

    def filter(self, request: RequestView, endpoints: Sequence[EndpointView]) -> list[EndpointView]:
        return [e for e in endpoints if not e.ejected]


@dataclasses.dataclass(frozen=True, slots=True)
class ServesModelFilter:
    """Keeps endpoints whose ``/v1/models`` lists the requested model."""

    name: str = "serves-model"
    soft: bool = False

    def filter(self, request: RequestView, endpoints: Sequence[EndpointView]) -> list[EndpointView]:
        return [e for e in endpoints if request.model in e.models]


@dataclasses.dataclass(frozen=True, slots=True)
class ContextFitsFilter:
    """Keeps endpoints whose context holds the prompt (estimated; soft).

    ``margin`` scales the character-based estimate down, so only prompts that
    clearly cannot fit are steered away from short-context engines.
    """

    margin: float = 0.5
    name: str = "context-fits"
    soft: bool = True

    def filter(self, request: RequestView, endpoints: Sequence[EndpointView]) -> list[EndpointView]:
        need = request.prompt_tokens * self.margin
        return [e for e in endpoints if e.max_model_len is None or need <= e.max_model_len]


# --------------------------------------------------------------------- scorers


@dataclasses.dataclass(frozen=True, slots=True)
class LoadScorer:
    """``1 / (1 + work)``: 1 for an idle engine, 0.5 at one full batch of work."""

    name: str = "load"

    def score(
        self, request: RequestView, endpoints: Sequence[EndpointView]
    ) -> dict[EndpointId, float]:
        return {e.id: 1.0 / (1.0 + max(0.0, e.load.work)) for e in endpoints}


@dataclasses.dataclass(frozen=True, slots=True)
class KvHeadroomScorer:
    """KV fraction left AFTER this request, counted in the engine's own blocks.

    0 when the request's blocks (prompt + max output, rounded up to the
    engine's block size) do not fit in the estimated free KV.
    """

    name: str = "kv-headroom"

    def score(
        self, request: RequestView, endpoints: Sequence[EndpointView]
    ) -> dict[EndpointId, float]:
        out: dict[EndpointId, float] = {}
        for e in endpoints:
            load = e.load
            if load.free_kv_tokens is not None and load.total_kv_tokens:
                need = kv_tokens_needed(request.prompt_tokens, request.max_tokens, load.block_size)
                left = load.free_kv_tokens - need
                out[e.id] = 0.0 if left < 0 else left / load.total_kv_tokens
            else:
                out[e.id] = 1.0 - load.kv_fraction
        return out


def over_bound(e: EndpointView, mean_work: float, bound: float, slack_requests: float) -> bool:
    """Consistent hashing with bounded loads: is ``e`` past ``(1 + bound) x mean``?

    ``slack_requests`` (in requests, converted to that engine's work units)
    keeps a nearly idle pool from spilling on every single request.
    """
    return e.load.work > (1.0 + bound) * mean_work + slack_requests / max(1, e.load.capacity)


def uncached_tokens(request: RequestView, matched_chunks: int) -> int:
    """Prompt tokens to prefill where ``matched_chunks`` leading chunks are cached."""
    if request.chunks <= 0:
        return request.prompt_tokens
    cached = min(1.0, max(0, matched_chunks) / request.chunks)
    return round(request.prompt_tokens * (1.0 - cached))


def prefill_cost(request: RequestView, e: EndpointView) -> int:
    """Prompt tokens to prefill on ``e`` before this request's first token: the router's
    own backlog there (requests without a first token yet) plus this prompt's uncached part.

    On an engine that spends its steps on prompt tokens (a long-document prefill costs
    tens of milliseconds per thousand tokens, a decode step a few), the first token
    arrives after roughly this many prompt tokens: a cost in the engine's own currency,
    comparable between a warm engine with a queue and a cold idle one.
    """
    return max(0, e.pending_prefill_tokens) + uncached_tokens(request, e.prefix_match)


@dataclasses.dataclass(frozen=True, slots=True)
class PrefixAffinityScorer:
    """Longest believed prefix match scores high; a new prefix goes where the least
    prefill is queued (by rendezvous among near-equals).

    * Some eligible endpoint holds part of the prompt: score = matched / total chunks.
    * None does (a cold prefix, or every holder is ineligible below): among the
      eligible endpoints whose prefill cost is within ``prefill_slack_tokens`` of the
      least (a new prefix is prefilled in full, so it goes where the fewest prompt
      tokens are queued), the first ``cold_choices`` in rendezvous order (of the
      prompt's first chunk) score 1, 0.99, ... and the load and KV scorers choose
      between them: the power of d choices; ``None`` = all of them, so the least
      loaded wins. With d = 1 router replicas that share no state agree on the engine
      whenever their backlogs agree (plain rendezvous when no prefill is queued);
      with more, one router balances new prefixes better, but replicas would place
      the same new prefix on different engines (a second copy), hence
      ``scheduling.router_replicas``. A spilled hot prefix goes the same way
      (consistent hashing with bounded loads), and the engine it lands on then holds
      the prefix too (the router records it), so it spreads instead of hot-spotting
      one engine.
    * Eligible means all of:

      - bounded load: work at most ``(1 + bound) x`` the pool mean (plus
        ``slack_requests``), where ``bound`` is ``load_bound`` scaled by what this
        endpoint's cache saves (:meth:`bounds`, when ``bound_tokens`` is set): a
        spill costs a second prefill of the prompt part only this endpoint holds,
        so a 3000-token document may keep its engine up to the full bound while a
        conversation whose few hundred history tokens are the only difference
        spills near the mean;
      - no queueing: not a full batch (work >= ``queue_work``) while another
        endpoint has a free slot;
      - prefill cost (:func:`prefill_cost`, when ``prefill_slack`` is not None): at
        most ``(1 + prefill_slack) x`` the cheapest endpoint's plus
        ``prefill_slack_tokens``. A cache hit saves this prompt's prefill; it is
        worth nothing if the warm engine has more prompt tokens queued than
        recomputing the whole prompt on an idle engine would cost. The slack
        keeps the hit (and the copy it avoids) when the two are close.

    * A prompt shorter than one chunk has nothing to reuse: all score 0.
    """

    load_bound: float = 0.25
    slack_requests: float = 2.0
    queue_work: float = 1.0
    """Affinity never sends a request to queue (work >= this) while another engine
    is below it: waiting behind a full batch costs more than a cache miss."""
    cold_choices: int | None = 1
    """Rendezvous candidates a cold prefix may go to (the load scorers pick among them);
    None = every eligible endpoint."""
    prefill_slack: float | None = 0.25
    """Relative slack of the prefill-cost rule; None turns the rule off."""
    prefill_slack_tokens: int = 512
    bound_tokens: int | None = None
    """Saved prompt tokens at which an endpoint gets the full ``load_bound``; fewer
    scale it down linearly (:meth:`bounds`). None: ``load_bound`` everywhere."""
    name: str = "prefix-affinity"

    def score(
        self, request: RequestView, endpoints: Sequence[EndpointView]
    ) -> dict[EndpointId, float]:
        if request.chunks <= 0 or not endpoints:
            return {e.id: 0.0 for e in endpoints}
        ok = self.eligible(request, endpoints)
        if any(e.prefix_match and ok[e.id] for e in endpoints):
            return {
                e.id: (min(1.0, e.prefix_match / request.chunks) if ok[e.id] else 0.0)
                for e in endpoints
            }
        if self.prefill_slack is not None and any(ok.values()):
            costs = {e.id: prefill_cost(request, e) for e in endpoints if ok[e.id]}
            near = min(costs.values()) + self.prefill_slack_tokens
            ok = {eid: eid in costs and costs[eid] <= near for eid in ok}
        scores = {e.id: 0.0 for e in endpoints}
        chosen = 0
        limit = len(endpoints) if self.cold_choices is None else self.cold_choices
        for e in sorted(endpoints, key=lambda v: v.rendezvous_rank):
            if chosen >= limit:
                break
            if ok[e.id]:
                # 1, 0.99, ...: rendezvous order breaks ties (replicas agree when
                # loads are level); about one request of load difference overrides it
                scores[e.id] = 1.0 - 0.01 * chosen
                chosen += 1
        return scores

    def eligible(
        self, request: RequestView, endpoints: Sequence[EndpointView]
    ) -> dict[EndpointId, bool]:
        """Which endpoints may get affinity credit (the three rules in the class doc)."""
        mean = sum(e.load.work for e in endpoints) / len(endpoints)
        bounds, slack = self.bounds(request, endpoints), self.slack_requests
        room = min(e.load.work for e in endpoints) < self.queue_work
        ok = {
            e.id: not over_bound(e, mean, bounds[e.id], slack)
            and not (room and e.load.work >= self.queue_work)
            for e in endpoints
        }
        if self.prefill_slack is not None:
            costs = {e.id: prefill_cost(request, e) for e in endpoints}
            limit = (1.0 + self.prefill_slack) * min(costs.values()) + self.prefill_slack_tokens
            ok = {eid: fine and costs[eid] <= limit for eid, fine in ok.items()}
        return ok

    def bounds(
        self, request: RequestView, endpoints: Sequence[EndpointView]
    ) -> dict[EndpointId, float]:
        """Each endpoint's load bound: ``load_bound x min(1, saved / bound_tokens)``.

        ``saved`` = prompt tokens this endpoint holds beyond the endpoint that holds
        the least of this prompt, i.e. the prefill a spill would repeat. A system
        prompt every engine holds saves nothing against the others, so it earns no
        extra load; a long document only one engine holds earns the full bound.
        """
        if not self.bound_tokens:
            return {e.id: self.load_bound for e in endpoints}
        uncached = {e.id: uncached_tokens(request, e.prefix_match) for e in endpoints}
        most = max(uncached.values())
        return {
            eid: self.load_bound * min(1.0, (most - u) / self.bound_tokens)
            for eid, u in uncached.items()
        }


#: The score every endpoint gets when speed should not steer (see EngineSpeedScorer).
NEUTRAL_SPEED_SCORE = 0.5


@dataclasses.dataclass(frozen=True, slots=True)
class EngineSpeedScorer:
    """Urgent requests to the fastest engines, batch requests to the slower ones.

    Issue #7's mixed-engine goal: route latency-critical work to the faster engines
    and keep them free of throughput work. Speed is ``EndpointView.decode_s_per_token``
    (seconds per output token, smoothed from each engine's decode-latency histogram:
    ``fleetgate.router.scheduling.speed``). With ``f`` the fastest known speed among
    the candidates and ``s`` an endpoint's speed, its relative quickness is

        q = min(1, (1 + dead_band) x f / s)        (1 within the band, -> 0 when slower)

    * ``priority > 0`` (urgent classes): score ``q``; an engine twice as slow as the
      fastest scores ``1.15 / 2 = 0.575``, four times as slow ``0.29``.
    * ``priority < 0`` (batch): score ``1 - q``: the fastest score 0, slower engines
      more, so throughput work fills the slow engines and leaves the fast ones free.
    * Endpoints of unknown speed (no metric, or no sample yet) score the mean of the
      known endpoints' scores for this request: neither preferred nor avoided.
    * Neutral (every endpoint :data:`NEUTRAL_SPEED_SCORE`): ``priority == 0``; no
      endpoint's speed known; or every known speed within the dead band of the
      fastest (``max s <= (1 + dead_band) x f``). A homogeneous fleet, or one without
      the metric, therefore ranks exactly as without this scorer (a constant added
      to every total changes no order), and load-driven inter-token-latency noise
      between identical engines (a fuller batch decodes a little slower) does not
      steer traffic unless it exceeds the band.

    Pure: reads the views only.
    """

    dead_band: float = 0.15
    name: str = "engine-speed"

    def __post_init__(self) -> None:
        if not self.dead_band >= 0:
            raise ValueError(f"dead_band must be >= 0, got {self.dead_band!r}")

    def score(
        self, request: RequestView, endpoints: Sequence[EndpointView]
    ) -> dict[EndpointId, float]:
        neutral = {e.id: NEUTRAL_SPEED_SCORE for e in endpoints}
        if request.priority == 0:
            return neutral
        known = {
            e.id: e.decode_s_per_token
            for e in endpoints
            if e.decode_s_per_token is not None
            and math.isfinite(e.decode_s_per_token)
            and e.decode_s_per_token > 0
        }
        if not known:
            return neutral
        band = 1.0 + self.dead_band
        fastest = min(known.values())
        if max(known.values()) <= band * fastest:
            return neutral
        quick = {eid: min(1.0, band * fastest / s) for eid, s in known.items()}
        scores = quick if request.priority > 0 else {eid: 1.0 - q for eid, q in quick.items()}
        unknown = sum(scores.values()) / len(scores)
        return {e.id: scores.get(e.id, unknown) for e in endpoints}


# ---------------------------------------------------------------------- picker


@dataclasses.dataclass(frozen=True, slots=True)
class MaxScorePicker:
    """Highest total first; endpoints tied (within ``epsilon``) are shuffled by ``rng``."""

    epsilon: float = 1e-9
    name: str = "max-score"
    decided_by: str = "picker:tie-break"

    def order(
        self, scored: Sequence[ScoredEndpoint], rng: random.Random
    ) -> tuple[list[ScoredEndpoint], bool]:
        if not scored:
            return [], False
        items = list(scored)
        rng.shuffle(items)
        items.sort(key=lambda s: s.total, reverse=True)
        tied = sum(1 for s in items if items[0].total - s.total <= self.epsilon)
        return items, tied > 1


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


def make_picker(name: PickerName) -> Picker:
    """The picker a ``scheduling.picker`` value names (a fresh instance each call)."""
    if name == "max-score":
        return MaxScorePicker()
    if name == "round-robin":
        return RoundRobinPicker()
    raise ValueError(f"unknown picker {name!r}; known: max-score, round-robin")
