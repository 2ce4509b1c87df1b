"""``fleetgate bench run`` never overwrites committed reports by default."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from fleetgate.cli import main
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
