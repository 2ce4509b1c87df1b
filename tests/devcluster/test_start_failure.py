"""A component that dies during start-up fails loudly, with its log, and leaks nothing.

Uses stand-in executables (no Kubernetes binaries needed): a fake etcd that exits with
a message, and a fake etcd that never becomes healthy.
"""

from __future__ import annotations

import shutil
import stat
import time
from pathlib import Path

import pytest

from fleetgate_tools import procs
from fleetgate_tools.devcluster.bins import STAGE_FILES, TOOLS, BinSet
from fleetgate_tools.devcluster.cluster import ClusterConfig, DevCluster
from fleetgate_tools.devcluster.errors import DevClusterError, StartError


def fake_bins(tmp_path: Path, etcd_body: str) -> BinSet:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in TOOLS:
        path = bin_dir / tool
        path.write_text("#!/bin/sh\n" + (etcd_body if tool == "etcd" else "exit 1\n"))
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    stages = tmp_path / "stages"
    for rel in STAGE_FILES:
        (stages / rel).parent.mkdir(parents=True, exist_ok=True)
        (stages / rel).touch()
    return BinSet(bin_dir, stages)


def test_dying_component_raises_start_error_with_its_log(tmp_path: Path) -> None:
    binset = fake_bins(tmp_path, "echo 'etcd: member exploded' >&2\nexit 3\n")
    work = tmp_path / "work"
    cluster = DevCluster(binset, ClusterConfig(work_dir=work, start_timeout_s=20))
    with pytest.raises(StartError) as info:
        cluster.start()
    message = str(info.value)
    assert "etcd exited with code 3" in message
    assert "etcd: member exploded" in message
    assert (work / "logs" / "etcd.log").is_file(), "logs are kept after a failed start"
    assert cluster.refs == []


def test_never_healthy_component_times_out_and_is_stopped(tmp_path: Path) -> None:
    pidfile = tmp_path / "etcd.pid"
    binset = fake_bins(tmp_path, f"echo $$ > {pidfile}\nexec sleep 60\n")
    now = [0.0]

    def clock() -> float:
        return now[0]

    def sleep(dt: float) -> None:  # fake time advances by dt, real time only a little
        now[0] += dt
        time.sleep(0.01)

    cluster = DevCluster(
        binset,
        ClusterConfig(work_dir=tmp_path / "work", start_timeout_s=3),
        clock=clock,
        sleep=sleep,
    )
    with pytest.raises(StartError, match="timed out after 3s waiting for etcd /health"):
        cluster.start()
    pid = int(pidfile.read_text())
    assert procs.start_ticks(pid) is None, "the hung etcd was stopped and reaped"


def test_accessors_before_start_raise(tmp_path: Path) -> None:
    cluster = DevCluster(fake_bins(tmp_path, "exit 0\n"))
    with pytest.raises(DevClusterError, match="not started"):
        _ = cluster.api_url
    with pytest.raises(DevClusterError, match="not started"):
        _ = cluster.kubeconfig


def test_non_empty_work_dir_is_refused(tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    (work / "leftover").touch()
    cluster = DevCluster(fake_bins(tmp_path, "exit 0\n"), ClusterConfig(work_dir=work))
    with pytest.raises(StartError, match="not empty"):
        cluster.start()
    assert (work / "leftover").exists()


def test_a_lost_port_race_is_retried_once_with_new_ports(tmp_path: Path) -> None:
    calls = tmp_path / "calls"
    body = (
        f'echo "$@" >> {calls}\necho "listen tcp 127.0.0.1: bind: address already in use"\nexit 1\n'
    )
    cluster = DevCluster(fake_bins(tmp_path, body), ClusterConfig(start_timeout_s=20))
    with pytest.raises(StartError, match="address already in use"):
        cluster.start()
    shutil.rmtree(cluster.work_dir)  # kept for its logs after a failed start
    attempts = calls.read_text().splitlines()
    assert len(attempts) == 2, "exactly one retry"
    assert attempts[0] != attempts[1], "the retry uses other ports and another work dir"
    # the first attempt's temp work dir was removed before retrying
    first_dir = next(a for a in attempts[0].split() if a.startswith("--data-dir=")).split("=")[1]
    assert not Path(first_dir).parent.exists()


def test_other_start_failures_are_not_retried(tmp_path: Path) -> None:
    calls = tmp_path / "calls"
    body = f'echo run >> {calls}\necho "etcd: corrupt" >&2\nexit 1\n'
    cluster = DevCluster(fake_bins(tmp_path, body), ClusterConfig(start_timeout_s=20))
    with pytest.raises(StartError, match="etcd: corrupt"):
        cluster.start()
    shutil.rmtree(cluster.work_dir)  # kept for its logs after a failed start
    assert calls.read_text().splitlines() == ["run"]
