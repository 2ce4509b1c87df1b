"""Table-driven tests of every manifest builder, for both engines.

We test these aspects: the children set per engine, container args/probes/resources
from the engine adapters, GPU affinity and tolerations, volumes per storage choice,
labels the router discovers by, owner references, determinism.
"""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from fleetgate.api.v1alpha1 import InferenceServiceSpec
from fleetgate.engines.base import EngineError
from fleetgate.operator import manifests
from fleetgate.operator.options import OperatorOptions

#: The example's image: TensorRT-LLM's release is read from the tag.
TRT_IMAGE = "nvcr.io/nvidia/tensorrt-llm/release:1.0.0"
OWNER = manifests.Owner(name="svc", namespace="ns", uid="uid-123")
KWOK = {"key": "kwok.x-k8s.io/node", "operator": "Equal", "value": "fake", "effect": "NoSchedule"}


def _spec(kind: str = "vllm", /, **overrides: Any) -> InferenceServiceSpec:
    data: dict[str, Any] = {
        "model": {"uri": "hf://org/model", "name": "org/Model-7B"},
        "engine": {"type": kind, "image": TRT_IMAGE if kind == "tensorrt-llm" else f"{kind}:1"},
    }
    data.update(overrides)
    return InferenceServiceSpec.model_validate(data)


def _build(spec: InferenceServiceSpec, **kw: Any) -> manifests.Children:
    options = kw.pop("options", OperatorOptions())
    kw.setdefault("service_monitor_supported", True)
    return manifests.build_children(OWNER, spec, options, **kw)


def _deployment(children: manifests.Children) -> dict[str, Any]:
    dep = children.by_kind("Deployment")
    assert dep is not None
    return dep


