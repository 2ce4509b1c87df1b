"""Child processes of the dev cluster: spawn with a log file, stop by PID, inspect sockets.

Design:

* Every component runs in its own session (``start_new_session``), with stdin closed and
  stdout+stderr appended to ``<work_dir>/logs/<component>.log``. A Ctrl-C in the
  terminal therefore reaches only ``fleetgate dev-cluster up``, which then stops the
  components in order instead of racing their own signal handlers.
* Attached clusters (tests, foreground ``up``) also set ``PR_SET_PDEATHSIG=SIGKILL`` so
  that a crashed or SIGKILLed parent cannot leak an API server onto a shared 2-core box.
  ``--detach`` clears that on purpose. The kernel fires it when the *thread* that
  forked the child exits, so it is only set when spawning from the main thread (a
  worker thread of ``asyncio.to_thread`` may exit while the cluster is still in use).
* A :class:`ProcRef` records the PID *and* the kernel start time (``/proc/PID/stat``
  field 22). :func:`stop` refuses to signal a PID whose start time changed, so a stale
  state file can never kill an unrelated process that reused the PID.
* Stopping is SIGTERM, wait, then SIGKILL, wait; a survivor raises ``StopError``.

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
from collections.abc import Callable, Sequence
from pathlib import Path

from fleetgate_tools.devcluster.errors import StopError

_PR_SET_PDEATHSIG = 1


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


def start_ticks(pid: int) -> int | None:
    """Kernel start time of ``pid`` in clock ticks, or None if there is no such process."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # comm (field 2) may contain spaces and parentheses: split after the last ')'
    fields = raw[raw.rindex(")") + 2 :].split()
    return int(fields[19])  # field 22 overall; fields[0] is field 3


def is_running(ref: ProcRef) -> bool:
    """True while the very process ``ref`` names exists and is not a zombie."""
    ticks = start_ticks(ref.pid)
    if ticks is None or ticks != ref.start_ticks:
        return False
    try:
        state = Path(f"/proc/{ref.pid}/stat").read_text()
    except OSError:
        return False
    return state[state.rindex(")") + 2] != "Z"


def _pdeathsig_kill() -> Callable[[], None]:
    libc = ctypes.CDLL(None, use_errno=True)
    prctl = libc.prctl

    def preexec() -> None:  # runs in the child between fork and exec: keep it tiny
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)

    return preexec


def _on_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def spawn(
    name: str,
    argv: Sequence[str],
    log_path: Path,
    *,
    env: dict[str, str] | None = None,
    die_with_parent: bool = True,
) -> tuple[subprocess.Popen[bytes], ProcRef]:
    """Start ``argv`` detached from our terminal with output appended to ``log_path``."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        log.write(f"# {' '.join(argv)}\n".encode())
        log.flush()
        proc = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            preexec_fn=_pdeathsig_kill() if die_with_parent and _on_main_thread() else None,
        )
    ticks = start_ticks(proc.pid)
    if ticks is None:  # exited before we could look: it is still our (zombie) child
        ticks = -1
    return proc, ProcRef(name=name, pid=proc.pid, start_ticks=ticks, log=str(log_path))


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


def stop(
    ref: ProcRef,
    proc: subprocess.Popen[bytes] | None = None,
    *,
    term_timeout_s: float = 10.0,
    kill_timeout_s: float = 5.0,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> str:
    """Stop one process by PID: SIGTERM, then SIGKILL. Returns how it ended.

    ``"gone"`` (already exited or PID reused), ``"terminated"`` or ``"killed"``.
    """
    if not is_running(ref):
        if proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        return "gone"
    with contextlib.suppress(ProcessLookupError):
        os.kill(ref.pid, signal.SIGTERM)
    if _wait_gone(ref, proc, term_timeout_s, clock, sleep):
        return "terminated"
    with contextlib.suppress(ProcessLookupError):
        os.kill(ref.pid, signal.SIGKILL)
    if _wait_gone(ref, proc, kill_timeout_s, clock, sleep):
        return "killed"
    raise StopError(f"{ref.name} (pid {ref.pid}) survived SIGKILL")


def free_loopback_port() -> int:
    """A port that was free on 127.0.0.1 a moment ago (the kernel picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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
