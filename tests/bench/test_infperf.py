"""inference-perf cross-check: workload mapping, config, offline env, report parsing.

No network and no inference-perf run here; the one test that validates the
config against inference-perf's own schema runs in its venv when installed
(``slow``) and says so when it is not.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from fleetgate.cli import CliError
from fleetgate.sim.core import tokenizer as simtok
from fleetgate_tools.bench import cli as bench_cli
from fleetgate_tools.bench import infperf, infperf_run, scenarios
from fleetgate_tools.bench.stats import RequestResult
from fleetgate_tools.bench.summary import EngineWindow, RunRecord


def _scenario(**kw: Any) -> scenarios.Scenario:
    args: dict[str, Any] = {"engines": 4, "duration_s": 30, "time_scale": 8, "seed": 0}
    args.update(kw)
    return scenarios.make("shared-prefix", **args)


def test_plan_matches_the_scenario_in_wall_time_and_emulator_tokens() -> None:
    sc = _scenario()
    plan = infperf.plan_for(sc)
    sessions = sc.sessions()
    assert plan.duration_s == 30
    # inference-perf sends int(rate x duration) requests: exactly our count
    assert plan.requests == len(sessions)
    assert int(plan.rate * plan.duration_s) == len(sessions)
    # 8 sessions / modelled s / engine x 4 engines = 4 per wall s at 8 wall s per modelled s
    assert abs(plan.rate - 4.0) < 4 * 4.0 / math.sqrt(4.0 * 30)
    p = sc.params()
    assert plan.groups == max(4, int(p.rate * p.duration_s / 4))
    # every request gets its own prompt (no reuse of a whole prompt)
    assert plan.groups * plan.prompts_per_group >= len(sessions)
    doc0 = sessions[0].turns[0].content.split("\n\nQuestion: ")[0]
    assert abs(plan.prefix_tokens - len(simtok.encode(doc0))) < 0.1 * plan.prefix_tokens
    assert plan.prefix_tokens > 2500  # 3000 words of the workload's word list
    assert 0 < plan.question_min < plan.question_max
    assert plan.output_tokens == sessions[0].turns[0].max_tokens == 124
    assert plan.seed == 0 and plan.time_scale == 8


def test_plan_follows_seed_and_load() -> None:
    a, b = infperf.plan_for(_scenario(seed=1)), infperf.plan_for(_scenario(seed=1))
    assert a == b
    half = scenarios.make(
        "shared-prefix", engines=4, duration_s=30, time_scale=8, seed=1, load_factor=0.5
    )
    assert infperf.plan_for(half).rate < 0.7 * a.rate


def test_plan_refuses_other_workloads() -> None:
    sc = scenarios.make("chat-multiturn", engines=2, duration_s=10, time_scale=4, seed=0)
    with pytest.raises(ValueError, match="only the shared-prefix"):
        infperf.plan_for(sc)


def _config(url: str = "http://127.0.0.1:18080", ratio: float = 2.5) -> dict[str, Any]:
    plan = infperf.plan_for(_scenario())
    return infperf.build_config(
        plan, url, scenarios.MODEL, Path("/tmp/tok"), Path("/tmp/rep"), ratio
    )


def test_config_shape_for_inference_perf_0_7() -> None:
    plan = infperf.plan_for(_scenario())
    cfg = _config(ratio=2.5)
    assert cfg["api"] == {"type": "completion", "streaming": True}
    sp = cfg["data"]["shared_prefix"]
    assert cfg["data"]["type"] == "shared_prefix"
    assert sp["num_groups"] == plan.groups
    assert sp["num_prompts_per_group"] == plan.prompts_per_group
    assert sp["system_prompt_len"] == round(plan.prefix_tokens / 2.5)
    q = sp["question_len"]
    assert q["type"] == "uniform"
    assert (q["min"], q["max"]) == (round(plan.question_min / 2.5), round(plan.question_max / 2.5))
    assert sp["output_len"] == plan.output_tokens  # emulator tokens: the server counts them
    assert sp["seed"] == plan.seed
    load = cfg["load"]
    assert load["type"] == "poisson"
    assert load["stages"] == [{"rate": plan.rate, "duration": plan.duration_s}]
    assert load["request_timeout"] > plan.duration_s
    assert load["base_seed"] == plan.seed
    assert cfg["server"] == {
        "type": "vllm",
        "model_name": scenarios.MODEL,  # named: no /v1/models discovery request
        "base_url": "http://127.0.0.1:18080",
        "ignore_eos": True,
    }
    assert cfg["tokenizer"]["pretrained_model_name_or_path"] == "/tmp/tok"
    rl = cfg["report"]["request_lifecycle"]
    assert {50, 90, 99} <= set(rl["percentiles"]) and rl["use_server_output_tokens"] is True
    # nothing that reaches beyond the router: no Prometheus client, local storage only
    assert "metrics" not in cfg
    assert cfg["storage"] == {"local_storage": {"path": "/tmp/rep"}}
    assert infperf.hard_deadline_s(plan) > plan.duration_s + load["stage_teardown_grace_seconds"]


@pytest.mark.parametrize(
    "url", ["http://10.0.0.5:8000", "http://example.com:80", "http://192.168.1.2", "http://[::2]:1"]
)
def test_config_refuses_non_loopback_targets(url: str) -> None:
    with pytest.raises(ValueError, match="loopback"):
        _config(url)


def test_config_accepts_loopback_range() -> None:
    assert _config("http://127.0.0.2:9")["server"]["base_url"] == "http://127.0.0.2:9"
    with pytest.raises(ValueError, match="ratio"):
        _config(ratio=0)


def test_offline_env_strips_proxies_and_exporters() -> None:
    base = {
        "PATH": "/usr/bin",
        "HTTPS_PROXY": "http://proxy:3128",
        "http_proxy": "http://proxy:3128",
        "ALL_PROXY": "socks5://x",
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317",
        "HF_TOKEN": "secret",
        "AWS_ACCESS_KEY_ID": "x",
        "PYTHONPATH": "/work/main",
    }
    env = infperf.offline_env(base)
    assert env["PATH"] == "/usr/bin"
    for gone in (
        "HTTPS_PROXY",
        "http_proxy",
        "ALL_PROXY",
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "HF_TOKEN",
        "AWS_ACCESS_KEY_ID",
        "PYTHONPATH",
    ):
        assert gone not in env
    for key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        assert env[key] == "1"
    assert env["HF_HUB_DISABLE_TELEMETRY"] == "1"
    assert env["OTEL_TRACES_ENABLED"] == "false"
    assert env["NO_PROXY"] == "127.0.0.1,localhost"
    assert "PATH" not in infperf.offline_env({})


def test_tokenizer_config_lifts_the_truncation_length() -> None:
    cfg = {"model_max_length": 2048, "tokenizer_class": "TokenizersBackend"}
    out = infperf.tokenizer_config_for_counting(cfg)
    assert out["model_max_length"] >= 1 << 20
    assert out["tokenizer_class"] == "TokenizersBackend"
    assert cfg["model_max_length"] == 2048  # input untouched
    assert infperf.tokenizer_config_for_counting({})["model_max_length"] >= 1 << 20


def test_prepare_tokenizer_copies_files_without_weights(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "tokenizer.json").write_text("{}")
    (src / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 2048}))
    (src / "model.safetensors").write_bytes(b"\0" * 16)
    dst = infperf_run.prepare_tokenizer(src, tmp_path / "dst")
    assert sorted(p.name for p in dst.iterdir()) == ["tokenizer.json", "tokenizer_config.json"]
    assert json.loads((dst / "tokenizer_config.json").read_text())["model_max_length"] > 2048
    with pytest.raises(FileNotFoundError):
        infperf_run.prepare_tokenizer(tmp_path / "nothing", tmp_path / "x")


def test_ratio_counts_emulator_tokens_per_tokenizer_token() -> None:
    # digits are one emulator token each (byte fallback)
    assert infperf.ratio_from_texts(["1234", "5678"], 2) == pytest.approx(2.0)
    with pytest.raises(ValueError):
        infperf.ratio_from_texts([], 5)


def _summary(**over: Any) -> dict[str, Any]:
    """Shaped like inference-perf 0.7.0's summary_lifecycle_metrics.json (trimmed real run)."""
    doc: dict[str, Any] = {
        "benchmark_time_seconds": 14.37,
        "load_summary": {"count": 42},
        "successes": {
            "count": 40,
            "latency": {
                "request_latency": {"mean": 6.1, "median": 6.0, "p90": 8.2, "p99": 9.0},
                "time_to_first_token": {
                    "mean": 1.41,
                    "min": 0.065,
                    "max": 4.12,
                    "median": 0.848,
                    "p90": 3.236,
                    "p99": 3.931,
                },
                "time_per_output_token": {"mean": 0.0468, "median": 0.0453, "p90": 0.0657},
                "inter_token_latency": {"mean": 0.0128, "median": 0.0, "p90": 0.0439},
            },
            "throughput": {"output_tokens_per_sec": 345.08, "requests_per_sec": 2.78},
            "prompt_tokens": {"total": 134497.0, "cached": 90160.0, "mean": 3362.4},
        },
        "failures": {
            "count": 2,
            "request_latency": {"mean": 1.0},
            "by_label": {"http_503": {"count": 2, "messages": [{"message": "overloaded"}]}},
        },
    }
    doc.update(over)
    return doc


