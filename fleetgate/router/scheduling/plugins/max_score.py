"""The ``max-score`` picker (the default): highest weighted total first."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence

from fleetgate.router.scheduling.types import ScoredEndpoint


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
