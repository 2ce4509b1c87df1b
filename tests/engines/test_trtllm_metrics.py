"""TensorRT-LLM metrics: trtllm-serve Prometheus, draining JSON iteration stats, Triton.

We test these aspects:
* each source's fixture (written from trtllm-serve's and Triton's documented
  examples) gives the documented fields;
* prefix counters are blocks * tokensPerBlock;
* the empty-drain carry-over policy of the JSON source, scenario by scenario;
* None for what a source does not carry; malformed input raises MetricsParseError.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from fleetgate.engines.base import LoadSnapshot, MetricsParseError, MetricsSource
from fleetgate.engines.trtllm import ADAPTER, ITERATION_STATS, PROMETHEUS, TRITON

DATA = Path(__file__).parent / "data"


def read(name: str) -> bytes:
    return (DATA / name).read_bytes()


@pytest.mark.parametrize(
    "name",
    [
        "trtllm_prometheus_main.prom.txt",
        "trtllm_prometheus_1.1.0rc5.prom.txt",
        "triton_metrics.prom.txt",
    ],
)
def test_own_fixtures_are_valid_expositions(name: str) -> None:
    families = list(text_string_to_metric_families(read(name).decode()))
    assert families


def test_sources_in_preference_order() -> None:
    assert ADAPTER.metrics_sources == (PROMETHEUS, ITERATION_STATS, TRITON)
    assert PROMETHEUS.path == "/prometheus/metrics" and not PROMETHEUS.drains
    assert ITERATION_STATS.path == "/metrics" and ITERATION_STATS.drains
    assert ITERATION_STATS.format == "json"
    assert TRITON.format == "prometheus" and not TRITON.drains


# ------------------------------------------------------------------ /prometheus/metrics
def test_trtllm_prometheus_main() -> None:
    snap = ADAPTER.parse_metrics(PROMETHEUS, read("trtllm_prometheus_main.prom.txt"), 7.0, None)
    assert snap.source == "prometheus"
    assert snap.scraped_at == 7.0
    assert (snap.running, snap.waiting, snap.paused) == (6, 2, 0)
    assert snap.kv_usage == 0.25
    assert (snap.blocks_total, snap.blocks_free, snap.block_size) == (8192, 6144, 32)
    assert snap.free_kv_tokens == 6144 * 32
    assert snap.prefix_hit_tokens == 1200 * 32  # not the iter_reused_blocks counter (999)
    assert snap.prefix_query_tokens == (1200 + 3400) * 32
    assert (snap.prompt_tokens, snap.generation_tokens) == (150000.0, 42000.0)
    assert snap.max_running == 256
    assert snap.preemptions is None  # TRT does not preempt; paused is its own field
    assert snap.models == ()  # the collector's "undefined" placeholder is not a model name


def test_trtllm_prometheus_real_model_label_and_utilization_fallback() -> None:
    body = (
        b'trtllm_num_requests_running{model_name="llama",engine_type="trtllm"} 1\n'
        b'trtllm_kv_cache_used_blocks{model_name="llama",engine_type="trtllm"} 30\n'
        b'trtllm_kv_cache_max_blocks{model_name="llama",engine_type="trtllm"} 120\n'
        b'trtllm_kv_cache_reused_blocks_total{model_name="llama",engine_type="trtllm"} 5\n'
    )
    snap = ADAPTER.parse_metrics(PROMETHEUS, body, 1.0, None)
    assert snap.models == ("llama",)
    assert snap.kv_usage == pytest.approx(0.25)  # used / max when utilization is absent
    # tokens per block unknown: block counters cannot become token counters
    assert snap.prefix_hit_tokens is None and snap.prefix_query_tokens is None
    assert snap.waiting is None and snap.block_size is None


def test_trtllm_prometheus_rc5_has_no_load_families_unknown_not_zero() -> None:
    snap = ADAPTER.parse_metrics(PROMETHEUS, read("trtllm_prometheus_1.1.0rc5.prom.txt"), 3.0, None)
    assert snap == LoadSnapshot(scraped_at=3.0, source="prometheus")


# ------------------------------------------------------------------ JSON /metrics (drains)
def iteration(**overrides: Any) -> dict[str, Any]:
    base: dict[str, Any] = json.loads(read("trtllm_iteration_stats.json"))[1]
    base.update(overrides)
    return base


def parse_json(
    payload: Any, previous: LoadSnapshot | None = None, now: float = 10.0
) -> LoadSnapshot:
    return ADAPTER.parse_metrics(ITERATION_STATS, json.dumps(payload).encode(), now, previous)


def test_iteration_stats_latest_by_iter_wins_even_out_of_order() -> None:
    snap = ADAPTER.parse_metrics(ITERATION_STATS, read("trtllm_iteration_stats.json"), 5.0, None)
    # The file lists iter 152, 154, 153: 154 is the latest.
    assert (snap.running, snap.waiting, snap.paused) == (4, 0, 2)
    assert snap.kv_usage == pytest.approx(3 / 101256)
    assert (snap.blocks_total, snap.blocks_free, snap.block_size) == (101256, 101253, 32)
    assert snap.prefix_hit_tokens == 4 * 32
    assert snap.prefix_query_tokens == (4 + 3121) * 32
    assert snap.max_running == 64
    assert snap.prompt_tokens is None and snap.generation_tokens is None
    assert snap.source == "iteration-stats"


def test_iteration_stats_of_attention_dp_ranks_read_rank_0s_row() -> None:
    """Main fans an iteration out one row per rank; rank 0's carries the queue."""
    rows = [
        iteration(iter=7, attentionDpRank=0, numActiveRequests=3, numQueuedRequests=5),
        iteration(iter=7, attentionDpRank=1, numActiveRequests=3, numQueuedRequests=0),
        iteration(iter=6, attentionDpRank=0, numActiveRequests=1, numQueuedRequests=9),
    ]
    assert (parse_json(rows).running, parse_json(rows).waiting) == (3, 5)
    assert parse_json(rows[::-1]).waiting == 5, "whatever the order"


