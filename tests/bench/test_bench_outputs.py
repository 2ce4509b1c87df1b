"""``fleetgate bench run`` never overwrites committed reports by default."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from fleetgate.cli import CliError, main
from fleetgate_tools.bench import cli as bench_cli


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench_cli.build_parser(parser)
    return parser.parse_args(argv)


def test_default_report_dir_is_a_new_directory_in_the_cache(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("FLEETGATE_CACHE", str(tmp_path))
    assert parse(["run", "agentic"]).report is None
    d = bench_cli.default_report_dir(0.0)
    assert d == tmp_path / "bench" / "19700101T000000Z"
    assert "bench/results" not in str(d)


def test_existing_report_is_not_overwritten_without_force(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "agentic.md").write_text("committed report\n")
    (tmp_path / "agentic.png").write_bytes(b"png")
    argv = ["bench", "run", "agentic", "--duration", "1", "--report", str(tmp_path)]
    # refused before any fleet starts (a run would take far longer than this test)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "would overwrite" in err and "agentic.md" in err and "--force" in err
    assert (tmp_path / "agentic.md").read_text() == "committed report\n"
    json_file = tmp_path / "r.json"
    json_file.write_text("{}")
    assert main(["bench", "run", "agentic", "--no-report", "--json", str(json_file)]) == 2
    assert "r.json" in capsys.readouterr().err


def test_existing_outputs_lists_what_a_run_would_replace(tmp_path: Path) -> None:
    args = parse(["run", "shared-prefix,agentic", "--report", str(tmp_path), "--report-name", "x"])
    settings = bench_cli.resolve(args)
    assert bench_cli.existing_outputs(args, settings) == []
    (tmp_path / "x.md").write_text("")
    (tmp_path / "x-agentic.png").write_bytes(b"")
    (tmp_path / "agentic.png").write_bytes(b"")  # another report's plot: not ours
    assert bench_cli.existing_outputs(args, settings) == [
        tmp_path / "x.md",
        tmp_path / "x-agentic.png",
    ]


def test_duration_is_modelled_and_wall_duration_keeps_the_old_meaning() -> None:
    s = bench_cli.resolve(parse(["run", "agentic", "--duration", "60", "--time-scale", "8"]))
    assert s.duration_s == 60 and s.modelled_s(8.0) == 60
    assert s.warmup_s(60) == pytest.approx(6.0), "default warm-up: 10% of the window"
    old = bench_cli.resolve(parse(["run", "agentic", "--wall-duration", "30", "--time-scale", "8"]))
    assert old.modelled_s(8.0) == 3.75
    with pytest.raises(CliError, match="not both"):
        bench_cli.resolve(parse(["run", "agentic", "--duration", "5", "--wall-duration", "5"]))
    assert bench_cli.resolve(parse(["run", "agentic"])).duration_s == 60


@pytest.mark.parametrize(
    ("text", "expected"), [("10%", (10.0, True)), ("5", (5.0, False)), ("0", (0.0, False))]
)
def test_warmup_is_seconds_or_a_percentage(text: str, expected: tuple[float, bool]) -> None:
    assert bench_cli.parse_warmup(text) == expected


@pytest.mark.parametrize("text", ["x", "-1", "100%"])
def test_bad_warmups_are_refused(text: str) -> None:
    with pytest.raises(CliError, match="--warmup"):
        bench_cli.parse_warmup(text)


def test_a_warmup_longer_than_the_run_is_refused() -> None:
    with pytest.raises(CliError, match="shorter than --duration"):
        bench_cli.resolve(parse(["run", "agentic", "--duration", "5", "--warmup", "5"]))


def test_seeds_and_the_old_seed_repeats_flags() -> None:
    assert bench_cli.resolve(parse(["run", "agentic", "--seeds", "0,1,2"])).seeds == [0, 1, 2]
    assert bench_cli.resolve(parse(["run", "agentic", "--seed", "4", "--repeats", "2"])).seeds == [
        4,
        5,
    ]
    assert bench_cli.resolve(parse(["run", "agentic"])).seeds == [0]
    with pytest.raises(CliError, match="not both"):
        bench_cli.resolve(parse(["run", "agentic", "--seeds", "1,2", "--repeats", "2"]))
    with pytest.raises(CliError, match="distinct"):
        bench_cli.resolve(parse(["run", "agentic", "--seeds", "1,1"]))
    with pytest.raises(CliError, match="integers"):
        bench_cli.resolve(parse(["run", "agentic", "--seeds", "a"]))


def test_time_scale_auto_number_or_default() -> None:
    assert bench_cli.resolve(parse(["run", "agentic", "--time-scale", "auto"])).time_scale is None
    assert bench_cli.resolve(parse(["run", "agentic", "--engines", "3"])).time_scale == 6.0
    assert bench_cli.resolve(parse(["run", "agentic", "--time-scale", "2.5"])).time_scale == 2.5
    with pytest.raises(CliError, match="a number or 'auto'"):
        bench_cli.resolve(parse(["run", "agentic", "--time-scale", "fast"]))
    with pytest.raises(CliError, match="--router-replicas"):
        bench_cli.resolve(parse(["run", "agentic", "--router-replicas", "0"]))


def test_command_line_spells_out_the_steady_state_settings(tmp_path: Path) -> None:
    args = parse(
        ["run", "evictions", "--seeds", "0,1,2", "--time-scale", "auto", "--router-replicas", "2"]
        + ["--warmup", "5", "--report", str(tmp_path)]
    )
    line = bench_cli.command_line(args, bench_cli.resolve(args))
    for part in ("--duration 60", "--warmup 5 ", "--seeds 0,1,2", "--time-scale auto"):
        assert part in line
    assert "--router-replicas 2" in line


def test_several_replica_counts_name_the_contenders() -> None:
    s = bench_cli.resolve(parse(["run", "agentic", "--router-replicas", "1,2"]))
    assert s.router_replicas == (1, 2)
    fg = s.contenders[0]
    assert [s.contender_name(fg, n) for n in (1, 2)] == ["fleetgate", "fleetgate@2r"]
    only_two = bench_cli.resolve(parse(["run", "agentic", "--router-replicas", "2"]))
    assert only_two.contender_name(fg, 2) == "fleetgate", "one count: plain names"
    for bad in ("0", "1,1", "x", "5"):
        with pytest.raises(CliError, match="--router-replicas"):
            bench_cli.resolve(parse(["run", "agentic", "--router-replicas", bad]))


def test_references_print_the_ceiling_and_the_ttft_floor_and_start_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--references`` computes from the requests alone (a conversation's answers
    replayed offline): no fleet, no report written even where one would be refused."""
    (tmp_path / "evictions.md").write_text("committed report\n")
    argv = ["bench", "run", "evictions,chat-multiturn", "--engines", "4", "--duration", "20"]
    argv += ["--warmup", "2", "--report", str(tmp_path), "--references"]
    assert main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("evictions: hit-rate ceiling 85.1%")
    assert "unloaded TTFT p90 floor" in out[1] and "0.108 s with the ceiling's hits" in out[1]
    assert out[2].startswith("chat-multiturn: hit-rate ceiling")
    assert "unloaded TTFT p90 floor" in out[3] and len(out) == 4
    assert (tmp_path / "evictions.md").read_text() == "committed report\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["evictions.md"]


