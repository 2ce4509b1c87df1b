"""vLLM priority fields, error bodies (on the real 0.32 fixtures) and container plan."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import BaseModel
from recordings import VLLM_032

from fleetgate.engines.base import LEVEL_MAX, LEVEL_MIN, EngineError, LaunchSpec
from fleetgate.engines.trtllm import TrtllmSettings
from fleetgate.engines.vllm import ADAPTER, VllmSettings, routing_error_body

FIXTURES = VLLM_032


# ------------------------------------------------------------------ priority
@pytest.mark.parametrize(
    ("level", "priority"),
    [
        pytest.param(0, 0, id="default"),
        pytest.param(1, -1, id="one-above"),
        pytest.param(LEVEL_MAX, -10, id="max"),
        pytest.param(LEVEL_MIN, 10, id="min"),
        pytest.param(-3, 3, id="below-default"),
        pytest.param(LEVEL_MAX + 5, -10, id="clamped-high"),
        pytest.param(LEVEL_MIN - 5, 10, id="clamped-low"),
    ],
)
def test_priority_fields(level: int, priority: int) -> None:
    fields = ADAPTER.priority_fields(level)
    assert fields == {"priority": priority}
    assert type(fields["priority"]) is int


def test_priority_order_is_inverted() -> None:
    # Higher fleetgate level = more urgent = lower vLLM value = scheduled sooner.
    values = [
        ADAPTER.priority_fields(level)["priority"] for level in range(LEVEL_MIN, LEVEL_MAX + 1)
    ]
    assert values == sorted(values, reverse=True)
    assert len(set(values)) == LEVEL_MAX - LEVEL_MIN + 1


@pytest.mark.parametrize("bad", [1.5, "3", True, None])
def test_priority_rejects_non_int(bad: Any) -> None:
    with pytest.raises(TypeError):
        ADAPTER.priority_fields(bad)


# ------------------------------------------------------------------ errors
def _fixture_response(name: str) -> tuple[int, bytes]:
    data = json.loads((FIXTURES / f"{name}.json").read_text())
    return int(data["response"]["status"]), data["response"]["body"].encode()


@pytest.mark.parametrize(
    ("name", "status", "kind", "err_type", "fragment"),
    [
        ("err_unknown_model", 404, "client", "NotFoundError", "`no-such-model` does not exist"),
        ("err_unknown_model_chat", 404, "client", "NotFoundError", "does not exist"),
        ("err_stream_unknown_model", 404, "client", "NotFoundError", "does not exist"),
        ("err_max_tokens_zero", 400, "client", "BadRequestError", "max_tokens must be at least 1"),
        ("err_negative_max_tokens", 400, "client", "BadRequestError", "got -1"),
        ("err_prompt_too_long", 400, "client", "BadRequestError", "maximum context length"),
        ("err_stream_prompt_too_long", 400, "client", "BadRequestError", "2049 input tokens"),
        # request-validation shape: same envelope, type is the HTTP phrase
        ("err_malformed_json", 400, "client", "Bad Request", "JSON decode error"),
        ("err_priority_string", 400, "client", "Bad Request", "int_parsing"),
        ("err_temperature_wrong_type", 400, "client", "Bad Request", "float_parsing"),
        ("err_wrong_content_type", 400, "client", "Bad Request", "Unsupported Media Type"),
        # FastAPI routing shape
        ("err_unknown_route", 404, "client", None, "Not Found"),
        ("err_get_on_post_route", 405, "client", None, "Method Not Allowed"),
    ],
)
def test_classify_real_vllm_error_bodies(
    name: str, status: int, kind: str, err_type: str | None, fragment: str
) -> None:
    got_status, body = _fixture_response(name)
    assert got_status == status
    info = ADAPTER.classify_error(status, body)
    assert info.status == status
    assert info.kind == kind
    assert info.type == err_type
    assert fragment in info.message


def test_all_error_fixtures_are_covered() -> None:
    names = {p.name.removesuffix(".json") for p in FIXTURES.glob("err_*.json")}
    covered = {
        "err_unknown_model",
        "err_unknown_model_chat",
        "err_stream_unknown_model",
        "err_max_tokens_zero",
        "err_negative_max_tokens",
        "err_prompt_too_long",
        "err_stream_prompt_too_long",
        "err_malformed_json",
        "err_priority_string",
        "err_temperature_wrong_type",
        "err_wrong_content_type",
        "err_unknown_route",
        "err_get_on_post_route",
    }
    assert names == covered


BUSY = "The engine is currently busy and cannot accept new requests. Please try again later."


@pytest.mark.parametrize(
    ("status", "body", "kind", "err_type"),
    [
        pytest.param(
            503,
            {"error": {"message": BUSY, "type": "Service Unavailable", "param": None, "code": 503}},
            "overload",
            "Service Unavailable",
            id="queue-limit-0.33",
        ),
        pytest.param(
            503,
            {
                "error": {
                    "message": "The engine has reached its prefill token backlog limit.",
                    "type": "Service Unavailable",
                    "param": None,
                    "code": 503,
                }
            },
            "overload",
            "Service Unavailable",
            id="token-backlog-0.33",
        ),
        pytest.param(
            503,
            {
                "error": {
                    "message": "retry",
                    "type": "ServiceUnavailableError",
                    "param": None,
                    "code": 503,
                }
            },
            "server",
            "ServiceUnavailableError",
            id="retryable-generation-error",
        ),
        pytest.param(
            429,
            {
                "error": {
                    "message": "Too many",
                    "type": "RateLimitError",
                    "param": None,
                    "code": 429,
                }
            },
            "overload",
            "RateLimitError",
            id="llm-d-sim-429",
        ),
        pytest.param(
            500,
            {
                "error": {
                    "message": "engine dead",
                    "type": "InternalServerError",
                    "param": None,
                    "code": 500,
                }
            },
            "server",
            "InternalServerError",
            id="engine-dead",
        ),
        pytest.param(
            400,
            {
                "object": "error",
                "message": "old flat body",
                "type": "BadRequestError",
                "param": None,
                "code": 400,
            },
            "client",
            "BadRequestError",
            id="flat-pre-envelope",
        ),
    ],
)
def test_classify_synthetic_bodies(
    status: int, body: dict[str, Any], kind: str, err_type: str
) -> None:
    info = ADAPTER.classify_error(status, json.dumps(body).encode())
    assert (info.kind, info.type) == (kind, err_type)


def test_classify_non_json_bodies() -> None:
    info = ADAPTER.classify_error(502, b"<html>bad gateway</html>")
    assert (info.kind, info.message, info.type) == ("server", "<html>bad gateway</html>", None)
    assert ADAPTER.classify_error(503, b"").message == "HTTP 503"
    assert ADAPTER.classify_error(503, b"").kind == "overload"
    long = ADAPTER.classify_error(400, b"x" * 5000)
    assert len(long.message) < 300
    assert ADAPTER.classify_error(400, b"\xff\xfe").kind == "client"


@pytest.mark.parametrize("status", [200, 302, 399, 600])
def test_classify_refuses_non_error_status(status: int) -> None:
    with pytest.raises(EngineError, match="not an HTTP error status"):
        ADAPTER.classify_error(status, b"{}")


def test_error_body_is_the_033_envelope_and_round_trips() -> None:
    body = ADAPTER.error_body(404, "The model `x` does not exist.", "NotFoundError", "model")
    assert body == {
        "error": {
            "message": "The model `x` does not exist.",
            "type": "NotFoundError",
            "param": "model",
            "code": 404,
        }
    }
    info = ADAPTER.classify_error(404, json.dumps(body).encode())
    assert (info.kind, info.type, info.message) == (
        "client",
        "NotFoundError",
        body["error"]["message"],
    )
    # Same shape as the real server's error (keys and nesting).
    _, real = _fixture_response("err_unknown_model")
    assert set(json.loads(real)["error"]) == set(body["error"])
    overload = ADAPTER.error_body(503, BUSY, "Service Unavailable")
    assert ADAPTER.classify_error(503, json.dumps(overload).encode()).kind == "overload"


@pytest.mark.parametrize(
    ("name", "err_type"),
    [
        ("err_unknown_model", "NotFoundError"),  # engine error shape
        ("err_max_tokens_zero", "BadRequestError"),
        ("err_priority_string", "Bad Request"),  # request-validation shape
        ("err_wrong_content_type", "Bad Request"),
    ],
)
def test_error_body_reproduces_real_bodies_byte_for_byte(name: str, err_type: str) -> None:
    status, real = _fixture_response(name)
    inner = json.loads(real)["error"]
    assert inner["type"] == err_type
    body = ADAPTER.error_body(status, inner["message"], err_type, inner["param"])
    assert json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode() == real


@pytest.mark.parametrize(
    ("name", "status"), [("err_unknown_route", 404), ("err_get_on_post_route", 405)]
)
def test_routing_error_body_reproduces_fastapi_shape(name: str, status: int) -> None:
    got_status, real = _fixture_response(name)
    assert got_status == status
    assert json.dumps(routing_error_body(status), separators=(",", ":")).encode() == real
    assert ADAPTER.classify_error(status, real).kind == "client"


# ------------------------------------------------------------------ container
def _arg(args: tuple[str, ...], flag: str) -> str:
    assert args.count(flag) == 1, f"{flag} appears {args.count(flag)} times"
    return args[args.index(flag) + 1]


def test_container_defaults() -> None:
    plan = ADAPTER.container(LaunchSpec("/models/llama", "llama-8b", 8000))
    assert plan.command == ("python3", "-m", "vllm.entrypoints.openai.api_server")
    assert _arg(plan.args, "--model") == "/models/llama"
    assert _arg(plan.args, "--served-model-name") == "llama-8b"
    assert _arg(plan.args, "--host") == "0.0.0.0"
    assert _arg(plan.args, "--port") == "8000"
    assert _arg(plan.args, "--tensor-parallel-size") == "1"
    assert _arg(plan.args, "--pipeline-parallel-size") == "1"
    assert _arg(plan.args, "--gpu-memory-utilization") == "0.9"
    assert _arg(plan.args, "--scheduling-policy") == "priority"
    assert "--enable-prefix-caching" in plan.args
    assert "--enable-prompt-tokens-details" in plan.args
    for unset in (
        "--revision",
        "--max-model-len",
        "--max-num-seqs",
        "--max-num-batched-tokens",
        "--block-size",
        "--enable-chunked-prefill",
        "--no-enable-chunked-prefill",
    ):
        assert unset not in plan.args
    assert plan.port == 8000
    assert [p.path for p in (plan.startup_probe, plan.readiness_probe, plan.liveness_probe)] == [
        "/health"
    ] * 3
    assert plan.startup_probe.port_name == "http"
    assert plan.metrics_path == "/metrics"
    assert plan.needs_shared_memory is True
    assert plan.config_files == {}


@pytest.mark.parametrize(
    ("settings", "expected", "absent"),
    [
        pytest.param(
            VllmSettings(
                max_model_len=4096,
                max_num_seqs=64,
                max_num_batched_tokens=8192,
                block_size=32,
                gpu_memory_utilization=0.85,
            ),
            {
                "--max-model-len": "4096",
                "--max-num-seqs": "64",
                "--max-num-batched-tokens": "8192",
                "--block-size": "32",
                "--gpu-memory-utilization": "0.85",
            },
            (),
            id="sizes",
        ),
        pytest.param(
            VllmSettings(enable_prefix_caching=False, scheduling_policy="fcfs"),
            {"--scheduling-policy": "fcfs", "--no-enable-prefix-caching": None},
            ("--enable-prefix-caching",),
            id="no-prefix-fcfs",
        ),
        pytest.param(
            VllmSettings(enable_chunked_prefill=True),
            {"--enable-chunked-prefill": None},
            ("--no-enable-chunked-prefill",),
            id="chunked-on",
        ),
        pytest.param(
            VllmSettings(enable_chunked_prefill=False),
            {"--no-enable-chunked-prefill": None},
            ("--enable-chunked-prefill",),
            id="chunked-off",
        ),
        pytest.param(
            VllmSettings.model_validate({"gpuMemoryUtilization": 1.0}),
            {"--gpu-memory-utilization": "1.0"},
            (),
            id="from-crd-camel-case",
        ),
    ],
)
def test_container_settings_flags(
    settings: VllmSettings, expected: dict[str, str | None], absent: tuple[str, ...]
) -> None:
    plan = ADAPTER.container(LaunchSpec("/m", "m", 8000, settings=settings))
    for flag, value in expected.items():
        if value is None:
            assert plan.args.count(flag) == 1
        else:
            assert _arg(plan.args, flag) == value
    for flag in absent:
        assert flag not in plan.args
    assert "--enable-prompt-tokens-details" in plan.args


def test_container_parallelism_revision_and_extra_args_last() -> None:
    launch = LaunchSpec(
        "org/model",
        "served",
        9000,
        tensor_parallel=4,
        pipeline_parallel=2,
        extra_args=("--dtype", "bfloat16", "--max-num-seqs", "8"),
        revision="abc123",
    )
    plan = ADAPTER.container(launch)
    assert _arg(plan.args, "--tensor-parallel-size") == "4"
    assert _arg(plan.args, "--pipeline-parallel-size") == "2"
    assert _arg(plan.args, "--revision") == "abc123"
    assert _arg(plan.args, "--port") == "9000"
    assert plan.args[-4:] == ("--dtype", "bfloat16", "--max-num-seqs", "8")


@pytest.mark.parametrize(
    ("launch", "fragment"),
    [
        pytest.param(LaunchSpec("", "m", 8000), "model_path", id="empty-model"),
        pytest.param(LaunchSpec("/m", " ", 8000), "served_model_name", id="empty-name"),
        pytest.param(LaunchSpec("/m", "m", 0), "port", id="port-0"),
        pytest.param(LaunchSpec("/m", "m", 70000), "port", id="port-high"),
        pytest.param(LaunchSpec("/m", "m", 8000, tensor_parallel=0), "parallelism", id="tp-0"),
        pytest.param(LaunchSpec("/m", "m", 8000, pipeline_parallel=-1), "parallelism", id="pp"),
        pytest.param(
            LaunchSpec("/m", "m", 8000, settings=TrtllmSettings()), "TrtllmSettings", id="wrong"
        ),
    ],
)
def test_container_rejects_bad_launch(launch: LaunchSpec, fragment: str) -> None:
    with pytest.raises(EngineError, match=fragment):
        ADAPTER.container(launch)


def test_container_is_pure_and_deterministic() -> None:
    launch = LaunchSpec("/m", "m", 8000, settings=VllmSettings(max_num_seqs=3))
    assert ADAPTER.container(launch) == ADAPTER.container(launch)
    assert isinstance(ADAPTER.settings_model(), BaseModel)


# ------------------------------------------------------------------ streams
def _events(name: str) -> list[bytes]:
    resp = json.loads((FIXTURES / name).read_text())["response"]
    if "http_chunks" in resp:
        chunks = [c.encode() for c in resp["http_chunks"]]
    else:
        chunks = [part.encode() + b"\n\n" for part in resp["body"].split("\n\n") if part]
    return [c for c in chunks if c != b"data: [DONE]\n\n"]


def _match(kind: Any, event: bytes) -> dict[str, bytes | None] | None:
    rest = event[event.index(b'"choices":[') + len(b'"choices":[') :]
    for p in ADAPTER.token_events.for_kind(kind):
        m = p.fullmatch(rest)
        if m is not None:
            return {k: m[k] for k in p.groupindex}
    return None


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("completions_stream.json", "completions"),
        ("completions_stream_return_token_ids.json", "completions"),
        ("chat_stream.json", "chat"),
        ("chat_stream_usage.json", "chat"),
    ],
)
def test_recorded_plain_token_events_match_the_shapes(name: str, kind: Any) -> None:
    """Every token event of a real stream but the finishing one is plain; the text and
    ids captured are the event's own."""
    for event in _events(name):
        doc = json.loads(event[6:])
        choice = (doc["choices"] or [{}])[0]
        plain = (
            bool(doc["choices"])
            and choice.get("finish_reason") is None
            and "role" not in choice.get("delta", {})
            and doc.get("prompt_token_ids") is None
            and choice.get("prompt_token_ids") is None
        )
        m = _match(kind, event)
        assert (m is not None) == plain, event
        if m is not None:
            text = choice["text"] if kind == "completions" else choice["delta"]["content"]
            assert json.loads(b'"' + (m["text"] or b"") + b'"') == text
            assert json.loads(m["ids"] or b"null") == choice.get("token_ids")
