"""The hit-rate ceiling counts exactly the blocks a prompt shares with an earlier one."""

from __future__ import annotations

from fleetgate.router.config import TokenizerSpec
from fleetgate.router.scheduling.tokenize import prompt_token_ids
from fleetgate.router.tokenizer_files import load_tokenizer
from fleetgate_tools.bench import scenarios
from fleetgate_tools.bench.ceiling import hit_ceiling
from fleetgate_tools.bench.workloads import Session, Turn

TOK = load_tokenizer("emulator", TokenizerSpec(kind="emulator"))
DOC = " ".join(f"word{i} of the shared document" for i in range(200))


def session(i: int, t: float, content: str) -> Session:
    return Session(f"s{i}", t, None, (Turn(content=content, max_tokens=8),))


def ids(content: str) -> list[int]:
    out = prompt_token_ids({"messages": [{"role": "user", "content": content}]}, TOK)
    assert out is not None
    return out


def test_ceiling_is_the_shared_blocks_over_the_steady_prompt_tokens() -> None:
    a, b, c = f"{DOC}\n\nQuestion: one", f"{DOC}\n\nQuestion: two?", "something else entirely"
    sessions = [session(0, 0.0, a), session(1, 2.0, b), session(2, 3.0, c), session(3, 4.0, a)]
    ia, ib, ic = ids(a), ids(b), ids(c)
    shared = 0
    while ia[shared] == ib[shared]:
        shared += 1
    full_a = len(ia) // 16 * 16  # a again: every whole block of it
    # the warm-up (1 s) drops the first request from the figure but not from the cache
    want = (shared // 16 * 16 + 0 + full_a) / (len(ib) + len(ic) + len(ia))
    assert hit_ceiling(sessions, 1.0, TOK) == want
    assert 0.5 < want < 1.0


def test_ceiling_is_none_for_conversations() -> None:
    sc = scenarios.make("chat-multiturn", engines=2, time_scale=4, seed=0, modelled_s=5)
    assert hit_ceiling(sc.sessions(), 0.5, TOK) is None


def test_shared_prefix_has_room_above_what_routers_measured() -> None:
    """16 engines, load 0.7, 16 modelled s, 3 s warm-up (the 246035b run: every router
    measured 72.1-72.2%): the ceiling is well above that."""
    sc = scenarios.make(
        "shared-prefix", engines=16, time_scale=16, seed=0, modelled_s=16, load_factor=0.7
    )
    ceiling = hit_ceiling(sc.sessions(), 3.0, TOK)
    assert ceiling is not None and 0.78 < ceiling < 0.9