def test_requests_file_holds_each_run_its_engines_and_every_request(tmp_path: Path) -> None:
    from fleetgate_tools.bench.stats import RequestResult
    from fleetgate_tools.bench.summary import EngineWindow, RunRecord

    engine = EngineWindow("vllm", "http://127.0.0.1:9", 100.0, 40.0, 7.0, 100.0, 0.0)
    done = RequestResult("chat-0", 1, "standard", 2.0, 200, 0.1, 0.5, [0.01] * 3, 4, 32, 80)
    failed = RequestResult("chat-1", 0, "standard", 0.1, 503, error="busy", text="partial")
    rec = RunRecord("chat-multiturn", "a", 0, 0.35, 15.0, 8.0, [engine], [done, failed], 1.0)
    rec.extra["seed"] = 3
    out = tmp_path / "sub" / "requests.jsonl"
    bench_cli.write_requests(out, [rec, rec])
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["record"] for r in lines] == ["run", "engine", "request", "request"] * 2
    assert lines[0]["seed"] == 3 and lines[0]["contender"] == "a" and lines[0]["warmup_s"] == 0
    assert lines[1]["prefix_hit_tokens"] == 40.0 and lines[1]["url"] == "http://127.0.0.1:9"
    assert lines[2]["session_id"] == "chat-0" and lines[2]["turn"] == 1
    assert (lines[2]["cached_tokens"], lines[2]["prompt_tokens"]) == (32, 80)
    assert lines[3]["error"] == "busy" and lines[3]["status"] == 503
    assert "itl" not in lines[2] and "text" not in lines[3]


def test_an_existing_requests_file_is_not_overwritten(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    kept = tmp_path / "r.jsonl"
    kept.write_text("old\n")
    assert main(["bench", "run", "agentic", "--no-report", "--requests", str(kept)]) == 2
    assert "r.jsonl" in capsys.readouterr().err and kept.read_text() == "old\n"
