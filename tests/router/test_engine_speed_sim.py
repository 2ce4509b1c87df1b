"""Engine speed end to end: emulated vLLM + TensorRT-LLM, the router's own scrapes.

We test these aspects:
* the router's pollers learn each engine's decode speed from the real exposition
  path (vLLM ``/metrics`` ITL histogram, TRT ``/prometheus/metrics`` TPOT histogram),
  and the slower emulated engine reads as slower;
* with speeds known and engines idle, ``x-fleetgate-priority`` > 0 requests go to
  the fast engine, < 0 to the slow one, and the decision names ``engine-speed``.
All servers bind 127.0.0.1 and are stopped by their context managers.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from routerkit import router_config, serve

from fleetgate.router.app import build_router
from fleetgate.router.config import parse_config
from fleetgate.router.scheduling.types import EndpointView
from fleetgate.sim import EngineSpec, run_fleet

MODEL = "m"
SLOW_FIXED_S = 0.010  # vLLM step overhead 10 ms against the "test" profile's 1 ms


@contextlib.asynccontextmanager
async def mixed_rig(classes: bool = False) -> AsyncIterator[tuple[str, Any, dict[str, str]]]:
    specs = [
        EngineSpec(kind="vllm", overrides={"fixed_s": SLOW_FIXED_S, "queue_policy": "priority"}),
        EngineSpec(kind="trtllm", overrides={"queue_policy": "priority"}),
    ]
    async with run_fleet(specs, "127.0.0.1", 0, model=MODEL) as fleet:
        backends = [(e.kind, e.url) for e in fleet.engines]
        sections: dict[str, Any] = {"priority": {}} if classes else {}
        app = build_router(router_config(backends, **sections))
        async with serve(app) as url:
            engines = {e.id: e.engine for e in app.state.router.fleet}
            yield url, app, engines


def views(app: Any) -> list[EndpointView]:
    services = app.state.router
    return services.fleet.views((), [], services.clock())


async def until_speeds_known(app: Any, c: httpx.AsyncClient, url: str) -> dict[str, float]:
    """Send rounds of short requests to both engines until both speeds are learned."""
    for round_ in range(20):
        known = {v.engine: v.decode_s_per_token for v in views(app)}
        if all(s is not None for s in known.values()):
            return {k: s for k, s in known.items() if s is not None}
        body = {"model": MODEL, "max_tokens": 12, "ignore_eos": True}
        replies = await asyncio.gather(
            *(
                c.post(url + "/v1/completions", json={**body, "prompt": f"r{round_} q{i}"})
                for i in range(16)
            )
        )
        assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
        await asyncio.sleep(0.2)  # a few scrapes (interval 0.05 s)
    raise AssertionError(f"speeds never learned: {known}")


@pytest.mark.parametrize("classes", [False, True], ids=["immediate", "class-queue"])
async def test_router_learns_speeds_and_routes_urgent_to_fast_batch_to_slow(classes: bool) -> None:
    """Class names (critical level 8, batch level -5) mean the same with immediate
    admission (no ``priority:`` section) and with the class queue."""
    header = {5: "critical", -5: "batch"}
    async with mixed_rig(classes) as (url, app, engines), httpx.AsyncClient(timeout=30) as c:
        speeds = await until_speeds_known(app, c, url)
        # Well outside the scorer's 15% dead band. Batching and wall-clock noise narrow
        # the modelled 10x step-overhead gap: three runs measured 4.6x-5.4x.
        assert speeds["vllm"] > 1.5 * speeds["trtllm"], speeds
        assert 0 < speeds["trtllm"] < 0.05, speeds

        served: dict[int, list[str]] = {5: [], -5: []}
        for i in range(6):
            level = 5 if i % 2 == 0 else -5
            resp = await c.post(
                url + "/v1/completions",
                json={"model": MODEL, "prompt": f"x{i}", "max_tokens": 2},
                headers={"x-fleetgate-priority": header[level]},
            )
            assert resp.status_code == 200, resp.text
            await asyncio.sleep(0.15)  # let the engine's finish show in the next scrape
            served[level].append(engines[resp.headers["x-fleetgate-endpoint"]])
        assert served[5] == ["trtllm"] * 3, served
        assert served[-5] == ["vllm"] * 3, served
        text = (await c.get(url + "/metrics")).text
        assert 'decided_by="scorer:engine-speed"' in text
        exported = {
            line.split('engine="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("fleetgate_endpoint_decode_seconds_per_token{")
        }
        assert set(exported) == {"vllm", "trtllm"}, exported
        assert exported["vllm"] > exported["trtllm"] > 0, exported


async def test_a_fresh_trtllm_1_0_engine_is_not_starved_by_idle_vllm() -> None:
    """TensorRT-LLM 1.0's load source drains iteration stats: an engine that has not
    served yet drains ``[]``. That read used to be "all unknown", which the scheduler
    priced as a nearly full KV cache, so idle vLLM engines always won and the TRT
    engine never served, so it stayed unknown (the mixed autoscale benchmark's static
    pool: 0 of 367 requests). Now a first empty drain reads idle, and idle with no KV
    figure reads as an empty cache."""
    specs = [EngineSpec(kind="vllm"), EngineSpec(kind="vllm"),
             EngineSpec(kind="trtllm", version="1.0.0")]  # fmt: skip
    async with run_fleet(specs, "127.0.0.1", 0, model=MODEL) as fleet:
        cfg = router_config([(e.kind, e.url) for e in fleet.engines]).model_dump()
        for b in cfg["pools"][0]["backends"]:
            if b["engine"] == "trtllm":
                b["version"] = "1.0.0"  # its load source: the drained iteration stats
        app = build_router(parse_config(cfg))
        async with serve(app) as url, httpx.AsyncClient(timeout=30) as c:
            engines = {e.id: e.engine for e in app.state.router.fleet}
            trt = next(e for e in app.state.router.fleet if e.engine == "trtllm")
            assert trt.adapter.metrics_sources[0].name == "iteration-stats"
            for _ in range(100):  # its first scrape: a fresh, empty drain
                if trt.snapshot is not None:
                    break
                await asyncio.sleep(0.05)
            assert trt.snapshot is not None and trt.snapshot.running == 0
            served: dict[str, int] = {}
            for i in range(24):  # one at a time: every engine idle at each pick
                r = await c.post(
                    url + "/v1/completions",
                    json={"model": MODEL, "prompt": f"question {i} " * 3, "max_tokens": 2},
                )
                assert r.status_code == 200, r.text
                kind = engines[r.headers["x-fleetgate-endpoint"]]
                served[kind] = served.get(kind, 0) + 1
            assert served.get("trtllm", 0) >= 3, served
