"""Saturation: per-endpoint verdicts and the pool rule (stale = unknown, never idle)."""

from __future__ import annotations

from typing import Any

import pytest
from endpoints import loopback_endpoint
from pydantic import ValidationError

from fleetgate.engines.base import LoadSnapshot
from fleetgate.router.priority.saturation import (
    SaturationThresholds,
    SaturationView,
    endpoint_verdict,
    pool_saturation,
)
from fleetgate.router.scheduling.load import LoadParams
from fleetgate.router.scheduling.prefix import PrefixIndex
from fleetgate.router.state import Fleet

T = SaturationThresholds(kv_usage_max=0.8, waiting_max=0, max_scrape_age_s=1.0)


def _view(**kw: Any) -> SaturationView:
    base: dict[str, Any] = {
        "endpoint": "e",
        "kv_usage": 0.1,
        "waiting": 0,
        "running": 1,
        "in_flight": 1,
        "scrape_age_s": 0.1,
        "max_running": 4,
    }
    base.update(kw)
    return SaturationView(**base)


@pytest.mark.parametrize(
    ("view", "verdict", "reason"),
    [
        pytest.param(_view(), "free", "under", id="idle-fresh"),
        pytest.param(_view(kv_usage=0.8), "over", "kv_usage", id="kv-at-bound"),
        pytest.param(_view(kv_usage=0.79), "free", "under", id="kv-below-bound"),
        pytest.param(_view(waiting=1), "over", "waiting", id="engine-queueing"),
        pytest.param(_view(running=4, in_flight=4), "over", "max_running", id="batch-full"),
        pytest.param(_view(running=1, in_flight=4), "over", "max_running", id="burst-since-scrape"),
        pytest.param(_view(running=3, in_flight=3), "free", "under", id="one-slot-left"),
        pytest.param(_view(max_running=None, running=50), "free", "under", id="no-batch-limit"),
        pytest.param(
            _view(scrape_age_s=None, in_flight=0), "unknown-free", "never scraped", id="new-idle"
        ),
        pytest.param(
            _view(scrape_age_s=None, in_flight=1), "unknown-over", "never scraped", id="new-busy"
        ),
        pytest.param(
            _view(scrape_age_s=5.0, kv_usage=0.0, waiting=0, in_flight=3),
            "unknown-over",
            "old",
            id="stale-zeros-are-not-idle",
        ),
        pytest.param(
            _view(scrape_age_s=5.0, in_flight=0), "unknown-free", "old", id="stale-below-floor"
        ),
        pytest.param(
            _view(kv_usage=None, in_flight=2), "unknown-over", "not reported", id="kv-missing"
        ),
        pytest.param(
            _view(waiting=None, in_flight=0), "unknown-free", "not reported", id="queue-missing"
        ),
    ],
)
def test_endpoint_verdict(view: SaturationView, verdict: str, reason: str) -> None:
    got = endpoint_verdict(view, T)
    assert got.verdict == verdict
    assert reason in got.reason
    assert got.available == (verdict in ("free", "unknown-free"))


def test_in_flight_cap_and_floor_and_waiting_bound_are_configurable() -> None:
    t = SaturationThresholds(max_in_flight=2, unknown_in_flight_floor=3, waiting_max=2)
    assert endpoint_verdict(_view(in_flight=2), t).verdict == "over"
    assert endpoint_verdict(_view(scrape_age_s=None, in_flight=1), t).verdict == "unknown-free"
    assert endpoint_verdict(_view(waiting=2, running=1, in_flight=1), t).verdict == "free"
    assert endpoint_verdict(_view(waiting=3), t).verdict == "over"
    t0 = SaturationThresholds(unknown_in_flight_floor=0)
    assert endpoint_verdict(_view(scrape_age_s=None, in_flight=0), t0).verdict == "unknown-over"


@pytest.mark.parametrize(
    ("views", "saturated", "available"),
    [
        pytest.param([], True, (), id="empty-pool-is-saturated"),
        pytest.param(
            [_view(endpoint="a", kv_usage=0.9), _view(endpoint="b", waiting=3)],
            True,
            (),
            id="all-over",
        ),
        pytest.param(
            [_view(endpoint="a", kv_usage=0.9), _view(endpoint="b")], False, ("b",), id="one-free"
        ),
        pytest.param(
            [_view(endpoint="a", scrape_age_s=9.0, in_flight=5), _view(endpoint="b", waiting=1)],
            True,
            (),
            id="stale-busy-counts-as-full",
        ),
        pytest.param(
            [_view(endpoint="a", scrape_age_s=9.0, in_flight=0), _view(endpoint="b", waiting=1)],
            False,
            ("a",),
            id="stale-below-floor-admits",
        ),
    ],
)
def test_pool_saturation(
    views: list[SaturationView], saturated: bool, available: tuple[str, ...]
) -> None:
    got = pool_saturation(views, T)
    assert got.saturated is saturated
    assert got.available == available
    assert len(got.verdicts) == len(views)


