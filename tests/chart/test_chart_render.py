"""The Helm chart without a cluster: lint, generated files fresh, template tests for
the values that matter, schema rejections, and args/config the CLIs accept."""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import chartkit
import pytest
import yaml
from chartkit import CHART, REPO, by_kind, one, render

from fleetgate.api import crd
from fleetgate.operator import cli as operator_cli
from fleetgate.operator import rbac
from fleetgate.operator.options import parse_tolerations
from fleetgate.router import cli as router_cli
from fleetgate.router.config import parse_config
from fleetgate.router.k8s_targets import KubernetesDiscoveryConfig
from fleetgate.router.priority.config import PriorityConfig


def _hack(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, REPO / "hack" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def test_helm_lint_passes() -> None:
    res = chartkit.helm("lint", "--strict", str(CHART))
    assert "1 chart(s) linted, 0 chart(s) failed" in res.stdout


def test_generated_templates_and_schema_are_fresh() -> None:
    assert _hack("gen_chart_templates").stale() == []
    schema = _hack("gen_values_schema")
    assert (CHART / "values.schema.json").read_text() == schema.render()


def test_default_render_has_every_workload() -> None:
    objs = render()
    kinds = sorted({o["kind"] for o in objs})
    assert kinds == [
        "ClusterRole",
        "ClusterRoleBinding",
        "ConfigMap",
        "CustomResourceDefinition",
        "Deployment",
        "Service",
        "ServiceAccount",
    ]
    assert {o["metadata"]["name"] for o in by_kind(objs, "Deployment")} == {
        "rel-fleetgate-operator",
        "rel-fleetgate-router",
    }
    assert all(o["metadata"].get("namespace") == "fg" for o in objs if o["kind"] == "Deployment")


def test_operator_cluster_role_is_exactly_the_operator_rules() -> None:
    role = one(render(), "ClusterRole", "operator")
    assert role["rules"] == [dict(r) for r in rbac.CLUSTER_ROLE_RULES]
    binding = one(render(), "ClusterRoleBinding", "operator")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    sa = one(render(), "ServiceAccount", "operator")
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": sa["metadata"]["name"], "namespace": "fg"}
    ]
    dep = one(render(), "Deployment", "operator")
    assert dep["spec"]["template"]["spec"]["serviceAccountName"] == sa["metadata"]["name"]


def test_router_role_is_read_only_and_follows_the_discovery_source() -> None:
    rules = one(render(), "ClusterRole", "router")["rules"]
    assert {r["verbs"] == ["get", "list", "watch"] for r in rules} == {True}
    assert [r["resources"] for r in rules] == [
        ["pods"],  # the scale-down drain annotation (discovery.kubernetes.drain_from_pods)
        ["endpointslices"],
        ["inferenceservices"],
    ]
    no_drain = one(
        render("--set", "router.config.discovery.kubernetes.drain_from_pods=false"),
        "ClusterRole",
        "router",
    )
    assert [r["resources"] for r in no_drain["rules"]] == [
        ["endpointslices"],
        ["inferenceservices"],
    ]
    pods = one(
        render("--set", "router.config.discovery.kubernetes.source=pods"), "ClusterRole", "router"
    )
    assert [r["resources"] for r in pods["rules"]] == [["pods"], ["inferenceservices"]]
    static = render("--set", "router.config.discovery.kind=static")
    assert [o for o in by_kind(static, "ClusterRole") if "router" in o["metadata"]["name"]] == []


def test_crd_is_the_generated_one_kept_by_default() -> None:
    got = one(render(), "CustomResourceDefinition")
    want = crd.render_crd()
    assert got["spec"] == want["spec"]
    assert got["metadata"]["name"] == want["metadata"]["name"]
    assert got["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep"}
    assert got["metadata"]["labels"]["app.kubernetes.io/part-of"] == "fleetgate"
    not_kept = one(render("--set", "crds.keep=false"), "CustomResourceDefinition")
    assert "annotations" not in not_kept["metadata"]
    assert by_kind(render("--set", "crds.enabled=false"), "CustomResourceDefinition") == []


