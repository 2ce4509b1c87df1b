"""Behaviour of the vLLM and TensorRT-LLM engine models (no HTTP, modelled time only)."""

from __future__ import annotations

import pytest

from fleetgate.sim.core import textgen
from fleetgate.sim.core import tokenizer as tk
from fleetgate.sim.core.api import EngineModel, SimRequest
from fleetgate.sim.core.engine_base import InvalidRequestError, PromptTooLongError
from fleetgate.sim.core.timing import build_engine_model

from .drive import request, run

MEAN = 256.0  # the test profile's mean output length (textgen's default)


def prompt(n: int, salt: int = 0) -> list[int]:
    """``n`` distinct-ish token ids (no accidental prefix sharing across salts)."""
    return [tk.CHUNK_BASE + (salt * 7919 + i * 31) % 18000 for i in range(n)]


def expected(p: list[int], max_tokens: int, seed: int = 0, ignore_eos: bool = True) -> list[int]:
    return textgen.generate(
        p, seed=seed, max_tokens=max_tokens, ignore_eos=ignore_eos, eos_hazard=1 / MEAN
    )[0]


PRESSURE = {"max_running": 8, "max_step_tokens": 512, "max_model_len": 512}


def _pressure_workload(engine: EngineModel) -> dict[str, list[int]]:
    prompts = {f"r{i}": prompt(40, salt=i) for i in range(8)}
    for i, (rid, p) in enumerate(prompts.items()):
        engine.add_request(request(rid, p, 120, arrival=i * 1e-3))
    return prompts


def test_vllm_preempts_under_kv_pressure_and_resumes_with_identical_tokens() -> None:
    # 8 requests x (40 + 120) tokens = 80 blocks of 16 > 39 usable blocks
    engine = build_engine_model("vllm", "test", {**PRESSURE, "num_blocks": 40})
    prompts = _pressure_workload(engine)
    result = run(engine)
    stats = engine.stats()
    assert stats.preemptions > 0
    assert max(s.running for s in result.samples) == 8  # admitted greedily, then evicted
    for rid, p in prompts.items():
        assert result.tokens(rid) == expected(p, 120), rid
        assert result.finish(rid) == "length"
    assert stats.kv_usage == 0.0 and stats.blocks_used == 0


def test_trtllm_guaranteed_no_evict_never_pauses_and_queues_instead() -> None:
    # each request reserves ceil(160 / 32) = 5 blocks: only 4 fit in 20
    engine = build_engine_model("trtllm", "test", {**PRESSURE, "num_blocks": 20})
    prompts = _pressure_workload(engine)
    result = run(engine)
    assert all(s.paused == 0 for s in result.samples)
    assert engine.stats().preemptions == 0
    assert max(s.running for s in result.samples) == 4
    assert max(s.waiting for s in result.samples) == 4
    for rid, p in prompts.items():
        assert result.tokens(rid) == expected(p, 120), rid


def test_trtllm_max_utilization_admits_greedily_and_pauses_the_newest() -> None:
    engine = build_engine_model(
        "trtllm", "test", {**PRESSURE, "num_blocks": 20, "capacity_policy": "MAX_UTILIZATION"}
    )
    prompts = _pressure_workload(engine)
    result = run(engine)
    assert max(s.running for s in result.samples) == 8
    assert max(s.paused for s in result.samples) > 0
    assert engine.stats().preemptions > 0  # cumulative pauses
    # the oldest request is never the one paused: it finishes first
    assert result.events[[e.request_id for _, e in result.events].index("r0")][1].first
    finish_order = [e.request_id for _, e in result.events if e.finish_reason]
    assert finish_order[0] == "r0"
    for rid, p in prompts.items():
        assert result.tokens(rid) == expected(p, 120), rid


@pytest.mark.parametrize("kind", ["vllm", "trtllm"])
def test_shared_prefix_hit_rate_is_the_shared_fraction_in_whole_blocks(kind: str) -> None:
    engine = build_engine_model(kind, "test", {"num_blocks": 200, "max_running": 16})
    shared = prompt(200, salt=1)  # 200 tokens: 12 blocks of 16 / 6 blocks of 32 = 192 tokens
    engine.add_request(request("warm", shared + prompt(56, salt=100), 4))
    run(engine)
    before = engine.stats()
    for i in range(10):
        engine.add_request(request(f"q{i}", shared + prompt(56, salt=200 + i), 4))
    result = run(engine)
    after = engine.stats()
    queries = after.prefix_query_tokens - before.prefix_query_tokens
    hits = after.prefix_hit_tokens - before.prefix_hit_tokens
    assert queries == 10 * 256
    assert hits == 10 * 192
    assert hits / queries == pytest.approx(0.75)  # 192 of 256 tokens, whole blocks only
    assert all(result.first_event(f"q{i}").cached_prompt_tokens == 192 for i in range(10))
    if kind == "trtllm":
        assert after.reused_blocks - before.reused_blocks == 10 * 6
        assert after.missed_blocks - before.missed_blocks == 10 * 2


