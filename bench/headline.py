"""Print the README headline table from ``fleetgate bench run --json`` files.

    python bench/headline.py /tmp/fg-bench/*.json
    python bench/headline.py --plots bench/results /tmp/fg-bench/x.json   # redraw PNGs

One row per workload for fleetgate (default settings) and each peer router,
medians of repeats with (min-max), followed by the goal verdicts.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from fleetgate_tools.bench import report
from fleetgate_tools.bench.summary import Aggregate


def load(path: Path) -> list[Aggregate]:
    doc = json.loads(path.read_text())
    out = []
    for m in doc["medians"]:
        metrics = {k: (tuple(v) if v is not None else None) for k, v in m["metrics"].items()}
        out.append(
            Aggregate(
                workload=m["workload"],
                contender=m["contender"],
                load_factor=m["load_factor"],
                repeats=m["repeats"],
                failed=m["failed"],
                errors=tuple(m["errors"]),
                metrics=metrics,  # type: ignore[arg-type]
            )
        )
    return out


def main(paths: list[str]) -> int:
    plots_dir = None
    if paths[:1] == ["--plots"]:
        plots_dir, paths = Path(paths[1]), paths[2:]
    aggs: list[Aggregate] = []
    commands = []
    for p in paths:
        aggs += load(Path(p))
        commands.append(json.loads(Path(p).read_text())["command"])
    print("\n".join(report.headline_table(aggs)))
    print()
    for w in dict.fromkeys(a.workload for a in aggs):
        print(f"{w}:")
        print("\n".join(report.goal_lines(w, [a for a in aggs if a.workload == w])))
    print()
    print("\n".join(commands))
    if plots_dir is not None:
        for p in paths:
            name = Path(p).stem
            mine = load(Path(p))
            prefix = f"{name}-" if name not in {a.workload for a in mine} else ""
            for written in report.write_plots(mine, plots_dir, prefix):
                print(f"plot: {written}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
