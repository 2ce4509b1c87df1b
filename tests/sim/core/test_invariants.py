"""Randomised (seeded) workloads: the KV bookkeeping stays exact at every step.

Requests arrive in bursts with mixed prompt lengths, shared prefixes, priorities
and occasional aborts, on small pools that force preemption / pausing. After
every step we check: refcounts equal the number of live requests holding each
block; the free queue holds exactly the unreferenced blocks; a running request
holds ``ceil(num_computed / block_size)`` blocks and a waiting or paused one
holds none; no request is in two places; and every request that was not
aborted produced exactly ``textgen.generate``'s tokens.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest

from fleetgate.sim.core import textgen
from fleetgate.sim.core import tokenizer as tk
from fleetgate.sim.core.engine_base import BaseEngine
from fleetgate.sim.core.timing import build_engine_model

from .drive import request


def _check(engine: BaseEngine) -> None:
    pool = engine.pool
    running = list(engine.running)
    waiting = [st for st in engine.requests.values() if st not in running]
    assert len({id(st) for st in running}) == len(running)
    assert len(running) + len(waiting) == len(engine.requests)
    assert len(running) <= engine.config.max_running
    holders: Counter[int] = Counter()
    for st in running:
        assert len(st.blocks) == -(-st.num_computed // engine.block_size), st.request_id
        assert len(set(st.blocks)) == len(st.blocks)
        holders.update(st.blocks)
    for st in waiting:
        assert st.blocks == [] and st.num_computed == 0, st.request_id
    first = 1 if pool.null_block else 0
    for block in range(first, pool.num_blocks):
        assert pool.ref_count(block) == holders[block], block
        assert (block in pool._free) == (holders[block] == 0), block
    assert pool.num_free + pool.num_used == pool.num_usable


@pytest.mark.parametrize(
    ("kind", "overrides"),
    [
        pytest.param("vllm", {"queue_policy": "fcfs"}, id="vllm-fcfs"),
        pytest.param("vllm", {"queue_policy": "priority"}, id="vllm-priority"),
        pytest.param("trtllm", {"queue_policy": "priority"}, id="trt-no-evict"),
        pytest.param(
            "trtllm",
            {"capacity_policy": "MAX_UTILIZATION", "queue_policy": "fcfs"},
            id="trt-maxutil",
        ),
    ],
)
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_kv_bookkeeping_is_exact_under_random_load(
    kind: str, overrides: dict[str, object], seed: int
) -> None:
    rng = random.Random(seed)
    blocks = 40 if kind == "vllm" else 20
    engine = build_engine_model(
        kind, "test", {**overrides, "num_blocks": blocks, "max_model_len": 400}, seed=seed
    )
    assert isinstance(engine, BaseEngine)
    shared = [tk.CHUNK_BASE + rng.randrange(18000) for _ in range(96)]
    prompts: dict[str, tuple[list[int], int, int, bool]] = {}
    aborted: set[str] = set()
    produced: dict[str, list[int]] = {}
    t = 0.0
    for step in range(3000):
        if step < 150 and rng.random() < 0.3:
            for _ in range(rng.randint(1, 3)):
                rid = f"s{seed}-{len(prompts)}"
                own = [tk.CHUNK_BASE + rng.randrange(18000) for _ in range(rng.randint(1, 120))]
                p = (shared[: rng.choice((0, 32, 96))] + own)[:300]
                max_tokens, ignore_eos = rng.randint(1, 90), rng.random() < 0.5
                prompts[rid] = (p, max_tokens, step, ignore_eos)
                pri = rng.choice((0.2, 0.5, 0.9)) if kind == "trtllm" else rng.randint(-3, 3)
                engine.add_request(
                    request(
                        rid,
                        p,
                        max_tokens,
                        arrival=t,
                        priority=pri,
                        ignore_eos=ignore_eos,
                        seed=step,
                    )
                )
        if engine.requests and rng.random() < 0.03:
            victim = rng.choice(sorted(engine.requests))
            assert engine.abort(victim)
            aborted.add(victim)
        if not engine.has_work() and step >= 150:
            break
        result = engine.step(t)
        t += result.duration
        for event in result.events:
            produced.setdefault(event.request_id, []).extend(event.token_ids)
        _check(engine)
        if overrides.get("capacity_policy") != "MAX_UTILIZATION" and kind == "trtllm":
            assert engine.stats().paused == 0 and engine.stats().preemptions == 0
    assert not engine.has_work()
    stats = engine.stats()
    assert stats.blocks_used == 0
    assert stats.prefix_hit_tokens > 0  # the shared prefixes were exercised
    if kind == "vllm" or overrides.get("capacity_policy") == "MAX_UTILIZATION":
        assert stats.preemptions > 0  # the pool was small enough to force evictions
    finished = [rid for rid in prompts if rid not in aborted]
    assert len(finished) > 20
    for rid in finished:
        p, max_tokens, req_seed, ignore_eos = prompts[rid]
        want, _ = textgen.generate(
            p,
            seed=req_seed,
            max_tokens=min(max_tokens, 400 - len(p)),
            ignore_eos=ignore_eos,
            eos_hazard=engine.eos_hazard,
        )
        assert produced.get(rid) == want, rid