def test_vllm_reproduces_the_fixture_prefix_pair() -> None:
    """Recording prefix_cache_summary.json: 377 shared tokens, 128-token
    blocks, two 388-token prompts: queries +388 each, hits +0 then +256."""
    engine = build_engine_model(
        "vllm",
        "test",
        {"num_blocks": 24, "block_size": 128, "max_running": 4, "max_model_len": 2048,
         "max_step_tokens": 2048},
    )  # fmt: skip
    shared = prompt(377, salt=3)
    engine.add_request(request("A", shared + prompt(11, salt=4), 8))
    run(engine)
    a = engine.stats()
    assert (a.prefix_query_tokens, a.prefix_hit_tokens, a.prompt_tokens) == (388, 0, 388)
    engine.add_request(request("B", shared + prompt(11, salt=5), 8))
    result = run(engine)
    b = engine.stats()
    assert (b.prefix_query_tokens, b.prefix_hit_tokens, b.prompt_tokens) == (776, 256, 776)
    assert result.first_event("B").cached_prompt_tokens == 256


def test_vllm_fixture_load_shape_running_4_waiting_6_then_preemptions() -> None:
    """load_timeseries: 10 x ~210-token prompts, max_tokens 600, 24 blocks of 128, 4 seqs."""
    engine = build_engine_model(
        "vllm",
        "test",
        {"num_blocks": 24, "block_size": 128, "max_running": 4, "max_model_len": 2048,
         "max_step_tokens": 2048},
    )  # fmt: skip
    for i in range(10):
        engine.add_request(request(f"l{i}", prompt(210, salt=i), 600, arrival=i * 1e-3))
    result = run(engine)
    assert (result.samples[0].running, result.samples[0].waiting) == (4, 6)
    assert engine.stats().preemptions >= 1
    assert all(len(result.tokens(f"l{i}")) == 600 for i in range(10))


def _throughput(max_running: int) -> tuple[float, int]:
    # every request needs (32 + 64) / 16 = 6 blocks: 96 usable blocks hold 16 at once
    engine = build_engine_model(
        "vllm",
        "test",
        {"num_blocks": 97, "max_running": max_running, "max_step_tokens": 4096,
         "max_model_len": 256},
    )  # fmt: skip
    for i in range(64):
        engine.add_request(request(f"t{i}", prompt(32, salt=i), 64))
    result = run(engine)
    stats = engine.stats()
    assert stats.generation_tokens == 64 * 64
    return stats.generation_tokens / result.duration, stats.preemptions


def test_throughput_rises_with_batch_size_until_kv_bound() -> None:
    tput = {b: _throughput(b) for b in (1, 2, 4, 8, 16, 32, 64)}
    rising = [tput[b][0] for b in (1, 2, 4, 8, 16)]
    assert rising == sorted(rising) and rising[-1] > 8 * rising[0]
    assert tput[16][1] == 0  # 16 x 6 blocks fit: no preemption
    # past the KV bound larger batches cannot help: they only preempt
    for b in (32, 64):
        assert tput[b][0] <= tput[16][0] * 1.1
        assert tput[b][1] > 0


def _start_order(kind: str, policy: str, priorities: dict[str, float]) -> list[str]:
    engine = build_engine_model(kind, "test", {"max_running": 1, "queue_policy": policy})
    engine.add_request(request("blocker", prompt(20), 5))
    engine.step(0.0)
    for i, (rid, pri) in enumerate(priorities.items()):
        engine.add_request(request(rid, prompt(20, salt=i + 1), 3, arrival=0.1 + i, priority=pri))
    return run(engine).start_order()


def test_vllm_priority_is_lower_first_then_arrival() -> None:
    order = _start_order("vllm", "priority", {"a": 5, "b": 0, "c": -5, "d": 0})
    assert order == ["c", "b", "d", "a"]
    assert _start_order("vllm", "fcfs", {"a": 5, "b": 0, "c": -5, "d": 0}) == ["a", "b", "c", "d"]


