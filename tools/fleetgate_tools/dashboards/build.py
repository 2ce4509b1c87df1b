"""Render :mod:`fleetgate_tools.dashboards.spec` to Grafana dashboard JSON.

Uses grafana-foundation-sdk's builders (a maintained dashboards-as-code
library) rather than hand-edited JSON. Every dashboard has a ``datasource``
variable (any Prometheus), and the filters its spec asks for, fed by
``label_values`` queries over fleetgate's own metrics.
"""

from __future__ import annotations

import json
from pathlib import Path

from grafana_foundation_sdk.builders import dashboard as gdash
from grafana_foundation_sdk.builders import prometheus as gprom
from grafana_foundation_sdk.builders import stat as gstat
from grafana_foundation_sdk.builders import timeseries as gts
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.dashboard import DataSourceRef, VariableRefresh

from fleetgate_tools.dashboards.spec import DASHBOARDS, DashboardSpec, PanelSpec

DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")

#: variable name -> (label_values query, label shown)
_VARIABLES = {
    "model": ("label_values(fleetgate_requests_total, model)", "Model"),
    "class": ("label_values(fleetgate_time_to_first_token_seconds_count, class)", "Class"),
    "namespace": ("label_values(fleetgate_operator_replicas_ready, namespace)", "Namespace"),
}


def _panel(spec: PanelSpec) -> gts.Panel | gstat.Panel:
    panel: gts.Panel | gstat.Panel = gstat.Panel() if spec.kind == "stat" else gts.Panel()
    panel.title(spec.title).unit(spec.unit).datasource(DATASOURCE).span(spec.width).height(8)
    if spec.description:
        panel.description(spec.description)
    for i, q in enumerate(spec.queries):
        panel.with_target(
            gprom.Dataquery().expr(q.expr).legend_format(q.legend).ref_id(chr(ord("A") + i))
        )
    return panel


def build(spec: DashboardSpec) -> dict[str, object]:
    d = (
        gdash.Dashboard(spec.title)
        .uid(spec.uid)
        .description(spec.description)
        .tags(["fleetgate", "llm-inference"])
        .refresh("30s")
        .time("now-1h", "now")
        .timezone("browser")
        .with_variable(
            gdash.DatasourceVariable("datasource").label("Data source").type("prometheus")
        )
    )
    for name in spec.variables:
        query, label = _VARIABLES[name]
        d.with_variable(
            gdash.QueryVariable(name)
            .label(label)
            .query(query)
            .datasource(DATASOURCE)
            .multi(True)
            .include_all(True)
            .all_value(".*")
            .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
        )
    for panel in spec.panels:
        d.with_panel(_panel(panel))
    rendered: dict[str, object] = json.loads(json.dumps(d.build(), cls=JSONEncoder))
    return rendered


def write_all(out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for spec in DASHBOARDS:
        path = out_dir / f"{spec.uid.removeprefix('fleetgate-')}.json"
        path.write_text(json.dumps(build(spec), indent=2, sort_keys=True) + "\n")
        written.append(path)
    return written
