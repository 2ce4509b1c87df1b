"""The ``fleetgate`` subcommands these tools add.

``tools/pyproject.toml`` registers each constant below in the entry-point group
``fleetgate.commands``; ``fleetgate/cli.py`` loads this small module to list
them and imports a command's module only when that command runs. Each value
is ``(module, one-line help)``; the module exposes ``build_parser(parser)``
and ``run(args) -> int``.
"""

from __future__ import annotations

DEMO = ("fleetgate_tools.demo", "run an emulated mixed fleet behind the router and summarise it")
BENCH = ("fleetgate_tools.bench.cli", "run fleet benchmarks")
DEV_CLUSTER = ("fleetgate_tools.devcluster.cli", "start/stop the local Kubernetes test cluster")
DASHBOARDS = ("fleetgate_tools.dashboards.cli", "write the Grafana dashboards shipped in the chart")
