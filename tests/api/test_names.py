"""Names and label values: what the operator copies into a child object is refused at
admission when Kubernetes would refuse the child.

Before these rules a 70-character name was accepted and then failed at apply
(``ApplyFailed``: labels must be no more than 63 bytes), and so did 19 of the cases
below (children dry-run on the 1.36 test API server); the other five never run
either (docs/operator.md "Names and limits" says how each fails).
Each case is checked twice: by the pydantic mirror (unit) and by the real API server
(``k8s``), which must refuse it with the CRD's own message. The boundary cases just
inside each limit are accepted by both, and every child the operator builds from
them passes the real API server (server-side dry run).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from fleetgate.api import v1alpha1
from fleetgate.api.crd import CRD_FILE_NAME, crd_name, render_crd
from fleetgate.api.v1alpha1 import InferenceServiceSpec, check_name
from fleetgate.operator import manifests
from fleetgate.operator.options import OperatorOptions

ROOT = Path(__file__).resolve().parents[2]

OBJECT_NAME = "must be a Kubernetes object name"
LABEL_VALUE = "must be a Kubernetes label value"
NAME = "metadata.name must be at most 63 characters"

# (metadata.name, spec overrides, message): each one the operator could not build.
REFUSED = [
    pytest.param("a" * 64, {}, NAME, id="name-64-chars"),
    pytest.param("a" * 70, {}, NAME, id="name-70-chars-issue-14"),
    pytest.param("llama.3", {}, NAME, id="name-with-dot"),
    pytest.param("8b-llama", {}, NAME, id="name-starts-with-digit"),
    pytest.param(
        "ok",
        {"model": {"uri": "hf://o/m", "authSecretRef": {"name": "Hf_Token"}}},
        OBJECT_NAME,
        id="secret-name",
    ),
    pytest.param(
        "ok",
        {"model": {"uri": "hf://o/m", "authSecretRef": {"name": "hf", "key": "a/b"}}},
        "must be a Secret key",
        id="secret-key",
    ),
    pytest.param("ok", {"model": {"uri": "pvc:///weights"}}, "CLAIM must be", id="pvc-no-claim"),
    pytest.param("ok", {"model": {"uri": "pvc://My_Claim/w"}}, "CLAIM must be", id="pvc-claim"),
    pytest.param(
        "ok",
        {"engine": {"type": "vllm", "image": "vllm/vllm-openai:v0.32.0 "}},
        "engine.image must not start or end with whitespace",
        id="image-whitespace",
    ),
    pytest.param("ok", {"gpu": {"product": "NVIDIA H100"}}, LABEL_VALUE, id="gpu-product"),
    pytest.param(
        "ok",
        {
            "engine": {
                "type": "vllm",
                "image": "v:1",
                "vllm": {"kvEvents": True, "enablePrefixCaching": False},
            }
        },
        "kvEvents is on but enablePrefixCaching is off",
        id="vllm-kv-events-without-prefix-caching",
    ),
    pytest.param(
        "ok",
        {
            "engine": {
                "type": "tensorrt-llm",
                "image": "t:1.0.0",
                "tensorrtLlm": {"kvEvents": True, "enableBlockReuse": False},
            }
        },
        "kvEvents is on but enableBlockReuse is off",
        id="trtllm-kv-events-without-block-reuse",
    ),
    pytest.param(
        "ok",
        {
            "engine": {
                "type": "tensorrt-llm",
                "image": "t:1.3.0",
                "tensorrtLlm": {"enableAttentionDp": True, "backend": "tensorrt"},
            }
        },
        "enableAttentionDp needs backend pytorch",
        id="trtllm-attention-dp-without-pytorch",
    ),
    pytest.param(
        "ok", {"gpu": {"resourceName": "gpu"}}, "gpu.resourceName must be", id="resource-no-domain"
    ),
    pytest.param(
        "ok",
        {"gpu": {"resourceName": "kubernetes.io/gpu"}},
        "gpu.resourceName must be",
        id="resource-native",
    ),
    pytest.param(
        "ok",
        {"scheduling": {"tolerations": [{"key": "bad key", "operator": "Exists"}]}},
        "toleration key must be a label key",
        id="toleration-key",
    ),
    pytest.param(
        "ok",
        {"scheduling": {"tolerations": [{"value": "v"}]}},
        "a toleration without a key must have operator Exists",
        id="toleration-no-key",
    ),
    pytest.param(
        "ok",
        {"scheduling": {"tolerations": [{"key": "k", "operator": "Exists", "value": "v"}]}},
        "with operator Exists must not have a value",
        id="toleration-exists-value",
    ),
    pytest.param(
        "ok",
        {"scheduling": {"tolerations": [{"key": "k", "value": "a b"}]}},
        LABEL_VALUE,
        id="toleration-value",
    ),
    pytest.param(
        "ok",
        {"scheduling": {"tolerations": [{"key": "k", "tolerationSeconds": 5}]}},
        "tolerationSeconds is only allowed with effect NoExecute",
        id="toleration-seconds",
    ),
    pytest.param(
        "ok",
        {"scheduling": {"nodeSelector": {"pool": "a b"}}},
        LABEL_VALUE,
        id="node-selector-value",
    ),
    pytest.param(
        "ok", {"scheduling": {"nodeSelector": {"pool": "x" * 64}}}, "63", id="node-selector-long"
    ),
    pytest.param(
        "ok", {"scheduling": {"priorityClassName": "High"}}, OBJECT_NAME, id="priority-class"
    ),
    pytest.param(
        "ok", {"scheduling": {"runtimeClassName": "nvidia_cdi"}}, OBJECT_NAME, id="runtime-class"
    ),
    pytest.param(
        "ok",
        {"storage": {"modelCache": {"pvc": {"claimName": "Cache"}}}},
        OBJECT_NAME,
        id="cache-claim",
    ),
    pytest.param(
        "ok",
        {"storage": {"modelCache": {"pvc": {"claimName": "c", "subPath": "/abs"}}}},
        "subPath must be a relative path",
        id="cache-subpath-absolute",
    ),
    pytest.param(
        "ok",
        {"storage": {"modelCache": {"pvc": {"claimName": "c", "subPath": "a/../../b"}}}},
        "subPath must be a relative path",
        id="cache-subpath-backstep",
    ),
]

#: Just inside every limit above: must be accepted (tests/operator builds its children).
MAX_NAME = "m" + "-x" * 30 + "-9"  # 63 characters
BOUNDARY_SPEC: dict[str, Any] = {
    "model": {
        "uri": "pvc://" + "c" * 253 + "/weights",
        "name": "org/" + "n" * 240,
        "authSecretRef": {"name": "s." + "t" * 251, "key": "Hf_TOKEN.v1-x"},
    },
    "engine": {"type": "vllm", "image": "vllm/vllm-openai:v0.32.0"},
    "gpu": {"product": "NVIDIA-H100-80GB-HBM3" + "x" * 42, "resourceName": "nvidia.com/gpu"},
    "scheduling": {
        "nodeSelector": {"example.com/" + "k" * 63: "V" * 63, "plain": ""},
        "tolerations": [
            {"operator": "Exists"},
            {"key": "", "operator": "Exists", "effect": "NoSchedule"},
            {
                "key": "example.com/t",
                "value": "v" * 63,
                "effect": "NoExecute",
                "tolerationSeconds": 30,
            },
        ],
        "priorityClassName": "p" * 253,
        "runtimeClassName": "nvidia",
    },
    "storage": {"modelCache": {"pvc": {"claimName": "cache.v1", "subPath": "a/..b/c.."}}},
    "routing": {"pool": "p" * 63},
}


def isvc(name: str, namespace: str, spec: dict[str, Any]) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": {"uri": "hf://org/tiny"},
        "engine": {"type": "vllm", "image": "vllm/vllm-openai:v0.32.0"},
        **spec,
    }
    return {
        "apiVersion": "fleetgate.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": name, "namespace": namespace},
        "spec": body,
    }


def _refused_by_models(name: str, spec: dict[str, Any]) -> str:
    """The pydantic mirror's message for ``name`` + ``spec``, or "" if accepted."""
    problem = check_name(name)
    if problem:
        return problem
    try:
        InferenceServiceSpec.model_validate(isvc(name, "ns", spec)["spec"])
    except ValidationError as e:
        return str(e)
    return ""


