"""TensorRT-LLM priority fields, error bodies and the trtllm-serve container plan."""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml

from fleetgate.engines.base import (
    LEVEL_MAX,
    LEVEL_MIN,
    EngineError,
    KvEventsEndpoint,
    LaunchSpec,
)
from fleetgate.engines.trtllm import ADAPTER, CONFIG_FILE, TrtllmSettings
from fleetgate.engines.vllm import VllmSettings


# ------------------------------------------------------------------ priority
@pytest.mark.parametrize(
    ("level", "priority"),
    [
        pytest.param(0, 0.5, id="default-is-engine-default"),
        pytest.param(LEVEL_MAX, 1.0, id="max"),
        pytest.param(LEVEL_MIN, 0.0, id="min"),
        pytest.param(5, 0.75, id="five"),
        pytest.param(-5, 0.25, id="minus-five"),
        pytest.param(1, 0.55, id="one"),
        pytest.param(LEVEL_MAX + 100, 1.0, id="clamped-high"),
        pytest.param(LEVEL_MIN - 100, 0.0, id="clamped-low"),
    ],
)
def test_priority_fields(level: int, priority: float) -> None:
    fields = ADAPTER.priority_fields(level)
    assert set(fields) == {"priority"}
    assert type(fields["priority"]) is float
    assert fields["priority"] == pytest.approx(priority)


def test_priority_monotone_higher_first_within_unit_interval() -> None:
    values = [ADAPTER.priority_fields(lv)["priority"] for lv in range(LEVEL_MIN, LEVEL_MAX + 1)]
    assert values == sorted(values)
    assert len(set(values)) == len(values)
    assert all(0.0 <= v <= 1.0 for v in values)


@pytest.mark.parametrize("bad", [0.5, "1", False, None])
def test_priority_rejects_non_int(bad: Any) -> None:
    with pytest.raises(TypeError):
        ADAPTER.priority_fields(bad)


# ------------------------------------------------------------------ errors
QUEUE_FULL = "Maximum queue size of 128 has been reached, please try again later"


@pytest.mark.parametrize(
    ("status", "body", "kind", "err_type", "message"),
    [
        pytest.param(
            400,
            {
                "object": "error",
                "message": "prompt too long",
                "type": "BadRequestError",
                "param": None,
                "code": 400,
            },
            "client",
            "BadRequestError",
            "prompt too long",
            id="flat-400",
        ),
        pytest.param(
            400,
            {
                "object": "error",
                "message": QUEUE_FULL,
                "type": "BadRequestError",
                "param": None,
                "code": 400,
            },
            "overload",
            "BadRequestError",
            QUEUE_FULL,
            id="queue-full-400",
        ),
        pytest.param(
            400,
            {"error": "1 validation error for CompletionRequest ..."},
            "client",
            None,
            "1 validation error for CompletionRequest ...",
            id="validation-400",
        ),
        pytest.param(
            404,
            {
                "object": "error",
                "message": "Not found",
                "type": "NotFoundError",
                "param": None,
                "code": 404,
            },
            "client",
            "NotFoundError",
            "Not found",
            id="flat-404",
        ),
        pytest.param(
            501,
            {
                "object": "error",
                "message": "n>1 unsupported",
                "type": "NotImplementedError",
                "param": None,
                "code": 501,
            },
            "server",
            "NotImplementedError",
            "n>1 unsupported",
            id="flat-501",
        ),
        pytest.param(
            429,
            {"error": {"message": "slow down", "type": "RateLimitError"}},
            "overload",
            "RateLimitError",
            "slow down",
            id="nested-429",
        ),
        pytest.param(
            405,
            {"detail": "Method Not Allowed"},
            "client",
            None,
            "Method Not Allowed",
            id="fastapi-405",
        ),
    ],
)
def test_classify(status: int, body: Any, kind: str, err_type: str | None, message: str) -> None:
    info = ADAPTER.classify_error(status, json.dumps(body).encode())
    assert (info.status, info.kind, info.type, info.message) == (status, kind, err_type, message)


def test_classify_health_503_text() -> None:
    text = b"LLM is unavailable. Please check the server logs for more details."
    info = ADAPTER.classify_error(503, text)
    assert info.kind == "server"
    assert info.message.startswith("LLM is unavailable")
    assert info.type is None


def test_classify_refuses_success_status() -> None:
    with pytest.raises(EngineError):
        ADAPTER.classify_error(200, b"{}")