@pytest.mark.parametrize(
    "bad",
    [
        {"kv_usage_max": 0},
        {"kv_usage_max": 1.5},
        {"waiting_max": -1},
        {"max_scrape_age_s": 0},
        {"max_in_flight": 0},
        {"nope": 1},
    ],
)
def test_thresholds_validation(bad: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        SaturationThresholds(**bad)


@pytest.mark.parametrize(
    ("running", "waiting", "in_flight", "at_scrape", "load"),
    [
        pytest.param(4, 0, 4, None, 4, id="no-correction"),
        pytest.param(4, 0, 3, 4, 3, id="one-ended-since-scrape"),
        pytest.param(2, 0, 4, 2, 4, id="two-dispatched-since-scrape"),
        pytest.param(4, 0, 1, 1, 4, id="other-clients-count"),
        pytest.param(0, 0, 0, 3, 0, id="never-negative"),
        pytest.param(1, 0, 3, 3, 3, id="own-requests-are-a-floor"),
    ],
)
def test_estimated_load(
    running: int, waiting: int, in_flight: int, at_scrape: int | None, load: int
) -> None:
    view = _view(
        running=running, waiting=waiting, in_flight=in_flight, in_flight_at_scrape=at_scrape
    )
    assert view.estimated_load() == load


def test_preempted_slot_is_free_before_the_next_scrape() -> None:
    # the scrape saw 4 running (all ours); the router cancelled one since
    stale_full = _view(running=4, in_flight=3, in_flight_at_scrape=4)
    assert endpoint_verdict(stale_full, T).verdict == "free"
    assert endpoint_verdict(_view(running=4, in_flight=3), T).verdict == "over"


def test_a_holders_short_queue_stays_available_to_its_own_requests() -> None:
    # every endpoint has one request waiting behind a long prefill, with free slots
    views = [_view(endpoint="a", waiting=1), _view(endpoint="b", waiting=1)]
    assert pool_saturation(views, T).saturated
    got = pool_saturation(views, T, holders=lambda: {"a"})
    assert not got.saturated and got.available == ("a",)
    assert [v.queue_only for v in got.verdicts] == [True, True]


@pytest.mark.parametrize(
    "holder",
    [
        pytest.param(_view(endpoint="a", waiting=1, kv_usage=0.85), id="kv-full"),
        pytest.param(_view(endpoint="a", waiting=1, running=3, in_flight=3), id="slots-full"),
        pytest.param(_view(endpoint="a", waiting=1, scrape_age_s=9.0), id="stale"),
    ],
)
def test_a_holder_over_by_more_than_its_queue_is_not_available(holder: SaturationView) -> None:
    got = pool_saturation([holder, _view(endpoint="b", waiting=1)], T, holders=lambda: {"a"})
    assert got.saturated and got.available == ()
    assert not got.verdicts[0].queue_only


def test_holders_are_asked_only_when_a_short_queue_could_open() -> None:
    asked: list[int] = []

    def holders() -> set[str]:
        asked.append(1)
        return {"a"}

    kv_full = [_view(endpoint="a", kv_usage=0.95), _view(endpoint="b", kv_usage=0.95)]
    assert pool_saturation(kv_full, T, holders).saturated
    assert pool_saturation([_view(endpoint="a")], T, holders).available == ("a",)
    assert asked == []
    assert pool_saturation([_view(endpoint="a", waiting=1)], T, holders).available == ("a",)
    assert asked == [1]


def test_an_attention_dp_replica_is_full_at_its_ranks_limits_not_one_ranks() -> None:
    """TensorRT-LLM reports one rank's maxNumActiveRequests; a 2-rank replica with 6 of
    the router's requests in flight under a reported 4 is not over: it holds 8."""
    verdicts = []
    for schedulers in (1, 2):
        e = loopback_endpoint("trtllm", f"t{schedulers}", 18000, schedulers=schedulers)
        e.scraped(LoadSnapshot(scraped_at=10.0, kv_usage=0.1, running=0, waiting=0, max_running=4))
        for _ in range(6):
            e.dispatch(kv_tokens=16)
        view = Fleet([e], index=PrefixIndex(16), load_params=LoadParams()).saturation_view(e, 10.1)
        assert view.max_running == 4 * schedulers
        verdicts.append(endpoint_verdict(view, T).verdict)
    assert verdicts == ["over", "free"]
