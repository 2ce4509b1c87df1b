"""The poller's real loop against emulated engines: with live KV-event feeds an idle
endpoint is scraped at the idle interval, and work sent there brings the next scrape
forward to the busy interval.

Two emulated vLLM engines with KV events (in-process, real ZeroMQ, real HTTP), one
router app; scrapes are counted by the router's own ``fleetgate_scrape_duration_seconds``.
"""

from __future__ import annotations

import asyncio

from fleetgate.router.app import build_router
from fleetgate.router.state import Fleet
from fleetgate.sim.fleet import run_fleet

from .test_exact_routing import sched_config
from .test_kvfeed import metric, until, vllm_spec


async def test_idle_endpoints_with_live_feeds_are_scraped_less() -> None:
    async with run_fleet([vllm_spec(), vllm_spec()], time_scale=0) as sim:
        cfg = sched_config(list(sim.engines))
        doc = cfg.model_dump(mode="json", exclude_none=True)
        doc["scrape"] = {"interval_s": 0.1, "interval_with_events_s": 0.3,
                         "idle_interval_with_events_s": 1.0}  # fmt: skip
        app = build_router(type(cfg).model_validate(doc))
        fleet: Fleet = app.state.router.fleet
        metrics = app.state.router.metrics

        def scrapes() -> float:
            return metric(metrics, "fleetgate_scrape_duration_seconds_count")

        async with app.router.lifespan_context(app):
            await until(lambda: all(e.kv_feed.state == "live" for e in fleet), "feeds live")
            await asyncio.sleep(1.2)  # past the start-up scrapes
            before = scrapes()
            await asyncio.sleep(2.0)
            idle = scrapes() - before
            # 2 endpoints x 2 s at 1.0 s (+ one tick): 4 at most; at 0.1 s it would be ~40
            assert 2 <= idle <= 6, idle

            # Just after an idle scrape of one endpoint, send it work: the next scrape
            # comes at the busy interval (0.3 s), not the idle one (1.0 s).
            e = next(iter(fleet))
            assert e.snapshot is not None
            last = e.snapshot.scraped_at
            await until(
                lambda: e.snapshot is not None and e.snapshot.scraped_at != last,
                "an idle scrape",
                within=1.5,
            )
            assert e.snapshot is not None
            idle_at = e.snapshot.scraped_at
            e.dispatch(kv_tokens=64)  # what the request path records for a request sent
            await until(
                lambda: e.snapshot is not None and e.snapshot.scraped_at != idle_at,
                "the next scrape",
                within=1.5,
            )
            assert e.snapshot is not None
            gap = e.snapshot.scraped_at - idle_at
            assert gap < 0.6, gap
            e.finish(kv_tokens=64)
