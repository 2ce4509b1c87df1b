"""inference-perf cross-check: workload mapping, config, offline env, report parsing.

No network and no inference-perf run here; the one test that validates the
config against inference-perf's own schema runs in its venv when installed
(``slow``) and says so when it is not.
"""

from __future__ import annotations

import argparse
import dataclasses
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


def _entry(
    start: float, prompt: str, ttft: float | None = 0.4, latency: float = 2.0, cached: int = 3000
) -> dict[str, Any]:
    """Shaped like one item of inference-perf 0.7.0's per_request_lifecycle_metrics.json
    (a trimmed real run: request body, info with the engine's usage, computed_metrics)."""
    body = {"model": scenarios.MODEL, "prompt": prompt, "max_tokens": 124, "stream": True}
    entry: dict[str, Any] = {
        "start_time": start,
        "end_time": start + latency,
        "request": json.dumps(body),
        "info": {
            "request_metrics": {"text": {"input_tokens": 3403}},
            "response_metrics": {
                "output_tokens": 486,  # re-tokenized by tiny-llama: not the engine's count
                "server_usage": {
                    "prompt_tokens": 3403,
                    "total_tokens": 3527,
                    "completion_tokens": 124,
                    "prompt_tokens_details": {"cached_tokens": cached},
                },
            },
        },
        "error": None,
    }
    if ttft is None:
        entry["error"] = {"error_type": "http_503", "error_msg": "overloaded"}
        entry["info"]["response_metrics"] = None
    else:
        entry["computed_metrics"] = {
            "request_latency": latency,
            "time_to_first_token": ttft,
            "time_per_output_token": 0.0128,
            "inter_token_latency": 0.0,
            "output_tokens": 486,
        }
    return entry


def test_per_request_records_become_modelled_results_in_dispatch_order() -> None:
    entries = [
        _entry(21050.0, "doc B question 2", ttft=0.8, latency=4.0, cached=0),
        _entry(21046.0, "doc A question 1", ttft=0.4, latency=2.0),
        _entry(21048.0, "doc A question 3", ttft=None),
    ]
    rs = infperf.results_from_per_request(entries, time_scale=4.0)
    assert [r.sent_at for r in rs] == [0.0, 0.5, 1.0]  # (start - first start) / scale
    first, failed, last = rs
    assert first.ok and first.ttft == pytest.approx(0.1) and first.e2e == pytest.approx(0.5)
    # the engine's own counts, not the tool's re-tokenized output
    assert (first.output_tokens, first.prompt_tokens, first.cached_tokens) == (124, 3403, 3000)
    assert last.cached_tokens == 0 and last.ttft == pytest.approx(0.2)
    assert not failed.ok and failed.ttft is None and "http_503" in (failed.error or "")
    assert first.itl == []  # its per-chunk gaps are re-tokenized: not used
    # the session id is the prompt: the same prompt pairs across contenders
    again = infperf.results_from_per_request([_entry(7.0, "doc A question 1")], 4.0)
    assert again[0].session_id == first.session_id != last.session_id


@pytest.mark.parametrize(
    "doc", [{}, [{"no": "start"}], [{"start_time": "x"}], "text", [["start_time"]]]
)
def test_per_request_parse_refuses_foreign_documents(doc: Any) -> None:
    with pytest.raises(ValueError, match="not an inference-perf"):
        infperf.results_from_per_request(doc, 1.0)


def test_find_per_request(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=infperf.PER_REQUEST_FILE):
        infperf_run.find_per_request(tmp_path)
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / infperf.PER_REQUEST_FILE).write_text("[]")
    assert infperf_run.find_per_request(tmp_path).parent.name == "r"


def _result(sid: str, sent: float, ttft: float, e2e: float, tokens: int) -> RequestResult:
    gap = (e2e - ttft) / (tokens - 1)
    return RequestResult(
        sid, 0, "standard", sent, 200, ttft, e2e, [gap] * (tokens - 1), tokens,
        cached_tokens=60, prompt_tokens=100,
    )  # fmt: skip


