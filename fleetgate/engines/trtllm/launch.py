"""The trtllm-serve container: command line and the LLM-API options YAML, per release.

``trtllm-serve <model> --host --port --backend --tp_size --pp_size [--max_batch_size]
[--max_num_tokens] [--revision] --extra_llm_api_options FILE`` (the click options of
``tensorrt_llm/commands/serve.py``); the options file holds ``kv_cache_config``,
``scheduler_config`` and the metrics switches (``tensorrt_llm/llmapi/llm_args.py``).
Only what the service's release accepts is written (:mod:`.versions`):

* ``--revision`` only where it exists (main); elsewhere a revision is refused with a
  clear error rather than a pod that exits with "No such option".
* ``scheduler_config.waiting_queue_policy`` only where ``SchedulerConfig`` has it (main).
* ``enable_iter_perf_stats`` is a field of the PyTorch backend's options only: written
  for ``backend: pytorch`` and never for ``backend: tensorrt``.
* ``return_perf_metrics`` starts TensorRT-LLM's own metrics collector, a second reader
  of the iteration-stats queue. It is written only where fleetgate reads load from the
  collector's ``/prometheus/metrics`` (main), never where the router polls the JSON
  ``/metrics`` queue (1.0, 1.1/1.2), so one queue never has two readers.
"""

from __future__ import annotations

from typing import Any, Literal

import yaml

from fleetgate.engines._common import validate_launch
from fleetgate.engines.base import ContainerPlan, KvEventsEndpoint, LaunchSpec, Probe
from fleetgate.engines.trtllm.kv_events import KV_EVENTS_PATH, TRTLLM_KV_EVENTS_FORMAT
from fleetgate.engines.trtllm.kv_zmq import (
    KV_EVENTS_PORT,
    KV_EVENTS_TOPIC,
    KV_REPLAY_PORT,
    TRTLLM_ZMQ_FORMAT,
    kv_events_config,
)
from fleetgate.engines.trtllm.settings import KV_EVENT_BUFFER, TrtllmSettings
from fleetgate.engines.trtllm.sources import ITERATION_STATS, PROMETHEUS
from fleetgate.engines.trtllm.versions import (
    EngineVersionError,
    TrtllmRelease,
    resolve_version,
)

__all__ = [
    "CONFIG_FILE",
    "attention_dp_ranks",
    "container_plan",
    "kv_events_endpoint",
    "kv_events_transport",
    "llm_api_options",
    "llm_api_options_yaml",
]

#: File name of the LLM-API options YAML inside ``ContainerPlan.config_mount_path``.
CONFIG_FILE = "extra-llm-api-options.yaml"

#: trtllm-serve's subcommands; a model path equal to one needs an explicit ``serve``.
_SUBCOMMANDS = frozenset(
    {"serve", "grpc", "disaggregated", "disaggregated_mpi_worker", "mm_embedding_serve"}
)


def container_plan(launch: LaunchSpec, release: TrtllmRelease | None = None) -> ContainerPlan:
    """``trtllm-serve <model> ...`` plus the LLM-API options YAML as a config file.

    ``release`` defaults to the one the launch spec names (version or image tag);
    :class:`~.versions.EngineVersionError` when that cannot be told.
    """
    validate_launch(launch, TrtllmSettings)
    if release is None:
        release = resolve_version(launch.engine_version, launch.image)
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
        if not release.revision_flag:
            raise EngineVersionError(
                f"trtllm-serve {release.line} has no --revision option; pin the revision "
                "by pre-loading the weights (pvc://) or use a newer image"
            )
        args += ["--revision", launch.revision]
    args += ["--extra_llm_api_options", f"{mount}/{CONFIG_FILE}"]
    args += launch.extra_args
    health = Probe("/health")
    source = PROMETHEUS if release.load_source == "prometheus" else ITERATION_STATS
    return ContainerPlan(
        command=("trtllm-serve",),
        args=tuple(args),
        port=launch.port,
        startup_probe=health,
        readiness_probe=health,
        liveness_probe=health,
        metrics_path=source.path,
        needs_shared_memory=True,
        config_files={CONFIG_FILE: llm_api_options_yaml(settings, release, launch.tensor_parallel)},
        config_mount_path=mount,
        engine_version=release.line,
        kv_events=kv_events_endpoint(settings, release, launch.tensor_parallel),
    )


