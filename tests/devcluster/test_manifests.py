"""Pure builders: command lines bind only loopback, nodes and kubeconfig are well formed."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest

from fleetgate_tools.devcluster import manifests as m
from fleetgate_tools.devcluster.bins import STAGE_FILES

LAYOUT = m.Layout(Path("/w"))
PORTS = m.Ports(
    etcd_client=2001, etcd_peer=2002, apiserver=2003, controller_manager=2004, scheduler=2005
)
STAGES = tuple(Path("/s") / rel for rel in STAGE_FILES)


def all_argvs() -> dict[str, list[str]]:
    b = Path("/bin/x")
    return {
        "etcd": m.etcd_argv(b, LAYOUT, PORTS),
        "apiserver": m.apiserver_argv(b, LAYOUT, PORTS),
        "kcm": m.controller_manager_argv(b, LAYOUT, PORTS),
        "scheduler": m.scheduler_argv(b, LAYOUT, PORTS),
        "kwok": m.kwok_argv(b, LAYOUT, STAGES),
    }


def flags(argv: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for a in argv[1:]:
        key, _, value = a.partition("=")
        out.setdefault(key, value)
    return out


def test_no_component_binds_a_wildcard_or_routable_address() -> None:
    for name, argv in all_argvs().items():
        joined = " ".join(argv)
        assert "0.0.0.0" not in joined, name
        assert "localhost" not in joined, name
        for key, value in flags(argv).items():
            if key.endswith(("-address", "-urls", "-servers")) or key == "--node-ip":
                assert "127.0.0.1" in value, (name, key, value)


@pytest.mark.parametrize(
    ("component", "flag", "value"),
    [
        pytest.param("etcd", "--listen-client-urls", "http://127.0.0.1:2001", id="etcd-client"),
        pytest.param("etcd", "--listen-peer-urls", "http://127.0.0.1:2002", id="etcd-peer"),
        pytest.param("etcd", "--unsafe-no-fsync", "", id="etcd-nofsync"),
        pytest.param("etcd", "--data-dir", "/w/etcd", id="etcd-data"),
        pytest.param("apiserver", "--etcd-servers", "http://127.0.0.1:2001", id="api-etcd"),
        pytest.param("apiserver", "--bind-address", "127.0.0.1", id="api-bind"),
        pytest.param("apiserver", "--secure-port", "2003", id="api-port"),
        pytest.param("apiserver", "--token-auth-file", "/w/pki/tokens.csv", id="api-tokens"),
        pytest.param("apiserver", "--authorization-mode", "RBAC", id="api-rbac"),
        pytest.param("apiserver", "--service-cluster-ip-range", "10.96.0.0/24", id="api-svc"),
        pytest.param(
            "apiserver", "--service-account-signing-key-file", "/w/pki/sa.key", id="api-sa"
        ),
        pytest.param("kcm", "--secure-port", "2004", id="kcm-port"),
        pytest.param("kcm", "--bind-address", "127.0.0.1", id="kcm-bind"),
        pytest.param("kcm", "--leader-elect", "false", id="kcm-le"),
        pytest.param("scheduler", "--secure-port", "2005", id="sched-port"),
        pytest.param("scheduler", "--bind-address", "127.0.0.1", id="sched-bind"),
        pytest.param("kwok", "--cidr", "127.0.1.0/24", id="kwok-cidr"),
        pytest.param("kwok", "--node-ip", "127.0.0.1", id="kwok-node-ip"),
        pytest.param("kwok", "--manage-all-nodes", "false", id="kwok-not-all"),
        pytest.param(
            "kwok",
            "--manage-nodes-with-annotation-selector",
            "kwok.x-k8s.io/node=fake",
            id="kwok-selector",
        ),
    ],
)
def test_component_flags(component: str, flag: str, value: str) -> None:
    assert flags(all_argvs()[component])[flag] == value


def test_kwok_loads_every_stage_file_once() -> None:
    configs = [a.split("=", 1)[1] for a in all_argvs()["kwok"] if a.startswith("--config=")]
    assert configs == [str(p) for p in STAGES]
    assert {Path(c).name for c in configs} == {
        "node-initialize.yaml",
        "node-heartbeat-with-lease.yaml",
        "pod-ready.yaml",
        "pod-complete.yaml",
        "pod-delete.yaml",
    }


def test_kubeconfig_with_ca_verifies_tls() -> None:
    kc = m.kubeconfig("https://127.0.0.1:2003", "tok", ca_pem="PEM")
    assert kc["clusters"][0]["cluster"] == {
        "server": "https://127.0.0.1:2003",
        "certificate-authority-data": base64.b64encode(b"PEM").decode(),
    }
    assert kc["users"][0]["user"] == {"token": "tok"}
    assert kc["current-context"] == kc["contexts"][0]["name"]


def test_kubeconfig_without_ca_skips_tls_verify() -> None:
    kc = m.kubeconfig("https://127.0.0.1:2003", "tok")
    assert kc["clusters"][0]["cluster"] == {
        "server": "https://127.0.0.1:2003",
        "insecure-skip-tls-verify": True,
    }


LEAF = "-----BEGIN CERTIFICATE-----\nLEAF\n-----END CERTIFICATE-----\n"
CA = "-----BEGIN CERTIFICATE-----\nCA\n-----END CERTIFICATE-----\n"


def test_ca_is_the_last_block_of_the_apiserver_bundle() -> None:
    assert m.ca_from_cert_bundle(LEAF + CA) == CA


def test_a_bundle_without_ca_is_rejected() -> None:
    with pytest.raises(ValueError, match="found 1 certificate"):
        m.ca_from_cert_bundle(LEAF)


def test_tokens_csv_grants_system_masters() -> None:
    assert m.tokens_csv("abc") == 'abc,admin,admin,"system:masters"\n'


def test_default_pools_are_two_h100_and_two_a100_nodes() -> None:
    nodes = m.gpu_nodes(m.DEFAULT_POOLS)
    summary = sorted(
        (
            n["metadata"]["name"],
            n["metadata"]["labels"][m.GPU_PRODUCT_LABEL],
            n["status"]["capacity"][m.GPU_RESOURCE],
            n["status"]["allocatable"][m.GPU_RESOURCE],
        )
        for n in nodes
    )
    assert summary == [
        ("gpu-a100-0", "NVIDIA-A100-SXM4-80GB", "4", "4"),
        ("gpu-a100-1", "NVIDIA-A100-SXM4-80GB", "4", "4"),
        ("gpu-h100-0", "NVIDIA-H100-80GB-HBM3", "8", "8"),
        ("gpu-h100-1", "NVIDIA-H100-80GB-HBM3", "8", "8"),
    ]
    for n in nodes:
        assert n["metadata"]["annotations"]["kwok.x-k8s.io/node"] == "fake"
        assert n["spec"]["taints"] == [
            {"key": "kwok.x-k8s.io/node", "value": "fake", "effect": "NoSchedule"}
        ]
        assert n["spec"]["providerID"] == f"kwok://{n['metadata']['name']}"
        # no Ready condition: kwok's node-initialize stage only selects non-Ready nodes
        assert "conditions" not in n["status"]


def test_toleration_matches_the_fake_node_taint() -> None:
    taint = m.gpu_node(m.DEFAULT_POOLS[0], "n")["spec"]["taints"][0]
    tol = m.FAKE_NODE_TOLERATION
    assert (tol["key"], tol["value"], tol["effect"]) == (
        taint["key"],
        taint["value"],
        taint["effect"],
    )


def test_colliding_pool_names_are_rejected() -> None:
    pool = m.GpuNodePool("gpu", 1, 8, "X", 1)
    with pytest.raises(ValueError, match="collide"):
        m.gpu_nodes((pool, pool))


@pytest.mark.parametrize(
    ("conditions", "taints", "ready"),
    [
        pytest.param([{"type": "Ready", "status": "True"}], [], True, id="ready"),
        pytest.param([{"type": "Ready", "status": "False"}], [], False, id="not-ready"),
        pytest.param([], [], False, id="no-conditions"),
        pytest.param(
            [{"type": "Ready", "status": "True"}],
            [{"key": "node.kubernetes.io/not-ready", "effect": "NoSchedule"}],
            False,
            id="ready-but-still-tainted",
        ),
        pytest.param(
            [{"type": "Ready", "status": "True"}],
            [{"key": "kwok.x-k8s.io/node", "value": "fake", "effect": "NoSchedule"}],
            True,
            id="only-our-taint",
        ),
    ],
)
def test_node_is_ready(
    conditions: list[dict[str, str]], taints: list[dict[str, str]], ready: bool
) -> None:
    node = {"spec": {"taints": taints}, "status": {"conditions": conditions}}
    assert m.node_is_ready(node) is ready


def test_aggregation_is_opt_in_and_names_the_front_proxy_files() -> None:
    b = Path("/bin/x")
    plain = flags(m.apiserver_argv(b, LAYOUT, PORTS))
    assert not any(k.startswith(("--requestheader", "--proxy-client")) for k in plain)
    agg = flags(m.apiserver_argv(b, LAYOUT, PORTS, aggregation=True))
    assert agg["--requestheader-client-ca-file"] == str(LAYOUT.front_proxy_ca)
    assert agg["--requestheader-allowed-names"] == m.FRONT_PROXY_CLIENT_CN
    assert agg["--proxy-client-cert-file"] == str(LAYOUT.front_proxy_client_cert)
    assert agg["--proxy-client-key-file"] == str(LAYOUT.front_proxy_client_key)
    assert agg["--requestheader-extra-headers-prefix"] == "X-Remote-Extra-"
    # loopback Endpoints are invalid: the aggregator must route to the Service, not endpoints
    assert "--enable-aggregator-routing" not in agg


def test_front_proxy_client_certificate_is_signed_by_the_ca_for_the_allowed_name() -> None:
    steps = m.front_proxy_openssl_steps("openssl", LAYOUT)
    ca, csr, sign = steps
    assert str(LAYOUT.front_proxy_ca) in ca and "-x509" in ca
    assert f"/CN={m.FRONT_PROXY_CLIENT_CN}" in csr
    assert sign[sign.index("-CA") + 1] == str(LAYOUT.front_proxy_ca)
    assert sign[sign.index("-out") + 1] == str(LAYOUT.front_proxy_client_cert)


def test_hpa_sync_period_flag() -> None:
    b = Path("/bin/x")
    assert not any(
        "horizontal-pod-autoscaler" in a for a in m.controller_manager_argv(b, LAYOUT, PORTS)
    )
    kcm = flags(m.controller_manager_argv(b, LAYOUT, PORTS, hpa_sync_period_s=0.5))
    assert kcm["--horizontal-pod-autoscaler-sync-period"] == "0.5s"
    with pytest.raises(ValueError, match="hpa_sync_period_s"):
        m.controller_manager_argv(b, LAYOUT, PORTS, hpa_sync_period_s=0)
