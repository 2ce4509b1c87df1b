"""Short, bounded end-to-end runs of ``fleetgate bench run`` and ``fleetgate demo``.

Both start a real emulated fleet and the router as loopback subprocesses
(about 15-25 s each on a loaded 2-core machine) and stop them again.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from fleetgate.cli import main


def test_bench_run_shared_prefix_against_fleetgate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "r.json"
    rc = main(
        [
            "bench", "run", "shared-prefix", "--engines", "2", "--duration", "5",
            "--contenders", "fleetgate", "--json", str(out), "--report", str(tmp_path),
        ]
    )  # fmt: skip
    assert rc == 0
    doc = json.loads(out.read_text())
    (run,) = doc["runs"]
    assert run["error"] is None
    assert run["requests"] >= 3 and run["errors"] == 0
    assert 0 < run["ttft_p50"] <= run["ttft_p99"]
    # the engines really served the documents and report their own cache counters
    assert run["hit_rate"] is not None and 0.0 <= run["hit_rate"] <= 1.0
    assert run["imbalance"] is not None and run["imbalance"] >= 1.0
    assert run["router_cpu_s"] is not None and run["router_cpu_s"] > 0
    assert run["output_tokens_per_s"] > 0
    md = (tmp_path / "shared-prefix.md").read_text()
    assert "fleetgate bench run shared-prefix --engines 2 --duration 5" in md
    assert re.search(r"^\| fleetgate \| \d+ \| 0 \|", md, re.M)
    assert (tmp_path / "shared-prefix.png").read_bytes()[:4] == b"\x89PNG"
    printed = capsys.readouterr().out
    assert "| fleetgate |" in printed


def test_bench_run_refuses_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "run", "nope"]) == 2
    assert "unknown workload 'nope'" in capsys.readouterr().err
    assert main(["bench", "run", "agentic", "--contenders", "fleetgate,bogus"]) == 2
    assert "unknown contender 'bogus'" in capsys.readouterr().err
    assert main(["bench", "run", "agentic", "--load-factors", "x"]) == 2
    assert "--load-factors" in capsys.readouterr().err
    assert main(["bench", "run", "agentic", "--report-name", "../x"]) == 2
    assert "plain file name" in capsys.readouterr().err
    assert main(["bench", "run", "agentic", "--source", "/nonexistent"]) == 2
    assert "no fleetgate package" in capsys.readouterr().err


def test_demo_short_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_dir = tmp_path / "out"
    argv = ["demo", "--duration", "5", "--baseline", "none", "--out", str(out_dir)]
    assert main(argv) == 0
    captured = capsys.readouterr()
    out = captured.out
    rows = {
        m[1]: int(m[2])
        for m in re.finditer(
            r"^(critical|batch|standard): TTFT <= \S+ s met\s+\S+ \(\d+/(\d+)\)", out, re.M
        )
    }
    assert set(rows) == {"critical", "batch", "standard"} and all(rows.values())
    assert "prefix-cache hit rate (engines)" in out and "router preemptions" in out
    load = re.search(r"^fleetgate: generated tokens per engine: (.*)$", out, re.M)
    assert load is not None and load[1].count("vLLM ") == 3 and load[1].count("TRT-LLM ") == 2
    png = out_dir / "fleetgate-demo.png"
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert f"plot: {png}" in out and f"summary: {out_dir / 'fleetgate-demo.txt'}" in out
    assert "critical: TTFT <= 0.5 s met" in (out_dir / "fleetgate-demo.txt").read_text()
    err = captured.err
    assert "fleetgate  [" in err, "progress bar on stderr"
    assert re.search(r"fleetgate\s+done in \d+ s \(start-up \d+ s, traffic 5 s", err)
