"""The engine command lines fleetgate's operator writes, for tests that run them.

Every case is an ``InferenceService`` spec: each ``examples/*.yaml`` as it is, and
for each engine every CRD engine setting set away from its default (booleans both
ways), plus ``extraArgs`` with flags the emulator does not know. :func:`engine_container`
turns one into the engine container exactly as the operator's manifests have it
(command, args, probes, the config files mounted next to it).

Importable from every test directory (``tests/`` is on ``sys.path``, see
``tests/realvllm.py``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import yaml

from fleetgate.api.v1alpha1 import InferenceServiceSpec
from fleetgate.engines.trtllm import TrtllmSettings
from fleetgate.engines.vllm import VllmSettings
from fleetgate.operator import manifests
from fleetgate.operator.options import OperatorOptions

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))

#: One non-default value per vLLM setting (a list: each value is one case).
VLLM_VALUES: dict[str, list[Any]] = {
    "max_model_len": [4096],
    "gpu_memory_utilization": [0.8],
    "enable_prefix_caching": [False],
    "scheduling_policy": ["fcfs"],
    "max_num_seqs": [32],
    "max_num_batched_tokens": [4096],
    "block_size": [32],
    "enable_chunked_prefill": [True, False],
    "kv_events": [False],
}
#: The same for TensorRT-LLM.
TRTLLM_VALUES: dict[str, list[Any]] = {
    "backend": ["tensorrt"],
    "max_batch_size": [16],
    "max_num_tokens": [4096],
    "kv_cache_free_gpu_memory_fraction": [0.5],
    "capacity_scheduler_policy": ["MAX_UTILIZATION"],
    "enable_block_reuse": [False],
    "tokens_per_block": [64],
    "waiting_queue_policy": ["priority"],
    "enable_attention_dp": [True],
    "kv_events": [False],
}
#: Flags a user may add through engine.extraArgs that the emulator does not know.
EXTRA_ARGS = {
    "vllm": ["--load-format", "runai_streamer", "--disable-log-requests"],
    "tensorrt-llm": ["--fail_fast_on_attention_window_too_large"],
}


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(p.capitalize() for p in rest)


def _base(kind: str) -> dict[str, Any]:
    engine: dict[str, Any] = {"type": kind, "image": "emulator"}
    if kind == "tensorrt-llm":
        # an untagged image names no release: say which one (every setting exists on main;
        # the contract tests check each supported release's flags and keys)
        engine["version"] = "main"
    return {
        "model": {"uri": "hf://meta-llama/Llama-3.1-8B-Instruct", "name": "llama-3.1-8b"},
        "engine": engine,
    }


def cases() -> list[Any]:
    """``pytest.param(spec_dict, id=...)`` for every case."""
    out = [
        pytest.param(yaml.safe_load(path.read_text())["spec"], id=f"example-{path.stem}")
        for path in EXAMPLES
    ]
    assert set(VLLM_VALUES) == set(VllmSettings.model_fields), "cover every vLLM setting"
    assert set(TRTLLM_VALUES) == set(TrtllmSettings.model_fields), "cover every TRT setting"
    for kind, key, table in (
        ("vllm", "vllm", VLLM_VALUES),
        ("tensorrt-llm", "tensorrtLlm", TRTLLM_VALUES),
    ):
        for field, values in table.items():
            for value in values:
                spec = _base(kind)
                spec["engine"][key] = {_camel(field): value}
                out.append(pytest.param(spec, id=f"{kind}-{field}={value}"))
        spec = _base(kind)
        spec["engine"]["extraArgs"] = EXTRA_ARGS[kind]
        out.append(pytest.param(spec, id=f"{kind}-extraArgs"))
    return out


@dataclasses.dataclass(frozen=True)
class EngineContainer:
    engine: str
    """Adapter name: ``vllm`` or ``trtllm``."""
    command: list[str]
    args: list[str]
    port: int
    probes: dict[str, str]
    """``startupProbe`` / ``readinessProbe`` / ``livenessProbe`` -> HTTP path."""
    config_files: dict[str, str]
    config_mount_path: str
    served_model: str
    spec: InferenceServiceSpec

    @property
    def argv(self) -> list[str]:
        return [*self.command, *self.args]


def engine_container(spec_data: dict[str, Any]) -> EngineContainer:
    """The engine container the operator generates for ``spec_data``."""
    spec = InferenceServiceSpec.model_validate(spec_data)
    children = manifests.build_children(
        manifests.Owner(name="svc", namespace="ns", uid="uid-1"),
        spec,
        OperatorOptions(),
        service_monitor_supported=False,
    )
    deployment = children.by_kind("Deployment")
    assert deployment is not None
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    probes = {}
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        get = container[kind]["httpGet"]
        assert ports[get["port"]] == manifests.ENGINE_PORT, get
        probes[kind] = get["path"]
    config_map = children.by_kind("ConfigMap")
    return EngineContainer(
        engine=children.engine,
        command=list(container["command"]),
        args=list(container["args"]),
        port=manifests.ENGINE_PORT,
        probes=probes,
        config_files=dict(config_map["data"]) if config_map else {},
        config_mount_path=children.plan.config_mount_path,
        served_model=children.served_model,
        spec=spec,
    )
