"""Binary discovery: a failed or incomplete build raises loudly, a complete set is found.

These tests run fake build scripts in a temp cache; they never start a Go build.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from fleetgate_tools.devcluster import bins
from fleetgate_tools.devcluster.errors import BuildError


def fake_script(tmp_path: Path, body: str) -> Path:
    script = tmp_path / "build.sh"
    script.write_text("set -eu\n" + body)
    return script


def env_for(tmp_path: Path) -> dict[str, str]:
    return {"FLEETGATE_CACHE": str(tmp_path / "cache"), "PATH": "/usr/bin:/bin"}


def test_failed_build_raises_with_the_build_output(tmp_path: Path) -> None:
    script = fake_script(tmp_path, "echo 'go: compile exploded' >&2\nexit 7\n")
    with pytest.raises(BuildError, match=r"exit code 7(.|\n)*go: compile exploded"):
        bins.ensure_binaries(build_script=script, env=env_for(tmp_path))


def test_build_that_produces_nothing_is_an_error(tmp_path: Path) -> None:
    script = fake_script(tmp_path, "echo ok\n")
    with pytest.raises(BuildError, match="left missing: etcd, kube-apiserver"):
        bins.ensure_binaries(build_script=script, env=env_for(tmp_path))


MAKE_ALL = """
ROOT="$FLEETGATE_CACHE/k8s-bins/k8s-$K8S_VERSION-etcd-$ETCD_VERSION-kwok-$KWOK_VERSION-helm-$HELM_VERSION"
mkdir -p "$ROOT/bin"
for t in etcd kube-apiserver kube-controller-manager kube-scheduler kubectl kwok helm; do
  printf '#!/bin/sh\\n' > "$ROOT/bin/$t"; chmod +x "$ROOT/bin/$t"
done
for f in node/fast/node-initialize.yaml node/heartbeat-with-lease/node-heartbeat-with-lease.yaml \\
         pod/fast/pod-ready.yaml pod/fast/pod-complete.yaml pod/fast/pod-delete.yaml; do
  mkdir -p "$(dirname "$ROOT/kwok-stages/$f")"; touch "$ROOT/kwok-stages/$f"
done
echo "$ROOT/bin"
"""


def test_successful_build_is_found_and_not_rerun(tmp_path: Path) -> None:
    env = env_for(tmp_path)
    counter = tmp_path / "runs"
    script = fake_script(tmp_path, f"echo run >> {counter}\n" + MAKE_ALL)
    announced: list[Path] = []
    first = bins.ensure_binaries(build_script=script, env=env, on_build=announced.append)
    second = bins.ensure_binaries(build_script=script, env=env, on_build=announced.append)
    assert announced == [tmp_path / "cache" / "k8s-bins-build.log"], "announced once"
    assert first == second
    assert first.missing() == []
    assert first.bin_dir == tmp_path / "cache" / "k8s-bins" / bins.Versions().dirname / "bin"
    assert counter.read_text().count("run") == 1
    assert first.path("kubectl") == first.bin_dir / "kubectl"


def test_incomplete_override_dir_is_an_error_not_a_build(tmp_path: Path) -> None:
    (tmp_path / "bin").mkdir()
    env = {"FLEETGATE_K8S_BIN_DIR": str(tmp_path / "bin")}
    script = fake_script(tmp_path, "exit 99\n")
    with pytest.raises(BuildError, match="FLEETGATE_K8S_BIN_DIR.*incomplete"):
        bins.ensure_binaries(build_script=script, env=env)


def test_unknown_tool_is_rejected() -> None:
    with pytest.raises(KeyError, match="unknown tool"):
        bins.expected_binset(env={}).path("minikube")


def test_python_versions_match_the_build_script_defaults() -> None:
    text = bins.default_build_script().read_text()
    found = dict(re.findall(r'^(\w+)_VERSION="\$\{\w+:-([^}]+)\}"', text, re.M))
    v = bins.Versions()
    assert found == {"K8S": v.kubernetes, "ETCD": v.etcd, "KWOK": v.kwok, "HELM": v.helm}
    assert (
        'ROOT="$CACHE/k8s-bins/k8s-$K8S_VERSION-etcd-$ETCD_VERSION-kwok-$KWOK_VERSION-helm-$HELM_VERSION"'
        in text
    )