def test_replicas() -> None:
    objs = render("--set", "router.replicas=5", "--set", "operator.replicas=0")
    assert one(objs, "Deployment", "router")["spec"]["replicas"] == 5
    assert one(objs, "Deployment", "operator")["spec"]["replicas"] == 0


def _router_config(objs: list[dict[str, Any]]) -> dict[str, Any]:
    cm = next(
        o for o in by_kind(objs, "ConfigMap") if o["metadata"]["name"] == "rel-fleetgate-router"
    )
    return dict(yaml.safe_load(cm["data"]["router.yaml"]))


def test_router_replicas_reach_the_router_config_and_its_checksum() -> None:
    """Replicas place new prefixes by rendezvous (they agree); one router balances them."""
    default = render()
    assert parse_config(_router_config(default)).scheduling.router_replicas == 2
    assert parse_config(_router_config(default)).scheduling.effective_cold_choices() == 1
    assert parse_config(_router_config(default)).scheduling.effective_load_bound() == 0.25
    single = render("--set", "router.replicas=1")
    assert parse_config(_router_config(single)).scheduling.effective_cold_choices() is None
    assert parse_config(_router_config(single)).scheduling.effective_load_bound() == 1.0
    assert parse_config(_router_config(default)).scheduling.effective_prefill_slack() is None
    assert parse_config(_router_config(single)).scheduling.effective_prefill_slack() == 0.25
    checksum = "checksum/config"
    pod = one(default, "Deployment", "router")["spec"]["template"]["metadata"]["annotations"]
    pod1 = one(single, "Deployment", "router")["spec"]["template"]["metadata"]["annotations"]
    assert pod[checksum] != pod1[checksum]  # the pods roll when the count changes
    # an explicit setting wins, and other scheduling settings are kept
    own = render(
        "--set", "router.config.scheduling.router_replicas=1",
        "--set-json", "router.config.scheduling.load_bound=0.5",  # --set makes 0.5 a string
    )  # fmt: skip
    sched = parse_config(_router_config(own)).scheduling
    assert (sched.router_replicas, sched.load_bound) == (1, 0.5)


def test_long_release_name_truncates_every_name_to_63() -> None:
    release = "a-very-long-release-name-that-goes-on-and-on-and-on-x"  # 53: helm's maximum
    assert len(release) == 53
    check_names(render(release=release))
    check_names(render("--set", "fullnameOverride=" + "x" * 70))


def check_names(objs: list[dict[str, Any]]) -> None:
    names = [o["metadata"]["name"] for o in objs if o["kind"] != "CustomResourceDefinition"]
    assert all(len(n) <= 63 and not n.endswith("-") for n in names), names
    deployments = {o["metadata"]["name"] for o in by_kind(objs, "Deployment")}
    assert len(deployments) == 2
    assert {n.rsplit("-", 1)[1] for n in deployments} == {"operator", "router"}
    assert len({(o["kind"], o["metadata"]["name"]) for o in objs}) == len(objs)  # no clash


def test_service_monitors_toggle() -> None:
    assert by_kind(render(), "ServiceMonitor") == []
    objs = render(
        "--set", "serviceMonitor.enabled=true", "--set", "serviceMonitor.labels.release=kps"
    )
    mons = by_kind(objs, "ServiceMonitor")
    assert sorted(m["metadata"]["labels"]["app.kubernetes.io/component"] for m in mons) == [
        "operator",
        "router",
    ]
    assert all(m["metadata"]["labels"]["release"] == "kps" for m in mons)
    ports = {
        m["metadata"]["labels"]["app.kubernetes.io/component"]: m["spec"]["endpoints"][0]["port"]
        for m in mons
    }
    services = {
        s["metadata"]["labels"]["app.kubernetes.io/component"]: s for s in by_kind(objs, "Service")
    }
    for component, port in ports.items():  # each ServiceMonitor names a port its Service has
        assert port in [p["name"] for p in services[component]["spec"]["ports"]]
    only_router = render("--set", "serviceMonitor.enabled=true", "--set", "operator.enabled=false")
    assert len(by_kind(only_router, "ServiceMonitor")) == 1


