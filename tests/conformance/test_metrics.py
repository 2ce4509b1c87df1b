"""The /metrics families and labels the router relies on, on both backends.

Names, types and labels as seen on real vLLM 0.32 (recordings ``metrics_*.prom.txt``):
every ``vllm:`` series
carries ``engine="0"`` and ``model_name=<served name>``; counters are exposed
with ``_total``; ``vllm:cache_config_info`` carries the KV geometry as labels;
``vllm:gpu_cache_usage_perc`` is gone in this version.
"""

from __future__ import annotations

import httpx
import pytest

from .backends import BLOCK_SIZE, NUM_BLOCKS, Backend
from .wire import poll, scrape

pytestmark = pytest.mark.slow

GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
COUNTERS = ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:num_preemptions")


async def test_router_metric_families_and_labels(backend: Backend) -> None:
    async with httpx.AsyncClient() as client:
        s = await scrape(client, backend.base_url)
    assert s.content_type.startswith("text/plain")
    want_labels = {"engine": "0", "model_name": backend.model}
    for name in GAUGES:
        assert s.families.get(name) == "gauge", (name, s.families.get(name))
        [labels] = s.labelsets(name)
        assert labels == want_labels, (name, labels)
    for name in COUNTERS:
        assert s.families.get(name) == "counter", (name, s.families.get(name))
        [labels] = s.labelsets(f"{name}_total")
        assert labels == want_labels, (name, labels)
        assert s.value(f"{name}_total") >= 0
    assert 0.0 <= s.value("vllm:kv_cache_usage_perc") <= 1.0
    assert "vllm:gpu_cache_usage_perc" not in s.families


async def test_cache_config_info_block_size(backend: Backend) -> None:
    """The KV geometry labels a router may read; the real one has ~35 more labels (see doc)."""
    async with httpx.AsyncClient() as client:
        s = await scrape(client, backend.base_url)
    [info] = s.labelsets("vllm:cache_config_info")
    assert s.value("vllm:cache_config_info") == 1.0
    assert info["block_size"] == str(BLOCK_SIZE)
    assert info["enable_prefix_caching"] == "True"
    assert info["num_gpu_blocks"] == str(NUM_BLOCKS)
    assert "engine" in info


async def test_request_success_counts_finished_reason_length(backend: Backend) -> None:
    async with httpx.AsyncClient(timeout=60) as client:
        before = await scrape(client, backend.base_url)
        payload = {
            "model": backend.model,
            "prompt": "count me",
            "max_tokens": 3,
            "ignore_eos": True,
        }
        resp = await client.post(f"{backend.base_url}/v1/completions", json=payload)
        assert resp.status_code == 200
        reasons = {d["finished_reason"] for d in before.labelsets("vllm:request_success_total")}
        assert {"stop", "length", "abort"} <= reasons
        key = "vllm:request_success_total"
        after = await poll(
            client,
            backend.base_url,
            lambda s: (
                s.value(key, finished_reason="length")
                >= before.value(key, finished_reason="length") + 1
            ),
            timeout_s=10,
            what="request_success_total{finished_reason=length} +1",
        )
        assert (
            after.value("vllm:generation_tokens_total")
            >= before.value("vllm:generation_tokens_total") + 3
        )
