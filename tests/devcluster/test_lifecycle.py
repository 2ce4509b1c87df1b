"""Starting and stopping leaves nothing behind, in-process and via the detached CLI.

Each test starts its own cluster (not the shared session one) because the point is
to watch it die. Start-up takes seconds once the binaries exist.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fleetgate_tools.devcluster import ClusterConfig, DevCluster, GpuNodePool, ensure_binaries
from fleetgate_tools.devcluster.state import read_state
from fleetgate_tools.procs import ProcRef, is_running, start_ticks

pytestmark = [pytest.mark.k8s, pytest.mark.slow]

ONE_NODE = (GpuNodePool("gpu-l4", 1, 1, "NVIDIA-L4", 23034),)


def test_stop_leaves_no_processes_and_no_work_dir() -> None:
    cluster = DevCluster(ensure_binaries(), ClusterConfig(pools=ONE_NODE))
    cluster.start()
    refs = list(cluster.refs)
    work = cluster.work_dir
    assert [r.name for r in refs] == [
        "etcd",
        "kube-apiserver",
        "kube-controller-manager",
        "kube-scheduler",
        "kwok",
    ]
    assert all(is_running(r) for r in refs)
    assert cluster.kubectl("get", "node", "gpu-l4-0").returncode == 0
    outcome = cluster.stop()
    assert set(outcome) == {r.name for r in refs}
    assert set(outcome.values()) <= {"terminated", "killed"}
    assert [r for r in refs if is_running(r)] == []
    assert all(start_ticks(r.pid) is None for r in refs), "every child was reaped"
    assert not work.exists()


def fleetgate(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fleetgate", "dev-cluster", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_cli_up_detach_then_down(tmp_path: Path) -> None:
    kubeconfig = tmp_path / "kc.yaml"
    state_file = tmp_path / "state.json"
    up = fleetgate("up", "--detach", "--kubeconfig", str(kubeconfig), "--state", str(state_file))
    refs: list[ProcRef] = []
    try:
        assert up.returncode == 0, up.stderr
        assert f"kubeconfig: {kubeconfig}" in up.stdout
        state = read_state(state_file)
        refs = list(state.procs)
        assert all(is_running(r) for r in refs), "the cluster outlives the `up` command"
        assert state.api_url.startswith("https://127.0.0.1:")
        assert f"api: {state.api_url}" in up.stdout
        kubectl = fleetgate("which", "kubectl").stdout.strip()
        nodes = subprocess.run(
            [kubectl, f"--kubeconfig={kubeconfig}", "get", "nodes", "-o", "json"],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        assert len(json.loads(nodes.stdout)["items"]) == 4
        again = fleetgate(
            "up", "--detach", "--kubeconfig", str(kubeconfig), "--state", str(state_file)
        )
        assert again.returncode == 2
        assert "already running" in again.stderr
    finally:
        down = fleetgate("down", "--state", str(state_file))
        leftovers = [r for r in refs if is_running(r)]
        for r in leftovers:  # never leak a control plane, even if `down` is broken
            os.kill(r.pid, 9)
    assert down.returncode == 0, down.stderr
    assert leftovers == []
    assert not state_file.exists()
    assert not Path(state.work_dir).exists()


def start_foreground(kubeconfig: Path) -> tuple[subprocess.Popen[str], dict[str, int], list[str]]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "fleetgate", "dev-cluster", "up", "--kubeconfig", str(kubeconfig)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line.rstrip("\n"))
        if line.startswith("running"):
            break
    pids_line = next((x for x in lines if x.startswith("pids: ")), None)
    if pids_line is None:
        proc.kill()
        proc.communicate(timeout=30)
        pytest.fail("foreground `up` never reported running:\n" + "\n".join(lines))
    pids = {k: int(v) for k, v in (kv.split("=") for kv in pids_line[6:].split())}
    return proc, pids, lines


def refs_of(pids: dict[str, int]) -> list[ProcRef]:
    out = []
    for name, pid in pids.items():
        ticks = start_ticks(pid)
        assert ticks is not None, f"{name} pid {pid} is not running"
        out.append(ProcRef(name, pid, ticks, ""))
    return out


def test_cli_foreground_stops_everything_on_ctrl_c(tmp_path: Path) -> None:
    proc, pids, _ = start_foreground(tmp_path / "kc.yaml")
    refs = refs_of(pids)
    proc.send_signal(signal.SIGINT)  # at once after "running": no window where it escapes
    time.sleep(0.3)
    proc.send_signal(signal.SIGINT)  # an impatient second Ctrl-C must not abort the stop
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert "stopping" in out
    assert "stopped: kwok terminated" in out
    assert [r for r in refs if is_running(r)] == []


def test_cli_foreground_exits_1_when_a_component_dies(tmp_path: Path) -> None:
    proc, pids, _ = start_foreground(tmp_path / "kc.yaml")
    refs = refs_of(pids)
    os.kill(pids["kwok"], signal.SIGKILL)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 1, out
    assert "component(s) died: kwok" in out
    assert "----- kwok" in out, "the dead component's log is shown"
    assert [r for r in refs if is_running(r)] == []
