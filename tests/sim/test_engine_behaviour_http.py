"""Engine behaviour seen through HTTP: non-stream disconnect, admission 503,
TensorRT-LLM priority direction, /health_generate, seeds, and the in-band error
when the fleet stops under an open stream.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import httpx
import pytest

from fleetgate.sim.fleet import EngineSpec, run_fleet


def metric(text: str, name: str, **labels: str) -> float:
    for line in text.splitlines():
        if line.startswith((name + "{", name + " ")) and all(
            f'{k}="{v}"' in line for k, v in labels.items()
        ):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} {labels} not exposed")


async def test_nonstream_disconnect_aborts() -> None:
    async with run_fleet([EngineSpec(kind="vllm")], "127.0.0.1", 0, model="m") as f:
        url = f.engines[0].url
        host, port = url.removeprefix("http://").split(":")
        body = json.dumps({"prompt": "long", "max_tokens": 400, "ignore_eos": True}).encode()
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        await writer.drain()
        async with httpx.AsyncClient(base_url=url) as c:
            for _ in range(100):
                if metric((await c.get("/metrics")).text, "vllm:num_requests_running") == 1:
                    break
                await asyncio.sleep(0.01)
            writer.close()
            await writer.wait_closed()
            for _ in range(100):
                text = (await c.get("/metrics")).text
                if metric(text, "vllm:num_requests_running") == 0:
                    break
                await asyncio.sleep(0.02)
        assert metric(text, "vllm:num_requests_running") == 0
        assert metric(text, "vllm:request_success_total", finished_reason="abort") == 0
        assert metric(text, "vllm:generation_tokens_total") < 400
        assert metric(text, "vllm:kv_cache_usage_perc") == 0


async def test_admission_limit_gives_503() -> None:
    spec = EngineSpec(kind="vllm", overrides={"max_running": 1}, max_num_queued_reqs=1)
    async with run_fleet([spec], "127.0.0.1", 0, model="m") as f:
        async with httpx.AsyncClient(base_url=f.engines[0].url, timeout=20) as c:
            body = {"prompt": "x", "max_tokens": 60, "ignore_eos": True}
            running = asyncio.create_task(c.post("/v1/completions", json=body))
            await asyncio.sleep(0.02)
            waiting = asyncio.create_task(c.post("/v1/completions", json=body))
            await asyncio.sleep(0.02)
            r = await c.post("/v1/completions", json=body)
            assert r.status_code == 503
            assert r.json()["error"]["type"] == "Service Unavailable"
            assert [(await t).status_code for t in (running, waiting)] == [200, 200]
            text = (await c.get("/metrics")).text
            assert (
                metric(text, "vllm:admission_rejections_total", reason="max_num_queued_reqs") == 1
            )


async def test_trtllm_priority_higher_first() -> None:
    spec = EngineSpec(kind="trtllm", overrides={"queue_policy": "priority", "max_running": 1})
    async with run_fleet([spec], "127.0.0.1", 0, model="m") as f:
        order: list[str] = []
        async with httpx.AsyncClient(base_url=f.engines[0].url, timeout=20) as c:

            async def send(tag: str, priority: float | None) -> None:
                body: dict[str, Any] = {
                    "prompt": f"{tag} the",
                    "max_tokens": 20,
                    "ignore_eos": True,
                }
                if priority is not None:
                    body["priority"] = priority
                r = await c.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
                order.append(tag)

            tasks = [asyncio.create_task(send("busy", 0.5))]
            await asyncio.sleep(0.01)
            for tag, p in (("low", 0.1), ("default", None), ("high", 0.9)):
                tasks.append(asyncio.create_task(send(tag, p)))
                await asyncio.sleep(0.005)
            await asyncio.gather(*tasks)
    assert order == ["busy", "high", "default", "low"]


async def test_trtllm_health_generate_and_version() -> None:
    async with run_fleet([EngineSpec(kind="trtllm")], "127.0.0.1", 0, model="m") as f:
        async with httpx.AsyncClient(base_url=f.engines[0].url, timeout=10) as c:
            r = await c.get("/health_generate")
            assert r.status_code == 200 and r.text == "Generation health check OK"
            assert (await c.get("/health")).status_code == 200
            assert "version" in (await c.get("/version")).json()
            assert (await c.get("/nope")).status_code == 404
            assert (await c.get("/v1/completions")).status_code == 405


async def test_same_seed_same_text_and_stop_strings() -> None:
    async with run_fleet([EngineSpec(kind="vllm")], "127.0.0.1", 0, model="m") as f:
        async with httpx.AsyncClient(base_url=f.engines[0].url, timeout=10) as c:
            body = {"prompt": "Tell me", "max_tokens": 12, "ignore_eos": True, "seed": 7}
            a = (await c.post("/v1/completions", json=body)).json()["choices"][0]["text"]
            b = (await c.post("/v1/completions", json=body)).json()["choices"][0]["text"]
            assert a == b and a
            word = re.findall(r"\w+", a)[2]
            r = (await c.post("/v1/completions", json={**body, "stop": [word]})).json()
            choice = r["choices"][0]
            assert choice["finish_reason"] == "stop" and choice["stop_reason"] == word
            assert word not in choice["text"] and a.startswith(choice["text"])


async def test_stop_fleet_under_open_stream_ends_in_band() -> None:
    chunks: list[str] = []
    async with run_fleet([EngineSpec(kind="vllm")], "127.0.0.1", 0, model="m") as f:
        client = httpx.AsyncClient(base_url=f.engines[0].url, timeout=10)
        body = {"prompt": "x", "max_tokens": 400, "ignore_eos": True, "stream": True}
        stream_cm = client.stream("POST", "/v1/completions", json=body)
        resp = await stream_cm.__aenter__()
        lines = resp.aiter_lines()
        chunks.append(await anext(lines))
        stopper = asyncio.create_task(f.engines[0].engine.driver.stop())
        async for line in lines:
            if line:
                chunks.append(line)
        await stopper
        await stream_cm.__aexit__(None, None, None)
        await client.aclose()
    assert chunks[-1] == "data: [DONE]"
    assert json.loads(chunks[-2].removeprefix("data: "))["error"]["code"] == 500


async def test_time_scale_stretches_wall_time_not_model_time() -> None:
    body = {"prompt": "x", "max_tokens": 10, "ignore_eos": True}
    walls = {}
    for scale in (1.0, 20.0):
        async with run_fleet([EngineSpec(kind="vllm")], "127.0.0.1", 0, time_scale=scale) as f:
            async with httpx.AsyncClient(base_url=f.engines[0].url, timeout=30) as c:
                t0 = asyncio.get_running_loop().time()
                assert (await c.post("/v1/completions", json=body)).status_code == 200
                walls[scale] = asyncio.get_running_loop().time() - t0
                e2e = metric((await c.get("/metrics")).text, "vllm:e2e_request_latency_seconds_sum")
        # "test" profile: ~1 ms per step, 10 decode steps (+ prefill) of model time
        assert 0.009 < e2e < 0.05, (scale, e2e)
    assert walls[20.0] > 0.2 > walls[1.0]


async def test_prefix_cache_hits_show_in_usage_and_metrics() -> None:
    prefix = " ".join(f"alpha{i} beta" for i in range(120)) + "."
    async with run_fleet([EngineSpec(kind="vllm")], "127.0.0.1", 0, model="m") as f:
        async with httpx.AsyncClient(base_url=f.engines[0].url, timeout=10) as c:
            a = await c.post(
                "/v1/completions", json={"prompt": prefix + " Question A?", "max_tokens": 2}
            )
            before = metric((await c.get("/metrics")).text, "vllm:prefix_cache_hits_total")
            b = await c.post(
                "/v1/completions", json={"prompt": prefix + " Question B?", "max_tokens": 2}
            )
            text = (await c.get("/metrics")).text
    assert a.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    cached = b.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    hits = metric(text, "vllm:prefix_cache_hits_total") - before
    assert cached > 0 and cached % 16 == 0, "whole 16-token blocks"
    assert hits == cached
    assert metric(text, "vllm:prompt_tokens_cached_total") == hits


async def test_many_streams_with_random_disconnects_leave_nothing_behind() -> None:
    import random

    rng = random.Random(7)
    spec = EngineSpec(kind="vllm", overrides={"max_running": 8})
    async with run_fleet([spec], "127.0.0.1", 0, model="m") as f:
        url = f.engines[0].url
        host, port = url.removeprefix("http://").split(":")

        async def one(i: int) -> None:
            body = json.dumps(
                {"prompt": f"s{i} go", "max_tokens": 60, "ignore_eos": True, "stream": True}
            ).encode()
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                b"Content-Type: application/json\r\nContent-Length: "
                + str(len(body)).encode()
                + b"\r\n\r\n"
                + body
            )
            cut = rng.choice([0, 1, 3, None])  # None: read to the end
            seen = 0
            while cut is None or seen < cut:
                data = await asyncio.wait_for(reader.read(4096), 10)
                if not data:
                    break
                seen += data.count(b"data: ")
            writer.close()
            await writer.wait_closed()

        await asyncio.gather(*(one(i) for i in range(60)))
        engine = f.engines[0].engine
        for _ in range(200):
            if engine.driver.in_flight() == 0 and not engine.driver.model.has_work():
                break
            await asyncio.sleep(0.01)
        stats = engine.driver.model.stats()
        assert engine.driver.in_flight() == 0
        assert (stats.running, stats.waiting, stats.blocks_used) == (0, 0, 0)
        async with httpx.AsyncClient(base_url=url) as c:
            text = (await c.get("/metrics")).text
            ok = await c.post("/v1/completions", json={"prompt": "after", "max_tokens": 2})
        assert ok.status_code == 200
        assert metric(text, "vllm:request_success_total", finished_reason="abort") == 0


async def test_phase_histograms_filled_from_the_scheduling_instant() -> None:
    """queue/prefill/inference/decode time histograms (vLLM) and the TRT queue time are
    observed per finished request from ``TokenEvent.scheduled_at``; with one slot the
    later requests queue, so queue time is positive, and e2e = queue + inference."""
    specs = [
        EngineSpec(kind="vllm", overrides={"max_running": 1}),
        EngineSpec(kind="trtllm", overrides={"max_running": 1}),
    ]
    body = {"prompt": "phases", "max_tokens": 12, "ignore_eos": True}
    async with run_fleet(specs, "127.0.0.1", 0, model="m") as f:
        async with httpx.AsyncClient(timeout=10) as c:
            for e in f.engines:
                rs = await asyncio.gather(
                    *(c.post(e.url + "/v1/completions", json=body) for _ in range(3))
                )
                assert [r.status_code for r in rs] == [200] * 3
            vllm = (await c.get(f.engines[0].url + "/metrics")).text
            trt = (await c.get(f.engines[1].url + "/prometheus/metrics")).text

    def h(text: str, name: str, part: str) -> float:
        return metric(text, f"{name}_{part}")

    phases = ["queue", "prefill", "inference", "decode"]
    sums = {p: h(vllm, f"vllm:request_{p}_time_seconds", "sum") for p in phases}
    for p in phases:
        assert h(vllm, f"vllm:request_{p}_time_seconds", "count") == 3, p
        assert sums[p] >= 0, p
    assert sums["queue"] > 0 and sums["prefill"] > 0 and sums["decode"] > 0
    assert sums["inference"] == pytest.approx(sums["prefill"] + sums["decode"], abs=1e-6)
    e2e = h(vllm, "vllm:e2e_request_latency_seconds", "sum")
    assert e2e == pytest.approx(sums["queue"] + sums["inference"], abs=1e-6)
    assert h(trt, "trtllm_request_queue_time_seconds", "count") == 3
    assert h(trt, "trtllm_request_queue_time_seconds", "sum") > 0
