"""``fleetgate operator`` start-up errors and option parsing (no cluster needed)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from fleetgate.cli import CliError, main
from fleetgate.operator import app, rbac
from fleetgate.operator.cli import build_parser, options_from
from fleetgate.operator.kube import KubeError, NotFound
from fleetgate.operator.options import OptionsError, parse_tolerations


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    build_parser(parser)
    return parser.parse_args(list(argv))


def test_missing_kubeconfig_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["operator", "--kubeconfig", str(tmp_path / "nope")])
    err = capsys.readouterr().err
    assert code == 2
    assert (
        err.strip() == f"fleetgate operator: error: kubeconfig {tmp_path / 'nope'} does not exist"
    )


def test_no_credentials_anywhere(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("KUBECONFIG", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(app.StartupError, match="no Kubernetes credentials: pass --kubeconfig"):
        app.load_credentials(None)


def test_broken_kubeconfig(tmp_path: Path) -> None:
    bad = tmp_path / "config"
    bad.write_text("this: is: not: a kubeconfig")
    with pytest.raises(app.StartupError, match="is not usable"):
        app.load_credentials(str(bad))


class _Api:
    def __init__(self, served: bool | Exception, listing: Exception | None = None) -> None:
        self.served = served
        self.listing = listing
        self.calls: list[str] = []

    def kind_exists(self, api_version: str, kind: str) -> bool:
        self.calls.append(f"kind_exists {kind}")
        if isinstance(self.served, Exception):
            raise self.served
        return self.served

    def list(self, api_version: str, kind: str, namespace: str, selector: str) -> list[Any]:
        self.calls.append(f"list {kind} in {namespace!r}")
        if self.listing is not None:
            raise self.listing
        return []


CRD_MISSING = "CRD inferenceservices.fleetgate.dev is not installed"


@pytest.mark.parametrize(
    ("api", "message"),
    [
        pytest.param(_Api(False), CRD_MISSING, id="not-discovered"),
        pytest.param(
            _Api(True, NotFound(404, "404 page not found")), CRD_MISSING, id="stale-discovery"
        ),
        pytest.param(
            _Api(True, KubeError(403, "forbidden")), "refused us: 403: forbidden", id="forbidden"
        ),
        pytest.param(
            _Api(ConnectionError("connection refused")),
            "unreachable: connection refused",
            id="down",
        ),
    ],
)
def test_start_up_checks_are_explained(api: _Api, message: str) -> None:
    with pytest.raises(app.StartupError) as info:
        app.check_api(api, "https://127.0.0.1:6443")  # type: ignore[arg-type]
    assert message in str(info.value)
    if message == CRD_MISSING:
        assert "kubectl apply -f crds/" in str(info.value)


def test_healthy_api_passes_the_checks() -> None:
    api = _Api(True)
    app.check_api(api, "https://127.0.0.1:6443", "ns")  # type: ignore[arg-type]
    assert api.calls == ["kind_exists InferenceService", "list InferenceService in 'ns'"]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param("", (), id="empty"),
        pytest.param(
            "kwok.x-k8s.io/node=fake:NoSchedule",
            (
                {
                    "key": "kwok.x-k8s.io/node",
                    "operator": "Equal",
                    "value": "fake",
                    "effect": "NoSchedule",
                },
            ),
            id="shorthand",
        ),
        pytest.param(
            "gpu, b:NoExecute",
            (
                {"key": "gpu", "operator": "Exists"},
                {"key": "b", "operator": "Exists", "effect": "NoExecute"},
            ),
            id="list",
        ),
        pytest.param(
            '[{"key": "k", "operator": "Exists"}]', ({"key": "k", "operator": "Exists"},), id="json"
        ),
    ],
)
def test_parse_tolerations(text: str, expected: tuple[dict[str, Any], ...]) -> None:
    assert parse_tolerations(text) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        pytest.param("k:Sometimes", "effect must be one of", id="bad-effect"),
        pytest.param("=v", "empty key", id="no-key"),
        pytest.param("[oops", "invalid JSON", id="bad-json"),
        pytest.param('{"key": "k"}', "must be a list", id="json-object-not-list"),
    ],
)
def test_parse_tolerations_errors(text: str, message: str) -> None:
    with pytest.raises(OptionsError, match=message):
        parse_tolerations(text)


def test_options_from_flags_and_env() -> None:
    opts = options_from(
        _args("--interval", "2", "--extra-toleration", "a=b:NoSchedule"),
        {"FLEETGATE_EXTRA_TOLERATIONS": "c"},
    )
    assert opts.reconcile_interval == 2
    assert [t["key"] for t in opts.extra_tolerations] == ["c", "a"]
    assert options_from(_args(), {}).extra_tolerations == (), "production: no extra toleration"


def test_pool_options_from_flags() -> None:
    opts = options_from(
        _args("--pool-gpu-budget", "chat=8", "--pool-gpu-budget", "bulk=16", "--class-role",
              "standard=throughput", "--pool-consolidation"),
        {},
    )  # fmt: skip
    assert opts.pool_consolidation is True
    assert opts.pool_gpu_budgets == {"chat": 8, "bulk": 16}
    assert opts.class_roles.role_of("standard") == "throughput"
    assert opts.class_roles.role_of("critical") == "latency"
    default = options_from(_args(), {})
    assert default.pool_gpu_budgets == {}, "no budget unless asked for"
    assert default.class_roles.role_of("batch") == "throughput"
    assert default.pool_consolidation is False, "each role its own replicas unless asked"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        pytest.param(["--interval", "0"], "--interval must be > 0", id="interval"),
        pytest.param(["--metrics-port", "70000"], "--metrics-port", id="port"),
        pytest.param(["--extra-toleration", "x:Bad"], "effect must be one of", id="toleration"),
        pytest.param(["--pool-gpu-budget", "chat=-2"], "whole number", id="budget"),
        pytest.param(["--class-role", "batch=bulk"], "CLASS=latency", id="class-role"),
    ],
)
def test_bad_options_are_cli_errors(argv: list[str], message: str) -> None:
    with pytest.raises(CliError, match=message):
        options_from(_args(*argv), {})


def test_cluster_role_lists_what_the_operator_touches() -> None:
    role = rbac.cluster_role()
    grants = {
        (group, resource): set(rule["verbs"])
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
    }
    assert grants[("fleetgate.dev", "inferenceservices")] == {"get", "list", "watch"}
    assert grants[("fleetgate.dev", "inferenceservices/status")] == {"get", "patch"}
    assert grants[("apps", "deployments")] >= {"create", "patch", "watch"}
    assert "delete" not in grants[("apps", "deployments")], "children go by garbage collection"
    assert grants[("", "events")] == {"create"}
    # autoscaling: drain annotations on engine pods, replicas through the scale subresource
    assert grants[("", "pods")] == {"list", "patch"}
    assert grants[("fleetgate.dev", "inferenceservices/scale")] == {"patch"}
    assert not any("*" in verbs or "*" in resource for (_, resource), verbs in grants.items())
    assert ("", "secrets") not in grants


def test_health_and_metrics_endpoint() -> None:
    import threading
    import urllib.error
    import urllib.request

    from fleetgate.operator.metrics import OperatorMetrics

    metrics = OperatorMetrics()
    metrics.reconciles.labels(result="ok").inc()
    healthy = threading.Event()
    server = app._http_server(app.Endpoints("127.0.0.1", 0), metrics, healthy)
    thread = threading.Thread(target=server.serve_forever)
    thread.start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(f"{base}/healthz", timeout=5)
        assert info.value.code == 503
        info.value.close()
        healthy.set()
        with urllib.request.urlopen(f"{base}/healthz", timeout=5) as resp:
            assert resp.status == 200
        with urllib.request.urlopen(f"{base}/metrics", timeout=5) as resp:
            text = resp.read().decode()
        assert 'fleetgate_operator_reconciles_total{result="ok"} 1.0' in text
        with pytest.raises(urllib.error.HTTPError) as missing:
            urllib.request.urlopen(f"{base}/nope", timeout=5)
        assert missing.value.code == 404
        missing.value.close()
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_connection_info_carries_the_same_credentials() -> None:
    from kubernetes import client as k8s_client

    cfg = k8s_client.Configuration()
    cfg.host = "https://127.0.0.1:6443"
    cfg.api_key = {"authorization": "Bearer T0KEN"}
    cfg.verify_ssl = False
    info = app.connection_info(cfg)
    assert (info.server, info.token, info.scheme, info.insecure) == (
        "https://127.0.0.1:6443",
        "T0KEN",
        "Bearer",
        True,
    )


def test_connection_info_reads_the_in_cluster_token(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The in-cluster loader writes "bearer <token>" (lower case): kopf must get the token.

    Found by the image test (tests/image/test_image_operator.py): the operator in a pod
    sent "Bearer bearer <token>" and every request was 401.
    """
    from kubernetes import config as k8s_config

    (tmp_path / "token").write_text("SA-T0KEN")
    (tmp_path / "ca.crt").write_text("not checked here")
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "6443")
    monkeypatch.setattr(
        k8s_config.incluster_config, "SERVICE_TOKEN_FILENAME", str(tmp_path / "token")
    )
    monkeypatch.setattr(
        k8s_config.incluster_config, "SERVICE_CERT_FILENAME", str(tmp_path / "ca.crt")
    )
    monkeypatch.delenv("KUBECONFIG", raising=False)
    info = app.connection_info(app.load_credentials(None))
    assert (info.server, info.token, info.scheme) == (
        "https://127.0.0.1:6443",
        "SA-T0KEN",
        "Bearer",
    )
