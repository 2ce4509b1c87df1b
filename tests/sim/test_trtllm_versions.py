"""The emulated trtllm-serve follows the release it emulates: strict request
validation, ``priority`` only where the request models have it, the ``trtllm_*`` gauges
set when a request completes (main) and no load gauges before main."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from fleetgate.engines.trtllm import ADAPTER
from fleetgate.engines.trtllm.versions import resolve_version
from fleetgate.sim.fleet import EngineSpec, run_fleet

EXAMPLE_IMAGE = "nvcr.io/nvidia/tensorrt-llm/release:1.0.0"  # examples/trtllm-qwen2.5-7b.yaml


@pytest.mark.parametrize("version", ["1.0.0", "1.2.0rc3", "main"])
async def test_unknown_fields_are_400_and_priority_only_where_accepted(version: str) -> None:
    async with run_fleet([EngineSpec(kind="trtllm", version=version)], model="m") as f:
        async with httpx.AsyncClient(base_url=f.engines[0].url, timeout=10) as c:
            body = {"prompt": "hello", "max_tokens": 2}
            assert (await c.post("/v1/completions", json=body)).status_code == 200
            r = await c.post("/v1/completions", json={**body, "no_such_field": 1})
            assert r.status_code == 400 and "no_such_field" in r.json()["error"]
            r = await c.post("/v1/completions", json={**body, "priority": 0.9})
            accepted = resolve_version(version, None).request_priority
            assert r.status_code == (200 if accepted else 400)
            # what the router's bound adapter adds is always accepted
            fields = ADAPTER.for_version(version).priority_fields(5)
            assert (await c.post("/v1/completions", json={**body, **fields})).status_code == 200


async def test_the_example_release_serves_the_router_fields() -> None:
    line = resolve_version(None, EXAMPLE_IMAGE).line
    async with run_fleet([EngineSpec(kind="trtllm", version="1.0.0")], model="m") as f:
        async with httpx.AsyncClient(base_url=f.engines[0].url, timeout=10) as c:
            req = {
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 3,
                "stream": True,
                "stream_options": {"include_usage": True},
                **ADAPTER.for_version(line).priority_fields(3),
            }
            r = await c.post("/v1/chat/completions", json=req)
            assert r.status_code == 200
            prom = (await c.get("/prometheus/metrics")).text
            assert "trtllm_request_success_total" in prom
            assert "trtllm_num_requests_running" not in prom  # no load gauges before main


async def test_main_gauges_change_only_when_a_request_completes() -> None:
    spec = EngineSpec(kind="trtllm", version="main")
    async with run_fleet([spec], model="m", time_scale=1.0) as f:
        async with httpx.AsyncClient(base_url=f.engines[0].url, timeout=30) as c:
            long = asyncio.create_task(
                c.post(
                    "/v1/completions",
                    json={"prompt": "x " * 20, "max_tokens": 1500, "ignore_eos": True},
                )
            )
            await asyncio.sleep(0.2)
            assert not long.done()
            prom = (await c.get("/prometheus/metrics")).text
            running = [
                ln for ln in prom.splitlines() if ln.startswith("trtllm_num_requests_running")
            ]
            assert running and running[0].endswith(" 0.0")  # stale while it runs
            assert (await c.get("/metrics")).json() == []  # JSON buffer refilled on completion
            assert (await long).status_code == 200
            assert (await c.get("/metrics")).json() != []
