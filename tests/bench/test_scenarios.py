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
