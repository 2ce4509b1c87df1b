"""Where the router learns that an engine publishes KV events: the operator's pod
annotation (Kubernetes discovery), the backend config field and the ``--backend`` flag."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import httpx
import pytest

from fleetgate.api.v1alpha1 import InferenceServiceSpec
from fleetgate.engines.base import KvEventsEndpoint
from fleetgate.operator import manifests
from fleetgate.operator.options import OperatorOptions
from fleetgate.router import k8s_addresses as ka
from fleetgate.router import k8s_targets as kt
from fleetgate.router import membership as fm
from fleetgate.router.app import build_fleet, build_router
from fleetgate.router.config import ConfigError, parse_backend_flag, parse_config
from fleetgate.router.scheduling.types import EndpointId

CFG = kt.KubernetesDiscoveryConfig()
TRT_IMAGE = "nvcr.io/nvidia/tensorrt-llm/release:1.3.0"


def _pod_of(
    kind: str, ip: str = "10.1.0.7", spec: InferenceServiceSpec | None = None
) -> dict[str, Any]:
    """A pod as the operator's Deployment template makes it, scheduled at ``ip``."""
    crd_type = "vllm" if kind == "vllm" else "tensorrt-llm"
    engine = {"type": crd_type, "image": "vllm:1" if kind == "vllm" else TRT_IMAGE}
    if spec is None:
        spec = InferenceServiceSpec.model_validate(
            {"model": {"uri": "hf://org/model", "name": "org/M"}, "engine": engine}
        )
    owner = manifests.Owner(name="svc", namespace="ns", uid="u")
    children = manifests.build_children(owner, spec, OperatorOptions(),
                                        service_monitor_supported=False)  # fmt: skip
    dep = children.by_kind("Deployment")
    assert dep is not None
    template = dep["spec"]["template"]
    return {
        "metadata": {**template["metadata"], "name": "svc-0", "namespace": "ns"},
        "spec": template["spec"],
        "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]},
    }


def _isvc(kind: str) -> dict[str, Any]:
    return {
        "metadata": {"name": "svc", "namespace": "ns"},
        "spec": {"engine": {"type": kind, "image": TRT_IMAGE}, "model": {"name": "org/M"}},
    }


def test_annotation_name_agrees_with_the_operator() -> None:
    assert ka.ANNOTATION_KV_EVENTS == manifests.ANNOTATION_KV_EVENTS


@pytest.mark.parametrize(
    ("kind", "want"),
    [
        ("vllm", KvEventsEndpoint("zmq", "vllm-zmq-msgpack", port=5557, replay_port=5558,
                                  topic="kv-events")),
        ("trtllm", KvEventsEndpoint("http-drain", "trtllm-http-json", path="/kv_cache_events")),
    ],
)  # fmt: skip
def test_operator_pods_give_their_kv_events_endpoint(kind: str, want: KvEventsEndpoint) -> None:
    found = ka.addresses_from_pod(_pod_of(kind), "http")
    (t,) = kt.desired_targets(found, {("ns", "svc"): _isvc(kind)}, CFG).values()
    assert t.kv_events == want and t.kv_events_error is None
    assert t.url == "http://10.1.0.7:8000"


def test_annotation_round_trips_what_the_operator_writes() -> None:
    for kv in (
        KvEventsEndpoint("zmq", "f", port=1, replay_port=2, topic="t"),
        KvEventsEndpoint("zmq", "f", port=1),
        KvEventsEndpoint("http-drain", "g", path="/x"),
        KvEventsEndpoint("zmq", "f", port=5557, replay_port=5567, ranks=8, rank_choice="cache"),
        KvEventsEndpoint("http-drain", "g", path="/x", ranks=2),
    ):
        assert ka.parse_kv_events_annotation(manifests.kv_events_annotation(kv)) == kv