def test_trtllm_priority_is_higher_first_then_fcfs() -> None:
    order = _start_order("trtllm", "priority", {"a": 0.2, "b": 0.5, "c": 0.9, "d": 0.5})
    assert order == ["c", "b", "d", "a"]
    assert _start_order("trtllm", "fcfs", {"a": 0.2, "c": 0.9}) == ["a", "c"]


def test_vllm_priority_preemption_evicts_the_least_urgent_newest_request() -> None:
    engine = build_engine_model(
        "vllm", "test", {**PRESSURE, "num_blocks": 40, "queue_policy": "priority"}
    )
    for i in range(8):
        engine.add_request(request(f"r{i}", prompt(40, salt=i), 120, priority=-i))
    result = run(engine)
    assert engine.stats().preemptions > 0
    finish_order = [e.request_id for _, e in result.events if e.finish_reason]
    assert finish_order[0] == "r7"  # most urgent (lowest value) is never the victim


@pytest.mark.parametrize("kind", ["vllm", "trtllm"])
def test_abort_frees_blocks_and_leaves_them_reusable(kind: str) -> None:
    engine = build_engine_model(kind, "test")
    p = prompt(100, salt=9)
    engine.add_request(request("victim", p, 50))
    t = 0.0
    for _ in range(5):
        t += engine.step(t).duration
    busy = engine.stats()
    assert busy.running == 1 and busy.blocks_used > 0 and busy.kv_usage > 0
    assert engine.abort("victim") is True
    assert engine.abort("victim") is False and engine.abort("never-seen") is False
    idle = engine.stats()
    assert (idle.running, idle.blocks_used, idle.kv_usage) == (0, 0, 0.0)
    assert not engine.has_work()
    engine.add_request(request("again", p + [5], 2))
    result = run(engine, now=t)
    assert result.first_event("again").cached_prompt_tokens >= 96 - engine.block_size


def test_abort_of_waiting_and_paused_requests() -> None:
    engine = build_engine_model(
        "trtllm", "test", {**PRESSURE, "num_blocks": 20, "capacity_policy": "MAX_UTILIZATION"}
    )
    _pressure_workload(engine)
    engine.add_request(request("late", prompt(40, salt=99), 10))
    t = 0.0
    while engine.stats().paused == 0:
        t += engine.step(t).duration
    trt = engine.stats()
    assert trt.waiting == 1 and trt.paused >= 1
    assert engine.abort("late")
    paused_id = engine.paused[0].request_id  # type: ignore[attr-defined]
    assert engine.abort(paused_id)
    after = engine.stats()
    assert after.waiting == 0 and after.paused == trt.paused - 1
    result = run(engine, now=t)
    assert paused_id not in {e.request_id for _, e in result.events}


def _events(kind: str, profile: str, seed: int) -> list[tuple[float, object]]:
    engine = build_engine_model(kind, profile, {"num_blocks": 60, "max_model_len": 512}, seed)
    for i in range(12):
        engine.add_request(
            request(f"d{i}", prompt(30 + i, salt=i % 3), 40, ignore_eos=False, seed=i)
        )
    return [(t, e) for t, e in run(engine).events]


@pytest.mark.parametrize("kind", ["vllm", "trtllm"])
def test_same_seed_gives_identical_event_streams(kind: str) -> None:
    profile = f"{kind}-llama8b-h100"
    a, b = _events(kind, profile, 11), _events(kind, profile, 11)
    assert a == b
    c = _events(kind, profile, 12)
    assert [e for _, e in c] == [e for _, e in a]  # tokens depend on the request seed only
    assert [t for t, _ in c] != [t for t, _ in a]  # the engine seed drives the jitter


def test_validation_errors_at_add_request() -> None:
    engine = build_engine_model("vllm", "test")  # max_model_len 512
    with pytest.raises(PromptTooLongError, match="maximum context length is 512") as err:
        engine.add_request(request("long", prompt(600), 4))
    assert err.value.param == "input_tokens" and "at least 513" in str(err.value)
    with pytest.raises(PromptTooLongError):
        engine.add_request(request("exact", prompt(512), 4))
    with pytest.raises(InvalidRequestError, match="at least 1") as bad:
        engine.add_request(request("zero", prompt(5), 0))
    assert bad.value.param == "max_tokens"
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.add_request(request("empty", [], 5))
    engine.add_request(request("dup", prompt(5), 5))
    with pytest.raises(InvalidRequestError, match="duplicate"):
        engine.add_request(request("dup", prompt(5), 5))