def test_error_body_flat_and_round_trips() -> None:
    body = ADAPTER.error_body(400, QUEUE_FULL, "BadRequestError")
    assert body == {
        "object": "error",
        "message": QUEUE_FULL,
        "type": "BadRequestError",
        "param": None,
        "code": 400,
    }
    assert ADAPTER.classify_error(400, json.dumps(body).encode()).kind == "overload"
    bad = ADAPTER.error_body(400, "bad", "BadRequestError", "max_tokens")
    assert bad["param"] == "max_tokens"
    assert ADAPTER.classify_error(400, json.dumps(bad).encode()).kind == "client"


# ------------------------------------------------------------------ container
def _arg(args: tuple[str, ...], flag: str) -> str:
    assert args.count(flag) == 1, f"{flag} appears {args.count(flag)} times"
    return args[args.index(flag) + 1]


def _options(plan_files: Any) -> dict[str, Any]:
    data = yaml.safe_load(plan_files[CONFIG_FILE])
    assert isinstance(data, dict)
    return data


def test_container_defaults() -> None:
    plan = ADAPTER.container(LaunchSpec("/models/llama", "llama", 8000, engine_version="main"))
    assert plan.command == ("trtllm-serve",)
    assert plan.args[0] == "/models/llama"
    assert _arg(plan.args, "--host") == "0.0.0.0"
    assert _arg(plan.args, "--port") == "8000"
    assert _arg(plan.args, "--backend") == "pytorch"
    assert _arg(plan.args, "--tp_size") == "1"
    assert _arg(plan.args, "--pp_size") == "1"
    assert _arg(plan.args, "--extra_llm_api_options") == f"/etc/fleetgate/{CONFIG_FILE}"
    assert plan.config_mount_path == "/etc/fleetgate"
    for unset in ("--max_batch_size", "--max_num_tokens", "--revision"):
        assert unset not in plan.args
    assert [p.path for p in (plan.startup_probe, plan.readiness_probe, plan.liveness_probe)] == [
        "/health"
    ] * 3
    assert plan.metrics_path == "/prometheus/metrics"
    assert plan.needs_shared_memory is True
    assert _options(plan.config_files) == {
        "kv_cache_config": {
            "free_gpu_memory_fraction": 0.9,
            "enable_block_reuse": True,
            "tokens_per_block": 32,
            # KV-cache events (on with block reuse): main streams them over ZeroMQ
            "kv_events_config": {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": "tcp://*:5557",
                "replay_endpoint": "tcp://*:5567",
                "topic": "kv-events",
            },
            "use_kv_cache_manager_v2": True,
        },
        "scheduler_config": {
            "capacity_scheduler_policy": "GUARANTEED_NO_EVICT",
            "waiting_queue_policy": "priority",
        },
        "enable_iter_perf_stats": True,
        "return_perf_metrics": True,
    }


@pytest.mark.parametrize(
    ("settings", "flags", "options"),
    [
        pytest.param(
            TrtllmSettings(max_batch_size=128, max_num_tokens=4096, backend="tensorrt"),
            {"--max_batch_size": "128", "--max_num_tokens": "4096", "--backend": "tensorrt"},
            {},
            id="batch-and-backend",
        ),
        pytest.param(
            TrtllmSettings(
                kv_cache_free_gpu_memory_fraction=0.6, enable_block_reuse=False, tokens_per_block=64
            ),
            {},
            {
                "kv_cache_config": {
                    "free_gpu_memory_fraction": 0.6,
                    "enable_block_reuse": False,
                    "tokens_per_block": 64,
                }
            },
            id="kv-cache",
        ),
        pytest.param(
            TrtllmSettings(
                capacity_scheduler_policy="MAX_UTILIZATION", waiting_queue_policy="fcfs"
            ),
            {},
            {
                "scheduler_config": {
                    "capacity_scheduler_policy": "MAX_UTILIZATION",
                    "waiting_queue_policy": "fcfs",
                }
            },
            id="scheduler",
        ),
        pytest.param(
            TrtllmSettings.model_validate({"tokensPerBlock": 16, "maxBatchSize": 8}),
            {"--max_batch_size": "8"},
            {
                "kv_cache_config": {
                    "free_gpu_memory_fraction": 0.9,
                    "enable_block_reuse": True,
                    "tokens_per_block": 16,
                    "kv_events_config": {
                        "enable_kv_cache_events": True,
                        "publisher": "zmq",
                        "endpoint": "tcp://*:5557",
                        "replay_endpoint": "tcp://*:5567",
                        "topic": "kv-events",
                    },
                    "use_kv_cache_manager_v2": True,
                }
            },
            id="from-crd-camel-case",
        ),
    ],
)
def test_container_settings(
    settings: TrtllmSettings, flags: dict[str, str], options: dict[str, Any]
) -> None:
    plan = ADAPTER.container(LaunchSpec("/m", "m", 8000, settings=settings, engine_version="main"))
    for flag, value in flags.items():
        assert _arg(plan.args, flag) == value
    got = _options(plan.config_files)
    for key, value in options.items():
        assert got[key] == value
    # enable_iter_perf_stats is a PyTorch-backend option only (tests/engines/trtllm_contract.py)
    assert got.get("enable_iter_perf_stats") is (True if settings.backend == "pytorch" else None)
    assert got["return_perf_metrics"] is True


