"""``fleetgate crds``: write (or check) the CRDs rendered from :mod:`fleetgate.api`.

``fleetgate crds`` writes ``crds/inferenceservices.fleetgate.dev.yaml``;
``fleetgate crds --check`` writes nothing and exits 1 when the file differs from
what the models render (for CI and pre-commit).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fleetgate.api import crd
from fleetgate.cli import CliError


def build_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("crds"),
        help="directory to write the CRD YAML into (default: ./crds)",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="do not write; exit 1 when the file on disk is out of date",
    )


def run(args: argparse.Namespace) -> int:
    out_dir: Path = args.out
    target = out_dir / crd.CRD_FILE_NAME
    text = crd.render_crd_yaml()
    if args.check:
        try:
            current = target.read_text(encoding="utf-8")
        except FileNotFoundError:
            print(f"{target}: missing; run 'fleetgate crds'", file=sys.stderr)
            return 1
        if current != text:
            print(f"{target}: out of date; run 'fleetgate crds'", file=sys.stderr)
            return 1
        print(f"{target}: up to date")
        return 0
    if out_dir.exists() and not out_dir.is_dir():
        raise CliError(f"{out_dir} exists and is not a directory")
    out_dir.mkdir(parents=True, exist_ok=True)
    target.write_text(text, encoding="utf-8")
    print(f"wrote {target}")
    return 0
