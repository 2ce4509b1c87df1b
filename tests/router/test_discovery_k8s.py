"""Kubernetes discovery: pure joins and watch cache without a server, the reflector on
httpx.MockTransport (410 Gone, dropped watches), and the whole thing against the real
API server of the dev cluster (``k8s`` marker).
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from recordings import VLLM_032

from fleetgate.api.v1alpha1 import InferenceServiceSpec
from fleetgate.operator import manifests
from fleetgate.operator.options import OperatorOptions
from fleetgate.router import discovery_k8s as d
from fleetgate.router import k8s_addresses as ka
from fleetgate.router import k8s_targets as kt
from fleetgate.router import k8s_watch as kwatch
from fleetgate.router import k8s_watchcache as kw
from fleetgate.router import membership as fm
from fleetgate.router.app import build_router
from fleetgate.router.config import ConfigError, RouterConfig, is_loopback_host
from fleetgate.router.scheduling.types import EndpointId
from fleetgate.router.served import adapter_for
from fleetgate_tools.devcluster import FAKE_NODE_TOLERATION, DevCluster

REPO = Path(__file__).resolve().parents[2]
CFG = kt.KubernetesDiscoveryConfig()


def isvc(name: str = "llama", ns: str = "ns", **routing: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": ns},
        "spec": {
            "model": {"uri": "hf://x/y", "name": "llama-3"},
            "engine": {"type": "vllm", "image": "i", "vllm": {"maxNumSeqs": 16}},
            "routing": {"pool": "chat", "role": "latency", "weight": 100, **routing},
        },
    }


def eps(
    service: str = "llama",
    ns: str = "ns",
    endpoints: list[dict[str, Any]] | None = None,
    ports: list[dict[str, Any]] | None = None,
    address_type: str = "IPv4",
) -> dict[str, Any]:
    return {
        "metadata": {
            "name": f"{service}-abc",
            "namespace": ns,
            "labels": {ka.LABEL_SERVICE_NAME: service, ka.LABEL_POOL: "chat"},
        },
        "addressType": address_type,
        "ports": [{"name": "http", "port": 8000}] if ports is None else ports,
        "endpoints": endpoints
        if endpoints is not None
        else [
            {"addresses": ["10.0.0.1"], "conditions": {"ready": True}, "targetRef": ref("p1")},
            {"addresses": ["10.0.0.2"], "conditions": {"ready": False}, "targetRef": ref("p2")},
            {"addresses": ["10.0.0.3"], "conditions": {}, "targetRef": ref("p3")},
        ],
    }


def ref(name: str) -> dict[str, str]:
    return {"kind": "Pod", "name": name}


def pod(name: str, ip: str | None, ready: bool = True, deleting: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": name,
        "namespace": "ns",
        "labels": {ka.LABEL_INSTANCE: "llama", ka.LABEL_POOL: "chat"},
    }
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    status: dict[str, Any] = {
        "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]
    }
    if ip:
        status["podIP"] = ip
    return {
        "metadata": meta,
        "spec": {
            "containers": [{"name": "engine", "ports": [{"name": "http", "containerPort": 8000}]}]
        },
        "status": status,
    }


# --------------------------------------------------------------------------- pure


def test_labels_agree_with_the_operator() -> None:
    assert (ka.LABEL_POOL, ka.LABEL_MODEL, ka.LABEL_ENGINE, ka.LABEL_ROLE) == (
        manifests.LABEL_POOL,
        manifests.LABEL_MODEL,
        manifests.LABEL_ENGINE,
        manifests.LABEL_ROLE,
    )
    assert ka.LABEL_INSTANCE in manifests.selector_labels("x")
    assert manifests.selector_labels("x")[ka.LABEL_INSTANCE] == "x"


def test_slice_ready_unset_counts_as_ready_and_unready_is_out() -> None:
    found = ka.addresses_from_slice(eps(), "http")
    assert [(a.pod, a.address, a.ready) for a in found] == [
        ("p1", "10.0.0.1", True),
        ("p2", "10.0.0.2", False),
        ("p3", "10.0.0.3", True),
    ]
    targets = kt.desired_targets(found, {("ns", "llama"): isvc()}, CFG)
    assert sorted(targets) == ["ns/p1", "ns/p3"]
    t = targets[EndpointId("ns/p1")]
    assert (t.engine, t.pool, t.url, t.capacity, t.model) == (
        "vllm",
        "chat",
        "http://10.0.0.1:8000",
        16,
        "llama-3",
    )


@pytest.mark.parametrize(
    "slice_, want",
    [
        pytest.param(eps(ports=[{"name": "metrics", "port": 9}, {"name": "http", "port": 81}]),
                     81, id="named-port"),
        pytest.param(eps(ports=[{"name": "other", "port": 82}]), 82, id="single-port"),
        pytest.param(eps(ports=[{"name": "a", "port": 1}, {"name": "b", "port": 2}]), None,
                     id="ambiguous-ports"),
        pytest.param(eps(ports=[]), None, id="no-ports"),
        pytest.param(eps(address_type="FQDN"), None, id="fqdn"),
    ],
)  # fmt: skip
def test_slice_port_choice(slice_: dict[str, Any], want: int | None) -> None:
    found = ka.addresses_from_slice(slice_, "http")
    assert (found[0].port if found else None) == want


def test_slice_without_service_label_is_ignored() -> None:
    s = eps()
    del s["metadata"]["labels"][ka.LABEL_SERVICE_NAME]
    assert ka.addresses_from_slice(s, "http") == []


def test_ipv6_url_is_bracketed() -> None:
    s = eps(address_type="IPv6", endpoints=[{"addresses": ["fd00::5"], "targetRef": ref("p")}])
    (t,) = kt.desired_targets(ka.addresses_from_slice(s, "http"), {("ns", "llama"): isvc()}, CFG)
    assert t == "ns/p"
    assert (
        kt.desired_targets(ka.addresses_from_slice(s, "http"), {("ns", "llama"): isvc()}, CFG)[
            t
        ].url
        == "http://[fd00::5]:8000"
    )


@pytest.mark.parametrize(
    "p, ready",
    [
        pytest.param(pod("a", "10.1.0.1"), True, id="ready"),
        pytest.param(pod("a", "10.1.0.1", ready=False), False, id="not-ready"),
        pytest.param(pod("a", "10.1.0.1", deleting=True), False, id="terminating"),
    ],
)
def test_pod_readiness(p: dict[str, Any], ready: bool) -> None:
    (a,) = ka.addresses_from_pod(p, "http")
    assert (a.address, a.port, a.service, a.pod, a.ready) == ("10.1.0.1", 8000, "llama", "a", ready)


def test_pod_without_ip_or_port_is_ignored() -> None:
    assert ka.addresses_from_pod(pod("a", None), "http") == []
    assert ka.addresses_from_pod(pod("a", "10.1.0.1"), "grpc") == []


@pytest.mark.parametrize(
    "config, service, want",
    [
        pytest.param(CFG, isvc(), True, id="default"),
        pytest.param(CFG, isvc(weight=0), False, id="weight-0-drains"),
        pytest.param(kt.KubernetesDiscoveryConfig(pools=("batch",)), isvc(), False, id="pool"),
        pytest.param(kt.KubernetesDiscoveryConfig(pools=("chat",)), isvc(), True, id="pool-ok"),
        pytest.param(kt.KubernetesDiscoveryConfig(roles=("throughput",)), isvc(), False, id="role"),
    ],
)
def test_filters(config: kt.KubernetesDiscoveryConfig, service: dict[str, Any], want: bool) -> None:
    found = ka.addresses_from_pod(pod("a", "10.1.0.1"), "http")
    assert bool(kt.desired_targets(found, {("ns", "llama"): service}, config)) is want


def test_engine_type_and_trtllm_capacity() -> None:
    svc = isvc()
    svc["spec"]["engine"] = {"type": "tensorrt-llm", "tensorrtLlm": {"maxBatchSize": 64}}
    found = ka.addresses_from_pod(pod("a", "10.1.0.1"), "http")
    (t,) = kt.desired_targets(found, {("ns", "llama"): svc}, CFG).values()
    assert (t.engine, t.capacity) == ("trtllm", 64)
    # attention DP: maxBatchSize is each rank's, the replica has parallelism.tensor ranks
    svc["spec"]["engine"]["tensorrtLlm"]["enableAttentionDp"] = True
    svc["spec"]["parallelism"] = {"tensor": 4}
    (t,) = kt.desired_targets(found, {("ns", "llama"): svc}, CFG).values()
    assert (t.capacity, t.schedulers) == (4 * 64, 4)
    svc["spec"]["engine"]["tensorrtLlm"]["enableAttentionDp"] = False
    (t,) = kt.desired_targets(found, {("ns", "llama"): svc}, CFG).values()
    assert (t.capacity, t.schedulers) == (64, 1), "tensor parallelism alone is one scheduler"
    svc["spec"]["engine"] = {"type": "sglang"}
    assert kt.desired_targets(found, {("ns", "llama"): svc}, CFG) == {}


def test_annotations_agree_with_the_operator() -> None:
    assert (ka.ANNOTATION_SERVED_MODEL, ka.ANNOTATION_ENGINE_VERSION) == (
        manifests.ANNOTATION_SERVED_MODEL,
        manifests.ANNOTATION_ENGINE_VERSION,
    )


def _trtllm_isvc(**engine: Any) -> dict[str, Any]:
    svc = isvc()
    svc["spec"]["model"] = {"uri": "hf://Qwen/Qwen2.5-7B-Instruct", "name": "qwen2.5-7b"}
    svc["spec"]["engine"] = {"type": "tensorrt-llm", **engine}
    return svc


@pytest.mark.parametrize(
    "engine, want",
    [
        pytest.param({"image": "nvcr.io/nvidia/tensorrt-llm/release:1.0.0"}, "1.0.0", id="tag"),
        pytest.param({"image": "reg:5000/trt/release:1.2.0rc3-py3"}, "1.2.0rc3", id="tag-suffix"),
        pytest.param({"image": "trt:1.0.0", "version": "main"}, "main", id="field-wins"),
        pytest.param({"image": "trt@sha256:abc"}, None, id="digest-only"),
        pytest.param({}, None, id="no-image"),
    ],
)
def test_release_from_the_inference_service(engine: dict[str, Any], want: str | None) -> None:
    found = ka.addresses_from_slice(eps(), "http")
    targets = kt.desired_targets(found, {("ns", "llama"): _trtllm_isvc(**engine)}, CFG)
    assert {t.engine_version for t in targets.values()} == {want}
    assert {t.model for t in targets.values()} == {"qwen2.5-7b"}


def test_pod_annotations_win_and_vllm_has_no_release() -> None:
    p = pod("a", "10.1.0.1")
    p["metadata"]["annotations"] = {
        ka.ANNOTATION_ENGINE_VERSION: "1.0",
        ka.ANNOTATION_SERVED_MODEL: "served",
        "other": "x",
    }
    found = ka.addresses_from_pod(p, "http")
    svc = _trtllm_isvc(image="trt:1.1.0")
    (t,) = kt.desired_targets(found, {("ns", "llama"): svc}, CFG).values()
    assert (t.engine_version, t.model) == ("1.0", "served")
    # A new release is a new target: plan() replaces the endpoint (rollout).
    bumped = ka.addresses_from_pod(pod("a", "10.1.0.1"), "http")
    (u,) = kt.desired_targets(bumped, {("ns", "llama"): svc}, CFG).values()
    assert u.engine_version == "1.1.0" and kt.plan({t.id: t}, {u.id: u}).remove == (t.id,)
    vllm = isvc()
    vllm["spec"]["engine"]["image"] = "vllm/vllm-openai:v0.11.0"
    (v,) = kt.desired_targets(found, {("ns", "llama"): vllm}, CFG).values()
    assert v.engine_version is None and v.engine == "vllm"


def test_the_operators_pods_give_the_example_its_release_and_served_name() -> None:
    """The trtllm example through the operator's manifests and the pods source."""
    doc = yaml.safe_load((REPO / "examples" / "trtllm-qwen2.5-7b.yaml").read_text())
    spec = InferenceServiceSpec.model_validate(doc["spec"])
    owner = manifests.Owner(name="qwen-7b", namespace="ns", uid="u")
    children = manifests.build_children(
        owner, spec, OperatorOptions(), service_monitor_supported=False
    )
    deployment = children.by_kind("Deployment")
    assert deployment is not None
    template = deployment["spec"]["template"]
    p = {
        "metadata": {**template["metadata"], "name": "qwen-7b-0", "namespace": "ns"},
        "spec": template["spec"],
        "status": {"podIP": "10.1.0.9", "conditions": [{"type": "Ready", "status": "True"}]},
    }
    found = ka.addresses_from_pod(p, "http")
    (t,) = kt.desired_targets(found, {("ns", "qwen-7b"): doc}, CFG).values()
    assert (t.engine, t.engine_version, t.model) == ("trtllm", "1.0", "qwen2.5-7b")
    adapter = adapter_for(t.engine, t.engine_version)
    assert adapter.metrics_sources[0].name == "iteration-stats"
    assert adapter.priority_fields(3) == {}


