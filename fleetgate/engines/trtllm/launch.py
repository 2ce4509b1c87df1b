"""The trtllm-serve container: command line and the LLM-API options YAML.

``trtllm-serve <model> --host --port --backend --tp_size --pp_size
[--max_batch_size] [--max_num_tokens] [--revision] --extra_llm_api_options FILE``
(the click options of ``tensorrt_llm/commands/serve.py``); the options file holds
``kv_cache_config`` and ``scheduler_config`` (``tensorrt_llm/llmapi/llm_args.py``).
"""

from __future__ import annotations

import yaml

from fleetgate.engines._common import validate_launch
from fleetgate.engines.base import ContainerPlan, LaunchSpec, Probe
from fleetgate.engines.trtllm.settings import TrtllmSettings
from fleetgate.engines.trtllm.sources import PROMETHEUS

__all__ = ["CONFIG_FILE", "container_plan", "llm_api_options_yaml"]

#: File name of the LLM-API options YAML inside ``ContainerPlan.config_mount_path``.
CONFIG_FILE = "extra-llm-api-options.yaml"

#: trtllm-serve's subcommands; a model path equal to one needs an explicit ``serve``.
_SUBCOMMANDS = frozenset(
    {"serve", "grpc", "disaggregated", "disaggregated_mpi_worker", "mm_embedding_serve"}
)


def container_plan(launch: LaunchSpec) -> ContainerPlan:
    """``trtllm-serve <model> ...`` plus the LLM-API options YAML as a config file."""
    validate_launch(launch, TrtllmSettings)
    settings = launch.settings if isinstance(launch.settings, TrtllmSettings) else TrtllmSettings()
    mount = str(ContainerPlan.__dataclass_fields__["config_mount_path"].default)
    args: list[str] = ["serve"] if launch.model_path in _SUBCOMMANDS else []
    args += [
        launch.model_path,
        "--host",
        "0.0.0.0",
        "--port",
        str(launch.port),
        "--backend",
        settings.backend,
        "--tp_size",
        str(launch.tensor_parallel),
        "--pp_size",
        str(launch.pipeline_parallel),
    ]
    if settings.max_batch_size is not None:
        args += ["--max_batch_size", str(settings.max_batch_size)]
    if settings.max_num_tokens is not None:
        args += ["--max_num_tokens", str(settings.max_num_tokens)]
    if launch.revision:
        args += ["--revision", launch.revision]
    args += ["--extra_llm_api_options", f"{mount}/{CONFIG_FILE}"]
    args += launch.extra_args
    health = Probe("/health")
    return ContainerPlan(
        command=("trtllm-serve",),
        args=tuple(args),
        port=launch.port,
        startup_probe=health,
        readiness_probe=health,
        liveness_probe=health,
        metrics_path=PROMETHEUS.path,
        needs_shared_memory=True,
        config_files={CONFIG_FILE: llm_api_options_yaml(settings)},
        config_mount_path=mount,
    )


def llm_api_options_yaml(settings: TrtllmSettings) -> str:
    """The ``--extra_llm_api_options`` YAML."""
    options = {
        "kv_cache_config": {
            "free_gpu_memory_fraction": settings.kv_cache_free_gpu_memory_fraction,
            "enable_block_reuse": settings.enable_block_reuse,
            "tokens_per_block": settings.tokens_per_block,
        },
        "scheduler_config": {
            "capacity_scheduler_policy": settings.capacity_scheduler_policy,
            "waiting_queue_policy": settings.waiting_queue_policy,
        },
        # JSON /metrics needs iteration stats; /prometheus/metrics is mounted only
        # with per-request perf metrics on.
        "enable_iter_perf_stats": True,
        "return_perf_metrics": True,
    }
    return yaml.safe_dump(options, sort_keys=False)
