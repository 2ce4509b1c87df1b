"""Prefix data (``scheduling.prefix``): rendering covers every chat message and role,
chain hashes are stable, the index is bounded and LRU, rendezvous order is
replica-independent.
"""

from __future__ import annotations

from fleetgate.router.scheduling.prefix import (
    PrefixIndex,
    chunk_chain,
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
