"""Engine speed: the per-endpoint decode-speed estimate and the ``engine-speed`` scorer.

We test these aspects:
* the estimate (``scheduling.speed.DecodeSpeed``): baseline, minimum observations
  accumulated across scrapes, the time-based EWMA with its running-mean warm-up,
  counter reset and source change start over, missing counters change nothing;
  times come from the snapshots (the injected clock);
* real vLLM 0.32 expositions scraped in sequence give the recorded ms/token;
* ``Endpoint.scraped`` feeds it and ``Fleet.views`` exposes ``decode_s_per_token``;
* the scorer, table-driven: urgent / batch / standard, dead band, unknown speeds;
* the default pipeline on a 2-engine mixed fleet (urgent -> fast, batch -> slow,
  load and prefix affinity still outweigh speed), and identical rankings with and
  without the scorer on homogeneous fleets;
* router config ``scheduling.weights.speed``.
"""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
from recordings import VLLM_032

from fleetgate.engines import get_adapter
from fleetgate.engines.base import LoadSnapshot
from fleetgate.router.config import ConfigError, parse_config
from fleetgate.router.scheduling.load import LoadParams
from fleetgate.router.scheduling.pipeline import PipelineWeights, default_pipeline
from fleetgate.router.scheduling.plugins.engine_speed import (
    NEUTRAL_SPEED_SCORE,
    EngineSpeedScorer,
)
from fleetgate.router.scheduling.prefix import PrefixIndex
from fleetgate.router.scheduling.speed import DecodeSpeed, SpeedParams
from fleetgate.router.scheduling.types import (
    EndpointId,
    EndpointView,
    LoadEstimate,
    RequestView,
)
from fleetgate.router.state import Endpoint, Fleet

FIXTURES = VLLM_032


def snap(
    at: float, total: float | None, count: float | None, source: str = "metrics"
) -> LoadSnapshot:
    return LoadSnapshot(
        scraped_at=at, decode_seconds_sum=total, decode_observations=count, source=source
    )


def feed(speed: DecodeSpeed, *snaps: LoadSnapshot) -> DecodeSpeed:
    for s in snaps:
        speed = speed.update(s)
    return speed


# ------------------------------------------------------------------------ estimate


def test_first_scrape_is_only_a_baseline() -> None:
    speed = DecodeSpeed().update(snap(1.0, 5.0, 100.0))
    assert speed.seconds_per_token is None
    assert (speed.base_sum, speed.base_observations, speed.base_at) == (5.0, 100.0, 1.0)


def test_first_sample_is_taken_as_is() -> None:
    speed = feed(DecodeSpeed(), snap(1.0, 5.0, 100.0), snap(1.2, 5.2, 110.0))
    assert speed.seconds_per_token == pytest.approx(0.02)
    assert speed.samples == 1


def test_too_few_observations_accumulate_across_scrapes() -> None:
    params = SpeedParams(min_observations=8)
    speed = feed(DecodeSpeed(params), snap(0.0, 0.0, 0.0), snap(0.2, 0.03, 3.0))
    assert speed.seconds_per_token is None and speed.base_observations == 0.0  # kept
    speed = speed.update(snap(0.4, 0.08, 8.0))  # 8 tokens since the baseline, 10 ms each
    assert speed.seconds_per_token == pytest.approx(0.01)
    assert speed.base_observations == 8.0


def test_ewma_warm_up_is_a_running_mean_then_the_half_life_rules() -> None:
    params = SpeedParams(half_life_s=10.0, min_observations=1)
    speed = feed(DecodeSpeed(params), snap(0.0, 0.0, 0.0), snap(1.0, 0.10, 10.0))  # 10 ms
    speed = speed.update(snap(2.0, 0.40, 20.0))  # 30 ms; alpha = max(1 - 2^-0.1, 1/2) = 1/2
    assert speed.seconds_per_token == pytest.approx(0.02)
    speed = speed.update(snap(3.0, 0.60, 30.0))  # 20 ms; running mean of 10, 30, 20
    assert speed.seconds_per_token == pytest.approx(0.02)
    # Once many samples are in, a sample covering one half-life moves it halfway...
    settled = dataclasses.replace(speed, samples=1000)
    after = settled.update(snap(13.0, 0.60 + 0.04 * 10, 40.0))  # 40 ms over 10 s
    assert after.seconds_per_token == pytest.approx(0.03)
    # ...and one covering two half-lives three quarters of the way.
    after = settled.update(snap(23.0, 0.60 + 0.04 * 10, 40.0))
    assert after.seconds_per_token == pytest.approx(0.02 + 0.75 * 0.02)


