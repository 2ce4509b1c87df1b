"""The ``fleetgate`` console command.

Each subcommand lives in its own module that exposes::

    def build_parser(parser: argparse.ArgumentParser) -> None: ...
    def run(args: argparse.Namespace) -> int: ...

Modules are imported only when their subcommand runs, so a slow import (kopf,
the kubernetes client) never slows ``fleetgate sim`` down.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

#: subcommand -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("fleetgate.demo", "run an emulated mixed fleet behind the router and summarise it"),
    "sim": ("fleetgate.sim.cli", "run emulated vLLM / TensorRT-LLM engines on loopback"),
    "router": ("fleetgate.router.cli", "run the OpenAI-compatible router"),
    "operator": ("fleetgate.operator.cli", "run the InferenceService operator"),
    "crds": ("fleetgate.api.cli", "write the CustomResourceDefinitions to crds/"),
    "dev-cluster": ("fleetgate.devcluster.cli", "start/stop the local Kubernetes test cluster"),
    "bench": ("fleetgate.bench.cli", "run fleet benchmarks"),
    "dashboards": ("fleetgate.dashboards.cli", "write the Grafana dashboards shipped in the chart"),
}


class CliError(Exception):
    """A user-facing error: printed as one line, exit code 2."""


def _usage() -> str:
    width = max(len(n) for n in COMMANDS)
    lines = ["usage: fleetgate COMMAND [options]", "", "commands:"]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "Run 'fleetgate COMMAND --help' for a command's options."]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in {"-h", "--help", "help"}:
        print(_usage())
        return 0
    if args[0] == "--version":
        from fleetgate import __version__

        print(__version__)
        return 0
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        print(f"fleetgate: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    parser = argparse.ArgumentParser(prog=f"fleetgate {name}", description=COMMANDS[name][1])
    module.build_parser(parser)
    ns = parser.parse_args(rest)
    try:
        return int(module.run(ns))
    except CliError as e:
        one_line = " ".join(str(e).split())  # e.g. a YAML parser's multi-line message
        print(f"fleetgate {name}: error: {one_line}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