def test_no_or_deleting_inference_service_means_no_endpoint() -> None:
    found = ka.addresses_from_pod(pod("a", "10.1.0.1"), "http")
    assert kt.desired_targets(found, {}, CFG) == {}
    assert kt.desired_targets(found, {("other", "llama"): isvc()}, CFG) == {}
    gone = isvc()
    gone["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    assert kt.desired_targets(found, {("ns", "llama"): gone}, CFG) == {}


def test_plan_adds_removes_and_replaces_changed() -> None:
    found = ka.addresses_from_slice(eps(), "http")
    cur = kt.desired_targets(found, {("ns", "llama"): isvc()}, CFG)
    assert kt.plan(cur, cur) == kt.Plan(add=(), remove=())
    moved = {k: v for k, v in cur.items() if k != "ns/p3"}
    changed = isvc()
    changed["spec"]["routing"]["pool"] = "other"
    new = kt.desired_targets(found, {("ns", "llama"): changed}, CFG)
    p = kt.plan(moved, new)
    assert p.remove == ("ns/p1",)
    assert [t.id for t in p.add] == ["ns/p1", "ns/p3"]
    assert all(t.pool == "other" for t in p.add)
    assert kt.plan(cur, {}) == kt.Plan(add=(), remove=("ns/p1", "ns/p3"))


def test_drain_annotation_on_pods() -> None:
    marked = pod("a", "10.1.0.1")
    marked["metadata"]["annotations"] = {ka.ANNOTATION_DRAIN: " True "}
    other = pod("b", "10.1.0.2")
    other["metadata"]["annotations"] = {ka.ANNOTATION_DRAIN: "false"}
    found = [a for p in (marked, other) for a in ka.addresses_from_pod(p, "http")]
    assert [(a.pod, a.draining) for a in found] == [("a", True), ("b", False)]
    got = kt.desired_targets(found, {("ns", "llama"): isvc()}, CFG)
    assert {eid: t.draining for eid, t in got.items()} == {"ns/a": True, "ns/b": False}
    # Slices carry no annotations: the pods marked for removal join by targetRef.
    assert ka.draining_pods([marked, other, pod("c", None)]) == {("ns", "a")}
    weird = pod("w", "10.1.0.3")
    weird["metadata"]["annotations"] = {ka.ANNOTATION_DRAIN: True}  # not a string
    assert ka.draining_pods([weird]) == frozenset()
    found = ka.addresses_from_slice(eps(), "http")
    got = kt.desired_targets(found, {("ns", "llama"): isvc()}, CFG, {("ns", "p3")})
    assert {eid: t.draining for eid, t in got.items()} == {"ns/p1": False, "ns/p3": True}


def test_plan_changes_the_drain_flag_in_place() -> None:
    found = ka.addresses_from_slice(eps(), "http")
    cur = kt.desired_targets(found, {("ns", "llama"): isvc()}, CFG)
    drained = kt.desired_targets(found, {("ns", "llama"): isvc()}, CFG, {("ns", "p1")})
    assert kt.plan(cur, drained) == kt.Plan(add=(), remove=(), drain=((EndpointId("ns/p1"), True),))
    assert kt.plan(drained, cur) == kt.Plan(
        add=(), remove=(), drain=((EndpointId("ns/p1"), False),)
    )
    # Another change on top of the flag: replaced, the flag rides on the new target.
    moved = isvc(pool="other")
    new = kt.desired_targets(found, {("ns", "llama"): moved}, CFG, {("ns", "p1")})
    p = kt.plan(cur, new)
    assert p.remove == ("ns/p1", "ns/p3") and p.drain == ()
    assert [(t.id, t.draining) for t in p.add] == [("ns/p1", True), ("ns/p3", False)]


def test_inference_services_known_without_pods() -> None:
    plain = isvc("llama")
    assert kt.known_service(plain, CFG) == kt.KnownService(
        "ns", "llama", "llama-3", "chat", min_replicas=None, cold_start_s=None
    )
    zero = isvc("zero")
    zero["spec"]["model"]["name"] = "qwen"
    zero["spec"]["autoscaling"] = {"minReplicas": 0, "maxReplicas": 4, "coldStartSeconds": 45}
    k = kt.known_service(zero, CFG)
    assert k is not None and k.autoscaled
    assert (k.model, k.pool, k.min_replicas, k.cold_start_s) == ("qwen", "chat", 0, 45.0)
    one = isvc("one")  # autoscaled from 1: held for while every replica starts
    one["spec"]["model"]["name"] = "mistral"
    one["spec"]["autoscaling"] = {"minReplicas": 1, "coldStartSeconds": 20}
    nameless = isvc("nameless")
    del nameless["spec"]["model"]["name"]
    nameless["spec"]["autoscaling"] = {"minReplicas": 0}
    ill = isvc("ill")  # ill-typed fields are None, never an error
    ill["spec"]["autoscaling"] = {"minReplicas": "0", "coldStartSeconds": "soon"}
    neg = isvc("neg")
    neg["spec"]["autoscaling"] = {"minReplicas": 0, "coldStartSeconds": -3}
    broken = isvc("broken")
    broken["spec"]["autoscaling"] = ["not", "a", "mapping"]
    gone = isvc("gone")
    gone["spec"]["autoscaling"] = {"minReplicas": 0}
    gone["spec"]["model"]["name"] = "gone-model"
    gone["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    assert kt.known_service(gone, CFG) is None
    assert kt.known_service(ill, CFG) == kt.KnownService(
        "ns", "ill", "llama-3", "chat", min_replicas=None, cold_start_s=None
    )
    assert kt.known_service(broken, CFG) is not None
    got = kt.standby_services([plain, zero, one, nameless, ill, neg, broken, gone], CFG)
    assert {m: (k.name, k.cold_start_s, k.min_replicas) for m, k in got.items()} == {
        "qwen": ("zero", 45.0, 0),
        "mistral": ("one", 20.0, 1),
        "nameless": ("nameless", None, 0),
        "llama-3": ("neg", None, 0),
    }
    assert got["mistral"].autoscaled
    only_batch = kt.KubernetesDiscoveryConfig(pools=("batch",))
    assert kt.standby_services([zero], only_batch) == {}
    throughput = kt.KubernetesDiscoveryConfig(roles=("throughput",))
    assert kt.standby_services([zero], throughput) == {}


async def test_reconcile_drains_in_place_and_keeps_standby_models() -> None:
    """The discovery's reconcile over filled caches (no API server): a drain annotation
    flips the live endpoint's flag without replacing it, an InferenceService at zero
    replicas becomes a standby model, and the router YAML's own are left alone."""
    config = RouterConfig.model_validate(
        {
            "test_mode": True,
            "models": {"static-zero": {"scale_from_zero": True}},
            "health": {"interval_s": 0.05},
            "scrape": {"interval_s": 0.02},
        }
    )
    app = build_router(config, transport=httpx.MockTransport(fake_engines), start_background=False)
    async with app.router.lifespan_context(app):
        fleet = app.state.router.fleet
        changes: list[int] = []
        app.state.poller.on_change = lambda: changes.append(1)
        membership = fm.FleetMembership(fleet, app.state.poller)
        access = kwatch.ApiAccess(host="http://127.0.0.1:9", verify=False, token=lambda: None)
        disc = d.KubernetesDiscovery(membership, CFG, access)
        assert len(disc.drains) == 1  # endpointslices: pods too, for the annotation
        slice_ = eps()
        for i, ep in enumerate(slice_["endpoints"]):
            ep["addresses"] = [f"127.0.1.{i + 1}"]
        zero = isvc("zero")
        zero["spec"]["model"]["name"] = "qwen"
        zero["spec"]["autoscaling"] = {"minReplicas": 0, "coldStartSeconds": 20}
        disc.addresses[0].cache.replace([slice_], "1")
        disc.services[0].cache.replace([isvc(), zero], "1")
        p1 = pod("p1", "127.0.1.1")
        disc.drains[0].cache.replace([p1], "1")
        for r in (*disc.addresses, *disc.services, *disc.drains):
            r.synced.set()
        await disc.reconcile()
        e = fleet.endpoints[EndpointId("ns/p1")]
        assert not e.draining
        assert set(fleet.standby) == {"qwen", "static-zero"}
        assert (
            fleet.standby["qwen"].cold_start_s == 20 and fleet.standby["qwen"].source == "ns/zero"
        )
        assert "qwen" in fleet.models(healthy_only=False, now=0.0)
        e.dispatch(10)  # a request in flight there
        p1["metadata"]["annotations"] = {ka.ANNOTATION_DRAIN: "true"}
        changes.clear()
        p = await disc.reconcile()
        assert p.add == () and p.remove == () and p.drain == (("ns/p1", True),)
        assert fleet.endpoints[EndpointId("ns/p1")] is e and e.draining
        assert e.counts.in_flight == 1 and changes  # kept; admission told
        assert membership.targets[EndpointId("ns/p1")].draining
        disc.services[0].cache.replace([isvc()], "2")  # zero's service deleted
        await disc.reconcile()
        assert set(fleet.standby) == {"static-zero"}
        await membership.close()
        await disc.client.aclose()


def test_watch_cache_events() -> None:
    c = kw.WatchCache()
    c.replace([{"metadata": {"namespace": "a", "name": "x", "resourceVersion": "3"}}], "5")
    assert c.resource_version == "5" and list(c.objects) == [("a", "x")]
    obj = {"metadata": {"namespace": "a", "name": "y", "resourceVersion": "6"}}
    assert c.apply({"type": "ADDED", "object": obj}) is True
    assert c.apply({"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "9"}}}) is False
    assert c.resource_version == "9"
    assert c.apply({"type": "DELETED", "object": obj}) is True
    assert c.apply({"type": "DELETED", "object": obj}) is False
    with pytest.raises(kw.Gone):
        c.apply({"type": "ERROR", "object": {"kind": "Status", "code": 410, "reason": "Expired"}})
    with pytest.raises(kw.WatchError):
        c.apply({"type": "ERROR", "object": {"kind": "Status", "code": 500}})
    with pytest.raises(kw.WatchError):
        c.apply({"type": "WEIRD", "object": {}})
    assert list(c.objects) == [("a", "x")]


# --------------------------------------------------------------------------- reflector


class FakeApi:
    """A scripted API: LISTs answer from ``lists`` (the last one repeats), watches
    replay ``watches`` (an int is an HTTP status; afterwards empty streams)."""

    def __init__(self) -> None:
        self.lists: list[tuple[list[dict[str, Any]], str]] = []
        self.watches: list[list[Any]] = []
        self.requests: list[httpx.Request] = []

    @staticmethod
    def obj(name: str, rv: int) -> dict[str, Any]:
        return {"metadata": {"namespace": "ns", "name": name, "resourceVersion": str(rv)}}

    def handler(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        assert request.headers["authorization"] == "Bearer t0ken"
        if request.url.params.get("watch") != "1":
            items, rv = self.lists.pop(0) if len(self.lists) > 1 else self.lists[0]
            return httpx.Response(200, json={"items": items, "metadata": {"resourceVersion": rv}})
        if not self.watches:  # script done: a watch that stays open and quiet
            return httpx.Response(200, content=_quiet())
        script = self.watches.pop(0)
        if script and isinstance(script[0], int):
            return httpx.Response(script[0], json={"kind": "Status", "code": script[0]})
        return httpx.Response(200, content="".join(json.dumps(e) + "\n" for e in script).encode())


async def _quiet() -> AsyncIterator[bytes]:
    await asyncio.Event().wait()
    yield b""


async def run_reflector(
    api: FakeApi, until: Callable[[kwatch.Reflector], bool]
) -> kwatch.Reflector:
    access = kwatch.ApiAccess(
        host="https://127.0.0.1:6443", verify=False, token=lambda: "Bearer t0ken"
    )
    changes: list[int] = []
    sleeps: list[float] = []

    async def fake_sleep(s: float) -> None:
        sleeps.append(s)
        await asyncio.sleep(0)

    async with httpx.AsyncClient(transport=httpx.MockTransport(api.handler)) as client:
        r = kwatch.Reflector(client, access, "/api/v1/pods", "fleetgate.dev/pool", CFG,
                        lambda: changes.append(1), sleep=fake_sleep)  # fmt: skip
        task = asyncio.get_running_loop().create_task(r.run())
        try:
            for _ in range(2000):
                if until(r):
                    break
                await asyncio.sleep(0)
            assert until(r), "reflector never reached the expected state"
        finally:
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
    return r


async def test_reflector_resumes_a_finished_watch_and_relists_on_410() -> None:
    api = FakeApi()
    a, b, c = api.obj("a", 11), api.obj("b", 12), api.obj("c", 13)
    api.lists = [([a], "11"), ([a, b], "20")]  # the relist: c was deleted meanwhile
    api.watches = [
        [{"type": "ADDED", "object": b}],  # ends cleanly: resume from b's version
        [{"type": "ADDED", "object": c}, {"type": "ERROR", "object": {"code": 410}}],
        [410],  # the next watch start is refused as well: list again
    ]
    r = await run_reflector(api, lambda r: r.lists == 3)
    assert sorted(n for _, n in r.cache.objects) == ["a", "b"]
    watches = [q.url.params for q in api.requests if q.url.params.get("watch") == "1"]
    assert [w["resourceVersion"] for w in watches[:3]] == ["11", "12", "20"]
    assert all(q.url.params["labelSelector"] == "fleetgate.dev/pool" for q in api.requests)
    assert watches[0]["allowWatchBookmarks"] == "true"


async def test_reflector_keeps_its_cache_through_api_errors() -> None:
    api = FakeApi()
    api.lists = [([api.obj("a", 5)], "5")]
    api.watches = [[500], [503]]
    r = await run_reflector(api, lambda r: len(api.requests) >= 4)
    assert r.lists == 1  # errors are retried by watching again from "5", not by relisting
    assert [q.url.params.get("resourceVersion") for q in api.requests[1:4]] == ["5"] * 3
    assert list(r.cache.objects) == [("ns", "a")]


# --------------------------------------------------------------------------- membership

VLLM_METRICS = VLLM_032 / "metrics_a_after_start.prom.txt"


def fake_engines(request: httpx.Request) -> httpx.Response:
    """Every engine answers health, models and the recorded vLLM 0.32 /metrics."""
    if request.url.path == "/health":
        return httpx.Response(200)
    if request.url.path == "/v1/models":
        return httpx.Response(200, json={"object": "list", "data": [{"id": "llama-3"}]})
    if request.url.path == "/metrics":
        return httpx.Response(200, content=VLLM_METRICS.read_bytes())
    return httpx.Response(404)


def target(eid: str, url: str) -> kt.Target:
    return kt.Target(EndpointId(eid), "chat", "vllm", url, 16, "ns", "llama", "llama-3")


async def test_membership_adds_polls_and_removes_only_its_own_endpoints() -> None:
    config = RouterConfig.model_validate(
        {
            "test_mode": True,
            "pools": [{"backends": [{"engine": "vllm", "url": "http://127.0.0.1:9"}]}],
            "health": {"interval_s": 0.05},
            "scrape": {"interval_s": 0.02},
        }
    )
    app = build_router(config, transport=httpx.MockTransport(fake_engines), start_background=False)
    async with app.router.lifespan_context(app):
        fleet = app.state.router.fleet
        m = fm.FleetMembership(
            fleet, app.state.poller, allow_url=lambda u: is_loopback_host(httpx.URL(u).host)
        )
        assert m.add(target("ns/a", "http://127.0.1.9:8000")) is True
        assert m.add(target("127.0.0.1:9", "http://127.0.1.10:8000")) is False  # static id
        assert m.add(target("ns/b", "http://192.0.2.1:8000")) is False  # not loopback
        e = fleet.endpoints[EndpointId("ns/a")]
        assert (e.engine, e.pool, e.capacity_hint) == ("vllm", "chat", 16)
        await _until(lambda: e.healthy and e.models == {"llama-3"} and e.snapshot is not None, 5)
        trt = dataclasses.replace(
            target("ns/t", "http://127.0.1.11:8000"),
            engine="trtllm",
            model="qwen2.5-7b",
            engine_version="1.0",
        )
        assert m.add(trt) is True
        t = fleet.endpoints[EndpointId("ns/t")]
        assert (t.metrics_source.name, t.served_model) == ("iteration-stats", "qwen2.5-7b")
        assert t.adapter.priority_fields(3) == {}
        assert m.add(dataclasses.replace(trt, id=EndpointId("ns/u"), engine_version="0.9"))
        u = fleet.endpoints[EndpointId("ns/u")]  # unknown release: the registry's adapter
        assert u.metrics_source.name == "prometheus"
        await m.close()
        assert list(fleet.endpoints) == ["127.0.0.1:9"]  # the static backend stays
        assert m.targets == {}


def test_attach_with_a_broken_kubeconfig_is_a_one_line_config_error(tmp_path: Path) -> None:
    bad = tmp_path / "kubeconfig"
    bad.write_text("apiVersion: v1\nkind: Config\nclusters: []\n")
    app = build_router(RouterConfig(test_mode=True), start_background=False)
    with pytest.raises(ConfigError, match=r"^discovery.kubernetes: cannot load credentials from"):
        d.attach(app, kt.KubernetesDiscoveryConfig(kubeconfig=str(bad)))
    with pytest.raises(ConfigError, match="cannot load credentials"):
        d.attach(app, kt.KubernetesDiscoveryConfig(kubeconfig=str(tmp_path / "missing")))


# --------------------------------------------------------------------------- real API


def _crd(cluster: DevCluster) -> None:
    cluster.kubectl("apply", "-f", str(REPO / "crds"))
    cluster.kubectl("wait", "--for=condition=Established", "crd/inferenceservices.fleetgate.dev")


def _k8s_isvc(name: str, ns: str) -> dict[str, Any]:
    obj = isvc(name, ns)
    obj["apiVersion"] = "fleetgate.dev/v1alpha1"
    obj["kind"] = "InferenceService"
    return obj


def _k8s_pod(
    name: str, ns: str, service: str, annotations: dict[str, str] | None = None
) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": ns,
            "labels": {ka.LABEL_INSTANCE: service, ka.LABEL_POOL: "chat"},
            "annotations": annotations or {},
        },
        "spec": {
            "tolerations": [FAKE_NODE_TOLERATION],
            "containers": [
                {
                    "name": "engine",
                    "image": "fake",
                    "ports": [{"name": "http", "containerPort": 8000}],
                }
            ],
        },
    }


async def _until(what: Callable[[], bool], within: float = 30.0) -> None:
    deadline = time.monotonic() + within
    while not what():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.1)


@pytest.fixture
def crd(k8s_cluster: DevCluster) -> Iterator[None]:
    _crd(k8s_cluster)
    yield


@pytest.mark.k8s
async def test_pods_join_and_leave_and_a_410_relist_loses_nothing(
    k8s_cluster: DevCluster, k8s_namespace: str, crd: None
) -> None:
    ns = k8s_namespace
    app = build_router(RouterConfig(test_mode=True), start_background=False)
    config = kt.KubernetesDiscoveryConfig(
        source="pods", namespaces=(ns,), kubeconfig=str(k8s_cluster.kubeconfig)
    )
    d.attach(app, config, allow_url=lambda u: is_loopback_host(httpx.URL(u).host))
    await asyncio.to_thread(
        k8s_cluster.apply, _k8s_isvc("llama", ns), _k8s_pod("llama-0", ns, "llama")
    )
    async with app.router.lifespan_context(app):
        discovery: d.KubernetesDiscovery = app.state.discovery
        fleet = app.state.router.fleet
        removed: list[str] = []
        original = discovery.membership.remove

        async def spy(eid: EndpointId) -> None:
            removed.append(eid)
            await original(eid)

        discovery.membership.remove = spy  # type: ignore[method-assign]
        await _until(lambda: f"{ns}/llama-0" in fleet.endpoints)
        e0 = fleet.endpoints[EndpointId(f"{ns}/llama-0")]
        assert e0.url.startswith("http://127.0.1.") and e0.engine == "vllm"
        assert e0.pool == "chat" and e0.capacity_hint == 16

        await asyncio.to_thread(k8s_cluster.apply, _k8s_pod("llama-1", ns, "llama"))
        await _until(lambda: f"{ns}/llama-1" in fleet.endpoints)

        # Unready leaves, ready again joins (the status a kubelet would write).
        def set_ready(status: str) -> None:
            patch = {"status": {"conditions": [{"type": "Ready", "status": status}]}}
            k8s_cluster.kubectl(
                "-n", ns, "patch", "pod", "llama-1", "--subresource=status",
                "--type=strategic", "-p", json.dumps(patch),
            )  # fmt: skip

        await asyncio.to_thread(set_ready, "False")
        await _until(lambda: f"{ns}/llama-1" not in fleet.endpoints)
        assert removed == [f"{ns}/llama-1"]
        await asyncio.to_thread(set_ready, "True")
        await _until(lambda: f"{ns}/llama-1" in fleet.endpoints)
        removed.clear()

        # Force a 410: pretend the last version seen is long compacted away.
        pods = discovery.addresses[0]
        lists = pods.lists
        pods.cache.resource_version = "1"
        await asyncio.to_thread(k8s_cluster.apply, _k8s_pod("llama-2", ns, "llama"))
        await _until(lambda: f"{ns}/llama-2" in fleet.endpoints)
        # The open watch may deliver llama-2 before it is restarted with the stale
        # version; restart it so the stale version is actually used.
        for t in discovery._tasks:
            if t.get_name() == f"reflector:{pods.path}":
                t.cancel()
        await _until(lambda: all(t.done() for t in discovery._tasks if "pods" in t.get_name()))
        discovery._tasks.append(asyncio.get_running_loop().create_task(pods.run()))
        await _until(lambda: pods.lists > lists)
        assert removed == []  # the relist replaced the cache; nothing left the fleet
        assert {f"{ns}/llama-{i}" for i in range(3)} <= set(fleet.endpoints)

        # A TensorRT-LLM pod as the operator annotates it: bound to its release (no
        # priority field, load from JSON /metrics), served under spec.model.name.
        qwen = _k8s_isvc("qwen", ns)
        qwen["spec"]["engine"] = {"type": "tensorrt-llm", "image": "trt/release:1.1.0"}
        qwen["spec"]["model"]["name"] = "qwen2.5-7b"
        notes = {ka.ANNOTATION_ENGINE_VERSION: "1.0", ka.ANNOTATION_SERVED_MODEL: "qwen2.5-7b"}
        await asyncio.to_thread(k8s_cluster.apply, qwen, _k8s_pod("qwen-0", ns, "qwen", notes))
        await _until(lambda: f"{ns}/qwen-0" in fleet.endpoints)
        q = fleet.endpoints[EndpointId(f"{ns}/qwen-0")]
        assert (q.engine, q.metrics_source.name) == ("trtllm", "iteration-stats")
        assert q.served_model == "qwen2.5-7b" and q.adapter.priority_fields(3) == {}
        assert e0.served_model == "llama-3"

        await asyncio.to_thread(
            k8s_cluster.kubectl, "-n", ns, "delete", "pod", "llama-1", "--wait=false"
        )
        await _until(lambda: f"{ns}/llama-1" not in fleet.endpoints)
        assert removed == [f"{ns}/llama-1"]
        await asyncio.to_thread(
            k8s_cluster.kubectl, "-n", ns, "delete", "inferenceservice", "llama", "qwen",
            "--wait=false",
        )  # fmt: skip
        await _until(lambda: not any(k.startswith(f"{ns}/") for k in fleet.endpoints))
    assert fleet.endpoints == {}


@pytest.mark.k8s
async def test_endpointslices_source_against_the_real_api(
    k8s_cluster: DevCluster, k8s_namespace: str, crd: None
) -> None:
    """Slices written by hand with TEST-NET addresses (the API refuses loopback ones).

    Nothing is dialled: the test-mode URL check refuses the non-loopback targets,
    so the test reads the discovery's desired set instead of the fleet.
    """
    ns = k8s_namespace
    slice_ = {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        **copy.deepcopy(eps("llama", ns)),
    }
    for i, ep in enumerate(slice_["endpoints"]):
        ep["addresses"] = [f"192.0.2.{i + 1}"]
    slice_["ports"][0]["protocol"] = "TCP"
    await asyncio.to_thread(k8s_cluster.apply, _k8s_isvc("llama", ns), slice_)
    app = build_router(RouterConfig(test_mode=True), start_background=False)
    config = kt.KubernetesDiscoveryConfig(namespaces=(ns,), kubeconfig=str(k8s_cluster.kubeconfig))
    refused: list[str] = []

    def allow(url: str) -> bool:
        refused.append(url)
        return False

    d.attach(app, config, allow_url=allow)
    async with app.router.lifespan_context(app):
        discovery: d.KubernetesDiscovery = app.state.discovery
        assert sorted(t.url for t in discovery.desired().values()) == [
            "http://192.0.2.1:8000",
            "http://192.0.2.3:8000",
        ]
        assert sorted(refused) == ["http://192.0.2.1:8000", "http://192.0.2.3:8000"]
        assert app.state.router.fleet.endpoints == {}
        slice_["endpoints"][1]["conditions"]["ready"] = True
        await asyncio.to_thread(k8s_cluster.apply, slice_)
        await _until(lambda: len(discovery.desired()) == 3)


@pytest.mark.k8s
async def test_an_inference_service_at_zero_pods_is_known(
    k8s_cluster: DevCluster, k8s_namespace: str
) -> None:
    ns = k8s_namespace
    await asyncio.to_thread(_crd, k8s_cluster)
    zero = _k8s_isvc("zero", ns)
    zero["spec"]["model"]["name"] = "qwen-zero"
    zero["spec"]["autoscaling"] = {
        "minReplicas": 0,
        "maxReplicas": 2,
        "coldStartSeconds": 5,
        "targetInFlightPerReplica": 4,
    }
    await asyncio.to_thread(k8s_cluster.apply, zero, _k8s_isvc("fixed", ns))
    stored = await asyncio.to_thread(
        k8s_cluster.kubectl_json, "-n", ns, "get", "inferenceservice", "zero"
    )
    assert stored["spec"]["autoscaling"]["minReplicas"] == 0  # kept, not pruned
    app = build_router(RouterConfig(test_mode=True), start_background=False)
    config = kt.KubernetesDiscoveryConfig(
        source="pods", namespaces=(ns,), kubeconfig=str(k8s_cluster.kubeconfig)
    )
    d.attach(app, config, allow_url=lambda u: is_loopback_host(httpx.URL(u).host))
    async with app.router.lifespan_context(app):
        fleet = app.state.router.fleet
        await _until(lambda: "qwen-zero" in fleet.standby)
        sb = fleet.standby["qwen-zero"]
        assert (sb.pool, sb.cold_start_s, sb.min_replicas) == ("chat", 5.0, 0)
        assert sb.source == f"{ns}/zero"
        assert fleet.endpoints == {}  # no pod at all, and still a known model
        assert fleet.models(healthy_only=False, now=0.0) == ["qwen-zero"]
        await asyncio.to_thread(
            k8s_cluster.kubectl, "-n", ns, "delete", "inferenceservice", "zero", "--wait=false"
        )
        await _until(lambda: "qwen-zero" not in fleet.standby)