@pytest.mark.parametrize(("name", "spec", "message"), REFUSED)
def test_models_refuse_what_kubernetes_would_refuse(
    name: str, spec: dict[str, Any], message: str
) -> None:
    assert message in _refused_by_models(name, spec)


def test_node_selector_keys_are_checked_by_the_models_only() -> None:
    # CEL cannot read map keys within the API server's cost budget (the real server
    # refused the CRD: "estimated rule cost exceeds budget by factor of 24.2x"), so a
    # bad key is the operator's InvalidSpec, not an admission error.
    spec = {"scheduling": {"nodeSelector": {"bad key": "x"}}}
    assert "scheduling.nodeSelector: every key must be a label key" in _refused_by_models(
        "ok", spec
    )
    assert _refused_by_models("ok", {"scheduling": {"nodeSelector": {"a.b/c_d": ""}}}) == ""


def test_models_accept_values_just_inside_the_limits() -> None:
    assert len(MAX_NAME) == 63
    assert _refused_by_models(MAX_NAME, BOUNDARY_SPEC) == ""


def test_crd_checks_metadata_name_at_the_root() -> None:
    schema = render_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    assert schema["x-kubernetes-validations"] == [
        {"rule": v1alpha1.NAME_RULE, "message": v1alpha1.NAME_MESSAGE}
    ]


