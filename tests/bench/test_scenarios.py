"""Scenarios: fleet files the emulator accepts, modelled vs wall time, mixed fleets."""

from __future__ import annotations

import pytest

from fleetgate.sim.core.timing import resolve_profile
from fleetgate.sim.fleet import FleetFile
from fleetgate_tools.bench import scenarios
from fleetgate_tools.bench.workloads import Session, Turn


@pytest.mark.parametrize("name", sorted(scenarios.LOADS))
def test_fleet_file_is_a_valid_emulator_fleet(name: str) -> None:
    sc = scenarios.make(name, engines=4, duration_s=40, time_scale=8, seed=1)
    doc = sc.fleet_file([18100, 18101, 18102, 18103])
    fleet = FleetFile.model_validate(doc)
    assert fleet.time_scale == 8
    assert [e.port for e in fleet.engines] == [18100, 18101, 18102, 18103]
    for e in fleet.engines:
        profile = resolve_profile(e.profile, e.overrides)
        assert profile.engine == e.kind
        # a long shared document must fit the context of every engine
        assert profile.max_model_len <= profile.num_blocks * (profile.block_size or 16)
    assert sc.sessions(), "a 5 modelled-second scenario has sessions"


def test_duration_is_wall_seconds_and_scenario_holds_modelled_time() -> None:
    sc = scenarios.make("shared-prefix", engines=2, duration_s=40, time_scale=8, seed=0)
    assert sc.duration_s == 5.0
    assert sc.rate == scenarios.LOADS["shared-prefix"].rate_per_engine * 2
    assert all(s.start_s < 5.0 for s in sc.sessions())


def test_mixed_fleets_alternate_engines_vllm_first() -> None:
    sc = scenarios.make("mixed-engine", engines=5, duration_s=10, time_scale=1, seed=0)
    assert sc.engine_kinds() == ["vllm", "trtllm", "vllm", "trtllm", "vllm"]
    plain = scenarios.make("shared-prefix", engines=3, duration_s=10, time_scale=1, seed=0)
    assert plain.engine_kinds() == ["vllm"] * 3
    forced = scenarios.make(
        "shared-prefix", engines=2, duration_s=10, time_scale=1, seed=0, mixed=True
    )
    assert forced.engine_kinds() == ["vllm", "trtllm"]


def test_wall_sessions_stretch_arrivals_and_think_times() -> None:
    s = Session("s", 1.5, None, (Turn("a", 4), Turn("b", 4, think_s=0.25)))
    (w,) = scenarios.wall_sessions([s], 4.0)
    assert w.start_s == 6.0
    assert [t.think_s for t in w.turns] == [0.0, 1.0]
    assert [t.content for t in w.turns] == ["a", "b"]


def test_objectives_per_class_fall_back_to_star() -> None:
    sc = scenarios.make("priority-storm", engines=2, duration_s=10, time_scale=1, seed=0)
    assert sc.objective("critical") == 0.5
    assert sc.objective("batch") == 10.0
    assert sc.objective("standard") == 2.0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"engines": 0}, "engines"),
        ({"duration_s": 0}, "> 0"),
        ({"time_scale": -1}, "> 0"),
    ],
)
def test_make_refuses_bad_settings(kwargs: dict[str, float], match: str) -> None:
    base: dict[str, float] = {"engines": 2, "duration_s": 10, "time_scale": 1, "seed": 0}
    base.update(kwargs)
    with pytest.raises(ValueError, match=match):
        scenarios.make("shared-prefix", **base)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown workload"):
        scenarios.make("nope", engines=2, duration_s=10, time_scale=1, seed=0)


def test_modelled_duration_is_kept_as_is() -> None:
    sc = scenarios.make("shared-prefix", engines=2, modelled_s=12, time_scale=8, seed=0)
    assert sc.duration_s == 12.0
    with pytest.raises(ValueError, match="exactly one"):
        scenarios.make("shared-prefix", engines=2, time_scale=8, seed=0)
    with pytest.raises(ValueError, match="exactly one"):
        scenarios.make("shared-prefix", engines=2, duration_s=8, modelled_s=1, time_scale=8, seed=0)