def test_parse_summary_converts_wall_to_modelled_seconds() -> None:
    f = infperf.parse_summary(_summary(), "fleetgate", time_scale=4.0, hit=0.67)
    assert f.tool == "inference-perf 0.7.0"
    assert (f.requests, f.errors) == (42, 2)
    assert f.ttft_p50 == pytest.approx(0.848 / 4)
    assert f.ttft_p90 == pytest.approx(3.236 / 4)
    assert f.ttft_p99 == pytest.approx(3.931 / 4)
    assert f.tpot_p50 == pytest.approx(0.0453 / 4)
    assert f.itl_p50 == 0.0
    assert f.output_tokens_per_s == pytest.approx(345.08 * 4)
    assert f.prompt_tokens_mean == pytest.approx(3362.4)
    assert f.hit_rate == 0.67
    assert f.error_kinds == {"http_503": 2}


def test_parse_summary_without_successes() -> None:
    doc = _summary(
        successes={
            "count": 0,
            "latency": {"time_to_first_token": None, "inter_token_latency": None},
            "throughput": {"output_tokens_per_sec": 0.0},
            "prompt_tokens": {"total": 0.0},
        }
    )
    f = infperf.parse_summary(doc, "x", 8.0)
    assert f.requests == 2 and f.errors == 2
    assert f.ttft_p50 is None and f.ttft_p90 is None and f.output_tokens_per_s is None
    assert f.prompt_tokens_mean is None


