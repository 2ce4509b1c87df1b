"""The one process supervisor of the tools: spawn with a log file, wait, stop by PID.

Used by the benchmarks and the demo (an emulated fleet, the router under test,
peer routers, inference-perf) and by the dev cluster (etcd, the API server,
controller manager, scheduler, kwok). One set of rules for all of them:

* Every child runs in its own session (``start_new_session``) with stdin closed
  and stdout+stderr in a log file, never a pipe that could fill up and stall
  it. A Ctrl-C in the terminal reaches only the tool, which then stops its
  children in order; an error message quotes the log's tail.
* ``die_with_parent`` (the default) sets ``PR_SET_PDEATHSIG=SIGKILL`` so that
  a crashed or SIGKILLed tool cannot leak servers onto a shared machine;
  ``fleetgate dev-cluster up --detach`` clears it on purpose. The kernel fires
  it when the *thread* that forked the child exits, so it is only set when
  spawning from the main thread (a worker thread of ``asyncio.to_thread`` may
  exit while the child is still in use).
* A :class:`ProcRef` records the PID *and* the kernel start time
  (``/proc/PID/stat`` field 22). :func:`stop` refuses to signal a PID whose
  start time changed, so a stale state file can never kill an unrelated
  process that reused the PID.
* Stopping is SIGTERM, wait, then SIGKILL, wait; a survivor raises
  :class:`StopError`. ``group=True`` signals the child's process group (the
  session it leads) instead, for children that start helpers of their own.
* CPU seconds come from ``/proc/PID/stat`` (``utime + stime``, proc(5)), which
  is why every contender of a benchmark is a process of its own.

Linux only (``/proc``); the project targets Linux CI.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import httpx

_PR_SET_PDEATHSIG = 1
_PROXY_VARS = ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "all_proxy", "ALL_PROXY")


class ProcessError(RuntimeError):
    """A child did not start, died or did not become ready; a one-line message."""


class StopError(ProcessError):
    """A child survived SIGKILL."""


@dataclasses.dataclass(frozen=True)
class ProcRef:
    """Enough to find (and only find) one child process again, even from another process."""

    name: str
    pid: int
    start_ticks: int
    log: str

    def to_json(self) -> dict[str, object]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, raw: dict[str, object]) -> ProcRef:
        return cls(
            name=str(raw["name"]),
            pid=int(str(raw["pid"])),
            start_ticks=int(str(raw["start_ticks"])),
            log=str(raw["log"]),
        )


# --------------------------------------------------------------- /proc readers


def _stat_fields(pid: int) -> list[str] | None:
    """Fields 3.. of ``/proc/PID/stat`` (None when there is no such process)."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # comm (field 2) may contain spaces and parentheses: split after the last ')'
    return raw[raw.rindex(")") + 2 :].split()


def start_ticks(pid: int) -> int | None:
    """Kernel start time of ``pid`` in clock ticks, or None if there is no such process."""
    fields = _stat_fields(pid)
    return None if fields is None else int(fields[19])  # field 22; fields[0] is field 3


def cpu_seconds(pid: int) -> float | None:
    """utime + stime of ``pid`` in seconds (None when the process is gone)."""
    fields = _stat_fields(pid)
    if fields is None:
        return None
    ticks = int(fields[11]) + int(fields[12])  # fields 14 and 15 of proc(5)
    return ticks / os.sysconf("SC_CLK_TCK")


def is_running(ref: ProcRef) -> bool:
    """True while the very process ``ref`` names exists and is not a zombie."""
    fields = _stat_fields(ref.pid)
    if fields is None or int(fields[19]) != ref.start_ticks:
        return False
    return fields[0] != "Z"


def tail(path: Path | str, lines: int = 5) -> str:
    """The last ``lines`` lines of a log, joined with `` | `` for a one-line message."""
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return ""
    return " | ".join(line.strip() for line in text.strip().splitlines()[-lines:])


# ---------------------------------------------------------------------- ports


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct ports the kernel considers free on ``host`` right now."""
    socks: list[socket.socket] = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            socks.append(s)
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def free_loopback_port() -> int:
    """A port that was free on 127.0.0.1 a moment ago (the kernel picks it)."""
    return free_ports(1)[0]


def _socket_inodes(pid: int) -> set[int]:
    out: set[int] = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return out
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            out.add(int(target[8:-1]))
    return out


def _decode_addr(hex_addr: str, v6: bool) -> str:
    raw = bytes.fromhex(hex_addr)
    if not v6:
        return socket.inet_ntop(socket.AF_INET, raw[::-1])
    # /proc/net/tcp6 prints four host-order 32-bit words
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
    return socket.inet_ntop(socket.AF_INET6, words)


def listening_addresses(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket in LISTEN state that ``pid`` holds."""
    inodes = _socket_inodes(pid)
    found: list[tuple[str, int]] = []
    for table, v6 in (("tcp", False), ("tcp6", True)):
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if cols[3] != "0A" or int(cols[9]) not in inodes:  # 0A == TCP_LISTEN
                continue
            addr, port = cols[1].split(":")
            found.append((_decode_addr(addr, v6), int(port, 16)))
    return found


