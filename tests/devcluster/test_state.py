"""The --detach state file round-trips and rejects garbage; the API client stays on loopback."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from fleetgate_tools.devcluster.apiclient import ApiClient
from fleetgate_tools.devcluster.errors import StateError
from fleetgate_tools.devcluster.state import ClusterState, read_state, write_state
from fleetgate_tools.procs import ProcRef

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


@pytest.mark.parametrize(
    "server",
    [
        pytest.param("https://10.0.0.1:6443", id="private"),
        pytest.param("https://kubernetes.example:6443", id="name"),
        pytest.param("https://0.0.0.0:6443", id="wildcard"),
    ],
)
def test_api_client_refuses_non_loopback_servers(server: str) -> None:
    with pytest.raises(ValueError, match="only talks to loopback"):
        ApiClient(server, "token")


def test_api_client_accepts_any_127_address() -> None:
    assert ApiClient("https://127.0.1.7:443", "t").server == "https://127.0.1.7:443"
