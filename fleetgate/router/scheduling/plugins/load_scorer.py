"""The ``load`` scorer: prefer the engine with the least work (``LoadEstimate.work``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from fleetgate.router.scheduling.types import EndpointId, EndpointView, RequestView


@dataclasses.dataclass(frozen=True, slots=True)
class LoadScorer:
    """``1 / (1 + work)``: 1 for an idle engine, 0.5 at one full batch of work."""

    name: str = "load"

    def score(
        self, request: RequestView, endpoints: Sequence[EndpointView]
    ) -> dict[EndpointId, float]:
        return {e.id: 1.0 / (1.0 + max(0.0, e.load.work)) for e in endpoints}
