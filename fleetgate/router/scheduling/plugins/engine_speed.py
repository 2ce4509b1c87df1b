"""The ``engine-speed`` scorer: urgent work to the fastest engines, batch work to the slower."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from fleetgate.router.scheduling.types import EndpointId, EndpointView, RequestView

#: The score every endpoint gets when speed should not steer (see EngineSpeedScorer).
NEUTRAL_SPEED_SCORE = 0.5


@dataclasses.dataclass(frozen=True, slots=True)
class EngineSpeedScorer:
    """Urgent requests to the fastest engines, batch requests to the slower ones.

    In a fleet of mixed engines, latency-critical work goes to the faster engines
    and throughput work is kept off them. Speed is ``EndpointView.decode_s_per_token``
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