def test_figures_are_the_steady_state_with_inference_perf_definitions() -> None:
    results = [
        _result("w", 0.0, 9.0, 9.5, 3),  # warm-up: in no figure
        _result("a", 1.0, 0.1, 1.1, 11),  # tpot 0.1
        _result("b", 2.0, 0.3, 0.8, 6),  # tpot 0.1
        _result("c", 3.0, 0.2, 2.2, 5),  # tpot 0.5, ends at 5.2
        RequestResult("d", 0, "standard", 4.0, 503, error="overloaded"),
    ]
    results[2].cached_tokens = 0
    window = EngineWindow("vllm", "http://127.0.0.1:1", 100.0, 60.0, 22.0, 300.0, 0.0)
    rec = RunRecord(
        "shared-prefix", "fleetgate", 3, 1.0, 6.0, 8.0, [window], results, 1.5, warmup_s=0.5
    )
    f = infperf.figures_of(rec, "fleetgate loadgen", lambda _c: 1.0)
    assert (f.tool, f.contender, f.seed) == ("fleetgate loadgen", "fleetgate", 3)
    assert (f.requests, f.errors, f.warmup_requests) == (4, 1, 1)
    assert f.ttft_p50 == pytest.approx(0.2) and f.ttft_p99 == pytest.approx(0.3)
    assert f.tpot_p50 == pytest.approx(0.1)
    # tokens / (last end - first start) over the steady requests
    assert f.output_tokens_per_s == pytest.approx(22 / 4.2)
    assert f.hit_rate == pytest.approx(120 / 300)  # the answers' usage, not the engines'
    assert f.prompt_tokens_mean == pytest.approx(100.0)
    assert f.router_cpu_s == 1.5
    broken = dataclasses.replace(rec, error="PeerUnavailable: pip said no")
    assert infperf.figures_of(broken, "x", lambda _c: 1.0).error == "PeerUnavailable: pip said no"


def test_table_gives_seed_medians_with_ranges_and_keeps_errors() -> None:
    def fig(seed: int, p90: float | None, error: str | None = None) -> infperf.Figures:
        return infperf.Figures(
            "inference-perf 0.7.0", "fleetgate", seed, 100, 0, 0.1, p90, 0.9, 0.012, 900.0,
            3400.0, 0.7, 1.2, error=error,
        )  # fmt: skip

    rows = [fig(0, 0.5), fig(1, 0.7), fig(2, 0.6), fig(3, None, "ProcessError: killed")]
    bad = infperf.Figures(
        "fleetgate loadgen", "sglang-router-cache_aware", 0, 0, 0, None, None, None, None,
        None, None, None, error="PeerUnavailable: pip said no",
    )  # fmt: skip
    lines = infperf.table([*rows, bad])
    assert len({line.count("|") for line in lines}) == 1, lines
    assert "| 3 | 300 |" in lines[2] and "0.600 (0.500-0.700)" in lines[2]
    assert "seed 3 error: ProcessError: killed" in lines[3]
    assert "pip said no" in lines[4]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["infperf", "chat-multiturn"], "only the shared-prefix"),
        (["infperf", "--contenders", "nope"], "unknown contender"),
        (["infperf", "--duration", "0"], "--duration"),
        (["infperf", "--seeds", "0,x"], "--seeds"),
        (["infperf", "--seeds", "1,1"], "distinct"),
        (["infperf", "--duration", "10", "--warmup", "10"], "shorter than --duration"),
        (["infperf", "--warmup", "abc"], "--warmup"),
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


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_a_real_inference_perf_run_becomes_a_record_of_its_requests(tmp_path: Path) -> None:
    """The contract with the tool itself: inference-perf 0.7.0 (installed on first use)
    drives a real 2-engine emulated fleet through fleetgate, and its per-request
    report parses into one result per request it sent, with the engines' usage."""
    from realvllm import ensure_model, ensure_venv

    from fleetgate_tools.bench import contenders

    venv = infperf_run.ensure()
    tok = infperf_run.prepare_tokenizer(ensure_model(ensure_venv()), tmp_path / "tok")
    ratio = infperf_run.calibrate_ratio(venv, tok)
    sc = scenarios.make("shared-prefix", engines=2, modelled_s=3.0, time_scale=4.0, seed=0)
    plan = infperf.plan_for(sc)
    rec = infperf_run.run_infperf(
        sc, contenders.CONTENDERS["fleetgate"], tmp_path / "run", venv, tok, ratio, None,
        warmup_s=0.3,
    )  # fmt: skip
    assert rec.error is None, rec.error
    assert rec.workload == "shared-prefix (inference-perf 0.7.0)" and rec.repeat == 0
    assert len(rec.results) == plan.requests
    assert all(r.ok for r in rec.results), [r.error for r in rec.results if not r.ok]
    assert len({r.session_id for r in rec.results}) == plan.requests  # one prompt each
    sent = [r.sent_at for r in rec.results]
    assert sent == sorted(sent) and sent[0] == 0.0 and sent[-1] < 2 * sc.duration_s
    for r in rec.results:
        assert r.ttft is not None and r.e2e is not None and 0 < r.ttft < r.e2e
        assert r.output_tokens == plan.output_tokens  # ignore_eos, the engine's count
        assert r.prompt_tokens is not None and r.cached_tokens is not None
        assert abs(r.prompt_tokens - plan.prefix_tokens) < 0.15 * plan.prefix_tokens
    # requests sharing a document hit the prefix cache
    assert sum(r.cached_tokens or 0 for r in rec.results) > plan.prefix_tokens
    assert len(rec.engines) == 2 and rec.router_cpu_s is not None
    f = infperf.figures_of(rec, infperf_run.tool_name(), sc.objective)
    assert f.requests + f.warmup_requests == plan.requests and f.errors == 0
    assert f.hit_rate is not None and 0 < f.hit_rate < 1


