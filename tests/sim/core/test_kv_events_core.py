"""The emulated vLLM's KV-cache events, at the core: what a step stores, evicts, clears."""

from __future__ import annotations

from fleetgate.engines.base import AllBlocksCleared, BlockRemoved, BlockStored
from fleetgate.sim.core.api import SimRequest
from fleetgate.sim.core.kv_vllm import BlockPool, external_hash
from fleetgate.sim.core.sched_vllm import VllmEngine
from fleetgate.sim.fleet import default_model_factory

BS = 16


def _engine(blocks: int = 8) -> VllmEngine:
    engine = default_model_factory()(
        "vllm", "test", {"block_size": BS, "num_gpu_blocks": blocks, "max_model_len": 100}, 0
    )
    assert isinstance(engine, VllmEngine)
    engine.pool.enable_kv_events()
    return engine


def _run(engine: VllmEngine, rid: str, tokens: list[int]) -> list[object]:
    engine.add_request(SimRequest(rid, tokens, 1, 0.0))
    events: list[object] = []
    while engine.has_work():
        engine.step(0.0)
        events += engine.pool.take_kv_events()
    return events


def test_off_by_default() -> None:
    pool = BlockPool(4, 4)
    pool.allocate(3)
    assert pool.kv_events is None and pool.take_kv_events() == []


def test_prefill_stores_full_blocks_chained_and_a_hit_stores_only_the_new_ones() -> None:
    engine = _engine()
    shared = list(range(10, 10 + 2 * BS))
    (first,) = _run(engine, "a", [*shared, *range(500, 520)])  # 52 tokens: 3 full blocks
    assert isinstance(first, BlockStored)
    assert first.parent_hash is None and len(first.block_hashes) == 3
    assert first.token_ids == tuple([*shared, *range(500, 516)])
    assert (first.block_size, first.medium, first.group) == (BS, "GPU", 0)
    assert all(0 <= h < 2**64 for h in first.block_hashes)
    # Same 2 leading blocks, another third one: only it is stored, under its parent.
    (second,) = _run(engine, "b", [*shared, *range(600, 620)])
    assert isinstance(second, BlockStored)
    assert second.parent_hash == first.block_hashes[1]
    assert len(second.block_hashes) == 1 and second.token_ids == tuple(range(600, 616))


def test_eviction_removes_each_hash_once_and_reset_clears() -> None:
    engine = _engine(blocks=8)  # 7 usable blocks of 16
    stored = _run(engine, "a", list(range(10, 74)))  # 4 full blocks (+1 generated token)
    hashes = [h for e in stored if isinstance(e, BlockStored) for h in e.block_hashes]
    later = _run(engine, "b", list(range(200, 264)))  # needs 5 blocks: evicts idle ones
    removed = [h for e in later if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert removed and set(removed) <= set(hashes) and len(removed) == len(set(removed))
    assert all(isinstance(e, BlockRemoved) and len(e.block_hashes) == 1 for e in later[:-1])
    assert engine.reset_prefix_cache()
    assert engine.pool.take_kv_events() == [AllBlocksCleared()]
    assert engine.pool.num_cached == 0


def test_reset_is_refused_while_blocks_are_in_use() -> None:
    pool = BlockPool(4, 4)
    pool.enable_kv_events()
    pool.allocate(1)
    assert not pool.reset()
    assert pool.take_kv_events() == []


def test_external_hash_is_unsigned_64_bit() -> None:
    assert external_hash(-1) == 2**64 - 1
    assert external_hash(5) == 5
