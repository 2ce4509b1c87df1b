"""The dashboards shipped in the chart are generated, fresh and well-formed."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from fleetgate_tools.dashboards.build import build
from fleetgate_tools.dashboards.spec import DASHBOARDS, DashboardSpec

CHART_DASHBOARDS = Path(__file__).resolve().parents[2] / "charts" / "fleetgate" / "dashboards"


@pytest.mark.parametrize("spec", DASHBOARDS, ids=lambda s: s.uid)
def test_chart_copy_is_fresh(spec: DashboardSpec) -> None:
    path = CHART_DASHBOARDS / f"{spec.uid.removeprefix('fleetgate-')}.json"
    assert path.exists(), "run: fleetgate dashboards"
    assert json.loads(path.read_text()) == build(spec), "stale: run `fleetgate dashboards`"


@pytest.mark.parametrize("spec", DASHBOARDS, ids=lambda s: s.uid)
def test_every_panel_queries_prometheus_through_the_datasource_variable(
    spec: DashboardSpec,
) -> None:
    d = build(spec)
    variables = {v["name"]: v for v in d["templating"]["list"]}  # type: ignore[index]
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for name in spec.variables:
        assert variables[name]["type"] == "query"
        assert variables[name]["includeAll"] is True
    panels = d["panels"]
    assert isinstance(panels, list) and len(panels) == len(spec.panels)
    for panel in panels:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            expr = target["expr"]
            used = set(re.findall(r"\$(\w+)", expr)) - {"__rate_interval"}
            assert used <= set(spec.variables), (panel["title"], used)


def test_dashboards_cover_the_four_views() -> None:
    titles = {s.title for s in DASHBOARDS}
    assert titles == {
        "fleetgate / Fleet overview",
        "fleetgate / Routing",
        "fleetgate / Priority and preemption",
        "fleetgate / Operator",
    }
