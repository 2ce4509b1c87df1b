"""Step-time profiles against the figures cited in ``timing.py``, and the factory's errors."""

from __future__ import annotations

import random

import pytest

from fleetgate.sim.core import tokenizer as tk
from fleetgate.sim.core.timing import PROFILES, build_engine_model, resolve_profile

from .drive import request, run


def _latencies(kind: str, profile: str, concurrency: int) -> tuple[float, float]:
    """Mean TTFT and mean inter-token gap for ``concurrency`` simultaneous 200/200 requests."""
    engine = build_engine_model(kind, profile, {"jitter": 0.0}, seed=0)
    for i in range(concurrency):
        p = [tk.CHUNK_BASE + (i * 7919 + j * 31) % 18000 for j in range(200)]
        engine.add_request(request(f"c{i}", p, 200))
    result = run(engine)
    times: dict[str, list[float]] = {}
    for t, e in result.events:
        times.setdefault(e.request_id, []).append(t)
    ttft = [ts[0] for ts in times.values()]
    gaps = [b - a for ts in times.values() for a, b in zip(ts, ts[1:], strict=False)]
    return sum(ttft) / len(ttft), sum(gaps) / len(gaps)


@pytest.mark.parametrize(
    ("profile", "ttft_1", "itl_1", "itl_100"),
    [
        # NVIDIA NIM benchmarking page, Llama-3.1-8b-instruct (NIM 1.8.0)
        pytest.param("trtllm-llama8b-h100", 10.26e-3, 4.63e-3, 7.57e-3, id="trt-8b"),
        # same page, Llama-3.1-70b-instruct (NIM 1.3.0)
        pytest.param("trtllm-llama70b-4xh100", 25.05e-3, 13.21e-3, 23.28e-3, id="trt-70b"),
    ],
)
def test_trtllm_profiles_match_the_cited_nim_figures(
    profile: str, ttft_1: float, itl_1: float, itl_100: float
) -> None:
    ttft, itl = _latencies("trtllm", profile, 1)
    assert ttft == pytest.approx(ttft_1, rel=0.15)
    assert itl == pytest.approx(itl_1, rel=0.15)
    _, itl_loaded = _latencies("trtllm", profile, 100)
    assert itl_loaded == pytest.approx(itl_100, rel=0.15)


@pytest.mark.parametrize("model", ["llama8b-h100", "llama70b-4xh100"])
def test_vllm_is_modelled_slower_than_tensorrt_llm_and_70b_slower_than_8b(model: str) -> None:
    v_ttft, v_itl = _latencies("vllm", f"vllm-{model}", 1)
    t_ttft, t_itl = _latencies("trtllm", f"trtllm-{model}", 1)
    assert t_ttft < v_ttft and t_itl < v_itl
    assert v_itl < 1.6 * t_itl  # same order of magnitude
    small, big = (
        _latencies("vllm", "vllm-llama8b-h100", 1),
        _latencies("vllm", "vllm-llama70b-4xh100", 1),
    )
    assert big[1] > 2 * small[1]


def test_jitter_is_bounded_and_seeded() -> None:
    profile = PROFILES["vllm-llama8b-h100"]
    draws = [profile.step_seconds(100, 10, 5000, random.Random(s)) for s in range(50)]
    nominal = profile.fixed_s + 100 * profile.prefill_token_s + 10 * profile.decode_seq_s
    nominal += 5000 * profile.kv_token_s
    assert all(abs(d / nominal - 1) <= profile.jitter + 1e-12 for d in draws)
    assert len(set(draws)) > 40
    assert profile.step_seconds(100, 10, 5000, random.Random(3)) == draws[3]


def test_overrides_are_coerced_from_strings_and_checked() -> None:
    resolved = resolve_profile(
        "test", {"num_blocks": "100", "prefix_caching": "false", "jitter": "0.1"}
    )
    assert (resolved.num_blocks, resolved.prefix_caching, resolved.jitter) == (100, False, 0.1)
    assert PROFILES["test"].num_blocks == 64  # the registry is never mutated