def _container(children: manifests.Children) -> dict[str, Any]:
    containers = _deployment(children)["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    result: dict[str, Any] = containers[0]
    return result


def _pod(children: manifests.Children) -> dict[str, Any]:
    pod: dict[str, Any] = _deployment(children)["spec"]["template"]["spec"]
    return pod


@pytest.mark.parametrize(
    ("engine", "kinds"),
    [
        pytest.param(
            "vllm", ["Deployment", "Service", "PodDisruptionBudget", "ServiceMonitor"], id="vllm"
        ),
        pytest.param(
            "tensorrt-llm",
            ["ConfigMap", "Deployment", "Service", "PodDisruptionBudget", "ServiceMonitor"],
            id="trtllm",
        ),
    ],
)
def test_children_per_engine(engine: str, kinds: list[str]) -> None:
    children = _build(_spec(engine))
    assert [o["kind"] for o in children.objects] == kinds
    for obj in children.objects:
        meta = obj["metadata"]
        assert meta["namespace"] == "ns"
        assert meta["ownerReferences"] == [
            {
                "apiVersion": "fleetgate.dev/v1alpha1",
                "kind": "InferenceService",
                "name": "svc",
                "uid": "uid-123",
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]
        assert meta["labels"]["app.kubernetes.io/instance"] == "svc"


@pytest.mark.parametrize(
    ("metrics", "supported", "present"),
    [
        pytest.param({"serviceMonitor": True}, True, True, id="wanted-and-crd"),
        pytest.param({"serviceMonitor": True}, False, False, id="wanted-no-crd"),
        pytest.param({"serviceMonitor": False}, True, False, id="off"),
    ],
)
def test_service_monitor_only_when_wanted_and_supported(
    metrics: dict[str, Any], supported: bool, present: bool
) -> None:
    children = _build(_spec(metrics=metrics), service_monitor_supported=supported)
    monitor = children.by_kind("ServiceMonitor")
    assert (monitor is not None) is present
    if monitor is not None:
        endpoint = monitor["spec"]["endpoints"][0]
        assert endpoint == {"port": "http", "path": "/metrics", "interval": "15s"}


@pytest.mark.parametrize(
    ("engine", "settings", "command0", "expected_args"),
    [
        pytest.param(
            "vllm",
            {
                "vllm": {
                    "maxModelLen": 4096,
                    "gpuMemoryUtilization": 0.8,
                    "enablePrefixCaching": False,
                    "schedulingPolicy": "fcfs",
                    "maxNumSeqs": 32,
                }
            },
            "python3",
            [
                ["--served-model-name", "org/Model-7B"],
                ["--tensor-parallel-size", "2"],
                ["--max-model-len", "4096"],
                ["--gpu-memory-utilization", "0.8"],
                ["--no-enable-prefix-caching"],
                ["--scheduling-policy", "fcfs"],
                ["--max-num-seqs", "32"],
                ["--enable-prompt-tokens-details"],
                ["--port", "8000"],
            ],
            id="vllm",
        ),
        pytest.param(
            "tensorrt-llm",
            {"tensorrtLlm": {"backend": "pytorch", "maxBatchSize": 16, "maxNumTokens": 2048}},
            "trtllm-serve",
            [["--tp_size", "2"], ["--max_batch_size", "16"], ["--max_num_tokens", "2048"]],
            id="trtllm",
        ),
    ],
)
def test_engine_args_come_from_the_adapter(
    engine: str, settings: dict[str, Any], command0: str, expected_args: list[list[str]]
) -> None:
    spec = _spec(
        engine,
        engine={"type": engine, "image": "img:1.0.0", "extraArgs": ["--x-extra", "1"], **settings},
        parallelism={"tensor": 2},
        gpu={"count": 2},
    )
    container = _container(_build(spec))
    assert container["command"][0] == command0
    args = container["args"]
    joined = "\x00".join(args)
    for seq in expected_args:
        assert "\x00".join(seq) in joined, (seq, args)
    assert args[-2:] == ["--x-extra", "1"], "extra args are appended last"
    assert container["image"] == "img:1.0.0"
    assert container["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]


@pytest.mark.parametrize(
    ("budget", "failures"),
    [
        pytest.param(60, 6, id="1min"),
        pytest.param(1800, 180, id="default-30min"),
        pytest.param(905, 91, id="rounds-up"),
    ],
)
@pytest.mark.parametrize("engine", ["vllm", "tensorrt-llm"])
def test_probes_sized_by_startup_budget(engine: str, budget: int, failures: int) -> None:
    container = _container(_build(_spec(engine, startupBudgetSeconds=budget)))
    startup = container["startupProbe"]
    assert startup["httpGet"] == {"path": "/health", "port": "http"}
    assert startup["failureThreshold"] == failures
    assert startup["periodSeconds"] * startup["failureThreshold"] >= budget
    assert math.ceil(budget / startup["periodSeconds"]) == failures
    assert container["readinessProbe"]["httpGet"]["port"] == "http"
    assert container["livenessProbe"]["httpGet"]["port"] == "http"
    dep = _deployment(_build(_spec(engine, startupBudgetSeconds=budget)))
    assert dep["spec"]["progressDeadlineSeconds"] > budget


@pytest.mark.parametrize(
    ("gpu", "parallelism", "limits"),
    [
        pytest.param({"count": 1}, {}, {"nvidia.com/gpu": "1"}, id="one"),
        pytest.param(
            {"count": 4}, {"tensor": 2, "pipeline": 2}, {"nvidia.com/gpu": "4"}, id="tp2pp2"
        ),
        pytest.param(
            {"count": 1, "resourceName": "amd.com/gpu"}, {}, {"amd.com/gpu": "1"}, id="other-vendor"
        ),
        pytest.param({"count": 0}, {}, None, id="cpu"),
    ],
)
def test_gpu_resources(
    gpu: dict[str, Any], parallelism: dict[str, Any], limits: dict[str, str] | None
) -> None:
    children = _build(_spec(gpu=gpu, parallelism=parallelism))
    container = _container(children)
    if limits is None:
        assert "resources" not in container
        assert not any(
            t.get("key") == "nvidia.com/gpu" for t in _pod(children).get("tolerations", [])
        )
    else:
        assert container["resources"] == {"limits": limits, "requests": limits}
        (resource,) = limits
        assert {"key": resource, "operator": "Exists", "effect": "NoSchedule"} in _pod(children)[
            "tolerations"
        ]


@pytest.mark.parametrize(
    ("affinity", "terms"),
    [
        pytest.param(None, 1, id="no-user-affinity"),
        pytest.param(
            {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [
                            {
                                "matchExpressions": [
                                    {"key": "zone", "operator": "In", "values": ["a"]}
                                ]
                            },
                            {
                                "matchExpressions": [
                                    {"key": "zone", "operator": "In", "values": ["b"]}
                                ]
                            },
                        ]
                    }
                },
                "podAntiAffinity": {"x": 1},
            },
            2,
            id="anded-into-each-user-term",
        ),
    ],
)
def test_gpu_product_node_affinity(affinity: dict[str, Any] | None, terms: int) -> None:
    spec = _spec(
        gpu={"count": 1, "product": "NVIDIA-H100-80GB-HBM3"},
        scheduling={"affinity": affinity} if affinity else {},
    )
    pod = _pod(_build(spec))
    selector_terms = pod["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]["nodeSelectorTerms"]
    assert len(selector_terms) == terms
    want = {"key": "nvidia.com/gpu.product", "operator": "In", "values": ["NVIDIA-H100-80GB-HBM3"]}
    for term in selector_terms:
        assert want in term["matchExpressions"]
    if affinity:
        assert pod["affinity"]["podAntiAffinity"] == {"x": 1}
        # the caller's spec object is not mutated
        assert (
            len(
                spec.scheduling.affinity["nodeAffinity"][  # type: ignore[index]
                    "requiredDuringSchedulingIgnoredDuringExecution"
                ]["nodeSelectorTerms"][0]["matchExpressions"]
            )
            == 1
        )


def test_no_product_no_affinity() -> None:
    assert "affinity" not in _pod(_build(_spec()))


@pytest.mark.parametrize(
    ("options", "expect_kwok"),
    [
        pytest.param(OperatorOptions(), False, id="production-default"),
        pytest.param(OperatorOptions(extra_tolerations=(KWOK,)), True, id="test-cluster"),
    ],
)
def test_extra_tolerations_only_when_configured(
    options: OperatorOptions, expect_kwok: bool
) -> None:
    pod = _pod(_build(_spec(), options=options))
    assert (KWOK in pod["tolerations"]) is expect_kwok


def test_scheduling_passthrough() -> None:
    spec = _spec(
        scheduling={
            "nodeSelector": {"pool": "gpu"},
            "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "llm"}],
            "priorityClassName": "inference-high",
            "runtimeClassName": "nvidia",
        },
        engine={"type": "vllm", "image": "i", "imagePullSecrets": ["regcred"]},
    )
    pod = _pod(_build(spec))
    assert pod["nodeSelector"] == {"pool": "gpu"}
    assert {"key": "dedicated", "operator": "Equal", "value": "llm"} in pod["tolerations"]
    assert pod["priorityClassName"] == "inference-high"
    assert pod["runtimeClassName"] == "nvidia"
    assert pod["imagePullSecrets"] == [{"name": "regcred"}]
    assert pod["enableServiceLinks"] is False


@pytest.mark.parametrize(
    ("uri", "storage", "model_arg", "volumes"),
    [
        pytest.param(
            "hf://org/model",
            {},
            "org/model",
            {
                "model-cache": {"emptyDir": {}},
                "dshm": {"emptyDir": {"medium": "Memory", "sizeLimit": "2Gi"}},
            },
            id="hf-emptydir-default",
        ),
        pytest.param(
            "hf://org/model",
            {
                "modelCache": {"pvc": {"claimName": "cache", "subPath": "hub"}},
                "sharedMemorySize": "8Gi",
            },
            "org/model",
            {
                "model-cache": {"persistentVolumeClaim": {"claimName": "cache"}},
                "dshm": {"emptyDir": {"medium": "Memory", "sizeLimit": "8Gi"}},
            },
            id="hf-pvc-cache",
        ),
        pytest.param(
            "pvc://weights/llama/8b",
            {"modelCache": {"emptyDir": {"sizeLimit": "10Gi"}}},
            "/mnt/models/llama/8b",
            {
                "model-cache": {"emptyDir": {"sizeLimit": "10Gi"}},
                "model-source": {
                    "persistentVolumeClaim": {"claimName": "weights", "readOnly": True}
                },
                "dshm": {"emptyDir": {"medium": "Memory", "sizeLimit": "2Gi"}},
            },
            id="pvc-source",
        ),
        pytest.param(
            "s3://bucket/llama",
            {},
            "s3://bucket/llama",
            {
                "model-cache": {"emptyDir": {}},
                "dshm": {"emptyDir": {"medium": "Memory", "sizeLimit": "2Gi"}},
            },
            id="s3-passthrough",
        ),
    ],
)
def test_model_location_and_volumes(
    uri: str, storage: dict[str, Any], model_arg: str, volumes: dict[str, Any]
) -> None:
    children = _build(_spec(model={"uri": uri}, storage=storage))
    container = _container(children)
    assert container["args"][container["args"].index("--model") + 1] == model_arg
    got = {
        v["name"]: {k: x for k, x in v.items() if k != "name"} for v in _pod(children)["volumes"]
    }
    assert got == volumes
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert mounts["dshm"]["mountPath"] == "/dev/shm"
    assert mounts["model-cache"]["mountPath"] == "/models"
    if "model-source" in volumes:
        assert mounts["model-source"] == {
            "name": "model-source",
            "mountPath": "/mnt/models",
            "readOnly": True,
        }
    if storage.get("modelCache", {}).get("pvc", {}).get("subPath"):
        assert mounts["model-cache"]["subPath"] == "hub"


def test_auth_secret_and_env() -> None:
    spec = _spec(
        model={"uri": "hf://org/gated", "authSecretRef": {"name": "hf", "key": "tok"}},
        engine={
            "type": "vllm",
            "image": "i",
            "env": [
                {"name": "A", "value": "1"},
                {"name": "B", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
            ],
        },
    )
    env = {e["name"]: e for e in _container(_build(spec))["env"]}
    assert env["HF_TOKEN"] == {
        "name": "HF_TOKEN",
        "valueFrom": {"secretKeyRef": {"name": "hf", "key": "tok"}},
    }
    assert env["HF_HOME"]["value"] == "/models/huggingface"
    assert env["A"] == {"name": "A", "value": "1"}
    assert env["B"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}


@pytest.mark.parametrize("engine", ["vllm", "tensorrt-llm"])
def test_router_discovery_labels_on_pods_and_service(engine: str) -> None:
    spec = _spec(engine, routing={"pool": "chat", "role": "throughput", "weight": 7})
    children = _build(spec)
    adapter_name = "vllm" if engine == "vllm" else "trtllm"
    service = children.by_kind("Service")
    assert service is not None
    template = _deployment(children)["spec"]["template"]["metadata"]
    for labels, notes in (
        (template["labels"], template["annotations"]),
        (service["metadata"]["labels"], service["metadata"]["annotations"]),
    ):
        assert labels["fleetgate.dev/pool"] == "chat"
        assert labels["fleetgate.dev/role"] == "throughput"
        assert labels["fleetgate.dev/engine"] == adapter_name
        assert labels["fleetgate.dev/model"] == "org_Model-7B"
        for key in ("name", "instance", "component", "managed-by", "part-of"):
            assert f"app.kubernetes.io/{key}" in labels
        assert notes["fleetgate.dev/weight"] == "7"
        assert notes["fleetgate.dev/served-model"] == "org/Model-7B"
    assert service["spec"]["selector"] == manifests.selector_labels("svc")
    assert service["spec"]["ports"] == [
        {"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP"}
    ]


def test_selector_is_stable_across_spec_changes() -> None:
    a = _deployment(_build(_spec("vllm")))
    b = _deployment(_build(_spec("tensorrt-llm", routing={"pool": "other"})))
    assert a["spec"]["selector"] == b["spec"]["selector"]
    labels = a["spec"]["template"]["metadata"]["labels"]
    assert all(labels[k] == v for k, v in a["spec"]["selector"]["matchLabels"].items())
    assert manifests.selector_string("svc") == (
        "app.kubernetes.io/component=engine,app.kubernetes.io/instance=svc,"
        "app.kubernetes.io/part-of=fleetgate"
    )


@pytest.mark.parametrize(
    ("rollout", "expected"),
    [
        pytest.param({}, {"maxSurge": 0, "maxUnavailable": 1}, id="gpu-safe-default"),
        pytest.param(
            {"maxSurge": "25%", "maxUnavailable": 0},
            {"maxSurge": "25%", "maxUnavailable": 0},
            id="surge",
        ),
    ],
)
def test_rollout_strategy(rollout: dict[str, Any], expected: dict[str, Any]) -> None:
    dep = _deployment(_build(_spec(rollout=rollout, replicas=3)))
    assert dep["spec"]["replicas"] == 3
    assert dep["spec"]["strategy"] == {"type": "RollingUpdate", "rollingUpdate": expected}


def test_pdb() -> None:
    pdb = _build(_spec()).by_kind("PodDisruptionBudget")
    assert pdb is not None
    assert pdb["apiVersion"] == "policy/v1"
    assert pdb["spec"] == {
        "maxUnavailable": 1,
        "selector": {"matchLabels": manifests.selector_labels("svc")},
    }


def test_trtllm_config_map_is_mounted_and_hashed() -> None:
    a = _build(_spec("tensorrt-llm", engine={"type": "tensorrt-llm", "image": TRT_IMAGE}))
    b = _build(
        _spec(
            "tensorrt-llm",
            engine={
                "type": "tensorrt-llm",
                "image": TRT_IMAGE,
                "tensorrtLlm": {"enableBlockReuse": False},
            },
        )
    )
    cm = a.by_kind("ConfigMap")
    assert cm is not None and cm["metadata"]["name"] == "svc-engine-config"
    assert cm["data"] == dict(a.plan.config_files)
    volumes = {v["name"]: v for v in _pod(a)["volumes"]}
    assert volumes["engine-config"]["configMap"] == {"name": "svc-engine-config"}
    mount = {m["name"]: m for m in _container(a)["volumeMounts"]}["engine-config"]
    assert mount["mountPath"] == a.plan.config_mount_path
    path_arg = [x for x in _container(a)["args"] if x.startswith(a.plan.config_mount_path)]
    assert path_arg, "the engine is pointed at the mounted config file"
    hash_a = _deployment(a)["spec"]["template"]["metadata"]["annotations"][
        "fleetgate.dev/config-hash"
    ]
    hash_b = _deployment(b)["spec"]["template"]["metadata"]["annotations"][
        "fleetgate.dev/config-hash"
    ]
    assert hash_a != hash_b, "a config change must roll the pods"


@pytest.mark.parametrize("engine", ["vllm", "tensorrt-llm"])
def test_builders_are_deterministic(engine: str) -> None:
    one = json.dumps([*_build(_spec(engine)).objects], sort_keys=True)
    two = json.dumps([*_build(_spec(engine)).objects], sort_keys=True)
    assert one == two


@pytest.mark.parametrize(
    ("text", "value"),
    [
        pytest.param("llama-3.1-8b", "llama-3.1-8b", id="valid"),
        pytest.param("meta-llama/Llama-3.1-8B", "meta-llama_Llama-3.1-8B", id="slash"),
        pytest.param("/weird name/", "weird_name", id="edges"),
        pytest.param("x" * 80, "x" * 54 + "-d929cdee", id="too-long"),
        pytest.param("o/" + "x" * 61, "o_" + "x" * 61, id="exactly-63"),
    ],
)
def test_label_value(text: str, value: str) -> None:
    assert manifests.label_value(text) == value


def test_long_served_names_keep_distinct_model_labels() -> None:
    # Cut to 63 characters, two served names sharing a long prefix got one label
    # value, so a selector on fleetgate.dev/model mixed two models' pods.
    prefix = "org/" + "a-very-long-fine-tuned-model-name-" * 2
    one, two = manifests.label_value(prefix + "v1"), manifests.label_value(prefix + "v2")
    assert one != two
    for value in (one, two):
        assert len(value) == 63 and value[0].isalnum() and value[-1].isalnum()
    assert manifests.label_value(prefix + "v1") == one, "stable across reconciles"
    children = _build(_spec(model={"uri": "hf://org/model", "name": prefix + "v1"}))
    assert _deployment(children)["metadata"]["labels"]["fleetgate.dev/model"] == one
    pod_meta = _deployment(children)["spec"]["template"]["metadata"]
    assert pod_meta["annotations"]["fleetgate.dev/served-model"] == prefix + "v1"


def test_service_url() -> None:
    assert manifests.service_url("svc", "ns", 8000, "cluster.local") == (
        "http://svc.ns.svc.cluster.local:8000"
    )


def test_adapter_refusal_surfaces_as_engine_error() -> None:
    class Refusing:
        name = "vllm"

        def container(self, launch: Any) -> Any:
            raise EngineError("no such flag")

    with pytest.raises(EngineError, match="no such flag"):
        manifests.build_children(
            OWNER,
            _spec(),
            OperatorOptions(),
            service_monitor_supported=False,
            adapter=Refusing(),  # type: ignore[arg-type]
        )
