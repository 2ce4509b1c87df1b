"""The emulated attention-DP replica (pure): how the engine picks a rank, ranks stepping
together, the replica's stats (fleetgate.sim.core.adp)."""

from __future__ import annotations

from typing import Any

import pytest

from fleetgate.sim.core.adp import AttentionDpModel
from fleetgate.sim.core.api import SimRequest
from fleetgate.sim.core.timing import build_engine_model

BS = 32


def model(cache_aware: bool, ranks: int = 2, **overrides: Any) -> AttentionDpModel:
    m = build_engine_model(
        "trtllm",
        "test",
        {"attention_dp_ranks": ranks, "adp_cache_routing": cache_aware, **overrides},
    )
    assert isinstance(m, AttentionDpModel)
    return m


def req(rid: str, tokens: list[int], max_tokens: int = 2) -> SimRequest:
    return SimRequest(rid, tokens, max_tokens, 0.0, ignore_eos=True)


def run(m: AttentionDpModel) -> None:
    now = 0.0
    while m.has_work():
        now += m.step(now).duration


DOC = [100 + i for i in range(8 * BS)]


def other(seed: int, n: int) -> list[int]:
    return [5000 + seed * 997 + i for i in range(n)]


def test_by_load_the_rank_with_the_fewest_active_prompt_tokens_takes_a_request() -> None:
    m = model(cache_aware=False, ranks=3)
    m.add_request(req("a", other(1, 300)))  # all idle: rank 0
    m.add_request(req("b", other(2, 100)))  # rank 1
    m.add_request(req("c", other(3, 200)))  # rank 2
    m.add_request(req("d", other(4, 50)))  # fewest tokens: rank 1 (100)
    assert m.placements == [1, 2, 1]
    assert m.abort("b") and not m.abort("b")
    m.add_request(req("e", other(5, 10)))  # rank 1 now holds 50
    assert m.placements == [1, 3, 1]
    run(m)
    m.add_request(req("f", other(6, 10)))  # all idle again: rank 0
    assert m.placements == [2, 3, 1]


@pytest.mark.parametrize(("cache_aware", "rank"), [(True, 0), (False, 1)])
def test_a_cached_prefix_draws_its_request_only_when_routing_is_cache_aware(
    cache_aware: bool, rank: int
) -> None:
    m = model(cache_aware)
    m.add_request(req("doc", DOC + [1]))
    run(m)  # rank 0 now caches the document's 8 blocks
    m.add_request(req("busy", other(1, 2 * BS), max_tokens=50))  # rank 0 (a tie), now busier
    m.add_request(req("q", DOC + [2, 3]))
    assert m.ranks[rank].requests.get("q") is not None
    run(m)
    hit = m.ranks[0].pool.hit_tokens
    assert (hit >= 8 * BS) == cache_aware, "the prefix was reused only on its own rank"


def test_ranks_step_together_and_report_as_tensorrt_llm_does() -> None:
    m = model(cache_aware=False, max_num_seqs=4, num_gpu_blocks=64)
    one = build_engine_model("trtllm", "test", {"max_num_seqs": 4, "num_gpu_blocks": 64})
    s = m.stats()
    # the limit and the blocks are rank 0's, as TensorRT-LLM's iteration stats give them
    assert (s.blocks_total, s.max_running) == (64, 4)
    m.add_request(req("long", other(1, 12 * BS)))
    m.add_request(req("short", other(2, 8)))
    assert m.placements == [1, 1]
    result = m.step(0.0)
    durations = [r.counters.last_step_duration for r in m.ranks]
    assert result.duration == max(durations), "an iteration lasts as long as the slowest rank"
    s = m.stats()
    # one runs on each rank: rank 0's active count and KV use are what the engine reports
    rank0 = m.ranks[0].stats()
    assert s.running == rank0.running == 1 and s.iterations == 1
    assert s.blocks_used == rank0.blocks_used < sum(r.stats().blocks_used for r in m.ranks)
    assert s.kv_usage == pytest.approx(rank0.blocks_used / 64)
    m.add_request(req("queued", other(3, 8)))  # waits for the next iteration on its rank
    assert m.stats().waiting == sum(r.stats().waiting for r in m.ranks) == 1
    assert one.stats().blocks_total == 64


def test_attention_dp_is_a_tensorrt_llm_setting() -> None:
    with pytest.raises(ValueError, match="for trtllm only"):
        build_engine_model("vllm", "test", {"attention_dp_ranks": 2})
    assert not isinstance(build_engine_model("trtllm", "test", {}), AttentionDpModel)
