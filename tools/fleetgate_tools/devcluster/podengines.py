"""Emulated engines for the dev cluster's engine pods (kwok runs no container).

kwok gives every pod an IP in 127.0.1.0/24 but runs nothing in it. This launcher
watches (polls) the pods of the InferenceServices selected by a label selector and,
for every pod with an IP, starts one ``fleetgate sim`` engine of the pod's engine
kind bound to the pod IP and the container's ``http`` port (a watch on the pods
triggers a poll at once, so a new pod is seen within milliseconds), after a modelled cold
start per engine kind: the child process is started at once (so its Python imports do
not add to the cold start), waits until ``first seen + cold start`` and only then
binds (first seen: the first poll that listed the pod, IP or not, so the scheduler's
and kwok's latency is part of the modelled cold start as a real node's is), so
the pod's address refuses connections (and ``/health`` fails) until then. When the pod
goes away (deleted, or marked for deletion) its engine is stopped by PID (SIGTERM: the
emulator lets open responses finish, 5 s at most). An engine that exits on its own is
started again after 2, 4, ... (at most 30) seconds, with its cold start again, as a
kubelet restarts a container. Only loopback pod IPs are accepted.

What the engine is comes from what the operator writes on the pod: the
``fleetgate.dev/engine`` label (``vllm`` | ``trtllm``), the
``fleetgate.dev/served-model`` annotation (the name clients use) and the engine
container's ``http`` port; ``--max-num-seqs`` (vLLM) or ``--max_batch_size``
(TensorRT-LLM) from the container args sizes the emulated batch.

The pure parts (:func:`engine_pod`, :func:`plan`, :func:`engine_argv`,
:func:`parse_cold_starts`) are unit-tested; :class:`PodEngines` does the I/O. A dev
tool: the runtime never imports it.

    python -m fleetgate_tools.devcluster.podengines --kubeconfig K --namespace NS \\
        --selector fleetgate.dev/pool --cold-start vllm=3 --cold-start trtllm=5 --logs DIR

prints one JSON line per event (``start``, ``stop``, ``exit``, ``crashed``, ``error``) with the
pod, its IP and ``time.time()`` stamps, for tests and benchmarks to read.
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import yaml

ENGINES = ("vllm", "trtllm")
LABEL_ENGINE = "fleetgate.dev/engine"
ANNOTATION_SERVED_MODEL = "fleetgate.dev/served-model"
BATCH_FLAGS = {"vllm": "--max-num-seqs", "trtllm": "--max_batch_size"}


class PodError(ValueError):
    """A pod this launcher cannot serve (not loopback, unknown engine, no port)."""


@dataclass(frozen=True)
class EnginePod:
    """What one emulated engine needs, read from one pod."""

    uid: str
    namespace: str
    name: str
    ip: str
    port: int
    engine: str
    model: str
    max_batch: int | None = None

    @property
    def address(self) -> tuple[str, int]:
        return (self.ip, self.port)


def _flag_value(args: Sequence[str], flag: str) -> str | None:
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def engine_pod(pod: Mapping[str, Any]) -> EnginePod | None:
    """The engine for ``pod``; None while it has no IP or once it is being deleted.

    Raises :class:`PodError` for a pod that cannot be served: an IP off loopback, an
    engine label other than ``vllm``/``trtllm``, no served-model annotation or no
    ``http`` container port."""
    meta = pod.get("metadata") or {}
    name = f"{meta.get('namespace')}/{meta.get('name')}"
    if meta.get("deletionTimestamp"):
        return None
    ip = (pod.get("status") or {}).get("podIP")
    if not ip:
        return None
    try:
        loopback = ipaddress.ip_address(ip).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise PodError(f"pod {name}: IP {ip!r} is not a loopback address")
    engine = (meta.get("labels") or {}).get(LABEL_ENGINE)
    if engine not in ENGINES:
        raise PodError(f"pod {name}: label {LABEL_ENGINE}={engine!r}, want one of {ENGINES}")
    model = (meta.get("annotations") or {}).get(ANNOTATION_SERVED_MODEL)
    if not model:
        raise PodError(f"pod {name}: no {ANNOTATION_SERVED_MODEL} annotation")
    port, batch = None, None
    for c in (pod.get("spec") or {}).get("containers") or []:
        for p in c.get("ports") or []:
            if p.get("name") == "http" and port is None:
                port = int(p["containerPort"])
                value = _flag_value([*(c.get("command") or []), *(c.get("args") or [])],
                                    BATCH_FLAGS[engine])  # fmt: skip
                if value is not None:
                    try:
                        batch = int(value)
                    except ValueError:
                        raise PodError(f"pod {name}: {BATCH_FLAGS[engine]} {value!r}") from None
    if port is None:
        raise PodError(f"pod {name}: no container port named http")
    return EnginePod(
        uid=str(meta.get("uid") or name), namespace=str(meta.get("namespace")),
        name=str(meta.get("name")), ip=ip, port=port, engine=engine, model=model,
        max_batch=batch,
    )  # fmt: skip


@dataclass(frozen=True)
class Plan:
    start: tuple[EnginePod, ...] = ()
    """Pods to start an engine for now."""
    stop: tuple[str, ...] = ()
    """uids of running engines whose pod is gone."""
    waiting: tuple[EnginePod, ...] = ()
    """New pods whose address an engine of a gone pod still holds (kwok reuses IPs):
    started once that engine has exited."""


def plan(
    pods: Mapping[str, EnginePod],
    running: Mapping[str, EnginePod],
    exiting: Iterable[tuple[str, int]] = (),
) -> Plan:
    """What to change so that exactly ``pods`` (by uid) have an engine.

    ``running``: engines started (by pod uid); ``exiting``: addresses of engines
    already told to stop that have not exited yet."""
    stop = tuple(sorted(uid for uid in running if uid not in pods))
    held = {p.address for uid, p in running.items() if uid not in pods} | set(exiting)
    start: list[EnginePod] = []
    waiting: list[EnginePod] = []
    for uid in sorted(pods):
        if uid in running:
            continue
        (waiting if pods[uid].address in held else start).append(pods[uid])
    return Plan(start=tuple(start), stop=stop, waiting=tuple(waiting))


def parse_cold_starts(items: Iterable[str]) -> dict[str, float]:
    """``["vllm=3", "trtllm=5.5"]`` -> seconds per engine kind (unnamed kinds: 0)."""
    out = dict.fromkeys(ENGINES, 0.0)
    for item in items:
        kind, sep, value = item.partition("=")
        if not sep or kind not in ENGINES:
            raise ValueError(f"--cold-start {item!r}: want ENGINE=SECONDS, ENGINE in {ENGINES}")
        try:
            seconds = float(value)
        except ValueError:
            raise ValueError(f"--cold-start {item!r}: {value!r} is not a number") from None
        if not 0 <= seconds < 3600:
            raise ValueError(f"--cold-start {item!r}: want 0 <= seconds < 3600")
        out[kind] = seconds
    return out


def engine_argv(pod: EnginePod, python: str, bind_at: float, seed: int = 0) -> list[str]:
    """The child: this module's ``--serve`` mode, which binds at ``bind_at`` (unix time)."""
    argv = [python, "-m", "fleetgate_tools.devcluster.podengines", "--serve",
            "--bind-at", f"{bind_at:.3f}", "--", "sim", f"--{pod.engine}", "1",
            "--host", pod.ip, "--port", str(pod.port), "--model", pod.model,
            "--seed", str(seed)]  # fmt: skip
    if pod.max_batch is not None:
        argv += ["--max-num-seqs", str(pod.max_batch)]
    return argv


