"""vLLM /metrics parsing, checked against the REAL vLLM 0.32 expositions.

We test these aspects:
* every recorded exposition parses, and every field equals what prometheus_client's
  full parser reads from the same bytes (an independent oracle);
* the situations the fixtures' .json sidecars and README describe (peak KV under load,
  preemptions after load, prefix hits after request B, abort after disconnect);
* data parallelism, label order, absent ``engine`` label, old metric names;
* malformed input is a MetricsParseError, never a snapshot.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from recordings import VLLM_032

from fleetgate.engines._common import PromScanner
from fleetgate.engines.base import LoadSnapshot, MetricsParseError, MetricsSource
from fleetgate.engines.vllm import ADAPTER

FIXTURES = VLLM_032
DATA = Path(__file__).parent / "data"
SOURCE = ADAPTER.metrics_sources[0]
EXPOSITIONS = sorted(FIXTURES.glob("metrics_*.prom.txt"))


def parse(body: bytes, now: float = 100.0) -> LoadSnapshot:
    return ADAPTER.parse_metrics(SOURCE, body, now, None)


def fixture(name: str) -> LoadSnapshot:
    return parse((FIXTURES / f"metrics_{name}.prom.txt").read_bytes())


def oracle(body: bytes) -> dict[str, float]:
    """Sums per sample name, and cache_config_info labels, via prometheus_client."""
    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
            if sample.name == "vllm:cache_config_info":
                sums["block_size"] = float(sample.labels["block_size"])
                sums["num_gpu_blocks"] = float(sample.labels["num_gpu_blocks"])
    return sums


def test_all_real_expositions_are_present() -> None:
    assert len(EXPOSITIONS) == 11


@pytest.mark.parametrize("path", EXPOSITIONS, ids=lambda p: p.name.removesuffix(".prom.txt"))
def test_real_exposition_matches_prometheus_client(path: Path) -> None:
    body = path.read_bytes()
    snap = parse(body, now=42.5)
    ref = oracle(body)
    assert snap.scraped_at == 42.5
    assert snap.source == "metrics"
    assert snap.running == ref["vllm:num_requests_running"]
    assert snap.waiting == ref["vllm:num_requests_waiting"]
    assert snap.kv_usage == ref["vllm:kv_cache_usage_perc"]
    assert snap.prefix_query_tokens == ref["vllm:prefix_cache_queries_total"]
    assert snap.prefix_hit_tokens == ref["vllm:prefix_cache_hits_total"]
    assert snap.preemptions == ref["vllm:num_preemptions_total"]
    assert snap.prompt_tokens == ref["vllm:prompt_tokens_total"]
    assert snap.generation_tokens == ref["vllm:generation_tokens_total"]
    assert snap.block_size == ref["block_size"] == 128
    assert snap.blocks_total == ref["num_gpu_blocks"] == 24
    assert snap.models == ("tiny-llama",)
    # vLLM exposes neither paused requests nor max_num_seqs: unknown, not zero.
    assert snap.paused is None
    assert snap.max_running is None


def test_sidecars_describe_the_same_files() -> None:
    for path in EXPOSITIONS:
        sidecar = json.loads(path.with_name(path.name.replace(".prom.txt", ".json")).read_text())
        assert sidecar["response"]["body_file"] == path.name
        assert sidecar["response"]["body_bytes"] == len(path.read_bytes())


def test_after_start_is_idle_with_the_whole_cache_free() -> None:
    snap = fixture("a_after_start")
    assert (snap.running, snap.waiting, snap.kv_usage) == (0, 0, 0.0)
    assert snap.prefix_query_tokens == 0.0
    assert snap.generation_tokens == 0.0
    # 24 blocks, one of which is vLLM's null block: 23 usable, all free.
    assert snap.blocks_free == 23
    assert snap.free_kv_tokens == 23 * 128


def test_during_load_first_scrape() -> None:
    snap = fixture("c1_during_load_first")
    assert (snap.running, snap.waiting) == (4, 6)
    assert snap.kv_usage == pytest.approx(0.5217391304347826)
    assert snap.kv_usage == pytest.approx(12 / 23)
    assert snap.blocks_free == 11


def test_peak_kv_under_load() -> None:
    snap = fixture("c2_during_load_peak_kv")
    assert (snap.running, snap.waiting) == (2, 7)
    assert snap.kv_usage == pytest.approx(14 / 23)
    assert snap.blocks_free == 9
    assert snap.free_kv_tokens == 9 * 128
    assert snap.generation_tokens == 4403.0


def test_after_load_gauges_drop_and_preemptions_count() -> None:
    snap = fixture("c3_after_load")
    assert (snap.running, snap.waiting, snap.kv_usage) == (0, 0, 0.0)
    assert snap.preemptions == 2.0
    assert fixture("c2_during_load_peak_kv").preemptions == 0.0


def test_prefix_pair_counters() -> None:
    before, after_a, after_b = (
        fixture(n) for n in ("d0_prefix_before", "d1_prefix_after_a", "d2_prefix_after_b")
    )
    assert before.prefix_query_tokens is not None and after_a.prefix_query_tokens is not None
    assert after_b.prefix_query_tokens is not None
    assert after_a.prefix_query_tokens - before.prefix_query_tokens == 388  # A's prompt
    assert after_a.prefix_hit_tokens == before.prefix_hit_tokens == 0.0
    assert after_b.prefix_query_tokens - after_a.prefix_query_tokens == 388
    assert after_b.prefix_hit_tokens == 256.0  # two whole 128-token blocks of the prefix


def test_disconnect_aborts_generation() -> None:
    before, after = fixture("7a0_before_disconnect"), fixture("7a1_after_disconnect")
    assert after.running == 0
    assert before.generation_tokens is not None and after.generation_tokens is not None
    assert after.generation_tokens - before.generation_tokens == 5


def test_data_parallel_sums_and_block_weighted_kv() -> None:
    snap = parse((DATA / "vllm_dp2.prom.txt").read_bytes())
    assert snap.running == 13
    assert snap.waiting == 3
    assert snap.prefix_query_tokens == 12288.0
    assert snap.prefix_hit_tokens == 4608.0
    assert snap.preemptions == 4.0
    assert snap.prompt_tokens == 12288.0
    assert snap.generation_tokens == 6000.0
    assert snap.block_size == 16
    assert snap.blocks_total == 6002
    # usable blocks 4000 and 2000: (0.75*4000 + 0.25*2000) / 6000
    assert snap.kv_usage == pytest.approx(3500 / 6000)
    assert snap.blocks_free == 1000 + 1500
    assert snap.models == ("meta-llama/Llama-3.1-8B-Instruct",)


def test_data_parallel_without_block_counts_uses_plain_mean() -> None:
    body = (
        (DATA / "vllm_dp2.prom.txt")
        .read_bytes()
        .replace(b'num_gpu_blocks="2001"', b'num_gpu_blocks="None"')
    )
    snap = parse(body)
    assert snap.kv_usage == pytest.approx(0.5)
    assert snap.blocks_free is None
    assert snap.blocks_total is None
    assert snap.free_kv_tokens is None


SIM_STYLE = b"""# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 3
vllm:num_requests_waiting{model_name="m"} 1
vllm:kv_cache_usage_perc{model_name="m"} 0.5
vllm:prefix_cache_hits_total{model_name="m"} 10
vllm:prefix_cache_queries_total{model_name="m"} 40
"""


def test_no_engine_label_and_missing_families_are_unknown() -> None:
    snap = parse(SIM_STYLE)
    assert (snap.running, snap.waiting, snap.kv_usage) == (3, 1, 0.5)
    assert (snap.prefix_hit_tokens, snap.prefix_query_tokens) == (10.0, 40.0)
    assert snap.preemptions is None  # the llm-d sim has no num_preemptions
    assert snap.block_size is None
    assert snap.blocks_total is None
    assert snap.blocks_free is None
    assert snap.models == ("m",)


def test_labels_by_name_in_any_order_with_escapes_and_timestamps() -> None:
    body = (
        b'vllm:num_requests_running{model_name="a \\"q\\" \\\\ n}",engine="0"} 2.0 1700000000000\n'
        b'vllm:num_requests_waiting { model_name = "a \\"q\\" \\\\ n}" , engine="0" , } 4\r\n'
        b"vllm:kv_cache_usage_perc 1e-1\n"
    )
    snap = parse(body)
    assert snap.running == 2
    assert snap.waiting == 4
    assert snap.kv_usage == pytest.approx(0.1)
    assert snap.models == ('a "q" \\ n}',)


def test_pre_0_12_names_are_fallbacks() -> None:
    body = (
        b'vllm:num_requests_running{engine="0",model_name="m"} 1.0\n'
        b'vllm:gpu_cache_usage_perc{engine="0",model_name="m"} 0.3\n'
        b'vllm:gpu_prefix_cache_queries_total{engine="0",model_name="m"} 100.0\n'
        b'vllm:gpu_prefix_cache_hits_total{engine="0",model_name="m"} 60.0\n'
    )
    snap = parse(body)
    assert snap.kv_usage == pytest.approx(0.3)
    assert (snap.prefix_query_tokens, snap.prefix_hit_tokens) == (100.0, 60.0)


def test_prefix_sharing_names_and_created_samples_are_not_mixed_up() -> None:
    found = PromScanner(("vllm:num_requests_waiting", "vllm:prefix_cache_hits_total")).scan(
        b'vllm:num_requests_waiting_by_reason{reason="capacity"} 7\n'
        b"vllm:num_requests_waiting 2\n"
        b"vllm:prefix_cache_hits_created 1.7e9\n"
        b"vllm:external_prefix_cache_hits_total 99\n"
        b"vllm:prefix_cache_hits_total 5\n"
    )
    assert [s.value for s in found["vllm:num_requests_waiting"]] == [2.0]
    assert [s.value for s in found["vllm:prefix_cache_hits_total"]] == [5.0]


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        pytest.param(b"", "empty", id="empty"),
        pytest.param(b"  \n", "empty", id="blank"),
        pytest.param(b'vllm:num_requests_running{engine="0"} 1.0', "newline", id="truncated"),
        pytest.param(
            b'vllm:num_requests_running{engine="0"} abc\n', "bad sample value", id="bad-value"
        ),
        pytest.param(b"vllm:num_requests_running{engine=0} 1\n", "label set", id="unquoted-label"),
        pytest.param(
            b'vllm:num_requests_running{engine="0" 1\n', "label set", id="unclosed-labels"
        ),
        pytest.param(b"vllm:num_requests_running 1 2 3\n", "value [timestamp]", id="extra-fields"),
        pytest.param(b"vllm:num_requests_running\t\n", "value [timestamp]", id="no-value"),
        pytest.param(b'vllm:num_requests_running{a="\xff"} 1\n', "UTF-8", id="not-utf8"),
        pytest.param(b'{"object": "list"}\n', "no vllm:", id="json-body"),
        pytest.param(b"<html>502 Bad Gateway</html>\n", "no vllm:", id="html-body"),
        pytest.param(b"vllm:kv_cache_usage_perc NaN\n", "finite", id="nan-kv"),
        pytest.param(b"vllm:num_requests_running +Inf\n", "finite", id="inf-running"),
        pytest.param(b"vllm:kv_cache_usage_perc 1.5\n", "out of [0, 1]", id="kv-over-1"),
        pytest.param(b"vllm:num_requests_waiting -1\n", "negative", id="negative-waiting"),
        pytest.param(
            b'vllm:cache_config_info{block_size="big",num_gpu_blocks="1"} 1\n',
            "integer",
            id="bad-info",
        ),
    ],
)
def test_malformed_expositions_raise(body: bytes, fragment: str) -> None:
    with pytest.raises(MetricsParseError, match=re.escape(fragment)):
        parse(body)


def test_other_vllm_series_only_is_unknown_not_an_error() -> None:
    snap = parse(b'vllm:request_success_total{finished_reason="stop"} 3\n')
    assert snap == LoadSnapshot(scraped_at=100.0, source="metrics")


def test_json_source_refused() -> None:
    with pytest.raises(MetricsParseError, match="json"):
        ADAPTER.parse_metrics(MetricsSource("x", "/metrics", "json"), b"[]", 1.0, None)
