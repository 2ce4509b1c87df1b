"""``fleetgate dev-cluster up|down|which``.

* ``up --kubeconfig FILE`` ensures the binaries (building them if missing), starts the
  cluster, prints the kubeconfig path, the API URL and start-up timings, then stays in
  the foreground until Ctrl-C/SIGTERM (or until a component dies: exit 1 with its log).
  ``--detach`` instead records the component PIDs in a state file and returns; the
  components then run in their own sessions and survive the command.
* ``down`` stops a detached cluster by the PIDs in the state file (SIGTERM, SIGKILL),
  removes its work dir and the state file.
* ``which TOOL`` prints the path of one built tool (building nothing: it fails with a
  one-line error if the tool is absent).
* ``operator [ARGS...]`` runs ``fleetgate operator`` in the foreground against the
  detached cluster of the state file: it applies ``crds/`` first and gives every engine
  pod the toleration of the fake GPU nodes' kwok taint, so ``kubectl apply -f
  examples/...`` schedules as written. ``ARGS`` go to ``fleetgate operator``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import FrameType

from fleetgate.cli import CliError
from fleetgate_tools import procs
from fleetgate_tools.devcluster import bins
from fleetgate_tools.devcluster.cluster import ClusterConfig, DevCluster
from fleetgate_tools.devcluster.errors import DevClusterError
from fleetgate_tools.devcluster.manifests import operator_command
from fleetgate_tools.devcluster.state import (
    ClusterState,
    default_state_path,
    read_state,
    write_state,
)


def build_parser(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    up = sub.add_parser("up", help="start a cluster (foreground unless --detach)")
    up.add_argument(
        "--kubeconfig", type=Path, required=True, help="write the admin kubeconfig here"
    )
    up.add_argument("--detach", action="store_true", help="leave it running and return")
    up.add_argument("--state", type=Path, default=None, help="state file (default: in the cache)")
    up.add_argument("--work-dir", type=Path, default=None, help="default: a fresh temp dir")
    up.add_argument("--timeout", type=float, default=120.0, help="start timeout in seconds")
    down = sub.add_parser("down", help="stop a cluster started with --detach")
    down.add_argument("--state", type=Path, default=None, help="state file (default: in the cache)")
    which = sub.add_parser("which", help="print the path of a built tool")
    which.add_argument("tool", help=", ".join(bins.TOOLS))
    op = sub.add_parser(
        "operator",
        help="run fleetgate operator against the detached cluster (CRDs applied, engine "
        "pods tolerate the fake nodes)",
    )
    op.add_argument("--state", type=Path, default=None, help="state file (default: in the cache)")
    op.add_argument("operator_args", nargs=argparse.REMAINDER, help="passed to fleetgate operator")


def run(args: argparse.Namespace) -> int:
    if args.action == "which":
        return _which(args.tool)
    if args.action == "up":
        return _up(args)
    if args.action == "down":
        return _down(args.state or default_state_path())
    if args.action == "operator":
        return _operator(args.state or default_state_path(), args.operator_args)
    raise CliError(f"unknown action {args.action!r}")


def _which(tool: str) -> int:
    if tool not in bins.TOOLS:
        raise CliError(f"unknown tool {tool!r}; known: {', '.join(bins.TOOLS)}")
    path = bins.expected_binset().path(tool)
    if not path.is_file():
        raise CliError(f"{tool} is not built yet ({path}); run hack/build-k8s-bins.sh")
    print(path)
    return 0


def _announce_build(log: Path) -> None:
    print(f"building the Kubernetes binaries (about 15 min cold); log: {log}", flush=True)


def _up(args: argparse.Namespace) -> int:
    state_path: Path = args.state or default_state_path()
    if args.detach and state_path.exists():
        old = read_state(state_path)
        if any(procs.is_running(p) for p in old.procs):
            raise CliError(f"a detached cluster is already running ({old.api_url}); run down first")
    try:
        binset = bins.ensure_binaries(on_build=_announce_build)
    except DevClusterError as e:
        raise CliError(str(e)) from e
    config = ClusterConfig(
        kubeconfig_path=args.kubeconfig.resolve(),
        work_dir=args.work_dir,
        die_with_parent=not args.detach,
        start_timeout_s=args.timeout,
    )
    cluster = DevCluster(binset, config)
    try:
        cluster.start()
    except DevClusterError as e:
        print(str(e), file=sys.stderr)
        raise CliError("dev cluster failed to start (component logs above)") from e
    timings = ", ".join(f"{k} {v:.1f}s" for k, v in cluster.timings.items())
    print(f"kubeconfig: {cluster.kubeconfig}")
    print(f"api: {cluster.api_url}")
    print(f"nodes: {', '.join(cluster.node_names())}")
    print(f"work dir: {cluster.work_dir} (component logs in logs/)")
    print("pids: " + " ".join(f"{r.name}={r.pid}" for r in cluster.refs))
    print(f"started in: {timings}")
    sys.stdout.flush()
    if args.detach:
        state = ClusterState(
            api_url=cluster.api_url,
            kubeconfig=str(cluster.kubeconfig),
            work_dir=str(cluster.work_dir),
            procs=tuple(cluster.refs),
        )
        write_state(state_path, state)
        cluster.detach()
        print(f"detached; state: {state_path} (stop with: fleetgate dev-cluster down)")
        return 0
    return _foreground(cluster)


def _foreground(cluster: DevCluster) -> int:
    # The handler only sets a flag: an exception raised from a signal handler can land
    # anywhere, e.g. between the "running" line and the try block (the test that sends
    # SIGINT right after that line saw exit 130 and nothing stopped). A second Ctrl-C
    # while stopping is ignored, so the stop always finishes.
    signals: list[int] = []

    def on_signal(signum: int, frame: FrameType | None) -> None:
        signals.append(signum)

    # SIGINT too: a shell starts background jobs with SIGINT ignored
    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    code = 0
    try:
        print("running; Ctrl-C to stop", flush=True)
        while not signals:
            dead = cluster.dead_components()
            if dead:
                print(
                    f"component(s) died: {', '.join(dead)}\n{cluster.log_tails()}", file=sys.stderr
                )
                code = 1
                break
            time.sleep(0.2)
        if signals:
            print("stopping", flush=True)
        outcome = cluster.stop()
        print("stopped: " + ", ".join(f"{k} {v}" for k, v in outcome.items()), flush=True)
    finally:
        cluster.stop()  # idempotent: a no-op after the stop above
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return code


def _operator(state_path: Path, extra: list[str]) -> int:
    try:
        state = read_state(state_path)
    except DevClusterError as e:
        raise CliError(f"{e} (start one with: fleetgate dev-cluster up --detach ...)") from e
    kubectl = bins.expected_binset().path("kubectl")
    crds = bins.repo_root() / "crds"
    res = subprocess.run(
        [
            str(kubectl),
            f"--kubeconfig={state.kubeconfig}",
            "apply",
            "--server-side",
            "-f",
            str(crds),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if res.returncode != 0:
        raise CliError(f"kubectl apply -f {crds} failed: {res.stderr.strip()}")
    argv = operator_command(sys.executable, Path(state.kubeconfig), list(extra))
    print(f"CRDs applied; running: {' '.join(argv[1:])}", flush=True)
    os.execv(argv[0], argv)
    return 0  # not reached


def _down(state_path: Path) -> int:
    try:
        state = read_state(state_path)
    except DevClusterError as e:
        raise CliError(str(e)) from e
    outcome = {}
    for ref in reversed(state.procs):
        try:
            outcome[ref.name] = procs.stop(ref)
        except procs.StopError as e:
            raise CliError(str(e)) from e
    shutil.rmtree(state.work_dir, ignore_errors=True)
    state_path.unlink(missing_ok=True)
    print("stopped: " + ", ".join(f"{k} {v}" for k, v in outcome.items()))
    return 0
