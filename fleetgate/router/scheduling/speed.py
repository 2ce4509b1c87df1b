"""Each engine's decode speed (seconds per output token), learned from its scrapes.

Engines export a decode-latency histogram whose ``_sum``/``_count`` the adapters put
into ``LoadSnapshot.decode_seconds_sum``/``decode_observations`` (vLLM's
``inter_token_latency_seconds``, TensorRT-LLM's ``time_per_output_token_seconds`` or
its iteration stats; see the adapters' docstrings). Over any interval the ratio of
the two deltas is the mean seconds per output token the engine delivered. The
router keeps one :class:`DecodeSpeed` per endpoint and feeds it every successful
scrape (``fleetgate.router.state.Endpoint.scraped``); the scheduling view carries the
result as ``EndpointView.decode_s_per_token`` for the ``engine-speed`` scorer.

Update rule, for each scrape with both counters known:

* **Baseline.** The first scrape (or the first after a restart) only records the
  counters; no delta exists yet.
* **Counter reset** (either counter went down: the engine restarted) or a change of
  metrics source: start over, the estimate becomes unknown and the new counters
  are the baseline. A restarted engine may run a different configuration.
* **Too few observations.** While fewer than ``min_observations`` new observations
  accumulated since the baseline, nothing changes and the baseline is kept, so a
  quiet engine's deltas add up over several scrapes instead of being dropped (a
  delta of one or two tokens is mostly noise).
* **Sample.** Otherwise ``sample = delta_sum / delta_observations`` and the baseline
  moves to this scrape. The estimate is an exponentially weighted moving average
  in *time*: ``estimate += alpha x (sample - estimate)`` with
  ``alpha = max(1 - 2^(-dt / half_life_s), 1 / (n + 1))``, where ``dt`` is the time
  the sample covers (since the previous baseline) and ``n`` the samples taken so
  far. The ``1 / (n + 1)`` floor makes the first samples a plain running mean (the
  first one is taken as is), so one noisy early delta does not stick for a whole
  half-life; after that a sample's weight depends on the time it covers, not on
  how often the router scrapes.

A scrape without the counters (Triton, an old engine, a failed parse upstream)
changes nothing: the last estimate stays, since an engine's speed is a property of
its hardware and configuration, not of the moment.

Pure: times come from ``LoadSnapshot.scraped_at`` (the injected clock), no I/O.
"""

from __future__ import annotations

import dataclasses
import math

from fleetgate.engines.base import LoadSnapshot

#: Default half-life of the speed average, in seconds of covered time. Long against
#: the 0.2 s scrape interval so that load-driven ITL swings (a batch filling up)
#: average out, short against a benchmark or a deployment's life so a slowed engine
#: is noticed within tens of seconds.
HALF_LIFE_S = 10.0
#: Default minimum new observations (tokens for vLLM, finished requests for
#: TensorRT-LLM's Prometheus histogram) before a delta becomes a sample.
MIN_OBSERVATIONS = 8.0


@dataclasses.dataclass(frozen=True, slots=True)
class SpeedParams:
    half_life_s: float = HALF_LIFE_S
    min_observations: float = MIN_OBSERVATIONS

    def __post_init__(self) -> None:
        if not self.half_life_s > 0:
            raise ValueError(f"half_life_s must be > 0, got {self.half_life_s!r}")
        if not self.min_observations >= 1:
            raise ValueError(f"min_observations must be >= 1, got {self.min_observations!r}")


@dataclasses.dataclass(frozen=True, slots=True)
class DecodeSpeed:
    """The smoothed decode speed of one endpoint and the baseline of its next delta."""

    params: SpeedParams = SpeedParams()
    seconds_per_token: float | None = None
    """The estimate; None until the first sample (and after a counter reset)."""
    samples: int = 0
    """Samples averaged into the estimate since the last start-over."""
    base_sum: float | None = None
    base_observations: float | None = None
    base_at: float = 0.0
    base_source: str = ""

    def update(self, snap: LoadSnapshot) -> DecodeSpeed:
        """The state after one successful scrape (see the module docstring)."""
        total, count = snap.decode_seconds_sum, snap.decode_observations
        if total is None or count is None or not math.isfinite(total + count):
            return self
        if (
            self.base_sum is None
            or self.base_observations is None
            or snap.source != self.base_source
            or total < self.base_sum
            or count < self.base_observations
        ):
            return DecodeSpeed(
                params=self.params,
                base_sum=total,
                base_observations=count,
                base_at=snap.scraped_at,
                base_source=snap.source,
            )
        observed = count - self.base_observations
        dt = snap.scraped_at - self.base_at
        if observed < self.params.min_observations or dt <= 0:
            return self
        sample = (total - self.base_sum) / observed
        if self.seconds_per_token is None:
            estimate = sample
        else:
            alpha = max(1.0 - 0.5 ** (dt / self.params.half_life_s), 1.0 / (self.samples + 1))
            estimate = self.seconds_per_token + alpha * (sample - self.seconds_per_token)
        return dataclasses.replace(
            self,
            seconds_per_token=estimate,
            samples=self.samples + 1,
            base_sum=total,
            base_observations=count,
            base_at=snap.scraped_at,
        )