@pytest.mark.parametrize("doc", [{}, {"successes": {}}, {"successes": {"count": 1}}, []])
def test_parse_summary_refuses_foreign_documents(doc: Any) -> None:
    with pytest.raises(ValueError, match="not an inference-perf"):
        infperf.parse_summary(doc, "x", 1.0)


def test_find_summary(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=infperf.SUMMARY_FILE):
        infperf_run.find_summary(tmp_path)
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / infperf.SUMMARY_FILE).write_text("{}")
    assert infperf_run.find_summary(tmp_path).parent.name == "r"


def _result(sid: str, sent: float, ttft: float, e2e: float, tokens: int) -> RequestResult:
    gap = (e2e - ttft) / (tokens - 1)
    return RequestResult(
        sid, 0, "standard", sent, 200, ttft, e2e, [gap] * (tokens - 1), tokens
    )  # fmt: skip


def test_loadgen_figures_use_inference_perf_definitions() -> None:
    results = [
        _result("a", 0.0, 0.1, 1.1, 11),  # tpot 0.1
        _result("b", 1.0, 0.3, 0.8, 6),  # tpot 0.1
        _result("c", 2.0, 0.2, 2.2, 5),  # tpot 0.5, ends at 4.2
        RequestResult("d", 0, "standard", 3.0, 503, error="overloaded"),
    ]
    window = EngineWindow("vllm", "http://127.0.0.1:1", 100.0, 60.0, 22.0, 300.0, 0.0)
    rec = RunRecord("shared-prefix", "fleetgate", 0, 1.0, 5.0, 8.0, [window], results, 1.5)
    f = infperf.loadgen_figures(rec, lambda _c: 1.0)
    assert f.tool == "fleetgate loadgen"
    assert (f.requests, f.errors) == (4, 1)
    assert f.ttft_p50 == pytest.approx(0.2)
    assert f.tpot_p50 == pytest.approx(0.1)
    # tokens / (last end - first start), not / the arrival window
    assert f.output_tokens_per_s == pytest.approx(22 / 4.2)
    assert f.hit_rate == pytest.approx(0.6)
    assert f.router_cpu_s == 1.5
    assert infperf.mean_prompt_tokens([window], 3) == pytest.approx(100.0)
    assert infperf.mean_prompt_tokens([window], 0) is None


