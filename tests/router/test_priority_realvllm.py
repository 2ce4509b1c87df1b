"""REAL vLLM 0.32 (CPU, tests/realvllm.py): a stream preempted and resumed THROUGH THE ROUTER.

The router has a ``priority:`` section and counts one sequence of capacity for
the one real engine, so a ``critical`` request arriving while a ``batch``
stream runs must wait; past its preemption threshold the router cancels the
batch stream upstream (vLLM aborts it), serves the critical request, and
resumes the batch stream as a continuation from token ids. Greedy decoding:
the batch client's token ids and text must equal an uninterrupted direct run.
Event boundaries are not compared (vLLM's output collector may merge events,
see tests/router/priority/test_realvllm_resume.py).

Never skipped: if vLLM cannot be installed or started, the fixture fails.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import pytest
from realvllm import real_vllm  # noqa: F401  (the session fixture)
from routerkit import router_config, serve

from fleetgate.router.app import build_router

pytestmark = [pytest.mark.realvllm, pytest.mark.slow, pytest.mark.timeout(900)]

BATCH = {
    "model": "tiny-llama",
    "prompt": "Preemption through the router: the quick brown fox jumps over the lazy dog.",
    "max_tokens": 400,
    "temperature": 0,
    "ignore_eos": True,
    "stream": True,
    "stream_options": {"include_usage": True},
    "return_token_ids": True,
}
CRITICAL = {"model": "tiny-llama", "prompt": "Urgent:", "max_tokens": 4, "temperature": 0}


def collect(raw: bytes) -> tuple[str, list[int], list[dict[str, Any]]]:
    text, ids, usage = "", list[int](), list[dict[str, Any]]()
    for line in raw.split(b"\n"):
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        ev = json.loads(line[6:])
        if ev.get("usage"):
            usage.append(ev["usage"])
        for ch in ev.get("choices", []):
            text += ch.get("text") or ""
            ids += ch.get("token_ids") or []
    return text, ids, usage


async def test_stream_preempted_and_resumed_through_router_equals_uninterrupted(
    real_vllm: Any,  # noqa: F811
) -> None:
    base = real_vllm.base_url
    priority = {
        "classes": [
            {
                "name": "critical",
                "level": 8,
                "ttft_objective_s": 5.0,
                "max_queue_time_s": 120,
                "max_queued": 10,
                "preempt_after_fraction": 0.02,
            },
            {
                "name": "standard",
                "level": 0,
                "ttft_objective_s": 10,
                "max_queue_time_s": 120,
                "max_queued": 10,
            },
            {
                "name": "batch",
                "level": -5,
                "ttft_objective_s": 60,
                "max_queue_time_s": 300,
                "max_queued": 10,
                "max_preemptions_per_request": 2,
            },
        ],  # fmt: skip
    }
    async with httpx.AsyncClient(timeout=300) as c:
        t0 = time.monotonic()
        whole = await c.post(base + "/v1/completions", json=BATCH)
        print(f"uninterrupted run: {time.monotonic() - t0:.2f}s")
        assert whole.status_code == 200
        want_text, want_ids, _ = collect(whole.content)
        assert len(want_ids) == 400

        cfg = router_config(
            [("vllm", base)], capacity=1, priority=priority, scrape={"interval_s": 0.2}
        )
        app = build_router(cfg)
        async with serve(app) as url:
            raw = b""
            crit: asyncio.Task[httpx.Response] | None = None
            hb = {"x-fleetgate-priority": "batch"}
            async with c.stream("POST", url + "/v1/completions", json=BATCH, headers=hb) as resp:
                assert resp.status_code == 200
                async for chunk in resp.aiter_raw():
                    raw += chunk
                    if crit is None and raw.count(b'"token_ids"') >= 8:
                        crit = asyncio.create_task(
                            c.post(url + "/v1/completions", json=CRITICAL,
                                   headers={"x-fleetgate-priority": "critical"})
                        )  # fmt: skip
            assert crit is not None
            answer = await crit
            metrics = (await c.get(url + "/metrics")).text
    assert answer.status_code == 200, answer.text
    got_text, got_ids, usage = collect(raw)
    print("\n".join(
        line for line in metrics.splitlines()
        if line.startswith(("fleetgate_preemptions_total", "fleetgate_resumes_total",
                            "fleetgate_dispatches_total", "fleetgate_ttft_objective_total",
                            "fleetgate_upstream_errors_total"))
    ))  # fmt: skip
    print(
        "token ids equal:", got_ids == want_ids, len(got_ids), "text equal:", got_text == want_text
    )
    assert 'fleetgate_preemptions_total{class="batch",model="tiny-llama"} 1.0' in metrics
    assert 'cause="preempted",class="batch",model="tiny-llama"} 1.0' in metrics
    assert got_ids == want_ids
    assert got_text == want_text
    assert raw.count(b"data: [DONE]") == 1
    assert len(usage) == 1 and usage[0]["completion_tokens"] == 400
