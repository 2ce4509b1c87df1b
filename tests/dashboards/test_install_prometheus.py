"""``hack/install-prometheus.sh`` stops only the Prometheus its install started.

A fake ``apt-get`` (``APT_GET``) "installs" a prometheus binary (a copy of
``sleep``) and starts it, as Debian's postinst would start the service; a
Prometheus the user already runs from elsewhere must survive, the started one
must be gone, by PID.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "hack" / "install-prometheus.sh"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie child of this test still answers kill(0)
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_stops_only_the_prometheus_the_install_started(tmp_path: Path) -> None:
    # hack/install-prometheus.sh finds prometheus processes with pgrep (procps)
    assert shutil.which("pgrep"), "pgrep (procps) is required by hack/install-prometheus.sh"
    sleep = shutil.which("sleep")
    assert sleep
    user_dir, pkg_dir, fake_dir = tmp_path / "user", tmp_path / "pkg", tmp_path / "fake"
    for d in (user_dir, pkg_dir, fake_dir):
        d.mkdir()
    shutil.copy(sleep, user_dir / "prometheus")
    started = tmp_path / "started.pid"
    apt = fake_dir / "apt-get"
    apt.write_text(
        f"#!{shutil.which('sh')}\n"
        'case "$1" in install)\n'
        f"  cp {sleep} {pkg_dir}/prometheus\n"
        f"  setsid {pkg_dir}/prometheus 300 </dev/null >/dev/null 2>&1 &\n"
        f"  echo $! > {started}\n"
        ";; esac\n"
    )
    apt.chmod(0o755)
    # the utilities the script and the fake use, without /usr/bin (which may hold
    # a real prometheus already)
    tools = tmp_path / "tools"
    tools.mkdir()
    for name in ("pgrep", "readlink", "seq", "sleep", "tr", "setsid", "cp", "sh"):
        found = shutil.which(name)
        assert found, name
        (tools / name).symlink_to(found)
    user = subprocess.Popen([str(user_dir / "prometheus"), "300"])
    try:
        env = {
            "PATH": f"{pkg_dir}:{tools}",
            "APT_GET": str(apt),
            "HOME": str(tmp_path),
        }
        out = subprocess.run(
            [shutil.which("bash") or "/bin/bash", str(SCRIPT)],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == str(pkg_dir / "prometheus")
        pid = int(started.read_text())
        assert f"pid {pid}" in out.stderr
        deadline = time.monotonic() + 5
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(pid), "the prometheus the install started is stopped"
        assert user.poll() is None, "the user's own prometheus is left running"
        assert "pkill" not in SCRIPT.read_text()
    finally:
        user.send_signal(signal.SIGTERM)
        user.wait(timeout=10)
        if started.exists():
            try:
                os.kill(int(started.read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass
