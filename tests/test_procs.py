"""The tools' one process supervisor (fleetgate_tools.procs).

Processes are stopped by PID (TERM, then KILL), never by a reused PID; they die
with the tool; benchmark children get a loopback environment and a fresh log;
ports, CPU seconds and listening sockets are read from /proc.
"""

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

from fleetgate_tools import procs


def test_stop_terminates_a_cooperative_process(tmp_path: Path) -> None:
    child = procs.spawn("sleeper", ["sleep", "60"], tmp_path / "sleeper.log")
    proc, ref = child.popen, child.ref
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
    child = procs.spawn("stubborn", argv, tmp_path / "stubborn.log")
    proc, ref = child.popen, child.ref
    log = tmp_path / "stubborn.log"
    for _ in range(200):
        if "armed" in log.read_text().splitlines()[1:]:
            break
        assert proc.poll() is None, log.read_text()
        time.sleep(0.01)
    assert procs.stop(ref, proc, term_timeout_s=0.5) == "killed"
    assert proc.returncode == -9


def test_a_reused_pid_is_never_signalled(tmp_path: Path) -> None:
    child = procs.spawn("victim", ["sleep", "60"], tmp_path / "v.log")
    proc, ref = child.popen, child.ref
    try:
        stale = dataclasses.replace(ref, start_ticks=ref.start_ticks - 1)
        assert not procs.is_running(stale)
        assert procs.stop(stale) == "gone"
        assert procs.is_running(ref), "a stale ProcRef must not kill the process now at that PID"
    finally:
        assert procs.stop(ref, proc) == "terminated"


def test_stop_of_an_exited_process_reports_gone(tmp_path: Path) -> None:
    child = procs.spawn("quick", ["true"], tmp_path / "q.log")
    proc, ref = child.popen, child.ref
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
        "from fleetgate_tools import procs\n"
        f"ref = procs.spawn('orphan', ['sleep', '60'], Path({str(tmp_path / 'o.log')!r})).ref\n"
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
    box: list[procs.Proc] = []
    worker = threading.Thread(
        target=lambda: box.append(procs.spawn("t", ["sleep", "60"], tmp_path / "t.log"))
    )
    worker.start()
    worker.join(timeout=10)
    proc, ref = box[0].popen, box[0].ref
    try:
        time.sleep(0.3)  # a pending PDEATHSIG would have fired by now
        assert procs.is_running(ref)
    finally:
        assert procs.stop(ref, proc) == "terminated"


def test_free_ports_are_distinct_and_bindable() -> None:
    ports = procs.free_ports(4)
    assert len(set(ports)) == 4 and all(1024 <= p < 65536 for p in ports)


def test_cpu_seconds_of_a_busy_process_grow() -> None:
    before = procs.cpu_seconds(os.getpid())
    assert before is not None
    end = time.process_time() + 0.2
    while time.process_time() < end:
        pass
    after = procs.cpu_seconds(os.getpid())
    assert after is not None and after - before >= 0.1
    assert procs.cpu_seconds(2**22 + 12345) is None


def test_start_stop_and_log_tail_on_early_exit(tmp_path: Path) -> None:
    sleeper = procs.start(
        "sleeper", [sys.executable, "-c", "import time; time.sleep(60)"], tmp_path / "s.log"
    )
    assert sleeper.alive()
    assert sleeper.stop(grace_s=5) is not None
    assert not sleeper.alive()
    dying = procs.start(
        "dying",
        [sys.executable, "-c", "print('boom: bad flag'); raise SystemExit(3)"],
        tmp_path / "d.log",
    )
    with pytest.raises(procs.ProcessError, match=r"dying exited with code 3 .*boom: bad flag"):
        procs.wait_until(dying, lambda: False, 10, "ready")
    waiting = procs.start(
        "waiting", [sys.executable, "-c", "import time; time.sleep(60)"], tmp_path / "w.log"
    )
    try:
        with pytest.raises(procs.ProcessError, match="waiting not ready after 0 s"):
            procs.wait_until(waiting, lambda: False, 0.3, "ready")
    finally:
        waiting.stop()


def test_proc_stop_takes_the_whole_process_group(tmp_path: Path) -> None:
    """A benchmark child that starts helpers of its own leaves none behind."""
    pidfile = tmp_path / "grandchild.pid"
    script = f"sleep 60 & echo $! > {pidfile}; wait"
    child = procs.start("parent", ["sh", "-c", script], tmp_path / "p.log")
    deadline = time.monotonic() + 10
    while not pidfile.exists() or not pidfile.read_text().strip():
        assert time.monotonic() < deadline, "the shell never started its helper"
        time.sleep(0.02)
    grandchild = int(pidfile.read_text())
    ticks = procs.start_ticks(grandchild)
    assert ticks is not None
    helper = procs.ProcRef("helper", grandchild, ticks, "")
    assert child.stop(grace_s=5) is not None
    deadline = time.monotonic() + 5
    while procs.is_running(helper) and time.monotonic() < deadline:
        time.sleep(0.02)  # reparented to init, which reaps it
    assert not procs.is_running(helper)


def test_start_gives_a_loopback_environment_in_the_logs_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("https_proxy", "http://192.0.2.1:3128")
    monkeypatch.setenv("FLEETGATE_PROCS_TEST", "inherited")
    code = (
        "import os; print(os.getcwd()); print(os.environ.get('https_proxy')); "
        "print(os.environ['NO_PROXY']); print(os.environ.get('FLEETGATE_PROCS_TEST')); "
        "print(os.environ.get('EXTRA'))"
    )
    run_dir = tmp_path / "run"
    child = procs.start("env", [sys.executable, "-c", code], run_dir / "e.log", {"EXTRA": "x"})
    child.popen.wait(timeout=30)
    cwd, proxy, no_proxy, inherited, extra = (run_dir / "e.log").read_text().split()
    assert Path(cwd) == run_dir
    assert (proxy, no_proxy, inherited, extra) == ("None", "127.0.0.1,localhost", "inherited", "x")

    exact = procs.start(
        "exact",
        [sys.executable, "-c", code],
        run_dir / "x.log",
        {"NO_PROXY": "-"},
        inherit_env=False,
    )
    exact.popen.wait(timeout=30)
    assert (run_dir / "x.log").read_text().split()[1:] == ["None", "-", "None", "None"]


def test_a_missing_program_is_a_one_line_process_error(tmp_path: Path) -> None:
    with pytest.raises(procs.ProcessError, match=r"^ghost: cannot start /nonexistent/ghost: "):
        procs.spawn("ghost", ["/nonexistent/ghost"], tmp_path / "g.log")
