"""Decode-speed counters (``LoadSnapshot.decode_seconds_sum`` / ``decode_observations``).

We test these aspects:
* the scanner's prefix-tree regex matches names that prefix each other exactly;
* vLLM: every real 0.32 exposition gives the ITL histogram's ``_sum``/``_count``
  exactly as prometheus_client reads them; the pre-0.12 name is a fallback only;
  half a pair is unknown; a negative value is a parse error;
* TensorRT-LLM Prometheus: the emulator's ``trtllm_time_per_output_token_seconds``
  (one observation per finished request) round-trips through the adapter;
* TensorRT-LLM iteration stats: ``iterLatencyMS x numGenRequests`` accumulates over
  drained iterations (the documented shape and the emulator's), carries over empty
  drains and restarts when the previous snapshot came from another source;
* Triton and sources without the family: unknown, never zero.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from recordings import VLLM_032

from fleetgate.engines._common import PromScanner
from fleetgate.engines.base import LoadSnapshot, MetricsParseError
from fleetgate.engines.trtllm import ADAPTER as TRT
from fleetgate.engines.trtllm import ITERATION_STATS, PROMETHEUS, TRITON
from fleetgate.engines.vllm import ADAPTER as VLLM
from fleetgate.sim.core.api import SimRequest
from fleetgate.sim.core.timing import build_engine_model
from fleetgate.sim.generation import EngineOptions, GenRequest
from fleetgate.sim.trtllm.metrics import TrtllmMetrics

FIXTURES = VLLM_032
DATA = Path(__file__).parent / "data"
VSOURCE = VLLM.metrics_sources[0]


def vllm(body: bytes) -> LoadSnapshot:
    return VLLM.parse_metrics(VSOURCE, body, 1.0, None)


# ---------------------------------------------------------------------------- scanner


def test_scanner_prefix_tree_matches_names_that_prefix_each_other_exactly() -> None:
    scanner = PromScanner(("h", "h_sum", "h_count", "hx"))
    body = b'h 1\nh_sum 2\nh_count{a="b"} 3\nh_bucket 4\nhx 5\nhxy 6\nh_su 7\n# h 8\n'
    found = scanner.scan(body)
    assert {k: [s.value for s in v] for k, v in found.items()} == {
        "h": [1.0],
        "h_sum": [2.0],
        "h_count": [3.0],
        "hx": [5.0],
    }
    assert found["h_count"][0].labels == {"a": "b"}


def test_scanner_refuses_no_names() -> None:
    with pytest.raises(ValueError, match="at least one"):
        PromScanner(())


# ---------------------------------------------------------------------------- vLLM


def test_vllm_real_exposition_after_load() -> None:
    snap = vllm((FIXTURES / "metrics_c3_after_load.prom.txt").read_bytes())
    assert snap.decode_observations == 8145.0
    assert snap.decode_seconds_sum == pytest.approx(14.549129518000427, rel=1e-15)


@pytest.mark.parametrize(
    "path", sorted(FIXTURES.glob("metrics_*.prom.txt")), ids=lambda p: p.name[8:-9]
)
def test_vllm_every_real_exposition_matches_prometheus_client(path: Path) -> None:
    body = path.read_bytes()
    ref: dict[str, float] = {}
    for family in text_string_to_metric_families(body.decode()):
        if family.name == "vllm:inter_token_latency_seconds":
            for s in family.samples:
                if s.name.endswith(("_sum", "_count")):
                    ref[s.name] = ref.get(s.name, 0.0) + s.value
    snap = vllm(body)
    assert snap.decode_seconds_sum == ref["vllm:inter_token_latency_seconds_sum"]
    assert snap.decode_observations == ref["vllm:inter_token_latency_seconds_count"]


def test_vllm_real_under_load_speed_is_milliseconds_per_token() -> None:
    """Between the two under-load scrapes the CPU engine decoded 1892 gaps at ~1.75 ms."""
    c1 = vllm((FIXTURES / "metrics_c1_during_load_first.prom.txt").read_bytes())
    c2 = vllm((FIXTURES / "metrics_c2_during_load_peak_kv.prom.txt").read_bytes())
    assert c1.decode_seconds_sum is not None and c2.decode_seconds_sum is not None
    assert c1.decode_observations is not None and c2.decode_observations is not None
    gaps = c2.decode_observations - c1.decode_observations
    assert gaps == 1892.0
    per_token = (c2.decode_seconds_sum - c1.decode_seconds_sum) / gaps
    assert per_token == pytest.approx(0.00175, rel=0.01)


def test_vllm_idle_engine_reports_zero_not_unknown() -> None:
    snap = vllm((FIXTURES / "metrics_a_after_start.prom.txt").read_bytes())
    assert (snap.decode_seconds_sum, snap.decode_observations) == (0.0, 0.0)


def test_vllm_pre_0_12_name_is_a_fallback_only() -> None:
    old = (
        b'vllm:time_per_output_token_seconds_sum{model_name="m"} 2.0\n'
        b'vllm:time_per_output_token_seconds_count{model_name="m"} 100.0\n'
    )
    snap = vllm(old)
    assert (snap.decode_seconds_sum, snap.decode_observations) == (2.0, 100.0)
    both = old + (
        b'vllm:inter_token_latency_seconds_sum{model_name="m"} 3.0\n'
        b'vllm:inter_token_latency_seconds_count{model_name="m"} 50.0\n'
    )
    snap = vllm(both)
    assert (snap.decode_seconds_sum, snap.decode_observations) == (3.0, 50.0)


def test_vllm_data_parallel_ranks_are_summed() -> None:
    body = (
        b'vllm:inter_token_latency_seconds_sum{engine="0",model_name="m"} 1.5\n'
        b'vllm:inter_token_latency_seconds_sum{engine="1",model_name="m"} 2.5\n'
        b'vllm:inter_token_latency_seconds_count{engine="0",model_name="m"} 10\n'
        b'vllm:inter_token_latency_seconds_count{engine="1",model_name="m"} 30\n'
    )
    snap = vllm(body)
    assert (snap.decode_seconds_sum, snap.decode_observations) == (4.0, 40.0)


def test_vllm_half_a_pair_is_unknown() -> None:
    body = (
        b'vllm:inter_token_latency_seconds_sum{model_name="m"} 1.5\nvllm:num_requests_running 1\n'
    )
    snap = vllm(body)
    assert snap.decode_seconds_sum is None and snap.decode_observations is None
    assert snap.running == 1


def test_vllm_request_tpot_and_bucket_lines_are_not_mistaken_for_the_pair() -> None:
    body = (
        b'vllm:request_time_per_output_token_seconds_sum{model_name="m"} 9.0\n'
        b'vllm:request_time_per_output_token_seconds_count{model_name="m"} 3.0\n'
        b'vllm:inter_token_latency_seconds_bucket{le="0.01",model_name="m"} 7.0\n'
        b"vllm:num_requests_running 0\n"
    )
    snap = vllm(body)
    assert snap.decode_seconds_sum is None and snap.decode_observations is None


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        (
            b"vllm:inter_token_latency_seconds_sum -1\nvllm:inter_token_latency_seconds_count 3\n",
            "negative",
        ),
        (
            b"vllm:inter_token_latency_seconds_sum NaN\nvllm:inter_token_latency_seconds_count 3\n",
            "not a finite number",
        ),
    ],
)
def test_vllm_bad_pair_raises(body: bytes, fragment: str) -> None:
    with pytest.raises(MetricsParseError, match=fragment):
        vllm(body)


# ---------------------------------------------------------------- TensorRT-LLM


def emulator_metrics(version: str = "main") -> TrtllmMetrics:
    model = build_engine_model("trtllm", "test", {"jitter": 0.0}, seed=0)
    stats = model.stats()
    options = EngineOptions(
        kind="trtllm",
        model_name="tiny",
        model_root="/models/tiny",
        max_model_len=model.max_model_len,
        block_size=model.block_size,
        num_gpu_blocks=stats.blocks_total,
        max_num_seqs=stats.max_running,
        version=version,
    )
    return TrtllmMetrics(options, model, created=1000.0)


def finish(metrics: TrtllmMetrics, rid: str, first: float, end: float, tokens: int) -> None:
    """A request whose tokens after the first took ``(end - first) / (tokens - 1)`` each."""
    req = GenRequest(request_id=rid, prompt_token_ids=(1, 2, 3), max_tokens=tokens)
    metrics.on_admit(req, first - 0.1)
    metrics.on_tokens(req, 1, first, True, 0)
    metrics.on_finish(req, "length", tokens, end)


def test_trtllm_prometheus_from_the_emulator_round_trips() -> None:
    metrics = emulator_metrics()
    finish(metrics, "a", first=1.0, end=1.0 + 0.02 * 10, tokens=11)  # 20 ms per token
    finish(metrics, "b", first=2.0, end=2.0 + 0.04 * 5, tokens=6)  # 40 ms per token
    snap = TRT.parse_metrics(PROMETHEUS, metrics.render(), 5.0, None)
    assert snap.decode_observations == 2.0  # one observation per finished request
    assert snap.decode_seconds_sum == pytest.approx(0.06)
    assert snap.running == 0  # the rest of the exposition still parses


def test_trtllm_prometheus_fixtures_without_the_histogram_are_unknown() -> None:
    snap = TRT.parse_metrics(
        PROMETHEUS, (DATA / "trtllm_prometheus_main.prom.txt").read_bytes(), 1, None
    )
    assert snap.decode_seconds_sum is None and snap.decode_observations is None


def test_trtllm_iteration_stats_documented_shape() -> None:
    """trtllm-serve's documented ``/metrics`` example: iters 152-154, each ~7 ms with 3
    generation requests."""
    snap = TRT.parse_metrics(
        ITERATION_STATS, (DATA / "trtllm_iteration_stats.json").read_bytes(), 1.0, None
    )
    assert snap.decode_observations == 9.0
    assert snap.decode_seconds_sum == pytest.approx((6.98 + 7.0069 + 7.1) / 1000 * 3)


def test_trtllm_iteration_stats_from_the_emulator_give_its_decode_step_time() -> None:
    """Run the emulator's TRT model to completion; the adapter's mean must be the truth:
    the step durations weighted by the decode (non-first) tokens each step produced.
    1.0 serves the drained iteration-stats queue (main refills it only on completions)."""
    metrics = emulator_metrics("1.0.0")
    model = metrics.model
    for i in range(3):
        model.add_request(
            SimRequest(f"r{i}", list(range(40)), max_tokens=20, arrival_time=0.0, ignore_eos=True)
        )
    now, true_sum, true_tokens = 0.0, 0.0, 0
    while model.has_work():
        result = model.step(now)
        metrics.on_step(now, result)
        now += result.duration
        decoded = sum(1 for e in result.events if not e.first and e.token_ids)
        true_sum, true_tokens = true_sum + result.duration * decoded, true_tokens + decoded
    snap = TRT.parse_metrics(ITERATION_STATS, json.dumps(metrics.drain()).encode(), now, None)
    assert snap.decode_seconds_sum is not None and snap.decode_observations is not None
    assert snap.decode_observations >= 0.9 * true_tokens > 0
    mean = snap.decode_seconds_sum / snap.decode_observations
    assert mean == pytest.approx(true_sum / true_tokens, rel=0.01)


def test_trtllm_iteration_stats_accumulate_over_drains_and_carry_over_silence() -> None:
    items = [
        {"iter": 1, "iterLatencyMS": 10.0, "inflightBatchingStats": {"numGenRequests": 4}},
        {"iter": 2, "iterLatencyMS": 30.0, "inflightBatchingStats": {"numGenRequests": 2}},
        {"iter": 3, "iterLatencyMS": 99.0, "inflightBatchingStats": {"numGenRequests": 0}},
        {"iter": 4, "iterLatencyMS": 50.0},  # no batching stats: not counted
    ]
    first = TRT.parse_metrics(ITERATION_STATS, json.dumps(items).encode(), 2.0, None)
    assert first.decode_observations == 6.0
    assert first.decode_seconds_sum == pytest.approx(0.010 * 4 + 0.030 * 2)
    silent = TRT.parse_metrics(ITERATION_STATS, b"[]", 3.0, first)
    assert silent.decode_seconds_sum == first.decode_seconds_sum
    assert silent.decode_observations == 6.0
    more = [{"iter": 5, "iterLatencyMS": 20.0, "inflightBatchingStats": {"numGenRequests": 1}}]
    second = TRT.parse_metrics(ITERATION_STATS, json.dumps(more).encode(), 4.0, silent)
    assert second.decode_observations == 7.0
    assert second.decode_seconds_sum == pytest.approx(0.1 + 0.02)


def test_trtllm_iteration_stats_restart_from_another_source_and_stay_unknown_without_data() -> None:
    other = LoadSnapshot(
        scraped_at=1.0, decode_seconds_sum=9.0, decode_observations=90.0, source="prometheus"
    )
    items = [{"iter": 1, "iterLatencyMS": 10.0, "inflightBatchingStats": {"numGenRequests": 1}}]
    snap = TRT.parse_metrics(ITERATION_STATS, json.dumps(items).encode(), 2.0, other)
    assert (snap.decode_seconds_sum, snap.decode_observations) == (0.01, 1.0)
    bare = TRT.parse_metrics(ITERATION_STATS, b'[{"iter": 1, "numActiveRequests": 1}]', 2.0, None)
    assert bare.decode_seconds_sum is None and bare.decode_observations is None


def test_trtllm_iteration_stats_bad_latency_raises() -> None:
    items = [{"iter": 1, "iterLatencyMS": -1.0, "inflightBatchingStats": {"numGenRequests": 1}}]
    with pytest.raises(MetricsParseError, match="iterLatencyMS"):
        TRT.parse_metrics(ITERATION_STATS, json.dumps(items).encode(), 1.0, None)


def test_triton_has_no_decode_speed() -> None:
    snap = TRT.parse_metrics(TRITON, (DATA / "triton_metrics.prom.txt").read_bytes(), 1.0, None)
    assert snap.decode_seconds_sum is None and snap.decode_observations is None
    assert snap.running is not None
