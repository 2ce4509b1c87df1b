"""The runtime package ships only the product and never needs the tools.

``fleetgate`` (api, engines, operator, router, sim, cli) must import nothing
from ``fleetgate_tools``; import-linter checks the same in ``make lint``, this
test also catches imports hidden in functions and ``import_module`` strings.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import fleetgate
from fleetgate import cli

RUNTIME = Path(fleetgate.__file__).resolve().parent


def _tool_imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names = [node.value] if node.value.startswith("fleetgate_tools.") else []
        found += [
            f"{path.relative_to(RUNTIME.parent)}:{node.lineno}: {n}"
            for n in names
            if n == "fleetgate_tools" or n.startswith("fleetgate_tools.")
        ]
    return found


def test_no_runtime_module_imports_the_tools() -> None:
    offenders = [hit for path in sorted(RUNTIME.rglob("*.py")) for hit in _tool_imports(path)]
    assert offenders == []


def test_the_tools_are_not_in_the_runtime_package() -> None:
    for name in ("bench", "devcluster", "dashboards", "demo.py"):
        assert not (RUNTIME / name).exists(), f"fleetgate/{name} belongs in tools/fleetgate_tools"


def test_a_missing_tool_command_says_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(cli, "entry_points", lambda group: [])
    assert cli.main(["bench", "run", "chat-multiturn"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert "development tool" in err[0] and "pip install -e ./tools" in err[0]
    assert cli.main(["--help"]) == 0
    assert "not installed (development tools): demo, bench" in capsys.readouterr().out