# ------------------------------------------------------------------ real API server


@pytest.fixture(scope="module")
def crd(k8s_cluster: Any) -> str:
    k8s_cluster.kubectl("apply", "--server-side", "-f", str(ROOT / "crds" / CRD_FILE_NAME))
    k8s_cluster.kubectl("wait", "--for=condition=Established", f"crd/{crd_name()}", "--timeout=60s")
    return crd_name()


@pytest.mark.k8s
@pytest.mark.parametrize(("name", "spec", "message"), REFUSED)
def test_api_server_refuses_with_the_crd_message(
    k8s_cluster: Any, k8s_namespace: str, crd: str, name: str, spec: dict[str, Any], message: str
) -> None:
    body = isvc(name, k8s_namespace, spec)
    res = k8s_cluster.kubectl("create", "-f", "-", input=json.dumps(body), check=False)
    assert res.returncode != 0, f"API server accepted it: {res.stdout}"
    assert message in res.stderr, res.stderr


@pytest.mark.k8s
def test_api_server_accepts_values_just_inside_the_limits(
    k8s_cluster: Any, k8s_namespace: str, crd: str
) -> None:
    body = isvc(MAX_NAME, k8s_namespace, BOUNDARY_SPEC)
    res = k8s_cluster.kubectl("create", "-f", "-", input=json.dumps(body), check=False)
    assert res.returncode == 0, res.stderr
    generated = isvc("", k8s_namespace, {})
    del generated["metadata"]["name"]
    # generateName: the API server cuts the prefix to 58 characters and adds 5 before
    # the root rule sees metadata.name, so a long prefix still yields a usable name.
    generated["metadata"]["generateName"] = "a" * 70
    res = k8s_cluster.kubectl(
        "create", "-f", "-", "-o", "json", input=json.dumps(generated), check=False
    )
    assert res.returncode == 0, res.stderr
    assert len(json.loads(res.stdout)["metadata"]["name"]) == 63


@pytest.mark.k8s
@pytest.mark.parametrize("engine", ["vllm", "tensorrt-llm"])
def test_children_of_values_just_inside_the_limits_pass_the_api_server(
    k8s_cluster: Any, k8s_namespace: str, engine: str
) -> None:
    # What the rules let through must also build: every child the operator derives
    # from a 63-character name and the longest accepted values, dry-run on the server.
    # a TensorRT-LLM image tag must name a release (or spec.engine.version must)
    image = "engine:1" if engine == "vllm" else "engine:1.0.0"
    spec = {**BOUNDARY_SPEC, "engine": {"type": engine, "image": image}}
    parsed = InferenceServiceSpec.model_validate(spec)
    owner = manifests.Owner(name=MAX_NAME, namespace=k8s_namespace, uid="0" * 36)
    children = manifests.build_children(
        owner, parsed, OperatorOptions(), service_monitor_supported=False
    )
    kinds = [o["kind"] for o in children.objects]
    assert {"Deployment", "Service", "PodDisruptionBudget"} <= set(kinds)
    assert ("ConfigMap" in kinds) == (engine == "tensorrt-llm")
    for obj in children.objects:
        res = k8s_cluster.kubectl(
            "apply",
            "--server-side",
            "--dry-run=server",
            "--field-manager=test",
            "-f",
            "-",
            input=json.dumps(obj),
            check=False,
        )
        assert res.returncode == 0, f"{obj['kind']} refused: {res.stderr}"
