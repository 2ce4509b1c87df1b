"""Prefix data (``scheduling.prefix``): rendering covers every chat message and role,
chain hashes are stable, the index is bounded and LRU, rendezvous order is
replica-independent.
"""

from __future__ import annotations

import pytest

from fleetgate.router.scheduling.prefix import (
    PrefixIndex,
    chunk_chain,
    chunk_prompt,
    first_chunk_key,
    render_prompt,
    rendezvous_order,
)
from fleetgate.router.scheduling.types import EndpointId


def chat(*msgs: tuple[str, str]) -> dict[str, object]:
    return {"model": "m", "messages": [{"role": r, "content": c} for r, c in msgs]}


def test_render_covers_every_message_and_role() -> None:
    a = render_prompt(chat(("system", "S"), ("user", "hi"), ("assistant", "yo"), ("user", "A")))
    b = render_prompt(chat(("system", "S"), ("user", "hi"), ("assistant", "yo"), ("user", "B")))
    c = render_prompt(
        chat(("system", "S"), ("assistant", "hi"), ("assistant", "yo"), ("user", "A"))
    )
    assert a != b and a != c
    assert a.startswith(b[:-3])  # shared history is a shared prefix
    assert render_prompt(chat(("user", "x"))) == render_prompt(chat(("user", "x")))


def test_render_completions_strings_tokens_and_parts() -> None:
    assert render_prompt({"model": "m", "prompt": "abc"}).endswith(b"abc")
    assert render_prompt({"model": "m", "prompt": [1, 2, 3]}).endswith(b"1 2 3")
    parts = {
        "model": "m",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}],
    }
    assert b'"text":"x"' in render_prompt(parts)
    assert render_prompt({"model": "a", "prompt": "p"}) != render_prompt(
        {"model": "b", "prompt": "p"}
    )


def test_chain_hash_is_a_prefix_chain_and_stable() -> None:
    # 100 estimated tokens each (one per digit / punctuation byte)
    x = b"1" * 100 + b"2" * 100
    y = b"1" * 100 + b"3" * 100
    cx, cy = chunk_chain(x, 50), chunk_chain(y, 50)
    assert len(cx) == 4 and cx[:2] == cy[:2] and cx[2] != cy[2]
    assert chunk_chain(b"short", 50) == ()
    # Fixed value: must not depend on PYTHONHASHSEED or the process.
    assert chunk_chain(b"0123456789", 10) == chunk_chain(b"0123456789", 10)
    assert first_chunk_key(x, 50) == first_chunk_key(y, 50)


def test_prefix_index_longest_match_bounded_lru() -> None:
    idx = PrefixIndex(capacity=5)
    e = EndpointId("e")
    idx.record(e, [1, 2, 3])
    assert idx.match(e, [1, 2, 3, 4]) == 3
    assert idx.match(e, [1, 9]) == 1
    assert idx.match(EndpointId("other"), [1]) == 0
    idx.record(e, [7, 8, 9])  # 6 entries -> oldest (1) evicted
    assert idx.size(e) == 5
    assert idx.match(e, [1, 2, 3]) == 3  # the longer hash still names the prefix
    idx.forget(e)
    assert idx.match(e, [1, 2, 3]) == 0


def test_rendezvous_is_replica_independent_and_stable_under_removal() -> None:
    eps = [EndpointId(f"e{i}") for i in range(5)]
    key = first_chunk_key(b"some prompt prefix", 16)
    order = rendezvous_order(key, eps)
    assert order == rendezvous_order(key, list(reversed(eps)))
    fewer = rendezvous_order(key, [e for e in eps if e != order[-1]])
    assert fewer[0] == order[0]
    firsts = {rendezvous_order(first_chunk_key(str(i).encode(), 16), eps)[0] for i in range(200)}
    assert len(firsts) == 5  # keys spread over all endpoints


def _shared_chunks(x: bytes, y: bytes, chunk_tokens: int) -> int:
    cx, cy = chunk_chain(x, chunk_tokens), chunk_chain(y, chunk_tokens)
    return next((i for i, (a, b) in enumerate(zip(cx, cy, strict=False)) if a != b), len(cx))


@pytest.mark.parametrize(
    "unit",
    [
        "The router sends every request where its prompt is cached, and the engine keeps it. ",
        "id 4471203 qty 0098 at 2026-11-29T14:13:15 sum 88213.50 ref 9920-3318-7710; ",
        "|row|0.125|0.250|0.375|0.500|1024|2048|4096|",
    ],
    ids=["english", "digits", "table"],
)
def test_approximate_chunks_follow_tokens_whatever_the_bytes_per_token(unit: str) -> None:
    """The shared prefix is found at the same TOKEN depth whether the text has 4 bytes
    per token (English) or about 1 (digits): the matched chunks stand for the shared
    tokens, and the prompt's token estimate is near the real count (the emulator's
    tokenizer, which splits digits one per token, is the reference)."""
    from fleetgate.sim.core import tokenizer as sim

    shared = unit * 40
    x = (shared + "first question, with its own words").encode()
    y = (shared + "another ask: 77 different things!").encode()
    real_shared = len(sim.encode(shared))
    chunk = 32
    matched_tokens = _shared_chunks(x, y, chunk) * chunk
    # within one chunk plus the estimator's error (+-35%) of the shared tokens
    assert 0.65 * real_shared - chunk <= matched_tokens <= 1.35 * real_shared + chunk
    estimate = chunk_prompt(x, chunk).tokens
    assert 0.65 <= estimate / len(sim.encode(x.decode())) <= 1.35
    # the same on another process / order: a pure function of the bytes
    assert chunk_chain(x, chunk) == chunk_chain(bytes(x), chunk)
