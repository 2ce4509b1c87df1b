"""The bench's emulated fleet starts again when a port it picked was taken meanwhile."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from fleetgate_tools import procs
from fleetgate_tools.bench import runner, scenarios


def test_a_port_taken_between_pick_and_bind_costs_a_retry_not_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    busy = int(taken.getsockname()[1])
    real = procs.free_ports
    picks: list[list[int]] = []

    def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
        ports = [busy] if not picks else real(count, host)  # first pick: a taken port
        picks.append(ports)
        return ports

    monkeypatch.setattr(procs, "free_ports", free_ports)
    scenario = scenarios.make("shared-prefix", engines=1, duration_s=4, time_scale=2, seed=0)
    try:
        fleet = runner.start_fleet(scenario, tmp_path, startup_s=30.0)
        try:
            assert len(picks) == 2 and len(fleet.engines) == 1
            assert str(picks[1][0]) in fleet.engines[0][1]
        finally:
            fleet.proc.stop()
        # every start taken: the error says why
        picks.clear()
        monkeypatch.setattr(procs, "free_ports", lambda count, host="127.0.0.1": [busy])
        with pytest.raises(procs.ProcessError, match="Address already in use"):
            runner.start_fleet(scenario, tmp_path, startup_s=30.0)
    finally:
        taken.close()