def test_engine_native_setting_names_are_accepted() -> None:
    vllm = resolve_profile(
        "test", {"num_gpu_blocks": 24, "max_num_seqs": "4", "scheduling_policy": "PRIORITY"}
    )
    assert (vllm.num_blocks, vllm.max_running, vllm.queue_policy) == (24, 4, "priority")
    trt = resolve_profile(
        "test",
        {
            "max_batch_size": 16,
            "tokens_per_block": 64,
            "capacity_scheduler_policy": "max_utilization",
        },
    )
    assert (trt.max_running, trt.block_size, trt.capacity_policy) == (16, 64, "MAX_UTILIZATION")
    with pytest.raises(ValueError, match="given twice"):
        resolve_profile("test", {"max_num_seqs": 4, "max_running": 5})


@pytest.mark.parametrize(
    ("args", "message"),
    [
        pytest.param(("sglang", "test", None), "unknown engine", id="engine"),
        pytest.param(("vllm", "nope", None), "unknown profile", id="profile"),
        pytest.param(("trtllm", "vllm-llama8b-h100", None), "is for vllm", id="mismatch"),
        pytest.param(("vllm", "test", {"colour": 1}), "unknown profile setting", id="setting"),
        pytest.param(("vllm", "test", {"num_blocks": "many"}), "expected int", id="type"),
        pytest.param(("vllm", "test", {"num_blocks": 2.5}), "expected int", id="fraction"),
        pytest.param(("vllm", "test", {"prefix_caching": "maybe"}), "expected bool", id="bool"),
        pytest.param(("vllm", "test", {"num_blocks": 8}), "exceeds the KV cache", id="kv-small"),
        pytest.param(
            ("vllm", "test", {"queue_policy": "lifo"}), "unknown queue policy", id="policy"
        ),
        pytest.param(
            ("trtllm", "test", {"capacity_policy": "STATIC"}), "unknown capacity", id="capacity"
        ),
        pytest.param(
            ("vllm", "test", {"chunked_prefill": False}), "without chunked prefill", id="chunk"
        ),
    ],
)
def test_factory_rejects_bad_settings_with_one_line_errors(
    args: tuple[str, str, dict[str, object] | None], message: str
) -> None:
    kind, profile, overrides = args
    with pytest.raises(ValueError, match=message) as err:
        build_engine_model(kind, profile, overrides)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_every_profile_builds_for_its_engines(name: str) -> None:
    kinds = [PROFILES[name].engine] if PROFILES[name].engine else ["vllm", "trtllm"]
    for kind in kinds:
        engine = build_engine_model(str(kind), name)
        stats = engine.stats()
        assert stats.blocks_total == PROFILES[name].num_blocks
        assert stats.block_size == (16 if kind == "vllm" else 32)
        assert engine.max_model_len == PROFILES[name].max_model_len


@pytest.mark.parametrize("kind", ["vllm", "trtllm"])
def test_lone_prefill_seconds_is_the_emulators_own_ttft_for_a_lone_prompt(kind: str) -> None:
    """The benchmark's TTFT floor prices a prompt alone on an idle engine with
    ``Profile.lone_prefill_seconds``: it must be what the engine model itself takes,
    for a cold prompt in several prefill chunks and for the same prompt again (a hit)."""
    overrides = {"jitter": 0.0, "max_step_tokens": 128}
    profile = resolve_profile("test", overrides)
    prompt = [tk.CHUNK_BASE + (j * 31) % 18000 for j in range(300)]

    engine = build_engine_model(kind, "test", overrides, seed=0)
    engine.add_request(request("cold", prompt, 1))
    cold = run(engine)
    assert cold.first_token_time("cold") == pytest.approx(profile.lone_prefill_seconds(300))

    engine.add_request(request("warm", prompt, 1))
    warm = run(engine, now=cold.duration)
    hit = engine.stats().prefix_hit_tokens
    assert 0 < hit < 300
    assert warm.first_token_time("warm") - cold.duration == pytest.approx(
        profile.lone_prefill_seconds(300 - hit, hit)
    )
    assert profile.lone_prefill_seconds(300 - hit, hit) < profile.lone_prefill_seconds(300) / 3