@pytest.mark.parametrize(
    ("version", "settings", "transport"),
    [
        ("main", TrtllmSettings(), "zmq"),
        ("1.4.0", TrtllmSettings(kv_events=True), "zmq"),
        # the streaming publisher is KV cache manager V2's, a PyTorch-backend manager
        ("main", TrtllmSettings(backend="tensorrt"), "http-drain"),
        ("1.3.0", TrtllmSettings(), "http-drain"),
        ("1.3.0rc1", TrtllmSettings(kv_events=True), "http-drain"),
        ("1.2.0", TrtllmSettings(kv_events=True), None),  # not verified for 1.0-1.2
        ("main", TrtllmSettings(kv_events=False), None),
        ("main", TrtllmSettings(enable_block_reuse=False), None),
    ],
)
def test_kv_events_transport_follows_release_and_backend(
    version: str, settings: TrtllmSettings, transport: str | None
) -> None:
    plan = ADAPTER.container(LaunchSpec("/m", "m", 8000, settings=settings, engine_version=version))
    kv_cache = _options(plan.config_files)["kv_cache_config"]
    if transport is None:
        assert plan.kv_events is None
        assert "kv_events_config" not in kv_cache and "event_buffer_max_size" not in kv_cache
    elif transport == "zmq":
        assert plan.kv_events == KvEventsEndpoint(
            "zmq", "trtllm-zmq-msgpack", port=5557, replay_port=5567, topic="kv-events"
        )
        events = kv_cache["kv_events_config"]
        # the sockets the router reads are the ones the engine binds (rank 0: base ports)
        assert events["endpoint"] == f"tcp://*:{plan.kv_events.port}"
        assert events["replay_endpoint"] == f"tcp://*:{plan.kv_events.replay_port}"
        assert events["topic"] == plan.kv_events.topic
        assert kv_cache["use_kv_cache_manager_v2"] is True
        assert "event_buffer_max_size" not in kv_cache
    else:
        assert plan.kv_events == KvEventsEndpoint(
            "http-drain", "trtllm-http-json", path="/kv_cache_events"
        )
        assert kv_cache["event_buffer_max_size"] == 4096
        assert "kv_events_config" not in kv_cache


def test_container_parallelism_revision_extra_args_last() -> None:
    launch = LaunchSpec(
        "org/model",
        "served",
        9001,
        tensor_parallel=8,
        pipeline_parallel=2,
        extra_args=("--trust_remote_code", "--ep_size", "4"),
        revision="v1.2",
        engine_version="main",
    )
    plan = ADAPTER.container(launch)
    assert plan.args[0] == "org/model"
    assert _arg(plan.args, "--tp_size") == "8"
    assert _arg(plan.args, "--pp_size") == "2"
    assert _arg(plan.args, "--revision") == "v1.2"
    assert plan.args[-3:] == ("--trust_remote_code", "--ep_size", "4")
    assert plan.port == 9001


def test_container_model_named_like_a_subcommand_gets_explicit_serve() -> None:
    plan = ADAPTER.container(LaunchSpec("grpc", "m", 8000, engine_version="main"))
    assert plan.args[:2] == ("serve", "grpc")


@pytest.mark.parametrize(
    ("launch", "fragment"),
    [
        pytest.param(LaunchSpec("", "m", 8000), "model_path", id="empty-model"),
        pytest.param(LaunchSpec("/m", "m", 65536), "port", id="bad-port"),
        pytest.param(LaunchSpec("/m", "m", 8000, tensor_parallel=0), "parallelism", id="tp"),
        pytest.param(
            LaunchSpec("/m", "m", 8000, settings=VllmSettings()), "VllmSettings", id="wrong"
        ),
    ],
)
def test_container_rejects_bad_launch(launch: LaunchSpec, fragment: str) -> None:
    with pytest.raises(EngineError, match=fragment):
        ADAPTER.container(launch)
