"""``fleetgate operator``: run the InferenceService operator (kopf underneath).

Credentials come from ``--kubeconfig``, ``KUBECONFIG``, in-cluster service account
or ``~/.kube/config``, in that order. Start-up problems (no credentials, API
unreachable, CRD not installed, a bad option) are one-line errors, exit code 2.
"""

from __future__ import annotations

import argparse
import logging
import os

from fleetgate.cli import CliError
from fleetgate.operator.options import (
    ENV_EXTRA_TOLERATIONS,
    OperatorOptions,
    OptionsError,
    parse_tolerations,
)
from fleetgate.operator.pools import PoolOptionError, parse_class_roles, parse_pool_budgets


def build_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kubeconfig", help="kubeconfig file (default: the usual places)")
    parser.add_argument(
        "--namespace",
        action="append",
        default=[],
        help="watch only this namespace (repeatable; default: all namespaces)",
    )
    parser.add_argument(
        "--metrics-host", default="0.0.0.0", help="address for /metrics and /healthz"
    )
    parser.add_argument(
        "--metrics-port", type=int, default=8080, help="port for /metrics and /healthz"
    )
    parser.add_argument(
        "--interval",
        type=float,
        default=30.0,
        help="seconds between level-based re-checks of every InferenceService (default 30)",
    )
    parser.add_argument(
        "--extra-toleration",
        action="append",
        default=[],
        metavar="KEY[=VALUE][:EFFECT]",
        help=f"add a toleration to every engine pod (test clusters; also ${ENV_EXTRA_TOLERATIONS})",
    )
    parser.add_argument("--cluster-domain", default="cluster.local", help="for status.url")
    parser.add_argument(
        "--autoscale-interval",
        type=float,
        default=15.0,
        help="seconds between autoscaling decisions (default 15)",
    )
    parser.add_argument(
        "--router-selector",
        default="app.kubernetes.io/component=router",
        help="label selector of the router pods whose /metrics carry the demand",
    )
    parser.add_argument(
        "--router-namespace",
        default=None,
        help="namespace of the router pods (default: the watched namespaces)",
    )
    parser.add_argument(
        "--router-metrics-port", type=int, default=8080, help="port of the routers' /metrics"
    )
    parser.add_argument(
        "--router-metrics-url",
        action="append",
        default=[],
        metavar="URL",
        help="a fixed router /metrics URL instead of finding router pods (repeatable)",
    )
    parser.add_argument(
        "--class-role",
        action="append",
        default=[],
        metavar="CLASS=ROLE",
        help="which role's services take a priority class's demand when one model has "
        "both roles in a pool (repeatable; over the defaults critical=latency, "
        "standard=latency, batch=throughput, sheddable=throughput; '*=ROLE' for "
        "unlisted classes, default latency)",
    )
    parser.add_argument(
        "--pool-gpu-budget",
        action="append",
        default=[],
        metavar="POOL=N",
        help="most GPUs (replicas x gpu.count) the autoscaled services of a routing pool "
        "may hold together (repeatable; default: no budget)",
    )
    parser.add_argument(
        "--pool-consolidation",
        action="store_true",
        help="let the roles of a pool share their replicas: the throughput role grows "
        "only for what the latency role's replicas have no room for, and one role at "
        "minReplicas 0 stands at zero while the other's one replica serves both "
        "(default: every role with demand runs its own replicas for its own classes)",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")


def options_from(args: argparse.Namespace, environ: dict[str, str]) -> OperatorOptions:
    """Options from flags and environment, or a :class:`CliError`."""
    if args.interval <= 0:
        raise CliError(f"--interval must be > 0, got {args.interval}")
    if args.autoscale_interval <= 0:
        raise CliError(f"--autoscale-interval must be > 0, got {args.autoscale_interval}")
    if not 1 <= args.router_metrics_port <= 65535:
        raise CliError(f"--router-metrics-port must be 1-65535, got {args.router_metrics_port}")
    if not 0 <= args.metrics_port <= 65535:
        raise CliError(f"--metrics-port must be 0-65535, got {args.metrics_port}")
    try:
        tolerations = parse_tolerations(environ.get(ENV_EXTRA_TOLERATIONS, ""))
        for text in args.extra_toleration:
            tolerations += parse_tolerations(text)
    except OptionsError as e:
        raise CliError(str(e)) from e
    try:
        class_roles = parse_class_roles(args.class_role)
        budgets = parse_pool_budgets(args.pool_gpu_budget)
    except PoolOptionError as e:
        raise CliError(str(e)) from e
    return OperatorOptions(
        extra_tolerations=tolerations,
        reconcile_interval=args.interval,
        cluster_domain=args.cluster_domain,
        autoscale_interval=args.autoscale_interval,
        router_selector=args.router_selector,
        router_namespace=args.router_namespace,
        router_metrics_port=args.router_metrics_port,
        router_metrics_urls=tuple(args.router_metrics_url),
        class_roles=class_roles,
        pool_gpu_budgets=budgets,
        pool_consolidation=args.pool_consolidation,
    )


def run(args: argparse.Namespace) -> int:
    options = options_from(args, dict(os.environ))
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    from fleetgate.operator.app import Endpoints, StartupError
    from fleetgate.operator.app import run as run_operator

    try:
        run_operator(
            options,
            kubeconfig=args.kubeconfig,
            namespaces=args.namespace,
            endpoints=Endpoints(host=args.metrics_host, port=args.metrics_port),
        )
    except StartupError as e:
        raise CliError(str(e)) from e
    except OSError as e:
        raise CliError(
            f"cannot serve metrics on {args.metrics_host}:{args.metrics_port}: {e}"
        ) from e
    return 0
