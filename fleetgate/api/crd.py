"""Render the ``InferenceService`` pydantic models into an apiextensions.k8s.io/v1 CRD.

The API server only accepts *structural* schemas
(https://kubernetes.io/docs/tasks/extend-kubernetes/custom-resources/custom-resource-definitions/#specifying-a-structural-schema),
which pydantic's JSON Schema is not. :func:`structural` rewrites it:

* ``$ref`` / ``$defs`` are resolved inline (a structural schema has no references);
* ``title`` and ``default: null`` go; ``anyOf: [X, {type: null}]`` (an optional
  field) becomes X: absence, not null, means "unset";
* ``anyOf: [integer, string]`` becomes ``x-kubernetes-int-or-string: true``;
* ``additionalProperties: false`` (pydantic ``extra="forbid"``) goes: the API
  server prunes and, with strict field validation, rejects unknown fields;
* a free-form object (``dict[str, Any]``) becomes
  ``x-kubernetes-preserve-unknown-fields: true``;
* numeric ``exclusiveMinimum: n`` becomes OpenAPI v3.0's ``minimum: n`` +
  ``exclusiveMinimum: true``; ``const`` becomes a one-value ``enum``.

CEL rules travel in ``x-kubernetes-validations`` from the models' json_schema_extra.
The result is deterministic (sorted keys) so ``crds/`` can be diffed in a test.

Pure: no I/O.
"""

from __future__ import annotations

import copy
from typing import Any

import yaml

from fleetgate.api import v1alpha1

__all__ = ["CRD_FILE_NAME", "crd_name", "render_crd", "render_crd_yaml", "structural"]

CRD_FILE_NAME = f"{v1alpha1.PLURAL}.{v1alpha1.GROUP}.yaml"

_DROP = {"title", "$defs", "x-fleetgate-int-or-string"}


def crd_name() -> str:
    """The CRD's metadata.name, ``inferenceservices.fleetgate.dev``."""
    return f"{v1alpha1.PLURAL}.{v1alpha1.GROUP}"


def _resolve(node: Any, defs: dict[str, Any]) -> Any:
    if isinstance(node, list):
        return [_resolve(item, defs) for item in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        target = node["$ref"].rsplit("/", 1)[-1]
        merged = {**copy.deepcopy(defs[target]), **{k: v for k, v in node.items() if k != "$ref"}}
        return _resolve(merged, defs)
    return {k: _resolve(v, defs) for k, v in node.items()}


def _is_null(node: Any) -> bool:
    return isinstance(node, dict) and node.get("type") == "null"


def _rewrite(node: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    any_of = node.get("anyOf")
    if any_of is not None:
        branches = [b for b in any_of if not _is_null(b)]
        types = sorted(b.get("type", "") for b in branches)
        rest = {k: v for k, v in node.items() if k != "anyOf"}
        if types == ["integer", "string"]:
            rest["x-kubernetes-int-or-string"] = True
            return _rewrite(rest)
        if len(branches) == 1:
            return _rewrite({**branches[0], **rest})
        raise ValueError(f"cannot express anyOf {any_of!r} in a structural schema")
    for key, value in node.items():
        if key in _DROP or (key == "default" and value is None):
            continue
        if key == "properties":
            out[key] = {name: _rewrite(sub) for name, sub in value.items()}
        elif key == "items":
            out[key] = _rewrite(value)
        elif key == "additionalProperties":
            if value is False:
                continue
            if value is True or value == {}:
                out["x-kubernetes-preserve-unknown-fields"] = True
            else:
                out[key] = _rewrite(value)
        elif key == "exclusiveMinimum" and not isinstance(value, bool):
            out["minimum"] = value
            out["exclusiveMinimum"] = True
        elif key == "exclusiveMaximum" and not isinstance(value, bool):
            out["maximum"] = value
            out["exclusiveMaximum"] = True
        elif key == "description":
            out[key] = " ".join(str(value).replace("``", "`").split())
        elif key == "const":
            out["enum"] = [value]
        else:
            out[key] = value
    if (
        out.get("type") == "object"
        and "properties" not in out
        and "additionalProperties" not in out
    ):
        out["x-kubernetes-preserve-unknown-fields"] = True
    if "x-kubernetes-int-or-string" in out:
        out.pop("type", None)
    return out


def structural(schema: dict[str, Any]) -> dict[str, Any]:
    """Turn a pydantic JSON Schema into a Kubernetes structural schema."""
    defs = schema.get("$defs", {})
    return _rewrite(_resolve(schema, defs))


def _schema_of(model: type[v1alpha1._Model]) -> dict[str, Any]:
    return structural(model.model_json_schema(by_alias=True, mode="validation"))


def _printer_columns() -> list[dict[str, Any]]:
    ready = '.status.conditions[?(@.type=="Ready")]'
    return [
        {"name": "Engine", "type": "string", "jsonPath": ".spec.engine.type"},
        {"name": "Model", "type": "string", "jsonPath": ".status.servedModel"},
        {"name": "Replicas", "type": "integer", "jsonPath": ".spec.replicas"},
        {"name": "Ready", "type": "string", "jsonPath": f"{ready}.status"},
        {"name": "Reason", "type": "string", "jsonPath": f"{ready}.reason"},
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
        {
            "name": "URL",
            "type": "string",
            "jsonPath": ".status.url",
            "priority": 1,
        },
    ]


def render_crd() -> dict[str, Any]:
    """The CustomResourceDefinition as a dict."""
    spec_schema = _schema_of(v1alpha1.InferenceServiceSpec)
    status_schema = _schema_of(v1alpha1.InferenceServiceStatus)
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": crd_name(),
            "labels": {"app.kubernetes.io/part-of": "fleetgate"},
        },
        "spec": {
            "group": v1alpha1.GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": v1alpha1.KIND,
                "listKind": f"{v1alpha1.KIND}List",
                "plural": v1alpha1.PLURAL,
                "singular": v1alpha1.SINGULAR,
                "shortNames": list(v1alpha1.SHORT_NAMES),
                "categories": ["fleetgate"],
            },
            "versions": [
                {
                    "name": v1alpha1.VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "description": (v1alpha1.InferenceService.__doc__ or "").strip(),
                            "required": ["spec"],
                            # Root-level rules may read metadata.name (and nothing
                            # else of metadata): the one place to check it.
                            "x-kubernetes-validations": [
                                {"rule": v1alpha1.NAME_RULE, "message": v1alpha1.NAME_MESSAGE}
                            ],
                            "properties": {
                                "apiVersion": {"type": "string"},
                                "kind": {"type": "string"},
                                "metadata": {"type": "object"},
                                "spec": spec_schema,
                                "status": status_schema,
                            },
                        }
                    },
                    "subresources": {
                        "status": {},
                        "scale": {
                            "specReplicasPath": ".spec.replicas",
                            "statusReplicasPath": ".status.replicas",
                            "labelSelectorPath": ".status.selector",
                        },
                    },
                    "additionalPrinterColumns": _printer_columns(),
                }
            ],
        },
    }


def render_crd_yaml() -> str:
    """The CRD as the YAML text stored in ``crds/``."""
    header = (
        "# Generated by `fleetgate crds` from fleetgate/api/v1alpha1.py. Do not edit:\n"
        "# change the models and re-run the command (tests/api fails when this is stale).\n"
    )
    body = yaml.safe_dump(render_crd(), sort_keys=True, width=100, allow_unicode=True)
    return header + body
