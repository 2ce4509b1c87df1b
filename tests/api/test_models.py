"""The InferenceService models: defaults, bounds and the cross-field rules.

The same rules exist as CEL in the CRD (tests/api/test_crd.py checks they are there,
tests/operator/test_cluster.py checks the API server enforces them); here the pydantic
mirror is checked case by case.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from fleetgate.api.v1alpha1 import InferenceService, InferenceServiceSpec

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _spec(**overrides: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "model": {"uri": "hf://org/model"},
        "engine": {"type": "vllm", "image": "vllm/vllm-openai:v0.32.0"},
    }
    spec.update(overrides)
    return spec


def test_minimal_spec_takes_documented_defaults() -> None:
    spec = InferenceServiceSpec.model_validate(_spec())
    assert spec.replicas == 1
    assert (spec.parallelism.tensor, spec.parallelism.pipeline, spec.gpu.count) == (1, 1, 1)
    assert spec.gpu.resource_name == "nvidia.com/gpu"
    assert (spec.rollout.max_surge, spec.rollout.max_unavailable) == (0, 1)
    assert spec.startup_budget_seconds == 1800
    assert spec.routing.pool == "default" and spec.routing.role == "latency"
    assert spec.storage.model_cache.pvc is None and spec.storage.shared_memory_size == "2Gi"
    assert spec.engine.vllm is None and spec.engine.tensorrt_llm is None


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        pytest.param(
            {"engine": {"type": "vllm", "image": "i", "tensorrtLlm": {"maxBatchSize": 8}}},
            "engine.tensorrtLlm settings are set but engine.type is not 'tensorrt-llm'",
            id="trt-settings-on-vllm",
        ),
        pytest.param(
            {"engine": {"type": "tensorrt-llm", "image": "i", "vllm": {"maxModelLen": 8}}},
            "engine.vllm settings are set but engine.type is not 'vllm'",
            id="vllm-settings-on-trt",
        ),
        pytest.param(
            {"parallelism": {"tensor": 2}, "gpu": {"count": 1}},
            "parallelism.tensor x parallelism.pipeline must equal gpu.count",
            id="tp-times-pp-not-gpus",
        ),
        pytest.param(
            {"gpu": {"count": 0, "product": "NVIDIA-L4"}},
            "gpu.product is set but gpu.count is 0",
            id="product-without-gpus",
        ),
        pytest.param(
            {"rollout": {"maxSurge": 0, "maxUnavailable": "0%"}},
            "cannot both be 0",
            id="rollout-stuck",
        ),
        pytest.param(
            {"rollout": {"maxSurge": "150%"}},
            "count or a percent",
            id="rollout-bad-percent",
        ),
        pytest.param(
            {"storage": {"modelCache": {"pvc": {"claimName": "c"}, "emptyDir": {}}}},
            "set either pvc or emptyDir, not both",
            id="two-caches",
        ),
        pytest.param({"model": {"uri": "ftp://x/y"}}, "uri", id="bad-uri-scheme"),
        pytest.param({"replicas": -1}, "replicas", id="negative-replicas"),
        pytest.param({"startupBudgetSeconds": 5}, "startupBudgetSeconds", id="budget-too-small"),
        pytest.param(
            {"engine": {"type": "sglang", "image": "i"}}, "engine.type", id="unknown-engine"
        ),
        pytest.param({"unknownField": 1}, "unknownField", id="unknown-field"),
        pytest.param(
            {"storage": {"sharedMemorySize": "lots"}}, "sharedMemorySize", id="bad-quantity"
        ),
    ],
)
def test_invalid_specs_are_rejected_with_a_readable_message(
    overrides: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValidationError) as info:
        InferenceServiceSpec.model_validate(_spec(**overrides))
    text = str(info.value)
    assert message in text, text


def test_valid_tensor_parallel_and_cpu_specs() -> None:
    tp = InferenceServiceSpec.model_validate(
        _spec(parallelism={"tensor": 2, "pipeline": 2}, gpu={"count": 4})
    )
    assert tp.gpu.count == 4
    cpu = InferenceServiceSpec.model_validate(_spec(parallelism={"tensor": 4}, gpu={"count": 0}))
    assert cpu.gpu.count == 0


def test_percent_rollout_is_allowed() -> None:
    spec = InferenceServiceSpec.model_validate(
        _spec(rollout={"maxSurge": "25%", "maxUnavailable": 0})
    )
    assert spec.rollout.max_surge == "25%"


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_examples_parse(path: Path) -> None:
    doc = yaml.safe_load(path.read_text())
    isvc = InferenceService.model_validate(doc)
    assert isvc.metadata["name"]
    engine = isvc.spec.engine
    if engine.type == "vllm":
        assert engine.vllm is not None
    else:
        assert engine.tensorrt_llm is not None


def test_examples_cover_both_engines() -> None:
    names = sorted(p.name for p in EXAMPLES.glob("*.yaml"))
    assert any(n.startswith("vllm-") for n in names), names
    assert any(n.startswith("trtllm-") for n in names), names