def test_output_is_clamped_to_max_model_len() -> None:
    engine = build_engine_model("vllm", "test")
    engine.add_request(request("near", prompt(500), 100))
    result = run(engine)
    assert len(result.tokens("near")) == 12
    assert result.finish("near") == "length"


def test_eos_and_stop_ids_finish_with_stop() -> None:
    engine = build_engine_model("vllm", "test", {"mean_output_tokens": 32})
    p = prompt(20)
    want, reason = textgen.generate(p, seed=4, max_tokens=400, eos_hazard=1 / 32)
    assert reason == "stop" and len(want) < 400
    engine.add_request(request("eos", p, 400, ignore_eos=False, seed=4))
    full = expected(p, 50, seed=4)
    stop_id = full[20]
    engine.add_request(
        SimRequest(
            "stop-id", p, 50, arrival_time=0.0, ignore_eos=True, stop_token_ids=(stop_id,), seed=4
        )
    )
    result = run(engine)
    assert result.tokens("eos") == want and result.finish("eos") == "stop"
    assert result.tokens("stop-id") == full[: full.index(stop_id) + 1]
    assert result.finish("stop-id") == "stop"


def test_idle_step_and_stats_invariants() -> None:
    engine = build_engine_model("vllm", "test", {"num_blocks": 40, **PRESSURE})
    idle = engine.step(0.0)
    assert idle.duration == 0.0 and idle.events == ()
    _pressure_workload(engine)
    result = run(engine)
    for s in result.samples:
        assert s.blocks_free + s.blocks_used == s.blocks_total - 1
        assert s.kv_usage == pytest.approx(1 - s.blocks_free / (s.blocks_total - 1))
        assert s.running <= s.max_running == 8
    assert result.samples[-1].iterations == result.steps


@pytest.mark.parametrize(("first", "second"), [("vllm", "trtllm"), ("trtllm", "vllm")])
def test_router_style_resume_on_another_engine_continues_exactly(first: str, second: str) -> None:
    """A request cut off after k tokens and resent elsewhere as prompt + generated ids
    (same seed, max_tokens - k) yields exactly the rest of the uninterrupted output."""
    p = prompt(60, salt=42)
    whole = build_engine_model(first, "test", {"mean_output_tokens": 64})
    whole.add_request(request("whole", p, 150, ignore_eos=False, seed=9))
    reference = run(whole)
    full = reference.tokens("whole")
    k = len(full) // 2
    assert k > 0
    cut = build_engine_model(first, "test", {"mean_output_tokens": 64})
    cut.add_request(request("cut", p, 150, ignore_eos=False, seed=9))
    t = 0.0
    got: list[int] = []
    while len(got) < k:
        step = cut.step(t)
        t += step.duration
        got += [tok for e in step.events for tok in e.token_ids]
    assert cut.abort("cut") and got == full[:k]
    other = build_engine_model(second, "test", {"mean_output_tokens": 64})
    other.add_request(request("resumed", p + got, 150 - k, ignore_eos=False, seed=9))
    resumed = run(other)
    assert got + resumed.tokens("resumed") == full
    assert resumed.finish("resumed") == reference.finish("whole")


@pytest.mark.parametrize("kind", ["vllm", "trtllm"])
def test_first_event_reports_when_the_request_was_first_scheduled(kind: str) -> None:
    """``TokenEvent.scheduled_at``: the ``now`` of the step that first scheduled the
    request (queue end / prefill start), on its first event only."""
    engine = build_engine_model(kind, "test", {"max_running": 1})
    engine.add_request(request("a", prompt(40, salt=1), 5))
    engine.add_request(request("b", prompt(40, salt=2), 5, arrival=1e-3))
    t = 10.0
    starts: list[float] = []
    first: dict[str, tuple[float, float | None]] = {}
    later: list[float | None] = []
    while engine.has_work():
        assert len(starts) < 1000
        starts.append(t)
        result = engine.step(t)
        for e in result.events:
            if e.first:
                first[e.request_id] = (t, e.scheduled_at)
            else:
                later.append(e.scheduled_at)
        t += result.duration
    assert set(later) == {None}
    # one slot: "a" is scheduled in the very first step, "b" only after "a" finished
    assert first["a"][1] == starts[0] == 10.0
    b_step, b_sched = first["b"]
    assert b_sched is not None and b_sched in starts
    assert b_sched > first["a"][0], "b waited for a's whole run"
    assert b_sched <= b_step
