"""What a scheduling plugin is: the Filter, Scorer and Picker Protocols.

* A **filter** returns the endpoints it keeps. A *soft* filter that would keep
  none is skipped (its judgement rests on estimates, e.g. prompt length from
  characters), so the engine answers the request itself.
* A **scorer** returns a score in [0, 1] per endpoint; the pipeline clamps it
  and applies the weight, which lives outside the scorer (:class:`WeightedScorer`).
* A **picker** orders the scored endpoints, best first; the first is the pick
  and the rest are the retry order.

Filters and scorers are small, synchronous and pure: they read the frozen views
of ``scheduling.types`` only, so each is a function of its inputs and is
unit-tested on plain values. A picker may hold state (the round-robin cursor),
never a clock or I/O.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Mapping, Sequence
from typing import Literal, Protocol

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