def test_dashboards_are_labelled_for_the_grafana_sidecar(tmp_path: Path) -> None:
    chart = tmp_path / "fleetgate"
    shutil.copytree(CHART, chart)
    (chart / "dashboards").mkdir(exist_ok=True)
    (chart / "dashboards" / "zz-test.json").write_text(json.dumps({"title": "t"}))
    files = sorted(p.name for p in (chart / "dashboards").glob("*.json"))
    objs = render(chart=chart)
    maps = [o for o in by_kind(objs, "ConfigMap") if "grafana_dashboard" in o["metadata"]["labels"]]
    assert sorted(k for m in maps for k in m["data"]) == files
    assert {m["metadata"]["labels"]["grafana_dashboard"] for m in maps} == {"1"}
    for m in maps:
        ((name, text),) = m["data"].items()
        assert json.loads(text) == json.loads((chart / "dashboards" / name).read_text())
    custom = render(
        "--set", "dashboards.label=my_dash", "--set", "dashboards.labelValue=yes",
        "--set", "dashboards.annotations.grafana_folder=LLM", chart=chart,
    )  # fmt: skip
    maps = [o for o in by_kind(custom, "ConfigMap") if "my_dash" in o["metadata"]["labels"]]
    assert len(maps) == len(files)
    assert {m["metadata"]["annotations"]["grafana_folder"] for m in maps} == {"LLM"}
    none = render("--set", "dashboards.enabled=false", chart=chart)
    assert [
        o for o in by_kind(none, "ConfigMap") if "grafana_dashboard" in o["metadata"]["labels"]
    ] == []


@pytest.mark.parametrize(
    "args, words",
    [
        pytest.param(["--set", "router.replicaz=3"], "replicaz", id="unknown-key"),
        pytest.param(["--set", "operator.watchNamespace=a"], "watchNamespace", id="typo"),
        pytest.param(["--set", "router.replicas=many"], "/router/replicas", id="wrong-type"),
        pytest.param(["--set", "image.pullPolicy=Sometimes"], "pullPolicy", id="bad-enum"),
        pytest.param(["--set", "router.service.type=Mesh"], "type", id="bad-service-type"),
        # router.config is the router's own model (one schema for chart and router)
        pytest.param(["--set", "router.config.priority.bogus=1"], "bogus", id="router-key"),
        pytest.param(
            ["--set", "router.config.scheduling.seed=soon"], "seed", id="router-wrong-type"
        ),
        pytest.param(
            ["--set", "router.config.limits.max_attempts=0"], "max_attempts", id="router-bound"
        ),  # fmt: skip
    ],
)
def test_schema_rejects_bad_values(args: list[str], words: str) -> None:
    res = chartkit.helm("template", "rel", str(CHART), *args, check=False)
    assert res.returncode != 0
    assert "values don't meet the specifications of the schema" in res.stderr
    assert words in res.stderr


def _container(objs: list[dict[str, Any]], component: str) -> dict[str, Any]:
    dep = one(objs, "Deployment", component)
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    return container