def test_sample_weight_depends_on_covered_time_not_on_scrape_count() -> None:
    params = SpeedParams(half_life_s=10.0, min_observations=1)
    base = dataclasses.replace(
        DecodeSpeed(params),
        seconds_per_token=0.02,
        samples=1000,
        base_sum=0.0,
        base_observations=0.0,
        base_at=0.0,
        base_source="metrics",
    )
    once = base.update(snap(2.0, 0.8, 20.0))  # one 2 s delta at 40 ms
    twice = base.update(snap(1.0, 0.4, 10.0)).update(snap(2.0, 0.8, 20.0))  # two 1 s deltas
    assert once.seconds_per_token == pytest.approx(twice.seconds_per_token or math.nan)
    assert 0.02 < (once.seconds_per_token or 0) < 0.03


@pytest.mark.parametrize(
    "reset",
    [
        pytest.param(snap(3.0, 0.01, 2.0), id="count-and-sum-down"),
        pytest.param(snap(3.0, 0.5, 10.0), id="sum-down"),
        pytest.param(snap(3.0, 9.0, 30.0, source="iteration-stats"), id="other-source"),
    ],
)
def test_reset_or_source_change_starts_over(reset: LoadSnapshot) -> None:
    params = SpeedParams(min_observations=1)
    speed = feed(DecodeSpeed(params), snap(1.0, 0.0, 0.0), snap(2.0, 1.0, 50.0))
    assert speed.seconds_per_token == pytest.approx(0.02)
    speed = speed.update(reset)
    assert speed.seconds_per_token is None and speed.samples == 0
    assert (speed.base_sum, speed.base_observations) == (
        reset.decode_seconds_sum,
        reset.decode_observations,
    )
    assert reset.decode_seconds_sum is not None and reset.decode_observations is not None
    again = speed.update(
        snap(4.0, reset.decode_seconds_sum + 0.05, reset.decode_observations + 10, reset.source)
    )
    assert again.seconds_per_token == pytest.approx(0.005)  # measured from the new baseline


