"""Render a dashboard to PNG from Prometheus query results (matplotlib, Agg).

No Grafana server can be had here, so this draws the same panels from the
same queries: one subplot per panel, one line per returned series, titled and
labelled like the Grafana panel. Used by the dashboard test and to make the
picture in the docs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fleetgate_tools.dashboards.spec import DashboardSpec

#: panel title -> list of (legend, [(t, value), ...])
PanelSeries = Mapping[str, Sequence[tuple[str, Sequence[tuple[float, float]]]]]


def legend_for(template: str, labels: Mapping[str, str]) -> str:
    out = template
    for key, value in labels.items():
        out = out.replace("{{" + key + "}}", value)
    return out


def series_from_matrix(template: str, result: Sequence[Mapping[str, Any]]) -> list[Any]:
    """Prometheus ``query_range`` matrix -> [(legend, [(t, v), ...])], NaN dropped."""
    series = []
    for item in result:
        points = [(float(t), float(v)) for t, v in item["values"] if math.isfinite(float(v))]
        series.append((legend_for(template, item.get("metric", {})), points))
    return series


def render_png(spec: DashboardSpec, data: PanelSeries, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = spec.panels
    cols = 2
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(14, 3.2 * rows), squeeze=False)
    fig.suptitle(spec.title, fontsize=14, fontweight="bold")
    for ax, panel in zip(axes.flat, panels, strict=False):
        ax.set_title(panel.title, fontsize=10)
        series = data.get(panel.title, ())
        t0 = min((p[0] for _, pts in series for p in pts), default=0.0)
        for legend, points in list(series)[:8]:
            if points:
                ax.plot([t - t0 for t, _ in points], [v for _, v in points], label=legend)
        ax.set_xlabel("seconds", fontsize=8)
        ax.set_ylabel(panel.unit, fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        if series:
            ax.legend(fontsize=6, loc="upper left")
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path
