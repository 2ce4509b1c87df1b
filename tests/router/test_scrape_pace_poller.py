"""The scrape-interval rule wired into the poller and the load estimate (fake clock,
fake getter serving a recorded vLLM 0.32 exposition of an idle engine).

A live KV-event feed stretches an idle endpoint's interval to
``idle_interval_with_events_s``; a dispatch or a KV event since the scrape brings it
back to ``interval_with_events_s``; no live feed keeps ``interval_s``. While the live
feed confirms the idle scrape, the load estimate keeps full confidence in it.
"""

from __future__ import annotations

import pytest
from recordings import VLLM_032
from routerkit import router_config

from fleetgate.router.app import build_fleet
from fleetgate.router.client import make_client
from fleetgate.router.metrics import RouterMetrics
from fleetgate.router.poller import Poller

IDLE_EXPOSITION = (VLLM_032 / "metrics_a_after_start.prom.txt").read_bytes()


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class Getter:
    def __init__(self) -> None:
        self.urls: list[str] = []

    async def get(self, url: str, within_s: float) -> tuple[int, bytes]:
        self.urls.append(url)
        return 200, IDLE_EXPOSITION


@pytest.fixture
async def setup() -> tuple[Poller, Clock]:
    config = router_config([("vllm", "http://127.0.0.1:1")], scrape={"interval_s": 0.2})
    fleet = build_fleet(config)
    clock = Clock()
    client = make_client(test_mode=True, max_connections=1, connect_timeout=1, read_timeout=1)
    await client.aclose()  # never used: the fake getter answers
    return Poller(fleet, client, config, RouterMetrics(), clock, getter=Getter()), clock


async def test_live_idle_endpoint_waits_the_idle_interval(setup: tuple[Poller, Clock]) -> None:
    poller, clock = setup
    (e,) = poller.fleet
    e.kv_feed.set("live", clock.t)
    await poller.scrape(e)
    assert e.snapshot is not None and e.snapshot.running == 0 and not e.snapshot.waiting
    clock.t += 1.4
    assert not poller.scrape_due(e)
    clock.t += 0.1
    assert poller.scrape_due(e)


async def test_activity_since_the_scrape_shortens_it(setup: tuple[Poller, Clock]) -> None:
    poller, clock = setup
    (e,) = poller.fleet
    e.kv_feed.set("live", clock.t)
    await poller.scrape(e)
    clock.t += 0.5
    assert not poller.scrape_due(e)
    e.kv_feed.last_event_at = clock.t  # a block stored by someone's prefill
    assert poller.scrape_due(e)
    await poller.scrape(e)
    clock.t += 0.5
    e.dispatch(kv_tokens=64)  # this router sent work there
    assert poller.scrape_due(e)


async def test_without_a_live_feed_the_interval_is_the_base(setup: tuple[Poller, Clock]) -> None:
    poller, clock = setup
    (e,) = poller.fleet
    await poller.scrape(e)
    clock.t += 0.19
    assert not poller.scrape_due(e)
    clock.t += 0.01
    assert poller.scrape_due(e)


async def test_live_feed_keeps_an_idle_scrape_trusted(setup: tuple[Poller, Clock]) -> None:
    poller, clock = setup
    (e,) = poller.fleet
    fleet = poller.fleet
    await poller.scrape(e)
    clock.t += 1.5  # the idle interval: the next scrape is only now due
    (without,) = fleet.views((), [], clock.t)
    # no feed: 1.5 s old, 1 s past fresh_for of a 2.5 s decay, towards "full"
    assert without.load.confidence == pytest.approx(0.6)
    e.kv_feed.set("live", clock.t)
    (live,) = fleet.views((), [], clock.t)
    assert live.load.confidence == 1.0
    assert live.load.work < without.load.work
    # Its own dispatch is counted exactly on top, and keeps the scrape trusted.
    e.dispatch(kv_tokens=64)
    (ours,) = fleet.views((), [], clock.t)
    assert ours.load.confidence == 1.0 and ours.load.requests == 1
    # The extension lasts until the idle scrape is due plus one tick, no longer.
    clock.t += 1.2
    (old,) = fleet.views((), [], clock.t)
    assert old.load.confidence == pytest.approx(1.0 - (2.7 - 1.7) / 2.5)
