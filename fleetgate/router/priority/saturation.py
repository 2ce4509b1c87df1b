"""Is a pool saturated? Per-endpoint verdicts from scraped load plus the router's own count.

A pool is *saturated* when every eligible endpoint is over one of its bounds,
so a new request would only queue inside an engine (where fleetgate's priority
order no longer holds). While saturated, requests wait in the router's
:class:`~fleetgate.router.priority.queue.AdmissionQueue` instead.

An endpoint with fresh metrics is **over** when any of these holds:

* ``kv_usage >= kv_usage_max`` (KV cache nearly full: new work would preempt
  inside the engine);
* ``waiting > waiting_max`` (the engine already queues work);
* ``max_running`` is known and the estimated load ``>= max_running +
  waiting_max``. The estimate is the hybrid of scrape and router count: with
  ``in_flight_at_scrape`` known it is ``running + waiting + (in_flight -
  in_flight_at_scrape)``, i.e. the scrape corrected by what the router
  dispatched and saw end since (so a preempted request frees its slot at once,
  not one scrape later); otherwise ``max(running + waiting, in_flight)``. Either
  way a burst cannot overfill an endpoint between two scrapes;
* ``max_in_flight`` is set and ``in_flight >= max_in_flight``.

**A holder's short queue** (``holders``). An endpoint over only by its own queue
(``waiting > waiting_max`` while KV use and slots are under their bounds: the
engine's step budget is spent on a long prefill) stays available to a request
whose prompt prefix it holds: that request starts there a step or a few later
with its prefix cached, whereas held in the router it goes, when a slot frees, to
whichever engine freed, where its prefix is rarely cached. The scheduling pipeline
then weighs the holder against the free endpoints with its own cost model.
Measured (``bench/results/shared-prefix-16-class-queue.md``): with 16 engines and
long shared documents at 70% load, short engine queues behind cold prefills made
every endpoint "over" at once; the router queued nearly every request from then on
and the hit rate fell from 73% to 38%.

**Stale-metrics policy (documented, never "idle").** Metrics older than
``max_scrape_age_s``, never scraped, or missing the KV/queue fields are
*unknown*. An unknown endpoint is treated as saturated unless the router's own
in-flight count for it is below ``unknown_in_flight_floor``: a small trickle
keeps a silent endpoint useful (and produces the traffic that shows whether it
is alive) but a stale endpoint never absorbs a burst. This is the fail-closed
side of the staleness trade-off (stale metrics: trust them and overload, or
distrust them and idle) with a bounded fail-open floor.

Pure: inputs are plain values; ``scrape_age_s`` is computed by the caller from
its injected clock.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

Verdict = Literal["free", "over", "unknown-free", "unknown-over"]


class SaturationThresholds(BaseModel):
    """Configurable bounds (router YAML ``priority.saturation``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kv_usage_max: float = Field(default=0.9, gt=0, le=1)
    waiting_max: int = Field(default=0, ge=0)
    max_scrape_age_s: float = Field(default=2.0, gt=0)
    unknown_in_flight_floor: int = Field(default=1, ge=0)
    max_in_flight: int | None = Field(default=None, ge=1)


@dataclasses.dataclass(frozen=True, slots=True)
class SaturationView:
    """What the saturation check needs to know about one eligible endpoint."""

    endpoint: str
    kv_usage: float | None
    waiting: int | None
    running: int | None
    in_flight: int
    """Requests the router has dispatched there and not yet seen finish."""
    scrape_age_s: float | None
    """Seconds since the last successful scrape; None = never scraped."""
    max_running: int | None = None
    in_flight_at_scrape: int | None = None
    """The router's in-flight count for this endpoint when the scrape was taken."""

    def estimated_load(self) -> int:
        """Requests on the engine now (running + waiting), scrape corrected by the router."""
        scraped = (self.running or 0) + (self.waiting or 0)
        if self.in_flight_at_scrape is not None:
            return max(0, scraped + self.in_flight - self.in_flight_at_scrape, self.in_flight)
        return max(scraped, self.in_flight)


@dataclasses.dataclass(frozen=True, slots=True)
class EndpointVerdict:
    endpoint: str
    verdict: Verdict
    reason: str
    queue_only: bool = False
    """Over only by the engine's own queue (KV use and slots under their bounds)."""

    @property
    def available(self) -> bool:
        return self.verdict in ("free", "unknown-free")


@dataclasses.dataclass(frozen=True, slots=True)
class PoolSaturation:
    saturated: bool
    verdicts: tuple[EndpointVerdict, ...]
    available: tuple[str, ...]
    """Endpoints the request may be dispatched to now (a holder's short queue included)."""


def endpoint_verdict(view: SaturationView, t: SaturationThresholds) -> EndpointVerdict:
    """Classify one endpoint (see the module docstring for the rules)."""
    if t.max_in_flight is not None and view.in_flight >= t.max_in_flight:
        return EndpointVerdict(view.endpoint, "over", f"in_flight {view.in_flight} >= cap")
    stale = view.scrape_age_s is None or view.scrape_age_s > t.max_scrape_age_s
    if stale or view.kv_usage is None or view.waiting is None:
        why = (
            "never scraped"
            if view.scrape_age_s is None
            else f"metrics {view.scrape_age_s:.3f}s old"
            if stale
            else "kv_usage/waiting not reported"
        )
        if view.in_flight < t.unknown_in_flight_floor:
            return EndpointVerdict(
                view.endpoint, "unknown-free", f"{why}; in_flight {view.in_flight} < floor"
            )
        return EndpointVerdict(
            view.endpoint, "unknown-over", f"{why}; in_flight {view.in_flight} >= floor"
        )
    if view.kv_usage >= t.kv_usage_max:
        return EndpointVerdict(view.endpoint, "over", f"kv_usage {view.kv_usage:.3f}")
    if view.max_running is not None:
        load = view.estimated_load()
        if load >= view.max_running + t.waiting_max:
            return EndpointVerdict(
                view.endpoint, "over", f"load {load} >= max_running {view.max_running}"
            )
    if view.waiting > t.waiting_max:
        return EndpointVerdict(view.endpoint, "over", f"waiting {view.waiting}", queue_only=True)
    return EndpointVerdict(view.endpoint, "free", "under all bounds")


def pool_saturation(
    views: Sequence[SaturationView],
    t: SaturationThresholds,
    holders: Callable[[], AbstractSet[str]] | None = None,
) -> PoolSaturation:
    """Saturated iff no eligible endpoint is available to the request (an empty pool is
    saturated). ``holders``: the endpoints holding the request's prompt prefix, which
    stay available to it while over only by their own queue (module docstring); asked
    only when some endpoint is (the lookup is a prefix match)."""
    verdicts = tuple(endpoint_verdict(v, t) for v in views)
    short = {v.endpoint for v in verdicts if v.queue_only}
    open_to_it = short.intersection(holders()) if short and holders is not None else set()
    available = tuple(v.endpoint for v in verdicts if v.available or v.endpoint in open_to_it)
    return PoolSaturation(saturated=not available, verdicts=verdicts, available=available)
