"""The CRD rendered from the models: structural, complete, and in sync with crds/."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from fleetgate.api import crd
from fleetgate.cli import main

CRDS = Path(__file__).resolve().parents[2] / "crds"


def _walk(node: Any, path: str = "") -> list[tuple[str, dict[str, Any]]]:
    found: list[tuple[str, dict[str, Any]]] = []
    if isinstance(node, dict):
        found.append((path, node))
        for key, value in node.items():
            found += _walk(value, f"{path}.{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            found += _walk(value, f"{path}[{i}]")
    return found


def _schema() -> dict[str, Any]:
    version = crd.render_crd()["spec"]["versions"][0]
    schema: dict[str, Any] = version["schema"]["openAPIV3Schema"]
    return schema


def test_crds_dir_is_up_to_date() -> None:
    on_disk = (CRDS / crd.CRD_FILE_NAME).read_text(encoding="utf-8")
    assert on_disk == crd.render_crd_yaml(), "crds/ is stale: run `fleetgate crds`"


def test_schema_is_structural() -> None:
    for path, node in _walk(_schema()):
        for banned in ("$ref", "$defs", "title", "anyOf", "oneOf", "allOf", "const"):
            assert banned not in node, f"{banned} at {path}"
        assert node.get("additionalProperties") is not False, path
        if "properties" in node or "items" in node:
            assert node.get("type") in {"object", "array"}, path
        assert node.get("default", "set") is not None, f"default: null at {path}"


def test_every_spec_field_is_documented() -> None:
    spec = _schema()["properties"]["spec"]
    undocumented = [
        path
        for path, node in _walk(spec)
        if path.count(".properties.") and path.rsplit(".", 2)[-2] == "properties"
        if not node.get("description")
    ]
    assert undocumented == []


def test_cel_rules_present_with_messages() -> None:
    rules = {
        path: node["x-kubernetes-validations"]
        for path, node in _walk(_schema())
        if "x-kubernetes-validations" in node
    }
    joined = " ".join(entry["rule"] for entries in rules.values() for entry in entries)
    assert "self.parallelism.tensor * self.parallelism.pipeline == self.gpu.count" in joined
    assert "!has(self.vllm) || self.type == 'vllm'" in joined
    assert "!has(self.tensorrtLlm) || self.type == 'tensorrt-llm'" in joined
    assert "maxSurge" in joined
    for entries in rules.values():
        for entry in entries:
            assert len(entry["message"]) > 20


def test_defaults_enums_and_bounds() -> None:
    spec = _schema()["properties"]["spec"]["properties"]
    assert spec["replicas"] == {**spec["replicas"], "default": 1, "minimum": 0}
    assert spec["engine"]["properties"]["type"]["enum"] == ["vllm", "tensorrt-llm"]
    rollout = spec["rollout"]["properties"]
    assert rollout["maxSurge"]["default"] == 0 and rollout["maxUnavailable"]["default"] == 1
    assert rollout["maxSurge"]["x-kubernetes-int-or-string"] is True
    assert "type" not in rollout["maxSurge"]
    assert spec["routing"]["properties"]["role"]["enum"] == ["latency", "throughput"]
    vllm = spec["engine"]["properties"]["vllm"]["properties"]
    assert vllm["gpuMemoryUtilization"]["exclusiveMinimum"] is True
    assert spec["scheduling"]["properties"]["affinity"]["x-kubernetes-preserve-unknown-fields"]
    # sub-objects default to their fully defaulted value: the API server checks a
    # default against CEL without applying nested defaults first
    assert spec["rollout"]["default"] == {"maxSurge": 0, "maxUnavailable": 1}
    assert spec["parallelism"]["default"] == {"tensor": 1, "pipeline": 1}
    assert spec["gpu"]["default"] == {"count": 1, "resourceName": "nvidia.com/gpu"}
    for name in ("routing", "storage", "metrics", "scheduling"):
        assert isinstance(spec[name]["default"], dict), name
    assert "vllm" not in spec["engine"].get("required", [])
    assert "default" not in spec["engine"]["properties"]["vllm"]


def test_names_subresources_and_columns() -> None:
    rendered = crd.render_crd()
    names = rendered["spec"]["names"]
    assert names["kind"] == "InferenceService" and "isvc" not in names["shortNames"]
    version = rendered["spec"]["versions"][0]
    assert version["subresources"]["status"] == {}
    assert version["subresources"]["scale"]["labelSelectorPath"] == ".status.selector"
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert columns["Engine"] == ".spec.engine.type"
    assert "Ready" in columns["Ready"] and columns["Reason"].endswith(".reason")
    assert columns["Age"] == ".metadata.creationTimestamp"
    assert "Model" in columns


def test_cli_check_detects_stale_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["crds", "--out", str(tmp_path)]) == 0
    assert main(["crds", "--out", str(tmp_path), "--check"]) == 0
    target = tmp_path / crd.CRD_FILE_NAME
    target.write_text(target.read_text() + "# edited\n")
    assert main(["crds", "--out", str(tmp_path), "--check"]) == 1
    assert "out of date" in capsys.readouterr().err


def test_structural_rejects_unions_it_cannot_express() -> None:
    with pytest.raises(ValueError, match="structural"):
        crd.structural({"anyOf": [{"type": "integer"}, {"type": "boolean"}]})
