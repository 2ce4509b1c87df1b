"""hack/decision_trace_placements.py: copies of a document made by two replicas."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "hack" / "decision_trace_placements.py"


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("decision_trace_placements", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _placement(t: float, rid: str, doc: int, pick: str, held: str | None) -> dict[str, object]:
    eps = {e: [0, 3000 if e == held else 0, 0.5, 0, 0.0] for e in ("a", "b")}
    return {"t": t, "id": rid, "doc": doc, "n": 3000, "pick": pick, "reason": "cold", "eps": eps}


def test_counts_a_document_copied_by_the_other_replica(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    r1 = [_placement(1.0, "r1", 7, "a", None), _placement(3.0, "r3", 7, "a", "a")]
    r2 = [_placement(2.0, "r2", 7, "b", None), _placement(2.5, "r4", 8, "b", None)]
    usage = {"usage": "r2", "ep": "b", "pred": 0, "src": "events", "cached": 0, "prompt": 3000}
    (tmp_path / "t.100").write_text("".join(json.dumps(r) + "\n" for r in r1))
    (tmp_path / "t.200").write_text("".join(json.dumps(r) + "\n" for r in [*r2, usage]))
    module = _script()
    placements, uses = module.load(str(tmp_path / "t"))
    assert [p["id"] for p in placements] == ["r1", "r2", "r4", "r3"]
    count, tokens = module.new_engine_placements(placements, uses)
    key = ("cold", "held nowhere", "other replica before")
    assert dict(count) == {key: 1}  # r2 copied doc 7 to b; r3 went back to a; doc 8 is new
    assert tokens[key] == 3000
    assert module.main(["x", str(tmp_path / "t")]) == 0
    assert "new-engine placements: 1, uncached tokens 3000" in capsys.readouterr().out
    assert module.main(["x", str(tmp_path / "none")]) == 2


def test_losses_split_a_lesser_holder_from_an_eviction_while_waiting(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def placed(rid: str, pick: str, reason: str, held: dict[str, int], work: float) -> object:
        # the approximate view over-guesses by 50 everywhere: the exact one counts here
        eps = {e: [held.get(e, 0), held.get(e, 0) + 50, work, 100 * work, 0.0]
               for e in ("a", "b")}  # fmt: skip
        return {"t": 1.0, "id": rid, "doc": 1, "n": 1000, "pick": pick, "reason": reason,
                "eps": eps}  # fmt: skip

    records = [
        placed("s", "b", "spill", {"a": 600, "b": 200}, 0.5),  # 400 left behind on a
        placed("w", "a", "affinity-hit", {"a": 800}, 2.0),  # predicted 800, got 300
        placed("k", "a", "affinity-hit", {"a": 500}, 1.0),  # as predicted
    ]
    usage = [
        {"usage": "s", "ep": "b", "pred": 200, "src": "events", "cached": 200, "prompt": 1000},
        {"usage": "w", "ep": "a", "pred": 800, "src": "events", "cached": 300, "prompt": 1000},
        {"usage": "k", "ep": "a", "pred": 500, "src": "events", "cached": 500, "prompt": 1000},
    ]
    (tmp_path / "t.1").write_text("".join(json.dumps(r) + "\n" for r in [*records, *usage]))
    module = _script()
    lost = module.losses(*module.load(str(tmp_path / "t")))
    assert (lost["prompt"], lost["cached"]) == (3000, 1000)
    assert lost["anywhere"] == 600 + 800 + 500  # the best holder of each, by the events view
    assert dict(lost["lesser"]) == {"spill": 400, "affinity-hit": 0}
    assert (lost["evicted"], lost["evicted_requests"]) == (500, 1)
    assert lost["evicted_at"] == [(2.0, 200.0)]
    assert module.main(["x", str(tmp_path / "t")]) == 0
    out = capsys.readouterr().out
    assert "hit rate 33.3% (1000 of 3000 prompt tokens)" in out
    assert "held by some engine at the decision: 63.3%" in out
    assert "lost to a lesser holder, spill: 400 tokens (13.3%)" in out
    assert "lost between decision and prefill: 500 tokens (16.7%) in 1 requests" in out