# ---- I/O ---------------------------------------------------------------------------


def kubeconfig_server_token(path: Path) -> tuple[str, str]:
    """The server URL and bearer token of a kubeconfig's current context."""
    config = yaml.safe_load(path.read_text())
    current = config.get("current-context")
    ctx = next(c["context"] for c in config["contexts"] if c["name"] == current)
    server = next(c["cluster"]["server"] for c in config["clusters"] if c["name"] == ctx["cluster"])
    user = next(u["user"] for u in config["users"] if u["name"] == ctx["user"])
    if "token" not in user:
        raise ValueError(f"{path}: the current user has no bearer token")
    return server, user["token"]


@dataclass
class Running:
    pod: EnginePod
    popen: Any
    log: TextIO


@dataclass
class PodEngines:
    """Poll the pods, start and stop engines (children of this process, by PID)."""

    list_pods: Callable[[], list[dict[str, Any]]]
    cold_start_s: Mapping[str, float]
    logs: Path
    emit: Callable[[dict[str, Any]], None]
    python: str = sys.executable
    now: Callable[[], float] = time.time
    running: dict[str, Running] = field(default_factory=dict)
    exiting: list[Running] = field(default_factory=list)
    started: int = 0
    crashes: dict[str, int] = field(default_factory=dict)
    """Engines that exited on their own, by pod uid: restarted after 2^n s (max 30)."""
    retry_at: dict[str, float] = field(default_factory=dict)
    first_seen: dict[str, float] = field(default_factory=dict)
    """When each pod (by uid) was first listed, IP or not: its cold start runs from
    there (the scheduler's and kwok's share is part of it, as pulling and starting a
    container is on a real node)."""

    def sync(self) -> None:
        pods: dict[str, EnginePod] = {}
        listed = self.list_pods()
        now = self.now()
        live = set()
        for raw in listed:
            meta = raw.get("metadata") or {}
            if not meta.get("deletionTimestamp"):
                uid = str(meta.get("uid") or f"{meta.get('namespace')}/{meta.get('name')}")
                live.add(uid)
                self.first_seen.setdefault(uid, now)
        for uid in [u for u in self.first_seen if u not in live]:
            del self.first_seen[uid]
        for raw in listed:
            try:
                found = engine_pod(raw)
            except PodError as e:
                self.emit({"event": "error", "error": str(e), "t": self.now()})
                continue
            if found is not None:
                pods[found.uid] = found
        still = []
        for r in self.exiting:
            if r.popen.poll() is None:
                still.append(r)
            else:
                r.log.close()
                self.emit({"event": "exit", "pod": r.pod.name, "ip": r.pod.ip,
                           "code": r.popen.returncode, "t": self.now()})  # fmt: skip
        self.exiting = still
        for uid, r in list(self.running.items()):
            if r.popen.poll() is not None:  # exited on its own (reaped: never signal it again)
                del self.running[uid]
                r.log.close()
                self.crashes[uid] = n = self.crashes.get(uid, 0) + 1
                self.retry_at[uid] = self.now() + min(30.0, 2.0**n)
                self.emit({"event": "crashed", "pod": r.pod.name, "ip": r.pod.ip,
                           "code": r.popen.returncode, "restarts_in_s": min(30.0, 2.0**n),
                           "t": self.now()})  # fmt: skip
        todo = plan(pods, {u: r.pod for u, r in self.running.items()},
                    [r.pod.address for r in self.exiting])  # fmt: skip
        for uid in todo.stop:
            r = self.running.pop(uid)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(r.popen.pid, signal.SIGTERM)
            self.exiting.append(r)
            self.emit({"event": "stop", "pod": r.pod.name, "ip": r.pod.ip, "t": self.now()})
        for pod in todo.start:
            if self.retry_at.get(pod.uid, 0.0) <= self.now():
                self._start(pod)
        for uid in [u for u in self.retry_at if u not in pods]:
            self.retry_at.pop(uid)
            self.crashes.pop(uid, None)

    def _start(self, pod: EnginePod) -> None:
        now = self.now()
        # a restart (after a crash) starts cold from now; a new pod from its first sight
        seen = now if pod.uid in self.crashes else self.first_seen.get(pod.uid, now)
        cold = self.cold_start_s.get(pod.engine, 0.0)
        log = open(self.logs / f"engine-{pod.name}.log", "w")  # closed when it exits
        tools = Path(__file__).resolve().parents[2]  # this tree's tools/ and repo
        path = os.pathsep.join([str(tools.parent), str(tools), os.environ.get("PYTHONPATH", "")])
        env = {**os.environ, "FLEETGATE_TEST_MODE": "1", "PYTHONPATH": path}
        popen = subprocess.Popen(
            engine_argv(pod, self.python, seen + cold, seed=self.started),
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
            start_new_session=True,
        )  # fmt: skip
        self.started += 1
        self.running[pod.uid] = Running(pod, popen, log)
        self.emit({"event": "start", "pod": pod.name, "ip": pod.ip, "port": pod.port,
                   "engine": pod.engine, "model": pod.model, "pid": popen.pid,
                   "cold_start_s": cold, "first_seen": seen, "t": now,
                   "bind_at": seen + cold})  # fmt: skip

    def stop_all(self, grace_s: float = 8.0) -> None:
        everyone = [*self.running.values(), *self.exiting]
        for r in everyone:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(r.popen.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for r in everyone:
            try:
                r.popen.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:  # still running: kill its group
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(r.popen.pid, signal.SIGKILL)
                r.popen.wait(5)
            r.log.close()
        self.running.clear()
        self.exiting.clear()


def _serve(bind_at: float, argv: list[str]) -> int:
    """Child mode: import the emulator first, then wait for the cold start, then run."""
    from fleetgate.cli import main as fleetgate_main
    from fleetgate.sim import cli as _sim_cli  # noqa: F401 - the heavy imports, before the wait

    delay = bind_at - time.time()
    if delay > 0:
        time.sleep(delay)
    print(json.dumps({"event": "binding", "t": time.time(), "late_s": -delay}), flush=True)
    return fleetgate_main(argv)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="podengines", description=__doc__.split("\n\n")[0])
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--bind-at", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--kubeconfig", type=Path)
    parser.add_argument("--namespace", action="append", default=[])
    parser.add_argument("--selector", default="fleetgate.dev/pool", help="pod label selector")
    parser.add_argument("--cold-start", action="append", default=[], metavar="ENGINE=SECONDS")
    parser.add_argument(
        "--interval",
        type=float,
        default=0.25,
        help="seconds between polls (and on every pod event)",
    )
    parser.add_argument("--logs", type=Path, default=Path("."), help="engine log directory")
    args, rest = parser.parse_known_args(argv)
    if args.serve:
        if rest[:1] == ["--"]:
            rest = rest[1:]
        return _serve(args.bind_at or 0.0, rest)
    if rest:
        parser.error(f"unknown arguments {rest}")
    if args.kubeconfig is None or not args.namespace:
        parser.error("--kubeconfig and --namespace are required")
    try:
        cold = parse_cold_starts(args.cold_start)
    except ValueError as e:
        parser.error(str(e))
    from fleetgate_tools.devcluster.apiclient import ApiClient

    server, token = kubeconfig_server_token(args.kubeconfig)
    api = ApiClient(server, token)  # refuses anything but a loopback API server
    query = urllib.parse.urlencode({"labelSelector": args.selector})

    def list_pods() -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = []
        for ns in args.namespace:
            status, body = api.get(f"/api/v1/namespaces/{ns}/pods?{query}")
            if status != 200:
                raise OSError(f"list pods in {ns}: HTTP {status}: {str(body)[:200]}")
            items += body.get("items", [])
        return items

    args.logs.mkdir(parents=True, exist_ok=True)

    def emit(event: dict[str, Any]) -> None:
        print(json.dumps(event), flush=True)

    engines = PodEngines(list_pods, cold, args.logs, emit)
    stop = threading.Event()
    nudge = threading.Event()
    """Set by the pod watches: sync now rather than at the next poll."""

    def on_signal(*_: object) -> None:
        stop.set()
        nudge.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)

    def watch(ns: str) -> None:
        path = f"/api/v1/namespaces/{ns}/pods?{query}&watch=1&timeoutSeconds=300"
        while not stop.is_set():
            try:
                for _ in api.watch_lines(path):
                    nudge.set()
            except OSError:
                stop.wait(1.0)  # the polls carry on meanwhile

    for ns in args.namespace:
        threading.Thread(target=watch, args=(ns,), name=f"watch-{ns}", daemon=True).start()
    try:
        while not stop.is_set():
            nudge.clear()
            try:
                engines.sync()
            except OSError as e:  # the API server blinked: try again next round
                emit({"event": "error", "error": str(e), "t": time.time()})
            nudge.wait(args.interval)
    finally:
        engines.stop_all()
    return 0


if __name__ == "__main__":
    sys.exit(main())
