"""KV-cache events in the manifests: flags/config, named ports, the discovery annotation."""

from __future__ import annotations

import json
from typing import Any

import pydantic
import pytest
import yaml

from fleetgate.api.v1alpha1 import InferenceServiceSpec
from fleetgate.operator import manifests
from fleetgate.operator.options import OperatorOptions

OWNER = manifests.Owner(name="svc", namespace="ns", uid="uid-123")
#: KV events are written only for a release line whose options were verified (1.3: the
#: HTTP drain; main, 1.4 and later: the streaming ZeroMQ publisher).
TRT_IMAGE = "nvcr.io/nvidia/tensorrt-llm/release:1.3.0"
TRT_MAIN_IMAGE = "nvcr.io/nvidia/tensorrt-llm/release:1.4.0rc4"
#: The discovery annotation of a TensorRT-LLM main replica (one rank).
TRT_MAIN_ANNOTATION = {
    "transport": "zmq",
    "format": "trtllm-zmq-msgpack",
    "port": 5557,
    "replayPort": 5567,
    "topic": "kv-events",
}


def _spec(
    kind: str, settings: dict[str, Any] | None = None, image: str = TRT_IMAGE
) -> InferenceServiceSpec:
    engine: dict[str, Any] = {"type": kind, "image": image if kind != "vllm" else "vllm:1"}
    if settings is not None:
        engine["vllm" if kind == "vllm" else "tensorrtLlm"] = settings
    return InferenceServiceSpec.model_validate(
        {"model": {"uri": "hf://org/model", "name": "org/M"}, "engine": engine}
    )


def _children(spec: InferenceServiceSpec) -> manifests.Children:
    return manifests.build_children(OWNER, spec, OperatorOptions(), service_monitor_supported=False)


def _parts(children: manifests.Children) -> tuple[dict[str, Any], dict[str, str], dict[str, str]]:
    dep = children.by_kind("Deployment")
    svc = children.by_kind("Service")
    assert dep is not None and svc is not None
    container = dep["spec"]["template"]["spec"]["containers"][0]
    pod_ann = dep["spec"]["template"]["metadata"]["annotations"]
    return container, pod_ann, svc["metadata"].get("annotations", {})


def _options(children: manifests.Children) -> dict[str, Any]:
    """The TensorRT-LLM options file the ConfigMap mounts."""
    cm = children.by_kind("ConfigMap")
    assert cm is not None
    options: dict[str, Any] = yaml.safe_load(next(iter(cm["data"].values())))
    return options


def test_vllm_events_on_by_default_with_prefix_caching() -> None:
    container, pod_ann, svc_ann = _parts(_children(_spec("vllm")))
    args = container["args"]
    config = json.loads(args[args.index("--kv-events-config") + 1])
    assert config == {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": "tcp://*:5557",
        "replay_endpoint": "tcp://*:5558",
        "topic": "kv-events",
    }
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": 8000, "kv-events": 5557, "kv-replay": 5558}
    expected = {
        "transport": "zmq",
        "format": "vllm-zmq-msgpack",
        "port": 5557,
        "replayPort": 5558,
        "topic": "kv-events",
    }
    assert json.loads(pod_ann[manifests.ANNOTATION_KV_EVENTS]) == expected
    assert json.loads(svc_ann[manifests.ANNOTATION_KV_EVENTS]) == expected


@pytest.mark.parametrize(
    "settings",
    [
        pytest.param({"kvEvents": False}, id="off"),
        pytest.param({"enablePrefixCaching": False}, id="no-prefix-caching"),
    ],
)
def test_vllm_events_off(settings: dict[str, Any]) -> None:
    container, pod_ann, svc_ann = _parts(_children(_spec("vllm", settings)))
    assert "--kv-events-config" not in container["args"]
    assert [p["name"] for p in container["ports"]] == ["http"]
    assert manifests.ANNOTATION_KV_EVENTS not in pod_ann
    assert manifests.ANNOTATION_KV_EVENTS not in svc_ann


def test_trtllm_events_keep_a_buffer_drained_over_http() -> None:
    children = _children(_spec("tensorrt-llm"))
    container, pod_ann, _svc = _parts(children)
    options = _options(children)
    assert options["kv_cache_config"]["event_buffer_max_size"] == 4096
    assert [p["name"] for p in container["ports"]] == ["http"]
    assert json.loads(pod_ann[manifests.ANNOTATION_KV_EVENTS]) == {
        "transport": "http-drain",
        "format": "trtllm-http-json",
        "path": "/kv_cache_events",
    }


def test_trtllm_main_events_stream_over_zeromq() -> None:
    children = _children(_spec("tensorrt-llm", image=TRT_MAIN_IMAGE))
    container, pod_ann, svc_ann = _parts(children)
    kv_cache = _options(children)["kv_cache_config"]
    assert kv_cache["kv_events_config"] == {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": "tcp://*:5557",
        "replay_endpoint": "tcp://*:5567",
        "topic": "kv-events",
    }
    assert kv_cache["use_kv_cache_manager_v2"] is True  # the streaming path is V2's
    assert "event_buffer_max_size" not in kv_cache
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": 8000, "kv-events": 5557, "kv-replay": 5567}
    assert json.loads(pod_ann[manifests.ANNOTATION_KV_EVENTS]) == TRT_MAIN_ANNOTATION
    assert json.loads(svc_ann[manifests.ANNOTATION_KV_EVENTS]) == TRT_MAIN_ANNOTATION


