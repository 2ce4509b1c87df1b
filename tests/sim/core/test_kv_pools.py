"""KV block pools: vLLM's usage formula, whole-block chained hashes, LRU reuse; TRT accounting."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from fleetgate.sim.core.kv_trtllm import TrtllmBlockPool
from fleetgate.sim.core.kv_vllm import BlockPool, extend_block_hashes


def _hashes(tokens: list[int], block_size: int = 4) -> list[int]:
    out: list[int] = []
    extend_block_hashes(out, tokens, block_size)
    return out


def test_usage_is_one_minus_free_over_total_minus_one() -> None:
    pool = BlockPool(11, 4)  # block 0 is the null block: 10 usable
    assert pool.num_free == 10 and pool.usage() == 0.0
    blocks = pool.allocate(5)
    assert 0 not in blocks
    assert pool.usage() == pytest.approx(1 - 5 / 10)
    pool.allocate(5)
    assert pool.usage() == 1.0
    with pytest.raises(RuntimeError, match="cannot allocate"):
        pool.allocate(1)


def test_hashes_cover_full_blocks_only_and_chain_on_the_parent() -> None:
    assert len(_hashes(list(range(11)))) == 2  # 11 tokens, blocks of 4: 2 full
    a = _hashes([1, 2, 3, 4, 9, 9, 9, 9])
    b = _hashes([5, 6, 7, 8, 9, 9, 9, 9])
    assert a[1] != b[1]  # same tokens, different parent
    assert _hashes([1, 2, 3, 4, 9, 9, 9, 9]) == a  # deterministic
    grown: list[int] = []
    extend_block_hashes(grown, [1, 2, 3, 4, 9, 9, 9, 9], 4, upto=5)
    assert grown == a[:1]
    extend_block_hashes(grown, [1, 2, 3, 4, 9, 9, 9, 9], 4)
    assert grown == a


def _fill(pool: BlockPool, tokens: list[int]) -> list[int]:
    """Allocate and cache the full blocks of ``tokens`` like a finished prefill."""
    hashes = _hashes(tokens, pool.block_size)
    blocks = pool.allocate(-(-len(tokens) // pool.block_size))
    for block, h in zip(blocks, hashes, strict=False):
        pool.cache(block, h)
    return blocks


def test_lookup_hits_whole_blocks_and_leaves_one_token_to_compute() -> None:
    pool = BlockPool(20, 4)
    prompt = list(range(100, 110))  # 10 tokens: 2 full blocks + 2 tokens
    blocks = _fill(pool, prompt)
    assert pool.lookup(_hashes(prompt), len(prompt)) == blocks[:2]
    # an exact multiple of the block size: the last block cannot be a hit
    eight = prompt[:8]
    assert pool.lookup(_hashes(eight), 8) == blocks[:1]
    # divergence inside block 2 -> only block 1 hits
    other = prompt[:5] + [0, 0, 0, 0, 0]
    assert pool.lookup(_hashes(other), len(other)) == blocks[:1]
    pool.record_lookup(10, 2)
    assert (pool.query_tokens, pool.hit_tokens) == (10, 8)  # tokens, whole blocks


def test_freed_cached_blocks_count_as_free_but_stay_reusable_until_evicted() -> None:
    pool = BlockPool(7, 4)  # 6 usable
    prompt = list(range(12))  # 3 full blocks
    blocks = _fill(pool, prompt)
    assert pool.usage() == pytest.approx(0.5)
    pool.release(blocks)
    assert pool.usage() == 0.0 and pool.num_cached == 3
    hit = pool.lookup(_hashes(prompt + [99]), 13)
    assert hit == blocks
    assert pool.cost_of(hit, 1) == 4  # three idle cached blocks + one fresh
    pool.acquire(hit)
    assert pool.ref_count(blocks[0]) == 1 and pool.num_free == 3
    pool.release(hit)
    # LRU: uncached blocks were never used, so allocation takes them first;
    # the prompt's blocks go tail-first (its last block is evicted first)
    pool.allocate(3)
    assert pool.num_cached == 3
    pool.allocate(1)
    assert pool.num_cached == 2
    assert pool.lookup(_hashes(prompt + [99]), 13) == blocks[:2]
    assert pool.evictions == 1


def test_release_more_than_acquired_is_an_error() -> None:
    pool = BlockPool(4, 4)
    (block,) = pool.allocate(1)
    pool.release([block])
    with pytest.raises(RuntimeError, match="released more often"):
        pool.release([block])


def test_disabled_caching_never_hits() -> None:
    pool = BlockPool(10, 4, enable_caching=False)
    prompt = list(range(9))
    blocks = _fill(pool, prompt)
    pool.release(blocks)
    assert pool.lookup(_hashes(prompt), 9) == []


def test_trtllm_pool_has_no_null_block_and_counts_reuse_in_blocks() -> None:
    pool = TrtllmBlockPool(10, 32)
    assert pool.num_free == 10
    pool.allocate(4)
    assert pool.usage() == pytest.approx(0.4)  # usedNumBlocks / maxNumBlocks
    assert pool.hit_rate() == 0.0
    pool.record_context(num_tokens=100, num_reused=2)  # 4 prompt blocks, 2 reused
    assert (pool.reused_blocks, pool.missed_blocks) == (2, 2)
    assert pool.hit_rate() == 0.5
    assert (pool.query_tokens, pool.hit_tokens) == (100, 64)


def test_block_hashes_do_not_depend_on_pythonhashseed() -> None:
    code = (
        "from fleetgate.sim.core.kv_vllm import extend_block_hashes as e; h=[]; "
        "e(h, list(range(64)), 16); print(h)"
    )
    outputs = set()
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        done = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done.stderr
        outputs.add(done.stdout)
    assert len(outputs) == 1
    assert outputs == {str(_hashes(list(range(64)), 16)) + "\n"}
