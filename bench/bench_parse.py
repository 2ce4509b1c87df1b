"""Cost per scrape of a real ~60 KB vLLM exposition: fleetgate's parser vs prometheus_client.

Usage: .venv/bin/python bench/bench_parse.py [--repeats N] [--file PATH]

Input: the recording ``metrics_c2_during_load_peak_kv.prom.txt`` (shared/fixtures/
vllm-0.32-cpu/ beside the clone, as for the tests), a real vLLM 0.32 /metrics body
captured under load (693 lines). Three contenders, each doing
what a router scrape needs:
* ``fleetgate``: ``VllmAdapter.parse_metrics`` (bytes in, LoadSnapshot out);
* ``prometheus_client``: ``text_string_to_metric_families`` over the decoded text,
  materialising every family (the common approach, e.g. production-stack);
* ``prometheus_client+extract``: the same plus picking out the load figures, so both
  sides end at equivalent data.
Each contender runs in timed batches; the figure is the median batch, per scrape.
Both results are checked to agree before timing, so a fast-but-wrong parser fails.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from fleetgate.engines.vllm import ADAPTER

DEFAULT_FILE = (
    Path(__file__).resolve().parents[2]
    / "shared/fixtures/vllm-0.32-cpu/metrics_c2_during_load_peak_kv.prom.txt"
)
WANTED = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kv_usage",
    "vllm:prefix_cache_queries_total": "prefix_query_tokens",
    "vllm:prefix_cache_hits_total": "prefix_hit_tokens",
    "vllm:num_preemptions_total": "preemptions",
    "vllm:prompt_tokens_total": "prompt_tokens",
    "vllm:generation_tokens_total": "generation_tokens",
}


def prometheus_client_families(body: bytes) -> list[Any]:
    return list(text_string_to_metric_families(body.decode("utf-8")))


def prometheus_client_extract(body: bytes) -> dict[str, float]:
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(body.decode("utf-8")):
        for sample in family.samples:
            key = WANTED.get(sample.name)
            if key is not None:
                out[key] = out.get(key, 0.0) + sample.value
            elif sample.name == "vllm:cache_config_info":
                out["block_size"] = float(sample.labels["block_size"])
    return out


def time_per_call(fn: Callable[[], object], repeats: int, budget_s: float) -> float:
    """Median seconds per call over ``repeats`` batches (batch sized to ~budget/repeats)."""
    start = time.perf_counter()
    fn()
    once = max(time.perf_counter() - start, 1e-7)
    batch = max(1, int(budget_s / repeats / once))
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(batch):
            fn()
        samples.append((time.perf_counter() - t0) / batch)
    return statistics.median(samples)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--budget", type=float, default=3.0, help="seconds per contender")
    parser.add_argument("--file", type=Path, default=DEFAULT_FILE)
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.budget <= 0:
        print("bench_parse: --repeats must be >= 1 and --budget > 0", file=sys.stderr)
        return 2
    body = args.file.read_bytes()
    source = ADAPTER.metrics_sources[0]

    ours = ADAPTER.parse_metrics(source, body, 0.0, None)
    ref = prometheus_client_extract(body)
    for key in WANTED.values():
        got = getattr(ours, key)
        if got != ref.get(key):
            print(f"bench_parse: MISMATCH {key}: ours {got!r}, prometheus_client {ref.get(key)!r}")
            return 1
    if ours.block_size != ref.get("block_size"):
        print("bench_parse: MISMATCH block_size")
        return 1

    lines = body.count(b"\n")
    print(f"input: {args.file.name}  {len(body)} bytes, {lines} lines")
    print(f"median of {args.repeats} batches, ~{args.budget:.1f} s per contender")
    contenders: list[tuple[str, Callable[[], object]]] = [
        (
            "fleetgate VllmAdapter.parse_metrics",
            lambda: ADAPTER.parse_metrics(source, body, 0.0, None),
        ),
        ("prometheus_client families", lambda: prometheus_client_families(body)),
        ("prometheus_client families+extract", lambda: prometheus_client_extract(body)),
    ]
    results = {}
    for name, fn in contenders:
        per_call = time_per_call(fn, args.repeats, args.budget)
        results[name] = per_call
        print(f"{name:40s} {per_call * 1e6:10.1f} us/scrape {1 / per_call:12,.0f} scrapes/s")
    ours_name = contenders[0][0]
    base = results[ours_name]
    for name, per_call in results.items():
        if name != ours_name:
            print(f"speed-up vs {name}: {per_call / base:.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