def test_trtllm_main_with_the_tensorrt_backend_keeps_the_drain() -> None:
    spec = _spec("tensorrt-llm", {"backend": "tensorrt"}, image=TRT_MAIN_IMAGE)
    container, pod_ann, _svc = _parts(_children(spec))
    assert [p["name"] for p in container["ports"]] == ["http"]
    assert json.loads(pod_ann[manifests.ANNOTATION_KV_EVENTS])["transport"] == "http-drain"


def test_trtllm_events_not_written_for_an_unverified_release() -> None:
    spec = InferenceServiceSpec.model_validate(
        {
            "model": {"uri": "hf://org/model"},
            "engine": {
                "type": "tensorrt-llm",
                "image": "nvcr.io/nvidia/tensorrt-llm/release:1.0.0",
            },
        }
    )
    children = _children(spec)
    assert "event_buffer_max_size" not in _options(children)["kv_cache_config"]
    assert manifests.ANNOTATION_KV_EVENTS not in _parts(children)[1]


def test_trtllm_events_off_without_block_reuse() -> None:
    children = _children(_spec("tensorrt-llm", {"enableBlockReuse": False}))
    options = _options(children)
    assert "event_buffer_max_size" not in options["kv_cache_config"]
    assert manifests.ANNOTATION_KV_EVENTS not in _parts(children)[1]


@pytest.mark.parametrize(
    ("kind", "settings", "words"),
    [
        ("vllm", {"kvEvents": True, "enablePrefixCaching": False}, "enablePrefixCaching is off"),
        ("tensorrt-llm", {"kvEvents": True, "enableBlockReuse": False}, "enableBlockReuse is off"),
    ],
)
def test_events_without_prefix_caching_are_refused(
    kind: str, settings: dict[str, Any], words: str
) -> None:
    with pytest.raises(pydantic.ValidationError, match=words):
        _spec(kind, settings)


def _adp_spec(image: str, tensor: int, **settings: Any) -> InferenceServiceSpec:
    return InferenceServiceSpec.model_validate(
        {
            "model": {"uri": "hf://deepseek-ai/DeepSeek-V3", "name": "ds"},
            "engine": {
                "type": "tensorrt-llm",
                "image": image,
                "tensorrtLlm": {"enableAttentionDp": True, **settings},
            },
            "parallelism": {"tensor": tensor},
            "gpu": {"count": tensor},
        }
    )


def test_attention_dp_on_main_streams_every_rank_and_routes_ranks_by_cache() -> None:
    children = _children(_adp_spec(TRT_MAIN_IMAGE, 4))
    container, pod_ann, svc_ann = _parts(children)
    options = _options(children)
    assert options["enable_attention_dp"] is True
    # the engine places each request on the rank holding its prefix
    assert options["attention_dp_config"] == {"enable_kv_cache_aware_routing": True}
    # rank 0's endpoints; rank r binds them + r (the engine's rule)
    assert options["kv_cache_config"]["kv_events_config"]["endpoint"] == "tcp://*:5557"
    assert options["kv_cache_config"]["kv_events_config"]["replay_endpoint"] == "tcp://*:5567"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {
        "http": 8000,
        "kv-events": 5557, "kv-replay": 5567,
        "kv-events-1": 5558, "kv-replay-1": 5568,
        "kv-events-2": 5559, "kv-replay-2": 5569,
        "kv-events-3": 5560, "kv-replay-3": 5570,
    }  # fmt: skip
    expected = {**TRT_MAIN_ANNOTATION, "ranks": 4, "rankChoice": "cache"}
    assert json.loads(pod_ann[manifests.ANNOTATION_KV_EVENTS]) == expected
    assert json.loads(svc_ann[manifests.ANNOTATION_KV_EVENTS]) == expected


def test_attention_dp_with_more_ranks_than_the_gap_moves_the_replay_base() -> None:
    container, pod_ann, _svc = _parts(_children(_adp_spec(TRT_MAIN_IMAGE, 16)))
    ann = json.loads(pod_ann[manifests.ANNOTATION_KV_EVENTS])
    assert (ann["port"], ann["replayPort"], ann["ranks"]) == (5557, 5573, 16)
    ports = [p["containerPort"] for p in container["ports"] if p["name"] != "http"]
    assert len(ports) == len(set(ports)) == 32, "no two ranks share a port"
    assert max(len(p["name"]) for p in container["ports"]) <= 15  # IANA service names


def test_attention_dp_on_1_3_drains_every_rank_placed_by_load() -> None:
    children = _children(_adp_spec(TRT_IMAGE, 2))
    container, pod_ann, _svc = _parts(children)
    options = _options(children)
    assert options["enable_attention_dp"] is True
    assert "attention_dp_config" not in options  # not on 1.3: the engine balances by load
    assert [p["name"] for p in container["ports"]] == ["http"]
    assert json.loads(pod_ann[manifests.ANNOTATION_KV_EVENTS]) == {
        "transport": "http-drain",
        "format": "trtllm-http-json",
        "path": "/kv_cache_events",
        "ranks": 2,
        "rankChoice": "load",
    }


def test_one_rank_without_attention_dp_writes_no_rank_fields() -> None:
    spec = _adp_spec(TRT_MAIN_IMAGE, 4, enableAttentionDp=False)
    children = _children(spec)
    _container, pod_ann, _svc = _parts(children)
    assert "ranks" not in json.loads(pod_ann[manifests.ANNOTATION_KV_EVENTS])
    options = _options(children)
    assert "enable_attention_dp" not in options and "attention_dp_config" not in options


def test_attention_dp_needs_the_pytorch_backend() -> None:
    with pytest.raises(pydantic.ValidationError, match="enableAttentionDp needs backend pytorch"):
        _adp_spec(TRT_MAIN_IMAGE, 2, backend="tensorrt")
