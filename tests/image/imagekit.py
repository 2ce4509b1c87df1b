"""Image test helpers (``import imagekit``): build the images, run containers.

The images are built by ``hack/build-image.sh runtime emulator`` with podman (it
installs podman, buildah and runc with hack/install-podman.sh when missing, makes
the debootstrapped base once, and reuses cached layers), right after collection
and before the first test, so a cold build is not cut short by a test's timeout.
A failed build is an ERROR of every image test, never a skip.

Every container runs as the chart runs it: ``--read-only --cap-drop=ALL --user
65532:65532 --security-opt=no-new-privileges``, on the host network (loopback
only: every address a container binds here is in 127.0.0.0/8), with the settings
of hack/containers.conf (``CONTAINERS_CONF``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("FLEETGATE_CACHE", Path.home() / ".cache" / "fleetgate"))
BUILD_TIMEOUT_S = 3600
RUN_FLAGS = (
    "--read-only",
    "--cap-drop=ALL",
    "--user=65532:65532",
    "--security-opt=no-new-privileges",
    "--network=host",
)


def podman_env() -> dict[str, str]:
    return {
        **os.environ,
        "CONTAINERS_CONF": str(REPO / "hack" / "containers.conf"),
        "FLEETGATE_IMAGE_ENGINE": "podman",
    }


def build_images() -> tuple[dict[str, str], str]:
    """(``{"runtime": ref, "emulator": ref}``, error text or '')."""
    log = CACHE / "image-build.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    refs: dict[str, str] = {}
    with log.open("w") as out:
        for target in ("runtime", "emulator"):
            started = time.monotonic()
            p = subprocess.run(
                ["bash", str(REPO / "hack" / "build-image.sh"), target],
                stdout=subprocess.PIPE,
                stderr=out,
                text=True,
                env=podman_env(),
                timeout=BUILD_TIMEOUT_S,
                check=False,
            )
            out.write(f"[image tests] {target}: exit {p.returncode} after "
                      f"{time.monotonic() - started:.0f} s\n")  # fmt: skip
            if p.returncode != 0:
                out.flush()
                return refs, f"hack/build-image.sh {target} failed:\n{log.read_text()[-4000:]}"
            refs[target] = p.stdout.strip().splitlines()[-1]
    return refs, ""


def podman(
    *args: str, check: bool = True, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("podman")
    assert exe, "podman is missing although the image build installs it"
    p = subprocess.run(
        [exe, *args], capture_output=True, text=True, env=podman_env(), timeout=timeout, check=False
    )
    if check and p.returncode != 0:
        raise AssertionError(f"podman {' '.join(args)} -> {p.returncode}: {p.stderr}")
    return p


@dataclass
class Container:
    name: str

    def logs(self) -> str:
        p = podman("logs", self.name, check=False)
        return p.stdout + p.stderr

    def running(self) -> bool:
        return self.state().get("Running") is True

    def state(self) -> dict[str, object]:
        p = podman("inspect", "--format", "{{json .State}}", self.name, check=False)
        return dict(json.loads(p.stdout)) if p.returncode == 0 else {}

    def stop(self, grace_s: int) -> tuple[int, float]:
        """``podman stop -t grace_s``: (exit code, seconds it took)."""
        started = time.monotonic()
        podman("stop", "-t", str(grace_s), self.name, timeout=grace_s + 30)
        took = time.monotonic() - started
        code = self.state().get("ExitCode")
        assert isinstance(code, int), self.state()
        return code, took

    def exec(self, *argv: str) -> str:
        return podman("exec", self.name, *argv).stdout


@contextlib.contextmanager
def container(
    image: str,
    args: Sequence[str] = (),
    *,
    entrypoint: Sequence[str] | None = None,
    env: dict[str, str] | None = None,
    volumes: Sequence[str] = (),
    name: str = "fg-test",
) -> Iterator[Container]:
    """``podman run -d`` with the chart's security settings; removed afterwards."""
    c = Container(f"{name}-{uuid.uuid4().hex[:8]}")
    argv = ["run", "-d", "--name", c.name, *RUN_FLAGS, "--env", "FLEETGATE_TEST_MODE=1"]
    for key, value in (env or {}).items():
        argv += ["--env", f"{key}={value}"]
    for volume in volumes:
        argv += ["--volume", volume]
    if entrypoint is not None:
        argv += ["--entrypoint", json.dumps(list(entrypoint))]
    podman(*argv, image, *args)
    try:
        yield c
    finally:
        if c.running():
            podman("stop", "-t", "2", c.name, check=False, timeout=60)
        logs = c.logs()
        podman("rm", "-f", c.name, check=False)
        print(f"--- logs of {c.name} ---\n{logs[-4000:]}")