def test_iteration_stats_without_iter_uses_last_element() -> None:
    first, second = iteration(numActiveRequests=9), iteration(numActiveRequests=1)
    del first["iter"], second["iter"]
    assert parse_json([first, second]).running == 1


def test_iteration_stats_missing_sections_are_unknown() -> None:
    snap = parse_json([{"iter": 1, "numActiveRequests": 2, "numQueuedRequests": 0}])
    assert (snap.running, snap.waiting) == (2, 0)
    assert snap.kv_usage is None and snap.blocks_total is None and snap.paused is None
    assert snap.prefix_hit_tokens is None


BUSY = LoadSnapshot(
    scraped_at=1.0,
    kv_usage=0.4,
    running=5,
    waiting=3,
    paused=1,
    prefix_query_tokens=640.0,
    prefix_hit_tokens=320.0,
    block_size=32,
    blocks_total=1000,
    blocks_free=600,
    max_running=64,
    source="iteration-stats",
)
IDLE = LoadSnapshot(
    scraped_at=1.0,
    kv_usage=0.0,
    running=0,
    waiting=0,
    paused=0,
    prefix_query_tokens=640.0,
    prefix_hit_tokens=320.0,
    block_size=32,
    blocks_total=1000,
    blocks_free=1000,
    max_running=64,
    source="iteration-stats",
)


def test_empty_drain_first_read_is_idle_with_unknown_capacity() -> None:
    """A fresh engine drains nothing until it serves: idle, not unknown (unknown would be
    avoided by the scheduler, so it would never serve and stay unknown)."""
    assert parse_json([], None, now=2.0) == LoadSnapshot(
        scraped_at=2.0, running=0, waiting=0, source="iteration-stats"
    )


def test_empty_drain_after_idle_stays_idle_and_carries_state() -> None:
    snap = parse_json([], IDLE, now=2.0)
    assert (snap.running, snap.waiting, snap.paused) == (0, 0, 0)
    assert snap.kv_usage == 0.0 and snap.blocks_free == 1000
    assert (snap.prefix_query_tokens, snap.prefix_hit_tokens) == (640.0, 320.0)
    assert (snap.block_size, snap.blocks_total, snap.max_running) == (32, 1000, 64)
    assert snap.scraped_at == 2.0


def test_empty_drain_after_busy_is_unknown_load_but_keeps_capacity_and_counters() -> None:
    snap = parse_json([], BUSY, now=2.0)
    assert (snap.running, snap.waiting, snap.paused) == (None, None, None)
    assert snap.kv_usage is None and snap.blocks_free is None and snap.free_kv_tokens is None
    assert (snap.prefix_query_tokens, snap.prefix_hit_tokens) == (640.0, 320.0)
    assert (snap.block_size, snap.blocks_total, snap.max_running) == (32, 1000, 64)


def test_empty_drain_after_a_busy_unknown_read_stays_unknown() -> None:
    unknown = parse_json([], BUSY, now=2.0)
    again = parse_json([], unknown, now=3.0)
    assert again.running is None and again.waiting is None
    assert again.blocks_total == 1000


def test_empty_drain_ignores_previous_from_another_source() -> None:
    other = LoadSnapshot(scraped_at=1.0, running=0, waiting=0, blocks_total=5, source="prometheus")
    assert parse_json([], other, now=2.0) == LoadSnapshot(scraped_at=2.0, source="iteration-stats")


def test_drain_sequence_busy_then_idle_then_silence() -> None:
    busy = parse_json([iteration(numActiveRequests=2, numQueuedRequests=1)], None, now=1.0)
    idle = parse_json(
        [iteration(iter=200, numActiveRequests=0, numQueuedRequests=0)], busy, now=2.0
    )
    silent = parse_json([], idle, now=3.0)
    assert (busy.running, idle.running, silent.running) == (2, 0, 0)
    assert silent.waiting == 0
    assert silent.prefix_hit_tokens == idle.prefix_hit_tokens == 4 * 32


# ------------------------------------------------------------------ Triton
def test_triton_families() -> None:
    snap = ADAPTER.parse_metrics(TRITON, read("triton_metrics.prom.txt"), 4.0, None)
    assert snap.source == "triton"
    assert (snap.running, snap.waiting, snap.paused, snap.max_running) == (8, 5, 1, 64)
    assert snap.kv_usage == pytest.approx(0.4875)
    assert (snap.blocks_total, snap.blocks_free, snap.block_size) == (4000, 2050, 64)
    assert snap.prefix_hit_tokens == 640 * 64
    assert snap.prefix_query_tokens is None  # Triton has no missed-blocks figure
    assert snap.models == ("tensorrt_llm",)


def test_triton_two_models_sum_and_block_weighted_kv() -> None:
    def kv(kind: str, value: str) -> bytes:
        labels = f'kv_cache_block_type="{kind}",model="llama_b",version="1"'
        return f"nv_trt_llm_kv_cache_block_metrics{{{labels}}} {value}\n".encode()

    body = (
        read("triton_metrics.prom.txt")
        + b'nv_trt_llm_request_metrics{model="llama_b",request_type="active",version="1"} 2\n'
        + kv("fraction", "0.1")
        + kv("max", "1000")
        + kv("tokens_per", "32")
    )
    snap = ADAPTER.parse_metrics(TRITON, body, 4.0, None)
    assert snap.running == 10
    assert snap.kv_usage == pytest.approx((0.4875 * 4000 + 0.1 * 1000) / 5000)
    assert snap.blocks_total == 5000
    assert snap.block_size is None  # the models disagree: unknown
    assert snap.models == ("llama_b", "tensorrt_llm")


# ------------------------------------------------------------------ malformed
@pytest.mark.parametrize(
    ("source", "body", "fragment"),
    [
        pytest.param(ITERATION_STATS, b"not json", "not JSON", id="json-garbage"),
        pytest.param(ITERATION_STATS, b'{"iter": 1}', "must be a JSON list", id="json-object"),
        pytest.param(ITERATION_STATS, b"[1, 2]", "element 0 is not an object", id="json-scalars"),
        pytest.param(
            ITERATION_STATS, b'[{"numActiveRequests": "4"}]', "not a number", id="json-str"
        ),
        pytest.param(
            ITERATION_STATS, b'[{"numActiveRequests": true}]', "not a number", id="json-bool"
        ),
        pytest.param(
            ITERATION_STATS, b'[{"numQueuedRequests": -1}]', "non-negative", id="json-neg"
        ),
        pytest.param(
            ITERATION_STATS, b'[{"kvCacheStats": [1]}]', "not an object", id="json-kv-list"
        ),
        pytest.param(
            ITERATION_STATS,
            b'[{"kvCacheStats": {"maxNumBlocks": 10, "usedNumBlocks": 20}}]',
            "out of [0, 1]",
            id="json-used-over-max",
        ),
        pytest.param(ITERATION_STATS, b"\xff\xfe", "not JSON", id="json-binary"),
        pytest.param(PROMETHEUS, b"", "empty", id="prom-empty"),
        pytest.param(PROMETHEUS, b"trtllm_num_requests_running 1", "newline", id="prom-truncated"),
        pytest.param(
            PROMETHEUS, b"trtllm_num_requests_running one\n", "bad sample value", id="prom-value"
        ),
        pytest.param(
            PROMETHEUS, b"trtllm_num_requests_running -2\n", "negative", id="prom-negative"
        ),
        pytest.param(
            PROMETHEUS, b"trtllm_kv_cache_utilization 1.2\n", "out of [0, 1]", id="prom-kv"
        ),
        pytest.param(
            PROMETHEUS, b'vllm:num_requests_running{engine="0"} 1\n', "no trtllm_", id="vllm"
        ),
        pytest.param(PROMETHEUS, b"[]\n", "no trtllm_", id="prom-json"),
        pytest.param(
            TRITON, b'nv_inference_request_success{model="x"} 1\n', "no nv_trt_llm_", id="no-trt"
        ),
        pytest.param(
            TRITON, b'nv_trt_llm_request_metrics{model="x"} 1\n', "request_type", id="no-cat"
        ),
        pytest.param(
            TRITON,
            b'nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="fraction",model="x"} NaN\n',
            "finite",
            id="nan",
        ),
    ],
)
def test_malformed_raise(source: MetricsSource, body: bytes, fragment: str) -> None:
    with pytest.raises(MetricsParseError, match=re.escape(fragment)):
        ADAPTER.parse_metrics(source, body, 1.0, None)


@pytest.mark.parametrize(
    "source",
    [
        MetricsSource("kserve", "/metrics", "prometheus"),
        MetricsSource("prometheus", "/prometheus/metrics", "json"),
        MetricsSource("iteration-stats", "/metrics", "prometheus"),
    ],
)
def test_unknown_source_raises(source: MetricsSource) -> None:
    with pytest.raises(MetricsParseError, match="unknown trtllm metrics source"):
        ADAPTER.parse_metrics(source, b"[]\n", 1.0, None)
