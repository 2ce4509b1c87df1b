"""Subprocesses for benchmarks: free loopback ports, start/ready/stop, CPU time.

Every contender and every emulated fleet runs as its own process so that its
CPU seconds can be read from ``/proc/<pid>/stat`` (``utime + stime``, in clock
ticks, see proc(5)) and so that a crash in one cannot take the harness down.

Invariants:

* Processes start in their own session (``start_new_session``) and are stopped
  by pid / process group id only: SIGTERM, then SIGKILL after a grace period.
* Output goes to a log file (never a pipe that could fill up and stall the
  process); the log's tail is what an error message quotes.
* Readiness is polled over HTTP on 127.0.0.1 with a hard time limit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import httpx


class ProcessError(RuntimeError):
    """A benchmark process did not start or become ready; one-line message."""


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct ports the kernel considers free on ``host`` right now."""
    socks: list[socket.socket] = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def cpu_seconds(pid: int) -> float | None:
    """utime + stime of ``pid`` in seconds (None when the process is gone)."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the command name (field 2) may contain spaces: split after its ')'
    fields = raw.rsplit(")", 1)[1].split()
    ticks = int(fields[11]) + int(fields[12])  # fields 14 and 15 of proc(5)
    return ticks / os.sysconf("SC_CLK_TCK")


def tail(path: Path, lines: int = 5) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return " | ".join(line.strip() for line in text.strip().splitlines()[-lines:])


@dataclasses.dataclass
class Proc:
    """A started process and its log file."""

    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def cpu(self) -> float | None:
        return cpu_seconds(self.pid)

    def stop(self, grace_s: float = 5.0) -> int | None:
        """SIGTERM the process group, SIGKILL after ``grace_s``; returns the exit code."""
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(grace_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait(grace_s)
        return self.popen.returncode


def start(name: str, argv: Sequence[str], log: Path, env: dict[str, str] | None = None) -> Proc:
    log.parent.mkdir(parents=True, exist_ok=True)
    full_env = dict(os.environ)
    # loopback only: never let a proxy setting route 127.0.0.1 traffic elsewhere
    for key in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        full_env.pop(key, None)
    full_env["NO_PROXY"] = full_env["no_proxy"] = "127.0.0.1,localhost"
    full_env.update(env or {})
    with log.open("wb") as out:
        try:
            popen = subprocess.Popen(
                list(argv),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=full_env,
                # the log's directory, not ours: ``python -m`` puts the working
                # directory first on sys.path, which would shadow PYTHONPATH
                cwd=log.parent,
                start_new_session=True,
            )
        except OSError as e:
            raise ProcessError(f"{name}: cannot start {argv[0]}: {e.strerror or e}") from None
    return Proc(name, popen, log)


def wait_until(
    proc: Proc,
    ready: Callable[[], bool],
    timeout_s: float,
    what: str,
    poll_s: float = 0.1,
) -> None:
    """Poll ``ready()`` until true; raise with the log tail if the process dies or time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not proc.alive():
            raise ProcessError(
                f"{proc.name} exited with code {proc.popen.returncode} before {what}: "
                f"{tail(proc.log)}"
            )
        if ready():
            return
        time.sleep(poll_s)
    raise ProcessError(f"{proc.name} not {what} after {timeout_s:.0f} s: {tail(proc.log)}")


def http_ok(url: str, timeout_s: float = 1.0) -> bool:
    """True when GET ``url`` answers 200 (loopback only; proxies ignored)."""
    try:
        resp = httpx.get(url, timeout=timeout_s, trust_env=False)
    except httpx.HTTPError:
        return False
    return resp.status_code == 200
