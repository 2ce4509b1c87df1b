"""The bench's emulated fleet binds ports the kernel picks, so none can be taken between
picking and binding (a 16-engine run lost its contender so at 1827003)."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlsplit

import httpx
import yaml

from fleetgate_tools.bench import runner, scenarios


def test_the_fleet_binds_ephemeral_ports_and_reports_the_ones_it_got(tmp_path: Path) -> None:
    scenario = scenarios.make("shared-prefix", engines=2, duration_s=4, time_scale=2, seed=0)
    fleet = runner.start_fleet(scenario, tmp_path, startup_s=30.0)
    try:
        asked = yaml.safe_load((tmp_path / "fleet.yaml").read_text())
        assert [e["port"] for e in asked["engines"]] == [0, 0]
        ports = {urlsplit(url).port for _, url in fleet.engines}
        assert len(ports) == 2 and 0 not in ports
        for _, url in fleet.engines:
            assert urlsplit(url).hostname == "127.0.0.1"
            assert httpx.get(f"{url}/health", timeout=5.0).status_code == 200
    finally:
        fleet.proc.stop()
