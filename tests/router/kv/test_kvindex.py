"""The exact index (pure): keys, chains, removal, the bound and its eviction order."""

from __future__ import annotations

import pytest

from fleetgate.engines.base import AllBlocksCleared, BlockRemoved, BlockStored, KvEventBatch
from fleetgate.router.scheduling.kvindex import KvIndex, block_keys
from fleetgate.router.scheduling.types import EndpointId

A, B, C = EndpointId("a"), EndpointId("b"), EndpointId("c")
BS = 4


def tokens(start: int, blocks: int) -> tuple[int, ...]:
    return tuple(range(start, start + blocks * BS))


def stored(hashes: list[int], toks: tuple[int, ...], parent: int | None = None) -> KvEventBatch:
    return KvEventBatch(seq=None, events=(BlockStored(tuple(hashes), parent, toks, BS),))


def removed(*hashes: int) -> KvEventBatch:
    return KvEventBatch(seq=None, events=(BlockRemoved(tuple(hashes)),))


def test_stored_chain_matches_the_router_keys_of_the_same_tokens() -> None:
    idx = KvIndex()
    toks = tokens(0, 3)
    idx.apply(A, stored([11, 12], toks[: 2 * BS]))
    idx.apply(A, stored([13], toks[2 * BS :], parent=12))
    keys = block_keys(list(toks) + [999], BS)
    assert len(keys) == 3
    assert idx.match(A, keys) == 3
    assert idx.match(B, keys) == 0
    assert idx.blocks(A) == 3 and len(idx) == 3
    other = block_keys(tokens(1, 3), BS)
    assert idx.match(A, other) == 0


def test_removed_middle_block_stops_the_chain_and_clear_forgets() -> None:
    idx = KvIndex()
    toks = tokens(0, 3)
    idx.apply(A, stored([1, 2, 3], toks))
    idx.apply(B, stored([7, 8, 9], toks))
    keys = block_keys(toks, BS)
    idx.apply(A, removed(2))
    assert idx.match(A, keys) == 1
    assert idx.match(B, keys) == 3
    assert idx.blocks(A) == 2 and len(idx) == 5
    idx.apply(B, KvEventBatch(seq=None, events=(AllBlocksCleared(),)))
    assert idx.match(B, keys) == 0 and idx.blocks(B) == 0
    idx.clear(A)
    assert len(idx) == 0 and idx.endpoints() == []


def test_unknown_parent_cpu_medium_and_partial_blocks_are_not_indexed() -> None:
    idx = KvIndex()
    idx.apply(A, stored([5], tokens(0, 1), parent=404))
    idx.apply(A, KvEventBatch(None, (BlockStored((6,), None, tokens(0, 1), BS, medium="CPU"),)))
    idx.apply(A, KvEventBatch(None, (BlockStored((7,), None, (1, 2), BS),)))
    assert len(idx) == 0
    # a CPU-tier removal does not remove the GPU entry
    idx.apply(A, stored([8], tokens(0, 1)))
    idx.apply(A, KvEventBatch(None, (BlockRemoved((8,), medium="CPU"),)))
    assert idx.blocks(A) == 1


def test_one_key_under_two_hashes_keeps_one_entry() -> None:
    idx = KvIndex()
    idx.apply(A, stored([1], tokens(0, 1)))
    idx.apply(A, stored([2], tokens(0, 1)))  # same tokens, another engine hash
    assert idx.blocks(A) == 1 and len(idx) == 1
    idx.apply(A, removed(1))  # the older hash: ignored
    assert idx.match(A, block_keys(tokens(0, 1), BS)) == 1
    idx.apply(A, removed(2))
    assert idx.blocks(A) == 0 and len(idx) == 0


def test_bound_evicts_from_the_biggest_holder_oldest_first() -> None:
    idx = KvIndex(max_blocks=10)
    for i in range(8):  # 8 separate one-block sequences on A
        idx.apply(A, stored([100 + i], tokens(1000 * i, 1)))
    for i in range(3):
        idx.apply(B, stored([200 + i], tokens(1000 * i, 1)))
    assert len(idx) <= 10
    assert idx.evicted == 1
    assert idx.blocks(B) == 3, "the small holder keeps its view"
    assert idx.match(A, block_keys(tokens(0, 1), BS)) == 0, "A's oldest went first"
    assert idx.match(A, block_keys(tokens(7000, 1), BS)) == 1


def test_match_refreshes_recency() -> None:
    idx = KvIndex(max_blocks=3)
    for i in range(3):
        idx.apply(A, stored([i + 1], tokens(1000 * i, 1)))
    assert idx.match(A, block_keys(tokens(0, 1), BS)) == 1  # the oldest, now the youngest
    idx.apply(A, stored([9], tokens(9000, 1)))
    assert idx.match(A, block_keys(tokens(0, 1), BS)) == 1
    assert idx.match(A, block_keys(tokens(1000, 1), BS)) == 0, "the least recent went"


def test_match_below_half_the_bound_keeps_store_order() -> None:
    idx = KvIndex(max_blocks=10)
    for i in range(4):  # 4 of 10: not over half
        idx.apply(A, stored([i + 1], tokens(1000 * i, 1)))
    assert idx.match(A, block_keys(tokens(0, 1), BS)) == 1
    for i in range(4, 11):
        idx.apply(A, stored([i + 1], tokens(1000 * i, 1)))
    # the match above (4 of 10 entries) did not move the first block: it went first
    assert idx.match(A, block_keys(tokens(0, 1), BS)) == 0


def test_eviction_takes_leaves_before_their_prefix() -> None:
    idx = KvIndex(max_blocks=4)
    toks = tokens(0, 4)
    idx.apply(A, stored([1, 2, 3, 4], toks))
    idx.apply(A, stored([9], tokens(5000, 1)))  # one over: something goes
    keys = block_keys(toks, BS)
    assert idx.match(A, keys) == 3, "the deepest block went, the prefix still matches"


def test_evicted_parent_drops_children_that_arrive_later() -> None:
    idx = KvIndex(max_blocks=1)
    idx.apply(A, stored([1], tokens(0, 1)))
    idx.apply(A, stored([2], tokens(100, 1)))  # evicts hash 1
    idx.apply(A, stored([3], tokens(4, 1), parent=1))
    assert idx.blocks(A) == 1 and len(idx) == 1


def test_bad_bound() -> None:
    with pytest.raises(ValueError, match="max_blocks"):
        KvIndex(max_blocks=0)


def test_memory_figure_is_in_range() -> None:
    """The docs' figure (bytes per entry) measured small: a regression guard."""
    from fleetgate_tools.bench.kvindex_memory import measure

    one = measure(blocks=20_000, holders=1)
    assert 100 < one.bytes_per_entry < 400, one
