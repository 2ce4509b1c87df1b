"""Processes are stopped by PID (TERM, then KILL), never by a reused PID; sockets inspected."""

from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from fleetgate_tools.devcluster import procs


def test_stop_terminates_a_cooperative_process(tmp_path: Path) -> None:
    proc, ref = procs.spawn("sleeper", ["sleep", "60"], tmp_path / "sleeper.log")
    assert procs.is_running(ref)
    assert procs.stop(ref, proc) == "terminated"
    assert not procs.is_running(ref)
    assert proc.returncode == -15
    assert (tmp_path / "sleeper.log").read_text().startswith("# sleep 60")


def test_stop_kills_a_process_ignoring_sigterm(tmp_path: Path) -> None:
    code = (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "print('armed', flush=True); time.sleep(60)"
    )
    argv = [sys.executable, "-c", code]
    proc, ref = procs.spawn("stubborn", argv, tmp_path / "stubborn.log")
    log = tmp_path / "stubborn.log"
    for _ in range(200):
        if "armed" in log.read_text().splitlines()[1:]:
            break
        assert proc.poll() is None, log.read_text()
        time.sleep(0.01)
    assert procs.stop(ref, proc, term_timeout_s=0.5) == "killed"
    assert proc.returncode == -9


def test_a_reused_pid_is_never_signalled(tmp_path: Path) -> None:
    proc, ref = procs.spawn("victim", ["sleep", "60"], tmp_path / "v.log")
    try:
        stale = dataclasses.replace(ref, start_ticks=ref.start_ticks - 1)
        assert not procs.is_running(stale)
        assert procs.stop(stale) == "gone"
        assert procs.is_running(ref), "a stale ProcRef must not kill the process now at that PID"
    finally:
        assert procs.stop(ref, proc) == "terminated"


def test_stop_of_an_exited_process_reports_gone(tmp_path: Path) -> None:
    proc, ref = procs.spawn("quick", ["true"], tmp_path / "q.log")
    proc.wait(timeout=10)
    assert procs.stop(ref, proc) == "gone"


def test_listening_addresses_sees_our_loopback_listener() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        assert ("127.0.0.1", port) in procs.listening_addresses(os.getpid())


def test_listening_addresses_decodes_ipv6_loopback() -> None:
    if not socket.has_ipv6:
        pytest.fail("this test needs IPv6 loopback")
    with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
        try:
            s.bind(("::1", 0))
        except OSError as e:
            pytest.fail(f"cannot bind ::1 on this machine: {e}")
        s.listen(1)
        port = s.getsockname()[1]
        assert ("::1", port) in procs.listening_addresses(os.getpid())


def test_free_loopback_port_is_bindable() -> None:
    port = procs.free_loopback_port()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", port))


def test_child_dies_with_its_parent(tmp_path: Path) -> None:
    """PR_SET_PDEATHSIG: a SIGKILLed parent (e.g. a crashed pytest) leaks no component."""
    script = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from fleetgate_tools.devcluster import procs\n"
        f"proc, ref = procs.spawn('orphan', ['sleep', '60'], Path({str(tmp_path / 'o.log')!r}))\n"
        "print(ref.pid, ref.start_ticks, flush=True)\n"
        "time.sleep(60)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        pid, ticks = (int(x) for x in parent.stdout.readline().split())
        ref = procs.ProcRef("orphan", pid, ticks, "")
        assert procs.is_running(ref)
    finally:
        parent.kill()
        parent.wait(timeout=10)
        if parent.stdout is not None:
            parent.stdout.close()
    deadline = time.monotonic() + 5
    while procs.is_running(ref) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not procs.is_running(ref)


def test_child_spawned_from_a_worker_thread_outlives_that_thread(tmp_path: Path) -> None:
    """PDEATHSIG follows the forking *thread*: it must not be set off the main thread."""
    box: list[tuple[subprocess.Popen[bytes], procs.ProcRef]] = []
    worker = threading.Thread(
        target=lambda: box.append(procs.spawn("t", ["sleep", "60"], tmp_path / "t.log"))
    )
    worker.start()
    worker.join(timeout=10)
    proc, ref = box[0]
    try:
        time.sleep(0.3)  # a pending PDEATHSIG would have fired by now
        assert procs.is_running(ref)
    finally:
        assert procs.stop(ref, proc) == "terminated"