def test_an_attention_dp_pod_gives_every_rank_to_the_router() -> None:
    """Operator -> pod annotation -> discovery: a TensorRT-LLM main replica with attention
    DP over 4 GPUs is one endpoint with 4 streams, ranks placed by cache."""
    spec = InferenceServiceSpec.model_validate(
        {
            "model": {"uri": "hf://org/model", "name": "org/M"},
            "engine": {"type": "tensorrt-llm", "image": "nvcr.io/nvidia/tensorrt-llm/release:1.4.0",
                       "tensorrtLlm": {"enableAttentionDp": True}},
            "parallelism": {"tensor": 4},
            "gpu": {"count": 4},
        }
    )  # fmt: skip
    pod = _pod_of("tensorrt-llm", spec=spec)
    (t,) = kt.desired_targets(ka.addresses_from_pod(pod, "http"),
                              {("ns", "svc"): _isvc("tensorrt-llm")}, CFG).values()  # fmt: skip
    assert t.kv_events == KvEventsEndpoint("zmq", "trtllm-zmq-msgpack", port=5557,
                                           replay_port=5567, topic="kv-events", ranks=4,
                                           rank_choice="cache")  # fmt: skip
    assert [t.kv_events.rank_ports(r) for r in (0, 3)] == [(5557, 5567), (5560, 5570)]


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("nope", "not JSON"),
        ("[1]", "JSON object"),
        ('{"transport": "zmq", "format": "f"}', "needs port"),
        ('{"transport": "zmq", "format": "f", "port": 70000}', "port 1-65535"),
        ('{"transport": "zmq", "format": "f", "port": true}', "port 1-65535"),
        ('{"transport": "zmq", "port": 1}', "format"),
        ('{"transport": "http-drain", "format": "f", "path": "x"}', "/path"),
        ('{"transport": "kafka", "format": "f"}', "unknown transport"),
        ('{"transport": "zmq", "format": "f", "port": 1, "extra": 1}', "unknown field"),
        ('{"transport": "zmq", "format": "f", "port": 1, "topic": 3}', "topic"),
        ('{"transport": "zmq", "format": "f", "port": 1, "ranks": 0}', "ranks must be 1-64"),
        ('{"transport": "zmq", "format": "f", "port": 1, "ranks": 65}', "ranks must be 1-64"),
        ('{"transport": "zmq", "format": "f", "port": 1, "ranks": true}', "ranks must be"),
        ('{"transport": "zmq", "format": "f", "port": 1, "rankChoice": "x"}', "load or cache"),
        (
            '{"transport": "zmq", "format": "f", "port": 10, "replayPort": 12, "ranks": 4}',
            "overlap",
        ),
        ('{"transport": "zmq", "format": "f", "port": 65535, "ranks": 2}', "past port 65535"),
    ],
)
def test_bad_annotations_are_one_line_errors(value: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ka.parse_kv_events_annotation(value)


def test_bad_annotation_keeps_the_endpoint_without_events() -> None:
    p = _pod_of("vllm")
    p["metadata"]["annotations"][ka.ANNOTATION_KV_EVENTS] = "{broken"
    (t,) = kt.desired_targets(ka.addresses_from_pod(p, "http"),
                              {("ns", "svc"): _isvc("vllm")}, CFG).values()  # fmt: skip
    assert t.kv_events is None and "not JSON" in (t.kv_events_error or "")


def test_slices_carry_no_annotation() -> None:
    found = ka.addresses_from_pod(_pod_of("vllm"), "http")
    assert found[0].annotation(ka.ANNOTATION_KV_EVENTS) is not None
    plain = dataclasses.replace(found[0], annotations=())
    (t,) = kt.desired_targets([plain], {("ns", "svc"): _isvc("vllm")}, CFG).values()
    assert t.kv_events is None


# ------------------------------------------------------------------ static config


def test_backend_kv_events_field_reaches_the_endpoint() -> None:
    cfg = parse_config(
        {
            "test_mode": True,
            "kv_events": {"max_blocks": 1000},
            "pools": [{"backends": [
                {"engine": "vllm", "url": "http://127.0.0.1:8000",
                 "kv_events": {"port": 5557, "replay_port": 5558, "topic": "kv-events"}},
                {"engine": "trtllm", "url": "http://127.0.0.1:8001",
                 "kv_events": {"transport": "http-drain", "path": "/kv_cache_events"}},
                {"engine": "vllm", "url": "http://127.0.0.1:8002"},
            ]}],
        }
    )  # fmt: skip
    fleet = build_fleet(cfg)
    v, t, plain = list(fleet)
    assert v.kv_events == KvEventsEndpoint("zmq", "vllm", port=5557, replay_port=5558,
                                           topic="kv-events")  # fmt: skip
    assert t.kv_events == KvEventsEndpoint("http-drain", "trtllm", path="/kv_cache_events")
    assert plain.kv_events is None
    assert fleet.kv_index.max_blocks == 1000


@pytest.mark.parametrize(
    ("kv", "message"),
    [
        ({"transport": "zmq"}, "needs port"),
        ({"transport": "http-drain"}, "needs path"),
        ({"transport": "http-drain", "path": "/x", "port": 3}, "no port"),
        ({"port": 3, "path": "/x"}, "path is for"),
        ({"port": 0}, "greater than or equal"),
        ({"port": 3, "nope": 1}, "Extra inputs"),
        ({"port": 3, "replay_port": 4, "ranks": 2}, "overlap"),
        ({"port": 3, "ranks": 0}, "greater than or equal"),
        ({"port": 3, "rank_choice": "random"}, "'load' or 'cache'"),
    ],
)
def test_bad_backend_kv_events(kv: dict[str, Any], message: str) -> None:
    data = {"pools": [{"backends": [{"engine": "vllm", "url": "http://127.0.0.1:1",
                                     "kv_events": kv}]}]}  # fmt: skip
    with pytest.raises(ConfigError, match=message):
        parse_config(data)


def test_backend_flag_takes_what_the_sim_prints() -> None:
    b = parse_backend_flag(
        "vllm=http://127.0.0.1:18100,kv_events=tcp://127.0.0.1:40001,"
        "kv_replay=tcp://127.0.0.1:40002,kv_topic=kv-events,name=v0"
    )
    assert b.name == "v0" and b.kv_events is not None
    assert b.kv_events.endpoint("vllm") == KvEventsEndpoint(
        "zmq", "vllm", port=40001, replay_port=40002, topic="kv-events"
    )
    t = parse_backend_flag("trtllm=http://127.0.0.1:18101,kv_events=http-drain:/kv_cache_events")
    assert t.kv_events is not None and t.kv_events.path == "/kv_cache_events"
    assert parse_backend_flag("vllm=http://127.0.0.1:1").kv_events is None
    adp = parse_backend_flag(
        "trtllm=http://127.0.0.1:18102,kv_events=tcp://127.0.0.1:40010,"
        "kv_replay=tcp://127.0.0.1:40020,kv_ranks=4,kv_rank_choice=cache"
    )
    assert adp.kv_events is not None
    assert adp.kv_events.endpoint("trtllm").rank_ports(3) == (40013, 40023)
    assert adp.kv_events.rank_choice == "cache"
    # the ranks are the replica's schedulers unless told otherwise
    assert adp.scheduler_count == 4
    plain = parse_backend_flag("trtllm=http://127.0.0.1:18103,schedulers=2")
    assert (plain.kv_events, plain.scheduler_count) == (None, 2)
    assert parse_backend_flag("vllm=http://127.0.0.1:1").scheduler_count == 1


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        ("vllm=http://127.0.0.1:1,kv_events=tcp://127.0.0.2:5", "backend's own host"),
        ("vllm=http://127.0.0.1:1,kv_events=udp://127.0.0.1:5", "tcp://HOST:PORT"),
        ("vllm=http://127.0.0.1:1,kv_events=tcp://127.0.0.1", "tcp://HOST:PORT"),
        ("vllm=http://127.0.0.1:1,kv_replay=tcp://127.0.0.1:5", "needs port"),
        ("vllm=http://127.0.0.1:1,bogus=1", "unknown option"),
        ("vllm=http://127.0.0.1:1,kv_events=tcp://127.0.0.1:5,kv_ranks=two", "valid integer"),
        ("vllm=http://127.0.0.1:1,kv_events", "not KEY=VALUE"),
        ("trtllm=http://127.0.0.1:1,schedulers=0", "greater than or equal to 1"),
    ],
)
def test_bad_backend_flags(flag: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_backend_flag(flag)


def test_test_mode_refuses_a_non_loopback_backend_with_events() -> None:
    backend = {"engine": "vllm", "url": "http://10.0.0.1:8000", "kv_events": {"port": 5557}}
    cfg = parse_config({"test_mode": True, "pools": [{"backends": [backend]}]})
    with pytest.raises(ConfigError, match="loopback"):
        cfg.check_loopback()


# ------------------------------------------------------------------ discovery membership


async def test_discovered_endpoint_gets_a_feed_and_leaving_clears_it() -> None:
    cfg = parse_config({"test_mode": True, "kv_events": {"connect_timeout_s": 0.1}})
    app = build_router(cfg, transport=httpx.MockTransport(lambda r: httpx.Response(503)),
                       start_background=False)  # fmt: skip
    async with app.router.lifespan_context(app):
        fleet = app.state.router.fleet
        feeds = app.state.kv_feeds
        m = fm.FleetMembership(fleet, app.state.poller, kv_feeds=feeds)
        kv = KvEventsEndpoint("zmq", "vllm", port=1, replay_port=2)
        t = kt.Target(EndpointId("ns/a"), "chat", "vllm", "http://127.0.1.9:8000", 16, "ns",
                      "llama", "llama-3", kv_events=kv)  # fmt: skip
        assert m.add(t)
        e = fleet.endpoints[EndpointId("ns/a")]
        assert e.kv_events == kv and EndpointId("ns/a") in feeds.feeds
        for _ in range(100):
            if e.kv_feed.state == "broken":
                break
            await asyncio.sleep(0.02)
        assert e.kv_feed.state == "broken", "nothing publishes at 127.0.1.9:1"
        await m.remove(EndpointId("ns/a"))
        assert EndpointId("ns/a") not in feeds.feeds and e.kv_feed.state == "off"
