"""Chart test helpers (``import chartkit``): the built helm, render to objects."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import yaml

from fleetgate_tools.devcluster import ensure_binaries

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "fleetgate"
KWOK_TOLERATION = {"key": "kwok.x-k8s.io/node", "operator": "Exists", "effect": "NoSchedule"}


def helm_path() -> Path:
    return ensure_binaries().path("helm")


def helm(
    *args: str, check: bool = True, timeout_s: float = 120.0
) -> subprocess.CompletedProcess[str]:
    res = subprocess.run(
        [str(helm_path()), *args], capture_output=True, text=True, timeout=timeout_s, check=False
    )
    if check and res.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed ({res.returncode}):\n{res.stderr}")
    return res


def render_text(
    *args: str, release: str = "rel", namespace: str = "fg", chart: Path = CHART
) -> str:
    return helm("template", release, str(chart), "--namespace", namespace, *args).stdout


def render(
    *args: str, release: str = "rel", namespace: str = "fg", chart: Path = CHART
) -> list[dict[str, Any]]:
    """``helm template`` output as objects (empty documents dropped)."""
    text = render_text(*args, release=release, namespace=namespace, chart=chart)
    return [d for d in yaml.safe_load_all(text) if d]


def by_kind(objs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objs if o["kind"] == kind]


def one(objs: list[dict[str, Any]], kind: str, component: str | None = None) -> dict[str, Any]:
    found = [
        o
        for o in by_kind(objs, kind)
        if component is None
        or o["metadata"].get("labels", {}).get("app.kubernetes.io/component") == component
    ]
    assert len(found) == 1, f"expected one {kind} {component or ''}, got {len(found)}"
    return found[0]
