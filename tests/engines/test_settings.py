"""The typed engine settings embedded in the InferenceService CRD spec."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from fleetgate.engines.trtllm import TrtllmSettings
from fleetgate.engines.vllm import VllmSettings


def test_vllm_defaults() -> None:
    s = VllmSettings()
    assert s.gpu_memory_utilization == 0.9
    assert s.enable_prefix_caching is True
    assert s.scheduling_policy == "priority"
    assert s.max_model_len is None
    assert s.max_num_seqs is None
    assert s.max_num_batched_tokens is None
    assert s.block_size is None
    assert s.enable_chunked_prefill is None


def test_trtllm_defaults() -> None:
    s = TrtllmSettings()
    assert s.backend == "pytorch"
    assert s.max_batch_size is None
    assert s.max_num_tokens is None
    assert s.kv_cache_free_gpu_memory_fraction == 0.9
    assert s.capacity_scheduler_policy == "GUARANTEED_NO_EVICT"
    assert s.enable_block_reuse is True
    assert s.tokens_per_block == 32
    assert s.waiting_queue_policy == "priority"


def test_camel_case_aliases_and_field_names_both_accepted() -> None:
    by_alias = VllmSettings.model_validate({"maxModelLen": 4096, "gpuMemoryUtilization": 0.5})
    by_name = VllmSettings.model_validate({"max_model_len": 4096, "gpu_memory_utilization": 0.5})
    assert by_alias == by_name
    assert by_alias.model_dump(by_alias=True)["maxModelLen"] == 4096
    t = TrtllmSettings.model_validate({"kvCacheFreeGpuMemoryFraction": 0.7, "tokensPerBlock": 64})
    assert t.kv_cache_free_gpu_memory_fraction == 0.7
    assert t.tokens_per_block == 64
    assert "capacitySchedulerPolicy" in t.model_dump(by_alias=True)


@pytest.mark.parametrize(
    ("model", "data"),
    [
        pytest.param(VllmSettings, {"gpuMemoryUtilization": 0.0}, id="vllm-gmu-zero"),
        pytest.param(VllmSettings, {"gpuMemoryUtilization": 1.01}, id="vllm-gmu-over-1"),
        pytest.param(VllmSettings, {"maxModelLen": 0}, id="vllm-max-model-len-zero"),
        pytest.param(VllmSettings, {"maxNumSeqs": -1}, id="vllm-max-num-seqs-negative"),
        pytest.param(VllmSettings, {"blockSize": 0}, id="vllm-block-size-zero"),
        pytest.param(VllmSettings, {"schedulingPolicy": "lifo"}, id="vllm-bad-policy"),
        pytest.param(VllmSettings, {"noSuchField": 1}, id="vllm-extra-forbidden"),
        pytest.param(TrtllmSettings, {"backend": "onnx"}, id="trt-bad-backend"),
        pytest.param(TrtllmSettings, {"tokensPerBlock": 0}, id="trt-tpb-zero"),
        pytest.param(TrtllmSettings, {"kvCacheFreeGpuMemoryFraction": 1.5}, id="trt-frac"),
        pytest.param(
            TrtllmSettings, {"capacitySchedulerPolicy": "STATIC_BATCH"}, id="trt-static-batch"
        ),
        pytest.param(TrtllmSettings, {"waitingQueuePolicy": "lifo"}, id="trt-bad-queue"),
        pytest.param(TrtllmSettings, {"maxBatchSize": 0}, id="trt-batch-zero"),
        pytest.param(TrtllmSettings, {"extra": True}, id="trt-extra-forbidden"),
    ],
)
def test_bad_settings_rejected(model: type[BaseModel], data: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        model.model_validate(data)


@pytest.mark.parametrize("model", [VllmSettings, TrtllmSettings])
def test_settings_frozen_and_every_field_described(model: type[BaseModel]) -> None:
    for name, field in model.model_fields.items():
        assert field.description, f"{model.__name__}.{name} has no description"
    instance = model()
    with pytest.raises(ValidationError):
        instance.__setattr__(next(iter(model.model_fields)), None)
    schema = model.model_json_schema(by_alias=True)
    assert schema["additionalProperties"] is False
