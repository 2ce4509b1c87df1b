"""The --detach state file round-trips and rejects garbage with a clear error."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from fleetgate.devcluster.errors import StateError
from fleetgate.devcluster.procs import ProcRef
from fleetgate.devcluster.state import ClusterState, read_state, write_state

STATE = ClusterState(
    api_url="https://127.0.0.1:1234",
    kubeconfig="/tmp/kc",
    work_dir="/tmp/w",
    procs=(ProcRef("etcd", 10, 111, "/tmp/w/logs/etcd.log"), ProcRef("kwok", 11, 112, "/l")),
)


def test_round_trip_and_private_mode(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "state.json"
    write_state(path, STATE)
    assert read_state(path) == STATE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_missing_file_is_a_state_error(tmp_path: Path) -> None:
    with pytest.raises(StateError, match="no detached dev cluster"):
        read_state(tmp_path / "nope.json")


@pytest.mark.parametrize(
    "text",
    [
        pytest.param("not json", id="not-json"),
        pytest.param('{"version": 99}', id="wrong-version"),
        pytest.param('{"version": 1, "api_url": "x"}', id="missing-keys"),
        pytest.param("[]", id="not-an-object"),
    ],
)
def test_malformed_state_is_rejected(tmp_path: Path, text: str) -> None:
    path = tmp_path / "state.json"
    path.write_text(text)
    with pytest.raises(StateError):
        read_state(path)