def test_table_rows_have_the_header_width() -> None:
    ok = infperf.parse_summary(_summary(), "fleetgate", 4.0, 0.5)
    bad = infperf.failed("sglang-router-cache_aware", "PeerUnavailable: pip said no")
    lines = infperf.table([ok, bad])
    widths = {line.count("|") for line in lines}
    assert len(widths) == 1, lines
    assert "0.212" in lines[2] and "pip said no" in lines[3]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["infperf", "chat-multiturn"], "only the shared-prefix"),
        (["infperf", "--contenders", "nope"], "unknown contender"),
        (["infperf", "--duration", "0"], "--duration"),
        (["infperf", "--source", "/nonexistent"], "no fleetgate package"),
    ],
)
def test_cli_refuses_bad_input_before_installing_anything(argv: list[str], message: str) -> None:
    parser = argparse.ArgumentParser()
    bench_cli.build_parser(parser)
    args = parser.parse_args(argv)
    with pytest.raises(CliError, match=message):
        bench_cli.run(args)


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_config_validates_against_inference_perf_schema(tmp_path: Path) -> None:
    # installs inference-perf into its cached venv on a machine that has none yet
    # (Python 3.12 + PyPI, as `fleetgate bench infperf` does); never skipped
    venv = infperf_run.ensure()
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(_config(), sort_keys=False))
    code = (  # read_config: the very loader `inference-perf -c FILE` uses
        "import sys; from inference_perf.config import read_config; c = read_config(sys.argv[1]); "
        "print(c.data.shared_prefix.num_groups, c.load.stages[0].rate, c.server.base_url)"
    )
    done = subprocess.run(
        [str(venv / "bin" / "python"), "-c", code, str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        env=infperf.offline_env({}),
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    plan = infperf.plan_for(_scenario())
    assert done.stdout.split() == [str(plan.groups), str(plan.rate), "http://127.0.0.1:18080"]


def test_tool_process_gets_only_the_offline_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4317")
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy:3128")
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    proc = infperf_run.start_offline(["env"], tmp_path / "env.log")
    try:
        assert proc.popen.wait(30) == 0
    finally:
        proc.stop()
    lines = set((tmp_path / "env.log").read_text().splitlines())
    assert "HF_HUB_OFFLINE=1" in lines and "TRANSFORMERS_OFFLINE=1" in lines
    assert not any(
        line.startswith(("OTEL_EXPORTER", "HTTPS_PROXY=", "PYTHONPATH=")) for line in lines
    )


@pytest.mark.parametrize(("name", "events"), [("fleetgate-events", True), ("fleetgate", False)])
def test_the_fleet_publishes_kv_events_when_the_contender_reads_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, events: bool
) -> None:
    """An events contender needs the engines' sockets: inference-perf's fleet is started
    as ``bench run`` starts it (it was started without events, and the router failed)."""
    from fleetgate_tools.bench import contenders, runner

    asked: list[object] = []

    def start_fleet(*args: object, **kwargs: object) -> runner.Fleet:
        asked.append(kwargs.get("kv_events"))
        raise OSError("no fleet in this test")

    monkeypatch.setattr(runner, "start_fleet", start_fleet)
    scenario = scenarios.make("shared-prefix", engines=2, duration_s=4, time_scale=2, seed=0)
    figs = infperf_run.run_infperf(
        scenario, contenders.CONTENDERS[name], tmp_path, tmp_path, tmp_path, 1.0, None
    )
    assert asked == [events]
    assert figs.error is not None and "no fleet in this test" in figs.error
