"""How often to scrape one endpoint's ``/metrics``: only as often as decisions need it.

A scrape is paid by the engine (its API-server process renders the whole
exposition: ~59 kB for a real vLLM 0.32) once per router replica per interval.
What the router reads from it is load (running, waiting, KV use, speed) and,
without KV events, nothing about the cache beyond restart detection. With a
``live`` KV-event feed the cache state comes by events, and every prefill or
newly filled block on the engine (whoever sent the request, another router
replica included) shows up as an event. So the interval is chosen per
endpoint, at every tick of the poller, from what the router knows now:

* ``base_s`` (``scrape.interval_s``): the feed is not ``live``, the last scrape
  failed or there is none, or the endpoint is **near saturation** (anything
  waiting, KV use ``>= near_kv``, or running + waiting + dispatched since the
  scrape ``>= near_load x`` its capacity). Near saturation the priority
  admission and the load bound decide on these figures; they get the freshest.
* ``idle_s`` (``scrape.idle_interval_with_events_s``): the feed is ``live``
  and the endpoint is **quiet**: its last scrape showed nothing running or
  waiting, this router has nothing in flight there and dispatched nothing
  since, and no KV event arrived since the scrape (no prefill, no decode block
  filled, by anyone). The idle scrape is then confirmed by the live, silent
  feed, and :func:`fresh_extension` lets the load estimate trust it that long.
* ``busy_s`` (``scrape.interval_with_events_s``): otherwise (live feed, work
  on the engine, far from saturation). The router's own counts cover its
  own traffic between scrapes (``scheduling.load``), and the default equals
  ``scheduling.fresh_for_s`` so the load confidence never decays between two
  scrapes.

The poller ticks every ``base_s`` and scrapes when the time since the last
attempt reaches :func:`interval`, so a quiet endpoint that gets work is
scraped at most ``base_s`` later, exactly as before.

Known gap: a request from another replica whose whole prompt is already
cached stores no block until its decode fills one (``block_size`` tokens);
until then a quiet endpoint keeps its idle interval.

Pure: plain values in, seconds out; no clock (the caller passes ages).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, slots=True)
class ScrapePace:
    base_s: float = 0.2
    busy_s: float | None = 0.5
    """Live feed, endpoint busy but not near saturation. None: ``base_s`` always."""
    idle_s: float | None = 1.5
    """Live feed, endpoint quiet. None: as ``busy_s``."""
    near_kv: float = 0.7
    near_load: float = 0.75

    def __post_init__(self) -> None:
        if self.base_s <= 0:
            raise ValueError(f"base_s must be > 0, got {self.base_s}")
        if self.busy_s is not None and self.busy_s < self.base_s:
            raise ValueError(f"busy_s {self.busy_s} is shorter than base_s {self.base_s}")
        low = self.busy_s if self.busy_s is not None else self.base_s
        if self.idle_s is not None and self.idle_s < low:
            raise ValueError(f"idle_s {self.idle_s} is shorter than {low}")
        if not 0 < self.near_kv <= 1 or not 0 < self.near_load <= 1:
            raise ValueError("near_kv and near_load must be in (0, 1]")


@dataclasses.dataclass(frozen=True, slots=True)
class PaceInputs:
    """What the router knows of one endpoint when it decides whether to scrape."""

    feed_live: bool
    scraped_ok: bool
    """A scrape has landed and the latest attempt did not fail."""
    events_since_scrape: bool
    """A KV-event batch was applied after the last successful scrape."""
    in_flight: int = 0
    dispatched_since_scrape: int = 0
    running: int | None = None
    waiting: int | None = None
    kv_usage: float | None = None
    capacity: int | None = None


def near_saturation(i: PaceInputs, pace: ScrapePace) -> bool:
    if (i.waiting or 0) > 0:
        return True
    if i.kv_usage is not None and i.kv_usage >= pace.near_kv:
        return True
    if i.capacity:
        load = max(i.in_flight, (i.running or 0) + (i.waiting or 0) + i.dispatched_since_scrape)
        return load >= pace.near_load * i.capacity
    return False


def quiet(i: PaceInputs) -> bool:
    """Live feed, nothing on the engine at the scrape, nothing of ours since, no events."""
    return (
        scraped_idle(i)
        and not i.events_since_scrape
        and i.in_flight == 0
        and i.dispatched_since_scrape == 0
    )


def interval(i: PaceInputs, pace: ScrapePace) -> float:
    """Seconds between two scrapes of this endpoint in its present state."""
    if not i.feed_live or not i.scraped_ok or pace.busy_s is None:
        return pace.base_s
    if near_saturation(i, pace):
        return pace.base_s
    if quiet(i) and pace.idle_s is not None:
        return pace.idle_s
    return pace.busy_s


def due(i: PaceInputs, pace: ScrapePace, since_attempt_s: float) -> bool:
    """Scrape now? ``since_attempt_s``: seconds since the last attempt (inf: never)."""
    return since_attempt_s >= interval(i, pace)


def scraped_idle(i: PaceInputs) -> bool:
    """Live feed, and the last scrape (which did not fail) showed nothing running or waiting."""
    return i.feed_live and i.scraped_ok and i.running == 0 and (i.waiting or 0) == 0


def fresh_extension(i: PaceInputs, pace: ScrapePace, fresh_for: float) -> float:
    """Seconds to add to the load estimate's ``fresh_for`` (and ``stale_after``) for
    this endpoint, so an idle endpoint scraped at ``idle_s`` does not decay towards
    "full" after ``fresh_for`` and push work away from idle engines.

    It applies while the feed is live and the last scrape showed the engine idle.
    What changed since is either this router's own traffic (counted exactly in the
    load estimate) or someone else's, which arrives as KV events, ends the quiet
    state and brings the next scrape within one tick (``base_s``): the window in
    which foreign load is unseen is the same one tick as without events.
    """
    if not scraped_idle(i) or pace.busy_s is None or pace.idle_s is None:
        return 0.0
    return max(0.0, pace.idle_s + pace.base_s - fresh_for)