@pytest.mark.parametrize(
    "other",
    [
        pytest.param(snap(3.0, None, None), id="no-counters"),
        pytest.param(snap(3.0, 2.0, None), id="half-a-pair"),
        pytest.param(snap(2.0, 2.0, 100.0), id="no-time-passed"),
    ],
)
def test_scrapes_without_usable_counters_change_nothing(other: LoadSnapshot) -> None:
    speed = feed(DecodeSpeed(SpeedParams(min_observations=1)), snap(1.0, 0.0, 0.0))
    speed = speed.update(snap(2.0, 1.0, 50.0))
    assert speed.update(other) is speed


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"half_life_s": 0.0}, "half_life_s"), ({"min_observations": 0.5}, "min_observations")],
)
def test_bad_params_are_refused(kwargs: dict[str, float], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SpeedParams(**kwargs)


def test_real_vllm_scrapes_in_sequence() -> None:
    """b -> c1 -> c2 of the real recordings: 347 gaps at 1.84 ms, then 1892 at 1.75 ms."""
    adapter = get_adapter("vllm")
    source = adapter.metrics_sources[0]
    speed = DecodeSpeed()
    samples = []
    for t, name in enumerate(
        ("b_after_requests", "c1_during_load_first", "c2_during_load_peak_kv")
    ):
        body = (FIXTURES / f"metrics_{name}.prom.txt").read_bytes()
        speed = speed.update(adapter.parse_metrics(source, body, float(t), None))
        samples.append(speed.seconds_per_token)
    assert samples[0] is None
    assert samples[1] == pytest.approx((4.782409841000117 - 4.143026313000064) / 347)
    # Second sample: warm-up running mean of the two deltas.
    second = (8.094621310000093 - 4.782409841000117) / 1892
    assert samples[2] == pytest.approx((samples[1] + second) / 2)
    assert 0.0017 < (samples[2] or 0) < 0.0019


# ----------------------------------------------------------------- state and views


def make_fleet() -> tuple[Fleet, Endpoint]:
    adapter = get_adapter("vllm")
    endpoint = Endpoint(
        id=EndpointId("e1"),
        pool="default",
        engine="vllm",
        url="http://127.0.0.1:1",
        adapter=adapter,
        metrics_source=adapter.metrics_sources[0],
    )
    return Fleet([endpoint], index=PrefixIndex(16), load_params=LoadParams()), endpoint


def test_scrapes_feed_the_endpoint_and_views_expose_the_speed() -> None:
    fleet, endpoint = make_fleet()
    endpoint.scraped(snap(1.0, 0.0, 0.0))
    assert fleet.views((), [], 1.0)[0].decode_s_per_token is None
    endpoint.scraped(snap(1.2, 0.5, 20.0))
    assert fleet.views((), [], 1.2)[0].decode_s_per_token == pytest.approx(0.025)
    endpoint.scrape_failed()
    assert fleet.views((), [], 2.0)[0].decode_s_per_token == pytest.approx(0.025)
    endpoint.scraped(snap(3.0, 0.1, 4.0))  # the engine restarted
    assert fleet.views((), [], 3.0)[0].decode_s_per_token is None


# ------------------------------------------------------------------------- scorer


def estimate(work: float = 0.0) -> LoadEstimate:
    return LoadEstimate(
        requests=work * 8,
        capacity=8,
        work=work,
        kv_fraction=0.0,
        free_kv_tokens=None,
        total_kv_tokens=None,
        block_size=16,
        confidence=1.0,
        age=0.0,
    )


def view(
    name: str,
    speed: float | None,
    *,
    work: float = 0.0,
    match: int = 0,
    rank: int = 0,
    engine: str = "vllm",
) -> EndpointView:
    return EndpointView(
        id=EndpointId(name),
        engine=engine,
        models=frozenset({"m"}),
        healthy=True,
        ejected=False,
        load=estimate(work),
        prefix_match=match,
        rendezvous_rank=rank,
        decode_s_per_token=speed,
    )


def request(priority: int, chunks: int = 0) -> RequestView:
    return RequestView(
        model="m", chunks=chunks, prompt_tokens=100, max_tokens=50, priority=priority
    )


N = NEUTRAL_SPEED_SCORE


@pytest.mark.parametrize(
    ("priority", "speeds", "expected"),
    [
        pytest.param(0, {"a": 0.01, "b": 0.02}, {"a": N, "b": N}, id="standard-neutral"),
        pytest.param(5, {"a": 0.01, "b": 0.02}, {"a": 1.0, "b": 0.575}, id="urgent-fast"),
        pytest.param(-3, {"a": 0.01, "b": 0.02}, {"a": 0.0, "b": 0.425}, id="batch-slow"),
        pytest.param(5, {"a": 0.01, "b": 0.04}, {"a": 1.0, "b": 0.2875}, id="urgent-4x"),
        pytest.param(5, {"a": 0.010, "b": 0.0114}, {"a": N, "b": N}, id="in-band-urgent"),
        pytest.param(-5, {"a": 0.010, "b": 0.0114}, {"a": N, "b": N}, id="in-band-batch"),
        pytest.param(
            5, {"a": 0.010, "b": 0.012}, {"a": 1.0, "b": 1.15 / 1.2}, id="just-out-of-band"
        ),
        pytest.param(
            5,
            {"a": 0.010, "b": 0.011, "c": 0.03},
            {"a": 1.0, "b": 1.0, "c": 1.15 / 3},
            id="band-is-relative-to-fastest",
        ),
        pytest.param(
            5,
            {"a": 0.01, "b": 0.02, "c": None},
            {"a": 1.0, "b": 0.575, "c": (1.0 + 0.575) / 2},
            id="unknown-gets-mean-urgent",
        ),
        pytest.param(
            -1,
            {"a": 0.01, "b": 0.02, "c": None},
            {"a": 0.0, "b": 0.425, "c": 0.425 / 2},
            id="unknown-gets-mean-batch",
        ),
        pytest.param(5, {"a": None, "b": None}, {"a": N, "b": N}, id="all-unknown"),
        pytest.param(5, {"a": 0.01, "b": None}, {"a": N, "b": N}, id="one-known"),
        pytest.param(
            5,
            {"a": 0.01, "b": 0.0, "c": math.nan, "d": math.inf, "e": -1.0},
            {"a": N, "b": N, "c": N, "d": N, "e": N},
            id="invalid-speeds-are-unknown",
        ),
    ],
)
def test_scorer_table(
    priority: int, speeds: dict[str, float | None], expected: dict[str, float]
) -> None:
    views = [view(n, s) for n, s in speeds.items()]
    got = EngineSpeedScorer().score(request(priority), views)
    assert got == pytest.approx({EndpointId(k): v for k, v in expected.items()})


def test_scorer_dead_band_is_a_parameter_and_must_not_be_negative() -> None:
    views = [view("a", 0.010), view("b", 0.0114)]
    got = EngineSpeedScorer(dead_band=0.0).score(request(1), views)
    assert got[EndpointId("b")] == pytest.approx(0.010 / 0.0114)
    with pytest.raises(ValueError, match="dead_band"):
        EngineSpeedScorer(dead_band=-0.1)


# ----------------------------------------------------------------------- pipeline


def mixed(vllm_work: float = 0.0, trt_work: float = 0.0, vllm_match: int = 0) -> list[EndpointView]:
    """A slow vLLM (30 ms/token) and a fast TensorRT-LLM (10 ms/token) engine."""
    return [
        view("vllm-0", 0.030, work=vllm_work, match=vllm_match, rank=0, engine="vllm"),
        view("trt-0", 0.010, work=trt_work, rank=1, engine="trtllm"),
    ]


def test_pipeline_mixed_fleet_urgent_to_fast_batch_to_slow() -> None:
    pipe = default_pipeline()
    urgent = pipe.schedule(request(5), mixed(), random.Random(0))
    assert urgent.pick == "trt-0" and urgent.decided_by == "scorer:engine-speed"
    batch = pipe.schedule(request(-5), mixed(), random.Random(0))
    assert batch.pick == "vllm-0" and batch.decided_by == "scorer:engine-speed"
    scores = dict(dict((s.id, s.scores) for s in urgent.scored)[EndpointId("vllm-0")])
    assert scores["engine-speed"] == pytest.approx(1.15 / 3)


def test_pipeline_standard_priority_is_untouched_by_speed() -> None:
    pipe = default_pipeline()
    decision = pipe.schedule(request(0), mixed(), random.Random(0))
    assert decision.decided_by == "picker:tie-break"  # equal totals: speed does not decide
    totals = {s.total for s in decision.scored}
    assert len(totals) == 1


def test_pipeline_load_and_affinity_still_outweigh_speed() -> None:
    pipe = default_pipeline()
    busy_fast = pipe.schedule(request(5), mixed(trt_work=1.0), random.Random(0))
    assert busy_fast.pick == "vllm-0" and busy_fast.decided_by == "scorer:load"
    hit_slow = pipe.schedule(request(5, chunks=4), mixed(vllm_match=4), random.Random(0))
    assert hit_slow.pick == "vllm-0" and hit_slow.reason == "affinity-hit"


def test_pipeline_weight_zero_turns_speed_off() -> None:
    pipe = default_pipeline(PipelineWeights(speed=0.0))
    decision = pipe.schedule(request(5), mixed(), random.Random(0))
    assert decision.decided_by == "picker:tie-break"


def test_homogeneous_fleets_rank_exactly_as_without_the_scorer() -> None:
    """Speeds within the dead band, or unknown: same ranking and decider, any priority."""
    rng = random.Random(7)
    with_speed, without = default_pipeline(), default_pipeline(PipelineWeights(speed=0.0))
    for case in range(300):
        n = rng.randint(2, 5)
        views = [
            view(
                f"e{i}",
                rng.choice([None, 0.02 * rng.uniform(1.0, 1.149)]),
                work=rng.choice([0.0, 0.25, 0.5, 1.0, 2.0]),
                match=rng.choice([0, 0, 1, 3]),
                rank=i,
            )
            for i in range(n)
        ]
        req = request(rng.randint(-10, 10), chunks=rng.choice([0, 4]))
        a = with_speed.schedule(req, views, random.Random(case))
        b = without.schedule(req, views, random.Random(case))
        assert (a.ranking, a.reason, a.decided_by) == (b.ranking, b.reason, b.decided_by), case


# ------------------------------------------------------------------------- config


def test_config_speed_weight_default_and_validation() -> None:
    assert parse_config({}).scheduling.weights.speed == 1.0
    assert parse_config({"scheduling": {"weights": {"speed": 2.5}}}).scheduling.weights.speed == 2.5
    with pytest.raises(ConfigError, match=r"^scheduling\.weights\.speed"):
        parse_config({"scheduling": {"weights": {"speed": -1}}})
    with pytest.raises(ConfigError, match=r"^scheduling\.weights\.sped"):
        parse_config({"scheduling": {"weights": {"sped": 1}}})


def test_config_and_pipeline_defaults_agree() -> None:
    w = parse_config({}).scheduling.weights
    assert PipelineWeights() == PipelineWeights(w.prefix, w.load, w.kv, w.speed)


def test_config_weights_reach_the_routers_pipeline() -> None:
    """Every ``scheduling.weights`` field, speed included, is the weight the router uses."""
    from fleetgate.router.app import build_router
    from fleetgate.router.config import parse_config

    raw = {
        "test_mode": True,
        "pools": [{"name": "p", "backends": [{"engine": "vllm", "url": "http://127.0.0.1:1"}]}],
        "scheduling": {"weights": {"prefix": 0.5, "load": 0.25, "kv": 0.125, "speed": 0.0}},
    }
    app = build_router(parse_config(raw), start_background=False)
    got = {w.scorer.name: w.weight for w in app.state.router.pipeline.scorers}
    assert got == {"prefix-affinity": 0.5, "load": 0.25, "kv-headroom": 0.125, "engine-speed": 0.0}
