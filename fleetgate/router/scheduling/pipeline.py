"""The scheduling cycle: filters -> weighted scorers -> picker, and why it chose.

``Pipeline.schedule`` is pure: frozen views in, a :class:`Decision` out. The
decision carries the full ranking (the retry order), the reason exported as
``fleetgate_decisions_total{reason}`` and the plugin that decided:

* ``filter:<name>``  only one endpoint survived; ``<name>`` cut the last rival.
* ``scorer:<name>``  the scorer with the largest weighted lead of the winner
  over the runner-up.
* ``picker:tie-break`` totals were equal and the seeded random picked
  (``max-score`` picker).
* ``picker:round-robin`` the ``round-robin`` picker took its turn (scores are
  still computed and recorded in ``Decision.scored``, but do not decide).

The pipeline itself holds no state and uses no clock or I/O. The picker is the
one plugin that may hold state (the round-robin cursor); it is built per
router app by :func:`default_pipeline`, so two apps never share a cursor.

Reasons: ``affinity-hit`` (the pick holds the longest believed prefix, in tokens:
the exact view where an endpoint's KV-event feed is live, the approximate one
elsewhere; ``Decision.cache_source`` says which applied to the pick),
``cold`` (no endpoint holds any of it; the pick is one of the first
``cold_choices`` rendezvous candidates), ``spill`` (the affinity target or
every rendezvous candidate was passed over, normally for the load bound),
``fallback`` (nothing to reuse: the prompt is shorter than one chunk and no exact
block is held anywhere; load alone decided),
``single`` (one candidate).
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence

from fleetgate.router.scheduling.plugins.base import (
    Filter,
    Picker,
    PickerName,
    WeightedScorer,
)
from fleetgate.router.scheduling.plugins.engine_speed import EngineSpeedScorer
from fleetgate.router.scheduling.plugins.filters import (
    ContextFitsFilter,
    HealthyFilter,
    NotDrainingFilter,
    NotEjectedFilter,
    ServesModelFilter,
)
from fleetgate.router.scheduling.plugins.kv_headroom import KvHeadroomScorer
from fleetgate.router.scheduling.plugins.load_scorer import LoadScorer
from fleetgate.router.scheduling.plugins.max_score import MaxScorePicker
from fleetgate.router.scheduling.plugins.prefix_affinity import (
    PrefixAffinityScorer,
    cache_source,
    cached_tokens,
    may_reuse,
)
from fleetgate.router.scheduling.plugins.round_robin import RoundRobinPicker
from fleetgate.router.scheduling.types import (
    Decision,
    DecisionReason,
    EndpointId,
    EndpointView,
    RequestView,
    ScoredEndpoint,
)


class NoEndpointError(Exception):
    """No endpoint survived the filters; ``filter`` names the one that emptied the set."""

    def __init__(self, filter_name: str) -> None:
        super().__init__(f"no endpoint left after filter {filter_name!r}")
        self.filter_name = filter_name


@dataclasses.dataclass(frozen=True, slots=True)
class Pipeline:
    filters: tuple[Filter, ...]
    scorers: tuple[WeightedScorer, ...]
    picker: Picker

    def __post_init__(self) -> None:
        names = [f.name for f in self.filters] + [s.scorer.name for s in self.scorers]
        if len(set(names)) != len(names):
            raise ValueError(f"plugin names must be unique: {names}")

    def eligible(
        self, request: RequestView, endpoints: Sequence[EndpointView]
    ) -> list[EndpointView]:
        """The endpoints that may serve ``request`` at all: the hard filters only.

        Admission asks this before it decides whether a pool is saturated, so the
        router has one definition of "can serve" (healthy, not ejected, serves the
        model); soft filters and scores come later, in :meth:`schedule`.
        """
        candidates = list(endpoints)
        for f in self.filters:
            if f.soft:
                continue
            candidates = f.filter(request, candidates)
            if not candidates:
                break
        return candidates

    def schedule(
        self, request: RequestView, endpoints: Sequence[EndpointView], rng: random.Random
    ) -> Decision:
        candidates = list(endpoints)
        removed: list[tuple[str, EndpointId]] = []
        last_cut = "none"
        if not candidates:
            raise NoEndpointError("none")
        for f in self.filters:
            kept = f.filter(request, candidates)
            if not kept:
                if f.soft:
                    continue
                raise NoEndpointError(f.name)
            if len(kept) < len(candidates):
                kept_ids = {e.id for e in kept}
                removed += [(f.name, e.id) for e in candidates if e.id not in kept_ids]
                last_cut = f.name
            candidates = kept

        raw: dict[str, dict[EndpointId, float]] = {}
        for ws in self.scorers:
            got = ws.scorer.score(request, candidates)
            raw[ws.scorer.name] = {e.id: _clamp(got.get(e.id, 0.0)) for e in candidates}
        scored = [
            ScoredEndpoint(
                id=e.id,
                total=sum(ws.weight * raw[ws.scorer.name][e.id] for ws in self.scorers),
                scores=tuple((ws.scorer.name, raw[ws.scorer.name][e.id]) for ws in self.scorers),
            )
            for e in candidates
        ]
        ordered, picker_decided = self.picker.order(scored, rng)
        winner = ordered[0]
        if len(ordered) == 1:
            decided_by = f"filter:{last_cut}"
        elif picker_decided:
            decided_by = self.picker.decided_by
        else:
            decided_by = self._lead(winner, ordered[1])
        by_id = {e.id: e for e in candidates}
        pick = by_id[winner.id]
        return Decision(
            ranking=tuple(s.id for s in ordered),
            reason=_reason(request, pick, candidates, self._cold_choices()),
            decided_by=decided_by,
            scored=tuple(ordered),
            filtered_out=tuple(removed),
            predicted_cached_chunks=pick.prefix_match,
            predicted_cached_tokens=cached_tokens(request, pick),
            cache_source=cache_source(pick),
        )

    def _cold_choices(self) -> int | None:
        for ws in self.scorers:
            if isinstance(ws.scorer, PrefixAffinityScorer):
                return ws.scorer.cold_choices
        return 1

    def _lead(self, winner: ScoredEndpoint, runner_up: ScoredEndpoint) -> str:
        best_name, best_lead = "none", float("-inf")
        w = dict(winner.scores)
        r = dict(runner_up.scores)
        for ws in self.scorers:
            lead = ws.weight * (w[ws.scorer.name] - r[ws.scorer.name])
            if lead > best_lead:
                best_name, best_lead = ws.scorer.name, lead
        return f"scorer:{best_name}"


def _clamp(value: float) -> float:
    if value != value:  # NaN never wins
        return 0.0
    return min(1.0, max(0.0, value))


def _reason(
    request: RequestView,
    pick: EndpointView,
    candidates: Sequence[EndpointView],
    cold_choices: int | None = 1,
) -> DecisionReason:
    if len(candidates) == 1:
        return "single"
    if not may_reuse(request, candidates):
        return "fallback"
    cached = {e.id: cached_tokens(request, e) for e in candidates}
    best = max(cached.values())
    if best > 0:
        return "affinity-hit" if cached[pick.id] == best else "spill"
    if cold_choices is None:
        return "cold"
    first = sorted(candidates, key=lambda e: e.rendezvous_rank)[: max(1, cold_choices)]
    return "cold" if any(pick.id == e.id for e in first) else "spill"


@dataclasses.dataclass(frozen=True, slots=True)
class PipelineWeights:
    """Scorer weights (router config ``scheduling.weights``; docs/router.md).

    ``speed`` 1.0: the engine-speed scorer moves an urgent request by at most
    ``1 - q`` (0.43 for an engine twice as slow), which the load scorer (weight 2,
    ``1 / (1 + work)``) outweighs once the faster engine carries about a quarter
    batch more work, and a prefix hit (weight 3) always outweighs: speed steers
    between otherwise similar choices and never piles urgent work into a queue.
    """

    prefix: float = 3.0
    load: float = 2.0
    kv: float = 1.0
    speed: float = 1.0


def make_picker(name: PickerName) -> Picker:
    """The picker a ``scheduling.picker`` value names (a fresh instance each call)."""
    if name == "max-score":
        return MaxScorePicker()
    if name == "round-robin":
        return RoundRobinPicker()
    raise ValueError(f"unknown picker {name!r}; known: max-score, round-robin")


def default_pipeline(
    weights: PipelineWeights = PipelineWeights(),
    *,
    load_bound: float = 0.25,
    slack_requests: float = 2.0,
    queue_work: float = 1.0,
    context_margin: float = 0.5,
    picker: PickerName = "max-score",
    cold_choices: int | None = 1,
    prefill_slack: float | None = 0.25,
    prefill_slack_tokens: int = 512,
    bound_tokens: int | None = None,
    queue_ratio: float | None = 1.5,
    spill_prefill_weight: float = 1.0,
) -> Pipeline:
    """The registered in-tree plugins, in order (one place to read them all).

    ``picker`` names the picker (``scheduling.picker``); each call builds a
    fresh instance, so a round-robin cursor belongs to one pipeline only.
    """
    return Pipeline(
        filters=(
            HealthyFilter(),
            NotEjectedFilter(),
            NotDrainingFilter(),
            ServesModelFilter(),
            ContextFitsFilter(margin=context_margin),
        ),
        scorers=(
            WeightedScorer(
                PrefixAffinityScorer(
                    load_bound,
                    slack_requests,
                    queue_work,
                    cold_choices,
                    prefill_slack,
                    prefill_slack_tokens,
                    bound_tokens,
                    queue_ratio,
                    spill_prefill_weight,
                ),
                weights.prefix,
            ),
            WeightedScorer(LoadScorer(), weights.load),
            WeightedScorer(KvHeadroomScorer(), weights.kv),
            WeightedScorer(EngineSpeedScorer(), weights.speed),
        ),
        picker=make_picker(picker),
    )
