"""The ``fleetgate`` console command.

Each subcommand lives in its own module that exposes::

    def build_parser(parser: argparse.ArgumentParser) -> None: ...
    def run(args: argparse.Namespace) -> int: ...

Modules are imported only when their subcommand runs, so a slow import (kopf,
the kubernetes client) never slows ``fleetgate sim`` down.

The runtime's own commands are listed in :data:`COMMANDS`. The development
tools (``demo``, ``bench``, ``dev-cluster``, ``dashboards``) are a separate
distribution, ``fleetgate-tools`` (``tools/`` in the repository), that adds
its commands through the entry-point group ``fleetgate.commands``: each entry
point loads to a ``(module, one-line help)`` pair. This module never imports a
tool by name; without the tools installed their commands say how to get them.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from importlib.metadata import entry_points

#: the runtime's subcommands: name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "sim": ("fleetgate.sim.cli", "run emulated vLLM / TensorRT-LLM engines on loopback"),
    "router": ("fleetgate.router.cli", "run the OpenAI-compatible router"),
    "operator": ("fleetgate.operator.cli", "run the InferenceService operator"),
    "crds": ("fleetgate.api.cli", "write the CustomResourceDefinitions to crds/"),
}

#: entry-point group through which other distributions add subcommands
ENTRY_POINT_GROUP = "fleetgate.commands"

#: commands of the development tools, named only to explain their absence
TOOL_COMMANDS = ("demo", "bench", "dev-cluster", "dashboards")

TOOLS_HINT = (
    "it is a development tool, not part of the runtime package; install it from a "
    "fleetgate checkout with 'make venv' or 'pip install -e ./tools'"
)


class CliError(Exception):
    """A user-facing error: printed as one line, exit code 2."""


def plugin_commands() -> dict[str, tuple[str, str]]:
    """Subcommands registered by installed distributions (``fleetgate.commands``).

    An entry point that does not load to a ``(module, help)`` pair of strings
    is skipped; a name of the runtime's own cannot be taken over.
    """
    found: dict[str, tuple[str, str]] = {}
    for ep in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        if ep.name in COMMANDS or ep.name in found:
            continue
        try:
            value = ep.load()
        except ImportError:
            continue
        if isinstance(value, tuple) and len(value) == 2 and all(isinstance(v, str) for v in value):
            found[ep.name] = (value[0], value[1])
    return found


def all_commands() -> dict[str, tuple[str, str]]:
    return {**COMMANDS, **plugin_commands()}


def _usage(commands: dict[str, tuple[str, str]]) -> str:
    width = max(len(n) for n in [*commands, *TOOL_COMMANDS])
    lines = ["usage: fleetgate COMMAND [options]", "", "commands:"]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, help_) in commands.items()]
    missing = [n for n in TOOL_COMMANDS if n not in commands]
    if missing:
        lines += ["", f"not installed (development tools): {', '.join(missing)}"]
    lines += ["", "Run 'fleetgate COMMAND --help' for a command's options."]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in {"-h", "--help", "help"}:
        print(_usage(all_commands()))
        return 0
    if args[0] == "--version":
        from fleetgate import __version__

        print(__version__)
        return 0
    name, rest = args[0], args[1:]
    commands = COMMANDS if name in COMMANDS else all_commands()
    if name not in commands:
        if name in TOOL_COMMANDS:
            print(f"fleetgate: command {name!r} is not installed: {TOOLS_HINT}", file=sys.stderr)
        else:
            print(f"fleetgate: unknown command {name!r}\n\n{_usage(commands)}", file=sys.stderr)
        return 2
    module = importlib.import_module(commands[name][0])
    parser = argparse.ArgumentParser(prog=f"fleetgate {name}", description=commands[name][1])
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
