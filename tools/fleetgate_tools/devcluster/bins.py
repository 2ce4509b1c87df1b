"""Locate, and if needed build, the control-plane binaries.

``hack/build-k8s-bins.sh`` is the only builder (it compiles kube-apiserver,
kube-controller-manager, kube-scheduler, kubectl, etcd, kwok and helm from their Go
modules at pinned versions with the machine's Go). It caches
per version under ``$FLEETGATE_CACHE/k8s-bins/<versions>/bin`` and copies kwok's stage
files (kwok >= 0.8 has no built-in stages) to ``<versions>/kwok-stages``.

Invariants:

* :class:`Versions` here and the defaults in the script name the same directory; the
  script receives the versions through its environment, so the two cannot drift apart.
* ``FLEETGATE_K8S_BIN_DIR`` (a ``bin`` directory with a sibling ``kwok-stages``)
  overrides the lookup; nothing is built then.
* :func:`ensure_binaries` never returns a partial set: either every tool exists and is
  executable, or :class:`~fleetgate_tools.devcluster.errors.BuildError` is raised with the tail
  of the build log. Concurrent callers serialise on an ``flock`` in the cache directory,
  so two pytest sessions never run two Go builds at once.
"""

from __future__ import annotations

import dataclasses
import fcntl
import os
import subprocess
from collections.abc import Callable, Mapping
from pathlib import Path

from fleetgate_tools.devcluster.errors import BuildError

#: every executable the build produces
TOOLS: tuple[str, ...] = (
    "etcd",
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kubectl",
    "kwok",
    "helm",
)

#: kwok v0.8 stage files the cluster loads, relative to ``kwok-stages``
STAGE_FILES: tuple[str, ...] = (
    "node/fast/node-initialize.yaml",
    "node/heartbeat-with-lease/node-heartbeat-with-lease.yaml",
    "pod/fast/pod-ready.yaml",
    "pod/fast/pod-complete.yaml",
    "pod/fast/pod-delete.yaml",
)

ENV_BIN_DIR = "FLEETGATE_K8S_BIN_DIR"
ENV_CACHE = "FLEETGATE_CACHE"


@dataclasses.dataclass(frozen=True)
class Versions:
    """One pinned set of component versions (they are built and tested together)."""

    kubernetes: str = "1.36.3"
    etcd: str = "v3.6.16"
    kwok: str = "v0.8.0"
    helm: str = "v3.21.4"

    @property
    def dirname(self) -> str:
        return f"k8s-{self.kubernetes}-etcd-{self.etcd}-kwok-{self.kwok}-helm-{self.helm}"

    def as_env(self) -> dict[str, str]:
        return {
            "K8S_VERSION": self.kubernetes,
            "ETCD_VERSION": self.etcd,
            "KWOK_VERSION": self.kwok,
            "HELM_VERSION": self.helm,
        }


@dataclasses.dataclass(frozen=True)
class BinSet:
    """A complete set of built tools plus kwok's stage files."""

    bin_dir: Path
    stages_dir: Path

    def path(self, tool: str) -> Path:
        if tool not in TOOLS:
            raise KeyError(f"unknown tool {tool!r}; known: {', '.join(TOOLS)}")
        return self.bin_dir / tool

    @property
    def stage_files(self) -> tuple[Path, ...]:
        return tuple(self.stages_dir / rel for rel in STAGE_FILES)

    def missing(self) -> list[str]:
        """Names of tools/stage files that are absent (empty when complete)."""
        out = [t for t in TOOLS if not os.access(self.bin_dir / t, os.X_OK)]
        out += [str(p) for p in self.stage_files if not p.is_file()]
        return out


def repo_root() -> Path:
    return Path(__file__).resolve().parents[3]


def default_build_script() -> Path:
    return repo_root() / "hack" / "build-k8s-bins.sh"


def cache_dir(env: Mapping[str, str] | None = None) -> Path:
    env = os.environ if env is None else env
    raw = env.get(ENV_CACHE)
    return Path(raw) if raw else Path.home() / ".cache" / "fleetgate"


def expected_binset(
    versions: Versions = Versions(), env: Mapping[str, str] | None = None
) -> BinSet:
    """Where the binaries are (or will be), without building anything."""
    env = os.environ if env is None else env
    override = env.get(ENV_BIN_DIR)
    if override:
        bin_dir = Path(override)
        return BinSet(bin_dir=bin_dir, stages_dir=bin_dir.parent / "kwok-stages")
    root = cache_dir(env) / "k8s-bins" / versions.dirname
    return BinSet(bin_dir=root / "bin", stages_dir=root / "kwok-stages")


def _tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no build log)"
    return "\n".join(text.splitlines()[-lines:])


def ensure_binaries(
    versions: Versions = Versions(),
    *,
    build_script: Path | None = None,
    env: Mapping[str, str] | None = None,
    timeout_s: float = 3 * 3600,
    on_build: Callable[[Path], None] | None = None,
) -> BinSet:
    """Return a complete :class:`BinSet`, running the build script if anything is missing.

    ``on_build(log_path)`` is called just before a build starts (a cold one takes about
    15 minutes, so callers should tell their user where the log is).
    Raises :class:`BuildError` (with the build log's tail) if the script fails or exits
    0 without producing every tool.
    """
    env = dict(os.environ if env is None else env)
    want = expected_binset(versions, env)
    if not want.missing():
        return want
    if env.get(ENV_BIN_DIR):
        raise BuildError(
            f"{ENV_BIN_DIR}={env[ENV_BIN_DIR]} is incomplete, missing: {', '.join(want.missing())}"
        )
    script = build_script or default_build_script()
    if not script.is_file():
        raise BuildError(f"build script not found: {script}")
    cache = cache_dir(env)
    cache.mkdir(parents=True, exist_ok=True)
    log_path = cache / "k8s-bins-build.log"
    with open(cache / "k8s-bins-build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another session may be building: wait for it
        if not want.missing():
            return want
        if on_build is not None:
            on_build(log_path)
        with open(log_path, "w") as log:
            try:
                proc = subprocess.run(
                    ["bash", str(script)],
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env={**env, **versions.as_env()},
                    timeout=timeout_s,
                    check=False,
                )
            except subprocess.TimeoutExpired as e:
                raise BuildError(
                    f"{script} timed out after {timeout_s:.0f}s; log {log_path}:\n{_tail(log_path)}"
                ) from e
    if proc.returncode != 0:
        raise BuildError(
            f"{script} failed with exit code {proc.returncode}; log {log_path}:\n{_tail(log_path)}"
        )
    if want.missing():
        raise BuildError(
            f"{script} succeeded but left missing: {', '.join(want.missing())}; "
            f"log {log_path}:\n{_tail(log_path)}"
        )
    return want