def _parse(build: Any, argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(exit_on_error=False)
    build(parser)
    return parser.parse_args(argv)


def test_operator_args_and_env_are_what_the_cli_accepts() -> None:
    tol = [chartkit.KWOK_TOLERATION]
    objs = render(
        "--set-json", f"operator.engineTolerations={json.dumps(tol)}",
        "--set-json", 'operator.watchNamespaces=["a","b"]',
    )  # fmt: skip
    c = _container(objs, "operator")
    assert c["args"][0] == "operator"
    args = _parse(operator_cli.build_parser, c["args"][1:])
    env = {e["name"]: e["value"] for e in c["env"]}
    options = operator_cli.options_from(args, env)
    assert args.namespace == ["a", "b"]
    assert args.metrics_port == c["ports"][0]["containerPort"] == 9090
    assert [dict(t) for t in options.extra_tolerations] == tol
    assert parse_tolerations(env["FLEETGATE_EXTRA_TOLERATIONS"]) == tuple(tol)
    probe = c["readinessProbe"]["httpGet"]
    assert (probe["path"], probe["port"]) == ("/healthz", "metrics")


def test_router_args_and_config_are_what_the_router_accepts() -> None:
    objs = render()
    c = _container(objs, "router")
    assert c["args"][0] == "router"
    args = _parse(router_cli.build_parser, c["args"][1:])
    assert (args.host, args.port, args.config) == ("0.0.0.0", 8080, "/etc/fleetgate/router.yaml")
    (mount,) = c["volumeMounts"]
    assert args.config.startswith(mount["mountPath"] + "/")
    cm = next(
        o for o in by_kind(objs, "ConfigMap") if o["metadata"]["name"] == "rel-fleetgate-router"
    )
    config = parse_config(yaml.safe_load(cm["data"]["router.yaml"]))
    assert config.discovery.kind == "kubernetes"
    k8s = KubernetesDiscoveryConfig.model_validate(config.discovery.kubernetes)
    assert (k8s.source, k8s.namespaces, k8s.kubeconfig) == ("endpointslices", (), None)
    assert c["ports"][0]["containerPort"] == args.port


def test_router_config_errors_name_the_field() -> None:
    """Caught by helm (the router's schema is the chart's), and by the router itself."""
    bad = ["--set", "router.config.scheduling.weights.prefx=1"]
    res = chartkit.helm("template", "rel", str(CHART), *bad, check=False)
    assert res.returncode != 0 and "/router/config/scheduling/weights" in res.stderr
    assert "prefx" in res.stderr
    objs = render(*bad, "--skip-schema-validation")
    cm = next(
        o for o in by_kind(objs, "ConfigMap") if o["metadata"]["name"] == "rel-fleetgate-router"
    )
    with pytest.raises(ValueError, match="scheduling.weights.prefx"):
        parse_config(yaml.safe_load(cm["data"]["router.yaml"]))


def test_kwok_tolerations_and_pull_secrets_render() -> None:
    tol = json.dumps([chartkit.KWOK_TOLERATION])
    objs = render(
        "--set-json", f"operator.tolerations={tol}", "--set-json", f"router.tolerations={tol}",
        "--set-json", 'imagePullSecrets=[{"name":"regcred"}]', "--set", "image.tag=9.9",
    )  # fmt: skip
    for component in ("operator", "router"):
        pod = one(objs, "Deployment", component)["spec"]["template"]["spec"]
        assert pod["tolerations"] == [chartkit.KWOK_TOLERATION]
        assert pod["imagePullSecrets"] == [{"name": "regcred"}]
        assert pod["containers"][0]["image"] == "ghcr.io/fleetgate/fleetgate:9.9"
        assert pod["securityContext"]["runAsNonRoot"] is True


def test_the_tuning_values_in_docs_deploy_md_render_and_validate(tmp_path: Path) -> None:
    text = (REPO / "docs" / "deploy.md").read_text()
    marker = text.index("<!-- deploy-values:")
    block = text[marker:].split("```yaml\n", 1)[1].split("```", 1)[0]
    values = tmp_path / "tuning.yaml"
    values.write_text(block)
    objs = render("-f", str(values))
    cm = next(
        o for o in by_kind(objs, "ConfigMap") if o["metadata"]["name"] == "rel-fleetgate-router"
    )
    config = parse_config(yaml.safe_load(cm["data"]["router.yaml"]))
    k8s = KubernetesDiscoveryConfig.model_validate(config.discovery.kubernetes)
    assert (k8s.namespaces, k8s.pools) == (("llm",), ("chat",))
    assert config.scheduling.weights.prefix == 3
    priority = PriorityConfig.model_validate(config.priority)
    assert [c.name for c in priority.classes] == ["critical", "standard", "batch"]
    assert priority.body_priority_map == {"1": "critical", "-1": "batch"}


def test_router_rbac_is_namespaced_when_discovery_is() -> None:
    objs = render("--set-json", 'router.config.discovery.kubernetes.namespaces=["a","b"]')
    bindings = [o for o in by_kind(objs, "RoleBinding")]
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["a", "b"]
    role = one(objs, "ClusterRole", "router")
    assert {b["roleRef"]["name"] for b in bindings} == {role["metadata"]["name"]}
    assert [
        o for o in by_kind(objs, "ClusterRoleBinding") if "router" in o["metadata"]["name"]
    ] == []
    default = render()
    assert by_kind(default, "RoleBinding") == []
    assert one(default, "ClusterRoleBinding", "router")["subjects"][0]["namespace"] == "fg"


def test_every_value_is_documented() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    missing: list[str] = []

    def walk(node: dict[str, Any], path: str) -> None:
        for key, sub in node.get("properties", {}).items():
            where = f"{path}.{key}" if path else key
            if not sub.get("description"):
                missing.append(where)
            if where != "router.config":  # the router's own model, docs/router.md
                walk(sub, where)

    walk(schema, "")
    assert missing == []
    assert schema["additionalProperties"] is False


@pytest.mark.parametrize(
    ("values", "sleep", "drain"),
    [pytest.param([], 5, 60, id="defaults"), pytest.param(
        ["--set", "router.shutdown.preStopSleepSeconds=10",
         "--set", "router.shutdown.drainTimeoutSeconds=300"], 10, 300, id="long-streams")],
)  # fmt: skip
def test_router_drains_within_its_grace_period(values: list[str], sleep: int, drain: int) -> None:
    """preStop sleep, then SIGTERM -> --drain-timeout; the grace period covers both."""
    objs = render(*values)
    c = _container(objs, "router")
    args = _parse(router_cli.build_parser, c["args"][1:])
    assert args.drain_timeout == drain
    assert c["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", str(sleep)]
    pod = one(objs, "Deployment", "router")["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == sleep + drain + 5


def test_identity_secrets_mount_and_reach_the_router_config() -> None:
    """router.identity: the API keys and gateway Secrets are mounted as directories (so a
    rotation reaches the pod) and their files become the router config's identity paths."""
    objs = render(
        "--set", "router.identity.apiKeysSecret=fg-keys",
        "--set", "router.identity.gatewaySecret=fg-gw",
        "--set", "router.config.identity.api_keys.above_max_class=lower",
    )  # fmt: skip
    c = _container(objs, "router")
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert mounts["api-keys"] == "/etc/fleetgate-identity/api-keys"
    assert mounts["gateway-secret"] == "/etc/fleetgate-identity/gateway"
    (dep,) = [o for o in by_kind(objs, "Deployment") if o["metadata"]["name"].endswith("router")]
    vols = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
    assert vols["api-keys"]["secret"] == {"secretName": "fg-keys"}
    assert "subPath" not in str(c["volumeMounts"])
    cm = next(
        o for o in by_kind(objs, "ConfigMap") if o["metadata"]["name"] == "rel-fleetgate-router"
    )
    config = parse_config(yaml.safe_load(cm["data"]["router.yaml"]))
    assert config.identity is not None and config.identity.api_keys is not None
    assert config.identity.api_keys.keys_file == "/etc/fleetgate-identity/api-keys/keys.yaml"
    assert config.identity.api_keys.above_max_class == "lower"
    assert config.identity.trusted_gateway is not None
    assert config.identity.trusted_gateway.secret_file == "/etc/fleetgate-identity/gateway/secret"
    default = render()
    cm = next(
        o for o in by_kind(default, "ConfigMap") if o["metadata"]["name"] == "rel-fleetgate-router"
    )
    assert parse_config(yaml.safe_load(cm["data"]["router.yaml"])).identity is None
