"""The scrape-interval rule (``scheduling.scrape_pace``): pure inputs, seconds out."""

from __future__ import annotations

import dataclasses
import math

import pytest

from fleetgate.router.config import RouterConfig, parse_config
from fleetgate.router.scheduling.scrape_pace import (
    PaceInputs,
    ScrapePace,
    due,
    fresh_extension,
    interval,
)

PACE = ScrapePace(base_s=0.2, busy_s=0.5, idle_s=1.5, near_kv=0.7, near_load=0.75)
IDLE = PaceInputs(
    feed_live=True,
    scraped_ok=True,
    events_since_scrape=False,
    running=0,
    waiting=0,
    kv_usage=0.0,
    capacity=8,
)
BUSY = dataclasses.replace(IDLE, running=2, in_flight=2, kv_usage=0.2)


def test_quiet_live_endpoint_is_scraped_at_the_idle_interval() -> None:
    assert interval(IDLE, PACE) == 1.5


def test_busy_live_endpoint_far_from_saturation_is_scraped_at_the_events_interval() -> None:
    assert interval(BUSY, PACE) == 0.5


@pytest.mark.parametrize(
    "change",
    [
        {"feed_live": False},  # no events: the cache and load come by scrape only
        {"scraped_ok": False},  # failing or never scraped
        {"waiting": 1},  # something queued
        {"kv_usage": 0.7},  # KV near full
        {"running": 6},  # 6 of 8 = 0.75 of capacity
        {"dispatched_since_scrape": 4},  # 2 running + 4 sent since: 6 of 8
    ],
)
def test_base_interval_without_a_live_feed_or_near_saturation(change: dict[str, object]) -> None:
    assert interval(dataclasses.replace(BUSY, **change), PACE) == 0.2  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "change",
    [
        {"events_since_scrape": True},  # someone (maybe another replica) prefilled there
        {"in_flight": 1},
        {"dispatched_since_scrape": 1},
        {"running": 1},
    ],
)
def test_any_activity_ends_the_idle_interval(change: dict[str, object]) -> None:
    assert interval(dataclasses.replace(IDLE, **change), PACE) == 0.5  # type: ignore[arg-type]


def test_without_events_interval_the_rule_is_the_old_fixed_interval() -> None:
    fixed = ScrapePace(base_s=0.2, busy_s=None)
    assert interval(IDLE, fixed) == interval(BUSY, fixed) == 0.2


def test_due_counts_from_the_last_attempt() -> None:
    assert not due(IDLE, PACE, 1.4)
    assert due(IDLE, PACE, 1.5)
    assert due(IDLE, PACE, math.inf)  # never attempted
    # the tick after a dispatch: the idle interval no longer holds
    assert due(dataclasses.replace(IDLE, dispatched_since_scrape=1), PACE, 0.6)


def test_fresh_extension_only_while_the_live_feed_confirms_an_idle_scrape() -> None:
    # fresh until the idle scrape is due plus one tick: 1.5 + 0.2 - 0.5
    assert fresh_extension(IDLE, PACE, 0.5) == pytest.approx(1.2)
    # the router's own dispatches since are counted exactly: still fresh
    ours = dataclasses.replace(IDLE, dispatched_since_scrape=1, in_flight=1)
    assert fresh_extension(ours, PACE, 0.5) == pytest.approx(1.2)
    assert fresh_extension(BUSY, PACE, 0.5) == 0.0
    assert fresh_extension(dataclasses.replace(IDLE, feed_live=False), PACE, 0.5) == 0.0
    assert fresh_extension(dataclasses.replace(IDLE, scraped_ok=False), PACE, 0.5) == 0.0
    assert fresh_extension(IDLE, ScrapePace(busy_s=None), 0.5) == 0.0


def test_pace_rejects_intervals_out_of_order() -> None:
    with pytest.raises(ValueError, match="busy_s"):
        ScrapePace(base_s=0.5, busy_s=0.2)
    with pytest.raises(ValueError, match="idle_s"):
        ScrapePace(base_s=0.2, busy_s=1.0, idle_s=0.5)


def test_config_defaults_and_errors() -> None:
    pace = RouterConfig().scrape.pace()
    assert (pace.base_s, pace.busy_s, pace.idle_s) == (0.2, 0.5, 1.5)
    off = parse_config({"scrape": {"interval_with_events_s": None}}).scrape.pace()
    assert interval(IDLE, off) == 0.2
    with pytest.raises(ValueError, match="interval_with_events_s"):
        parse_config({"scrape": {"interval_s": 1.0, "interval_with_events_s": 0.5}})
    with pytest.raises(ValueError, match="max_scrape_age_s"):
        parse_config({"scrape": {"idle_interval_with_events_s": 5.0}})
    ok = parse_config(
        {
            "scrape": {"idle_interval_with_events_s": 5.0},
            "priority": {"saturation": {"max_scrape_age_s": 6.0}},
        }
    )
    assert ok.scrape.pace().idle_s == 5.0
