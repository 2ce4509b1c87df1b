"""``hack/conversation_hits.py``: kept and lost conversation history from a requests file."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def _module() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "conversation_hits", ROOT / "hack" / "conversation_hits.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _req(
    session: str, turn: int, sent: float, ttft: float, prompt: int, cached: int, ep: str
) -> dict[str, Any]:
    return {
        "record": "request", "contender": "c", "seed": 0, "session_id": session, "turn": turn,
        "sent_at": sent, "ttft": ttft, "prompt_tokens": prompt, "cached_tokens": cached,
        "endpoint": ep,
    }  # fmt: skip


def test_a_later_turn_keeps_its_history_when_the_previous_prompt_hit(tmp_path: Path) -> None:
    mod = _module()
    lines = [
        {"record": "run", "contender": "c", "seed": 0, "warmup_s": 1.0},
        {
            "record": "engine",
            "contender": "c",
            "seed": 0,
            "prefix_query_tokens": 1000.0,
            "prefix_hit_tokens": 250.0,
        },  # fmt: skip
        _req("warm", 0, 0.5, 0.01, 300, 256, "a"),  # before the warm-up ends: left out
        _req("s1", 0, 2.0, 0.01, 300, 256, "a"),
        _req("s1", 1, 4.0, 0.01, 500, 288, "a"),  # previous prompt 300 -> 288 in blocks: kept
        _req("s1", 2, 6.0, 0.6, 700, 256, "b"),  # previous 500 -> 496: lost 240, moved
    ]
    runs, meta = mod.load(json.dumps(x) for x in lines)
    a = mod.analyse(runs[("c", 0)], meta[("c", 0)]["warmup_s"])
    c = a["counts"]
    assert (c["first_n"], c["later_n"], c["kept"], c["lost_tokens"]) == (1, 2, 1, 240)
    assert a["total"] == 1500 and a["later"] == [(0.01, True, True), (0.6, False, False)]
    text = "\n".join(mod.report(("c", 0), a, meta[("c", 0)]["engines"]))
    assert "hit 53.3%" in text and "lost 1 (16.0% of prompt tokens)" in text
    assert "another endpoint as the previous turn: 1, kept 0%" in text and "25%/1000" in text


def test_the_block_size_sets_what_a_kept_history_is() -> None:
    mod = _module()
    turns = [_req("s", 0, 2.0, 0.01, 310, 256, "a"), _req("s", 1, 4.0, 0.01, 500, 290, "a")]
    # 310 tokens are 304 in 16-token blocks (290 cached: lost) and 288 in 32-token ones (kept)
    assert mod.analyse(turns, 0.0)["counts"]["kept"] == 0
    assert mod.analyse(turns, 0.0, block=32)["counts"]["kept"] == 1
