"""The state file of a detached dev cluster (``fleetgate dev-cluster up --detach``).

It records what ``down`` needs and nothing else: the API URL, the kubeconfig path, the
work dir to remove, and one :class:`~fleetgate_tools.procs.ProcRef` per component
in start order. Because a ProcRef carries the kernel start time, ``down`` on a stale
file (machine rebooted, PIDs reused) signals nothing it did not start.

Written atomically (temp file + rename) with mode 0600 (it names the kubeconfig, which
holds the admin token).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from fleetgate_tools.devcluster.bins import cache_dir
from fleetgate_tools.devcluster.errors import StateError
from fleetgate_tools.procs import ProcRef

STATE_VERSION = 1


def default_state_path() -> Path:
    return cache_dir() / "dev-cluster" / "state.json"


@dataclasses.dataclass(frozen=True)
class ClusterState:
    api_url: str
    kubeconfig: str
    work_dir: str
    procs: tuple[ProcRef, ...]

    def to_json(self) -> str:
        return json.dumps(
            {
                "version": STATE_VERSION,
                "api_url": self.api_url,
                "kubeconfig": self.kubeconfig,
                "work_dir": self.work_dir,
                "procs": [p.to_json() for p in self.procs],
            },
            indent=2,
        )

    @classmethod
    def from_json(cls, text: str) -> ClusterState:
        try:
            raw = json.loads(text)
            if raw.get("version") != STATE_VERSION:
                raise StateError(f"unsupported state version {raw.get('version')!r}")
            return cls(
                api_url=str(raw["api_url"]),
                kubeconfig=str(raw["kubeconfig"]),
                work_dir=str(raw["work_dir"]),
                procs=tuple(ProcRef.from_json(p) for p in raw["procs"]),
            )
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise StateError(f"malformed dev-cluster state: {e}") from e


def write_state(path: Path, state: ClusterState) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(state.to_json())
    os.replace(tmp, path)


def read_state(path: Path) -> ClusterState:
    try:
        text = path.read_text()
    except FileNotFoundError as e:
        raise StateError(f"no detached dev cluster: {path} does not exist") from e
    return ClusterState.from_json(text)