def test_the_command_compares_each_tool_against_its_own_best_peer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``bench infperf`` end to end with the runs replaced by seeded records: one row
    per (contender, tool), seed medians, and one comparison per tool, paired by seed."""
    import random

    from fleetgate_tools.bench import peers

    monkeypatch.setattr(infperf_run, "ensure", lambda *a, **k: tmp_path)
    monkeypatch.setattr(peers, "prepare", lambda *a, **k: {})
    monkeypatch.setattr(infperf_run, "prepare_tokenizer", lambda src, dst: dst)
    monkeypatch.setattr(infperf_run, "calibrate_ratio", lambda *a, **k: 2.5)

    def record(sc: scenarios.Scenario, name: str, tool: str, slow: float) -> RunRecord:
        rng = random.Random(sc.seed)  # the same requests for every contender of a seed
        results = [
            RequestResult(f"p{i}", 0, "standard", i * 0.05, 200, rng.uniform(0.1, 1.0) * slow)
            for i in range(200)
        ]
        for r in results:
            r.e2e, r.output_tokens, r.cached_tokens, r.prompt_tokens = 2.0, 124, 2000, 3400
        return RunRecord(
            infperf_run.workload_label(sc, tool), name, sc.seed, 1.0, sc.duration_s,
            sc.time_scale, [], results, 1.0, warmup_s=1.0,
        )  # fmt: skip

    slow = {"fleetgate-events": 0.5, "sglang-router-cache_aware": 1.0}
    monkeypatch.setattr(
        infperf_run,
        "run_loadgen",
        lambda sc, c, *a: record(sc, c.name, infperf_run.LOADGEN, slow[c.name]),
    )
    monkeypatch.setattr(
        infperf_run,
        "run_infperf",
        lambda sc, c, *a: record(sc, c.name, infperf_run.tool_name(), slow[c.name] * 1.2),
    )
    parser = argparse.ArgumentParser()
    bench_cli.build_parser(parser)
    out = tmp_path / "out.json"
    args = parser.parse_args(
        ["infperf", "--contenders", "fleetgate-events,sglang-router-cache_aware",
         "--engines", "2", "--duration", "10", "--warmup", "1", "--seeds", "0,1",
         "--time-scale", "4", "--keep", str(tmp_path / "keep"), "--json", str(out),
         "--bootstrap", "200"]
    )  # fmt: skip
    assert bench_cli.run(args) == 0
    doc = json.loads(out.read_text())
    assert len(doc["rows"]) == 8  # 2 contenders x 2 tools x 2 seeds
    assert {r["requests"] for r in doc["rows"]} == {180}  # 20 sent in the warm-up
    comps = {c["workload"]: c for c in doc["comparisons"]}
    assert set(comps) == {
        "shared-prefix (fleetgate loadgen)",
        "shared-prefix (inference-perf 0.7.0)",
    }
    for c in comps.values():
        assert (c["contender"], c["baseline"], c["seeds"]) == (
            "fleetgate-events",
            "sglang-router-cache_aware",
            2,
        )
        p90 = c["figures"]["ttft_p90_ratio"]
        assert p90["estimate"] == pytest.approx(0.5) and p90["verdict"] == "win"
    text = capsys.readouterr().out
    assert "| fleetgate-events | inference-perf 0.7.0 | 2 | 360 |" in text
