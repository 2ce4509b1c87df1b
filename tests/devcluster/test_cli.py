"""``fleetgate dev-cluster``: user errors are one line with exit code 2."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from fleetgate.cli import main
from fleetgate_tools.devcluster.bins import STAGE_FILES, TOOLS


def fake_bin_dir(tmp_path: Path) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in TOOLS:
        (bin_dir / tool).write_text("#!/bin/sh\n")
        (bin_dir / tool).chmod(stat.S_IRWXU)
    for rel in STAGE_FILES:
        (tmp_path / "kwok-stages" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "kwok-stages" / rel).touch()
    return bin_dir


def test_which_prints_the_tool_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    bin_dir = fake_bin_dir(tmp_path)
    monkeypatch.setenv("FLEETGATE_K8S_BIN_DIR", str(bin_dir))
    assert main(["dev-cluster", "which", "helm"]) == 0
    assert capsys.readouterr().out.strip() == str(bin_dir / "helm")


def test_which_unknown_tool_is_a_one_line_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["dev-cluster", "which", "minikube"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("fleetgate dev-cluster: error: unknown tool 'minikube'")
    assert "\n" not in err


def test_which_of_an_unbuilt_tool_says_how_to_build(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("FLEETGATE_K8S_BIN_DIR", str(tmp_path / "empty" / "bin"))
    assert main(["dev-cluster", "which", "kubectl"]) == 2
    assert "hack/build-k8s-bins.sh" in capsys.readouterr().err


def test_down_without_a_detached_cluster(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["dev-cluster", "down", "--state", str(tmp_path / "none.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert "no detached dev cluster" in err
    assert "\n" not in err


def test_up_requires_a_kubeconfig_path(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["dev-cluster", "up"])
    assert info.value.code == 2
    assert "--kubeconfig" in capsys.readouterr().err