# ------------------------------------------------------------- start and stop


def loopback_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: our environment) without proxy settings: a proxy must
    never carry 127.0.0.1 traffic (or a token) elsewhere."""
    env = dict(os.environ if base is None else base)
    for key in _PROXY_VARS:
        env.pop(key, None)
    env["NO_PROXY"] = env["no_proxy"] = "127.0.0.1,localhost"
    return env


def _pdeathsig_kill() -> Callable[[], None]:
    libc = ctypes.CDLL(None, use_errno=True)
    prctl = libc.prctl

    def preexec() -> None:  # runs in the child between fork and exec: keep it tiny
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)

    return preexec


def _on_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@dataclasses.dataclass
class Proc:
    """A child we started: its ``Popen`` (to reap it) and its :class:`ProcRef`."""

    popen: subprocess.Popen[bytes]
    ref: ProcRef

    @property
    def name(self) -> str:
        return self.ref.name

    @property
    def pid(self) -> int:
        return self.ref.pid

    @property
    def log(self) -> Path:
        return Path(self.ref.log)

    def alive(self) -> bool:
        return self.popen.poll() is None

    def cpu(self) -> float | None:
        return cpu_seconds(self.pid)

    def stop(self, grace_s: float = 5.0) -> int | None:
        """Stop the child's process group (SIGTERM, SIGKILL after ``grace_s``);
        its exit code."""
        stop(self.ref, self.popen, group=True, term_timeout_s=grace_s, kill_timeout_s=grace_s)
        return self.popen.returncode


def spawn(
    name: str,
    argv: Sequence[str],
    log_path: Path,
    *,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    die_with_parent: bool = True,
    append: bool = True,
) -> Proc:
    """Start ``argv`` in its own session with stdout+stderr in ``log_path``.

    ``env`` is the child's whole environment (None: ours). With ``append`` the
    log keeps earlier runs and gets a ``# argv`` header line; otherwise it is
    truncated. Raises :class:`ProcessError` when the program cannot be started.
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab" if append else "wb") as log:
        if append:
            log.write(f"# {' '.join(argv)}\n".encode())
            log.flush()
        try:
            popen = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=None if env is None else dict(env),
                cwd=cwd,
                start_new_session=True,
                preexec_fn=_pdeathsig_kill() if die_with_parent and _on_main_thread() else None,
            )
        except OSError as e:
            raise ProcessError(f"{name}: cannot start {argv[0]}: {e.strerror or e}") from None
    ticks = start_ticks(popen.pid)
    if ticks is None:  # exited before we could look: it is still our (zombie) child
        ticks = -1
    return Proc(popen, ProcRef(name=name, pid=popen.pid, start_ticks=ticks, log=str(log_path)))


def start(
    name: str,
    argv: Sequence[str],
    log: Path,
    env: Mapping[str, str] | None = None,
    *,
    inherit_env: bool = True,
) -> Proc:
    """A loopback server or client for a benchmark: :func:`spawn` with a fresh log.

    The environment is ours without proxy settings, updated with ``env``; with
    ``inherit_env=False`` it is exactly ``env``. The working directory is the
    log's directory, not ours: ``python -m`` puts the working directory first
    on ``sys.path``, which would shadow ``PYTHONPATH`` (``bench run --source``).
    """
    if inherit_env:
        full_env = loopback_env()
        full_env.update(env or {})
    else:
        full_env = dict(env or {})
    return spawn(name, argv, log, env=full_env, cwd=log.parent, append=False)


def _wait_gone(
    ref: ProcRef,
    proc: subprocess.Popen[bytes] | None,
    timeout_s: float,
    clock: Callable[[], float],
    sleep: Callable[[float], None],
) -> bool:
    deadline = clock() + timeout_s
    while True:
        if not is_running(ref):  # exited (maybe a zombie): reap it if it is our child
            if proc is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=5)
            return True
        if clock() >= deadline:
            return False
        sleep(0.05)


def _signal(ref: ProcRef, sig: signal.Signals, group: bool) -> None:
    with contextlib.suppress(ProcessLookupError):
        if group:
            os.killpg(ref.pid, sig)  # spawn made the child a session (and group) leader
        else:
            os.kill(ref.pid, sig)


def stop(
    ref: ProcRef,
    proc: subprocess.Popen[bytes] | None = None,
    *,
    group: bool = False,
    term_timeout_s: float = 10.0,
    kill_timeout_s: float = 5.0,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> str:
    """Stop one process by PID: SIGTERM, then SIGKILL. Returns how it ended.

    ``"gone"`` (already exited or PID reused), ``"terminated"`` or ``"killed"``.
    ``proc``, when we are the parent, is reaped.
    """
    if not is_running(ref):
        if proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        return "gone"
    _signal(ref, signal.SIGTERM, group)
    if _wait_gone(ref, proc, term_timeout_s, clock, sleep):
        return "terminated"
    _signal(ref, signal.SIGKILL, group)
    if _wait_gone(ref, proc, kill_timeout_s, clock, sleep):
        return "killed"
    raise StopError(f"{ref.name} (pid {ref.pid}) survived SIGKILL")


# ------------------------------------------------------------------ readiness


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
