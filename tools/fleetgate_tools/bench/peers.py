"""Install the peer routers from PyPI into private virtualenvs.

``~/.cache/fleetgate/peers/<name>-<version>`` holds one venv per peer
(``vllm-router==0.1.17``, ``sglang-router==0.3.2``), created with the running
interpreter's ``venv`` module and filled with ``pip install name==version``.
An installed peer is detected by its entry point and reused. A failure raises
:class:`PeerUnavailable` carrying pip's last lines so the benchmark can record
the exact error and carry on with the other contenders.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from fleetgate_tools.bench.contenders import PEER_VERSIONS, Contender, peer_dir


class PeerUnavailable(RuntimeError):
    pass


def default_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "fleetgate" / "peers"


def entry_point(kind: str, root: Path) -> Path:
    venv = peer_dir(kind, root)
    return venv / "bin" / ("vllm-router" if kind == "vllm-router" else "sglang-router")


def ensure(kind: str, root: Path | None = None, timeout_s: float = 900.0) -> Path:
    """The venv of peer ``kind``, installing it first when missing."""
    if kind not in PEER_VERSIONS:
        raise PeerUnavailable(f"unknown peer {kind!r}")
    root = root or default_root()
    venv = peer_dir(kind, root)
    if entry_point(kind, root).exists():
        return venv
    root.mkdir(parents=True, exist_ok=True)
    install_venv(
        sys.executable, venv, f"{kind}=={PEER_VERSIONS[kind]}", entry_point(kind, root), timeout_s
    )
    return venv


def prepare(chosen: list[Contender], root: Path) -> dict[str, str]:
    """Install the peers ``chosen`` needs; kind -> exact error for those that cannot be."""
    failed: dict[str, str] = {}
    for kind in dict.fromkeys(c.kind for c in chosen if c.kind != "fleetgate"):
        print(f"bench: preparing {kind} {PEER_VERSIONS[kind]} ...", file=sys.stderr)
        try:
            ensure(kind, root)
        except PeerUnavailable as e:
            failed[kind] = str(e)
            print(f"bench: {kind} unavailable: {e}", file=sys.stderr)
    return failed


def install_venv(python: str, venv: Path, spec: str, entry: Path, timeout_s: float) -> None:
    """Create ``venv`` with ``python``, pip-install ``spec``; ``entry`` must exist after.

    Raises :class:`PeerUnavailable` with the tool's last lines on any failure.
    """
    steps = [
        [python, "-m", "venv", str(venv)],
        [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", spec],
    ]
    for argv in steps:
        try:
            done = subprocess.run(
                argv, capture_output=True, text=True, timeout=timeout_s, check=False
            )
        except (OSError, subprocess.TimeoutExpired) as e:
            raise PeerUnavailable(f"{spec}: {' '.join(argv[:4])}: {e}") from None
        if done.returncode != 0:
            last = " | ".join((done.stderr or done.stdout).strip().splitlines()[-3:])
            raise PeerUnavailable(f"{spec}: exit {done.returncode}: {last}")
    if not entry.exists():
        raise PeerUnavailable(f"{spec}: installed but {entry} is missing")
