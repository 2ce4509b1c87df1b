"""Generate charts/fleetgate/values.schema.json from values.yaml.

values.yaml is the single source (as in cert-manager's chart): each key's
``# --`` comment becomes its description, each default's type its type, and
every object that lists its keys rejects unknown ones. Keys whose default is an
empty map, or that are listed in FREE_FORM, accept any object (node selectors,
affinity, labels). ``router.config`` is the router's own typed model
(``fleetgate.router.config.RouterConfig``, its JSON schema embedded here), so
the chart and the router share one schema and ``helm install`` refuses an
unknown or mistyped router key before any pod starts.

    python hack/gen_values_schema.py          # rewrite the schema
    python hack/gen_values_schema.py --check  # exit 1 if it is out of date
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import yaml

from fleetgate.router.config import RouterConfig

CHART = Path(__file__).resolve().parent.parent / "charts" / "fleetgate"
FREE_FORM = {"resources", "config"}
LIST_ITEMS: dict[str, dict[str, Any]] = {
    "imagePullSecrets": {"type": "object", "properties": {"name": {"type": "string"}}},
    "watchNamespaces": {"type": "string", "minLength": 1},
    "extraArgs": {"type": "string"},
    "extraEnv": {"type": "object", "required": ["name"]},
    "tolerations": {"type": "object"},
}
ENUMS = {
    "pullPolicy": ["Always", "IfNotPresent", "Never"],
    "type": ["ClusterIP", "NodePort", "LoadBalancer"],
}


def descriptions(text: str) -> dict[str, str]:
    """Map dotted key paths to their ``# --`` comments."""
    out: dict[str, str] = {}
    stack: list[tuple[int, str]] = []
    pending: list[str] = []
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("# --"):
            pending = [stripped[4:].strip()]
            continue
        if stripped.startswith("#") and pending:
            pending.append(stripped[1:].strip())
            continue
        m = re.match(r"^(\s*)([A-Za-z0-9_]+):", line)
        if not m:
            pending = []
            continue
        indent = len(m.group(1))
        while stack and stack[-1][0] >= indent:
            stack.pop()
        stack.append((indent, m.group(2)))
        if pending:
            out[".".join(k for _, k in stack)] = " ".join(pending)
        pending = []
    return out


ROUTER_CONFIG = "router.config"


def router_config_schema() -> tuple[dict[str, Any], dict[str, Any]]:
    """RouterConfig's JSON schema and its definitions (to hoist to the document root,
    where its ``#/$defs/...`` references point)."""
    s = RouterConfig.model_json_schema()
    defs = s.pop("$defs", {})
    s.pop("title", None)
    return s, defs


def schema_for(value: Any, path: str, docs: dict[str, str]) -> dict[str, Any]:
    key = path.rsplit(".", 1)[-1]
    s: dict[str, Any]
    if path == ROUTER_CONFIG:
        s = router_config_schema()[0]
    elif isinstance(value, dict) and value and key not in FREE_FORM:
        s = {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                k: schema_for(v, f"{path}.{k}" if path else k, docs) for k, v in value.items()
            },
        }
    elif isinstance(value, dict):
        s = {"type": "object"}
    elif isinstance(value, bool):
        s = {"type": "boolean"}
    elif isinstance(value, int):
        s = {"type": "integer", "minimum": 0}
    elif isinstance(value, list):
        s = {"type": "array", "items": LIST_ITEMS.get(key, {})}
    else:
        s = {"type": "string"}
        if key in ENUMS:
            s["enum"] = ENUMS[key]
    if path in docs:
        s["description"] = docs[path]
    return s


def render() -> str:
    text = (CHART / "values.yaml").read_text()
    schema = schema_for(yaml.safe_load(text), "", descriptions(text))
    schema = {
        "$schema": "https://json-schema.org/draft-07/schema#",
        **schema,
        "$defs": router_config_schema()[1],
    }
    return json.dumps(schema, indent=2, sort_keys=False) + "\n"


def main() -> int:
    target = CHART / "values.schema.json"
    rendered = render()
    if "--check" in sys.argv:
        if not target.exists() or target.read_text() != rendered:
            print(f"{target} is out of date: run python hack/gen_values_schema.py", file=sys.stderr)
            return 1
        return 0
    target.write_text(rendered)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
