"""The scheduling plugins: filters, scorers and the picker (GIE style).

Contracts (``style-anchors.md`` §5):

* A **filter** returns the endpoints it keeps. A *soft* filter that would keep
  none is skipped (its judgement rests on estimates, e.g. prompt length from
  characters), so the engine answers the request itself.
* A **scorer** returns a score in [0, 1] per endpoint; the pipeline clamps it
  and applies the weight, which lives outside the scorer (``WeightedScorer``).
* The **picker** orders the scored endpoints; equal totals are broken by an
  injected, seeded ``random.Random``.

Every plugin is small, synchronous and pure: it reads frozen views only.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Mapping, Sequence
from typing import Protocol

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

    def order(
        self, scored: Sequence[ScoredEndpoint], rng: random.Random
    ) -> tuple[list[ScoredEndpoint], bool]:
        """Endpoints best first, and whether a random tie-break decided the first."""
        ...


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


@dataclasses.dataclass(frozen=True, slots=True)
class PrefixAffinityScorer:
    """Longest believed prefix match scores high; a new prefix goes by rendezvous.

    * Some endpoint holds part of the prompt: score = matched / total chunks.
    * None does: the first endpoint in rendezvous order (of the prompt's first
      chunk) scores 1, so every router replica picks the same engine.
    * Either way an endpoint over the load bound (or with a full batch while
      another engine has a free slot) scores 0: the request spills
      to the next best, which then holds the prefix too (the router records
      it), so a hot prefix spreads instead of hot-spotting one engine.
    * A prompt shorter than one chunk has nothing to reuse: all score 0.
    """

    load_bound: float = 0.25
    slack_requests: float = 2.0
    queue_work: float = 1.0
    """Affinity never sends a request to queue (work >= this) while another engine
    is below it: waiting behind a full batch costs more than a cache miss."""
    name: str = "prefix-affinity"

    def score(
        self, request: RequestView, endpoints: Sequence[EndpointView]
    ) -> dict[EndpointId, float]:
        if request.chunks <= 0 or not endpoints:
            return {e.id: 0.0 for e in endpoints}
        mean = sum(e.load.work for e in endpoints) / len(endpoints)
        bound, slack = self.load_bound, self.slack_requests
        room = min(e.load.work for e in endpoints) < self.queue_work
        ok = {
            e.id: not over_bound(e, mean, bound, slack)
            and not (room and e.load.work >= self.queue_work)
            for e in endpoints
        }
        if any(e.prefix_match for e in endpoints):
            return {
                e.id: (min(1.0, e.prefix_match / request.chunks) if ok[e.id] else 0.0)
                for e in endpoints
            }
        scores = {e.id: 0.0 for e in endpoints}
        for e in sorted(endpoints, key=lambda v: v.rendezvous_rank):
            if ok[e.id]:
                scores[e.id] = 1.0
                break
        return scores


# ---------------------------------------------------------------------- picker


@dataclasses.dataclass(frozen=True, slots=True)
class MaxScorePicker:
    """Highest total first; endpoints tied (within ``epsilon``) are shuffled by ``rng``."""

    epsilon: float = 1e-9
    name: str = "max-score"

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