def kv_events_transport(
    settings: TrtllmSettings, release: TrtllmRelease
) -> Literal["http-drain", "zmq"] | None:
    """How the engine publishes KV-cache events (None: off or not verified for the line)."""
    if not settings.kv_events_on or release.kv_events is None:
        return None
    if release.kv_events == "zmq" and settings.backend != "pytorch":
        return "http-drain"  # the streaming publisher is KV cache manager V2's (PyTorch)
    return release.kv_events


def attention_dp_ranks(settings: TrtllmSettings, tensor_parallel: int) -> int:
    """Attention-DP ranks of one replica: its tensor-parallel GPUs with attention DP on
    (each runs attention for its own requests on its own KV cache), else 1."""
    return max(1, tensor_parallel) if settings.enable_attention_dp else 1


def kv_events_endpoint(
    settings: TrtllmSettings, release: TrtllmRelease, tensor_parallel: int = 1
) -> KvEventsEndpoint | None:
    """Where the replica publishes KV-cache events (the operator's annotation and ports).

    With attention DP every rank publishes its own stream: on ``zmq`` rank ``r`` binds
    the base ports + ``r`` (the replay base stays at least ``ranks`` above the PUB base:
    the engine refuses overlapping ranges); the drain returns all ranks' events, gathered
    on rank 0, each tagged with its rank."""
    transport = kv_events_transport(settings, release)
    ranks = attention_dp_ranks(settings, tensor_parallel)
    choice: Literal["load", "cache"] = (
        "cache" if ranks > 1 and release.adp_cache_routing else "load"
    )
    if transport == "zmq":
        return KvEventsEndpoint(
            transport="zmq",
            format=TRTLLM_ZMQ_FORMAT,
            port=KV_EVENTS_PORT,
            replay_port=KV_EVENTS_PORT + max(KV_REPLAY_PORT - KV_EVENTS_PORT, ranks),
            topic=KV_EVENTS_TOPIC,
            ranks=ranks,
            rank_choice=choice,
        )
    if transport == "http-drain":
        return KvEventsEndpoint(
            transport="http-drain",
            format=TRTLLM_KV_EVENTS_FORMAT,
            path=KV_EVENTS_PATH,
            ranks=ranks,
            rank_choice=choice,
        )
    return None


def llm_api_options(
    settings: TrtllmSettings, release: TrtllmRelease, tensor_parallel: int = 1
) -> dict[str, Any]:
    """The ``--extra_llm_api_options`` mapping for ``release``."""
    scheduler: dict[str, Any] = {"capacity_scheduler_policy": settings.capacity_scheduler_policy}
    if release.waiting_queue_policy:
        scheduler["waiting_queue_policy"] = settings.waiting_queue_policy
    options: dict[str, Any] = {
        "kv_cache_config": {
            "free_gpu_memory_fraction": settings.kv_cache_free_gpu_memory_fraction,
            "enable_block_reuse": settings.enable_block_reuse,
            "tokens_per_block": settings.tokens_per_block,
        },
        "scheduler_config": scheduler,
    }
    kv_events = kv_events_endpoint(settings, release, tensor_parallel)
    if kv_events is not None and kv_events.transport == "zmq":
        options["kv_cache_config"]["kv_events_config"] = kv_events_config(kv_events)
        options["kv_cache_config"]["use_kv_cache_manager_v2"] = True
    elif kv_events is not None:
        options["kv_cache_config"]["event_buffer_max_size"] = KV_EVENT_BUFFER
    if settings.enable_attention_dp:
        options["enable_attention_dp"] = True
        if release.adp_cache_routing and settings.enable_block_reuse:
            options["attention_dp_config"] = {"enable_kv_cache_aware_routing": True}
    if settings.backend == "pytorch":
        # Iteration stats feed both the JSON /metrics and the collector's gauges.
        options["enable_iter_perf_stats"] = True
    if release.load_source == "prometheus":
        options["return_perf_metrics"] = True
    return options


def llm_api_options_yaml(
    settings: TrtllmSettings, release: TrtllmRelease, tensor_parallel: int = 1
) -> str:
    """:func:`llm_api_options` as YAML."""
    return yaml.safe_dump(llm_api_options(settings, release, tensor_parallel), sort_keys=False)
