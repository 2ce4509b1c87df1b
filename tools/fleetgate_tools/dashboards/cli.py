"""``fleetgate dashboards``: write the Grafana dashboards the Helm chart ships."""

from __future__ import annotations

import argparse
from pathlib import Path

from fleetgate_tools.dashboards.build import write_all

DEFAULT_OUT = Path(__file__).resolve().parents[3] / "charts" / "fleetgate" / "dashboards"


def build_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help="directory for the JSON files"
    )


def run(args: argparse.Namespace) -> int:
    for path in write_all(args.out):
        print(path)
    return 0