@pytest.mark.parametrize("engines", [2, 4, 16])
@pytest.mark.parametrize("mixed", [False, True])
def test_evictions_working_set_is_two_to_three_times_the_fleet_cache(
    engines: int, mixed: bool
) -> None:
    sc = scenarios.make(
        "evictions", engines=engines, modelled_s=60, time_scale=8, seed=3, mixed=mixed
    )
    # the fleet's cache, from the emulator's own profile with the scenario's overrides
    doc = sc.fleet_file(list(range(18000, 18000 + engines)))
    cache = 0
    for e in FleetFile.model_validate(doc).engines:
        p = resolve_profile(e.profile, e.overrides)
        cache += p.num_blocks * (p.block_size or (16 if e.kind == "vllm" else 32))
    assert sc.cache_tokens() == cache
    sessions = sc.sessions()
    docs = {
        s.session_id.split("-")[0]: s.turns[0].content.split("\n\nQuestion:")[0] for s in sessions
    }
    working_set = sum(len(d.split()) for d in docs.values())
    assert 2.0 * cache <= working_set <= 3.0 * cache
    # one document fits an engine, the working set does not fit the fleet
    smallest = min(
        resolve_profile(e.profile, e.overrides).max_model_len
        for e in FleetFile.model_validate(doc).engines
    )
    assert max(len(d.split()) for d in docs.values()) < smallest


def test_flash_crowd_bursts_hundreds_of_questions_on_one_document() -> None:
    sc = scenarios.make("flash-crowd", engines=4, modelled_s=20, time_scale=8, seed=1)
    sessions = sc.sessions()
    hot = [s for s in sessions if s.session_id.startswith("hot-")]
    assert len(hot) >= 200 and len(hot) >= sc.slots()
    docs = {s.turns[0].content.split("\n\nQuestion:")[0] for s in hot}
    assert len(docs) == 1 and len(next(iter(docs)).split()) == 6000
    starts = [s.start_s for s in hot]
    assert 6.0 <= min(starts) and max(starts) <= 6.5
    background = [s for s in sessions if not s.session_id.startswith("hot-")]
    assert background and any(s.start_s > 6.5 for s in background)


def test_choose_time_scale_keeps_measured_cpu_under_the_target() -> None:
    # 1.4 cores busy on a 2-core machine at scale 8 = 70%: scale 8 is just enough
    assert scenarios.choose_time_scale(8, cpu_seconds=14, wall_s=10, cores=2) == 8.0
    # a quarter of that: a quarter of the scale
    assert scenarios.choose_time_scale(8, cpu_seconds=3.5, wall_s=10, cores=2) == 2.0
    # over the target: a larger scale, rounded up to a half
    assert scenarios.choose_time_scale(8, cpu_seconds=16, wall_s=10, cores=2) == 9.5
    # never below 1 (faster than the modelled hardware)
    assert scenarios.choose_time_scale(8, cpu_seconds=0.1, wall_s=10, cores=2) == 1.0
    with pytest.raises(ValueError, match="positive"):
        scenarios.choose_time_scale(8, cpu_seconds=1, wall_s=0, cores=2)


def test_choose_time_scale_keeps_the_idle_share_out_of_the_1_over_scale_part() -> None:
    # 30% of the machine at scale 8, 10% of it idle (per wall second): the load's 20%
    # scales as 1/scale, so 70% allows 8 x 0.2 / 0.6 = 2.67 -> 3
    assert scenarios.choose_time_scale(8, 6.0, 10, 2, idle_share=0.1) == 3.0
    # without the idle part the same run would ask for 8 x 0.3 / 0.7 = 3.43 -> 3.5
    assert scenarios.choose_time_scale(8, 6.0, 10, 2) == 3.5
    with pytest.raises(ValueError, match="idle processes alone"):
        scenarios.choose_time_scale(8, 16.0, 10, 2, idle_share=0.75)


def test_fleet_file_turns_kv_events_on_for_every_engine() -> None:
    sc = scenarios.make("shared-prefix", engines=2, modelled_s=5, time_scale=4, seed=0, mixed=True)
    fleet = FleetFile.model_validate(sc.fleet_file([18100, 18101], kv_events=True))
    assert [e.kv_events for e in fleet.engines] == [True, True]
    plain = FleetFile.model_validate(sc.fleet_file([18100, 18101]))
    assert [e.kv_events for e in plain.engines] == [False, False]
