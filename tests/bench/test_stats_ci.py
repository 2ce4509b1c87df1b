"""Bootstrap confidence intervals (stats.py) on known distributions, fixed RNG."""

from __future__ import annotations

import random

import pytest

from fleetgate_tools.bench.stats import (
    Interval,
    RequestResult,
    difference,
    paired_bootstrap,
    percentile_stat,
    ratio,
    ratio_of_sums,
    steady,
    verdict,
)


def _exp_clusters(rng: random.Random, n: int, mean: float) -> dict[str, list[tuple[float, ...]]]:
    return {f"s{i}": [(rng.expovariate(1 / mean),)] for i in range(n)}


def test_ratio_of_p90_of_two_exponentials_is_found_and_called_a_win() -> None:
    data = random.Random(1)
    a = _exp_clusters(data, 2000, 1.0)
    b = _exp_clusters(data, 2000, 2.0)
    ci = paired_bootstrap([(a, b)], percentile_stat(90), ratio, random.Random(2), replicates=400)
    assert ci is not None
    # p90 of Exp(mean m) is m ln 10: the true ratio is 0.5
    assert ci.low < 0.5 < ci.high
    assert 0.4 < ci.low and ci.high < 0.6
    assert ci.estimate == pytest.approx(0.5, abs=0.06)
    assert verdict(ci, 1.0, lower_is_better=True) == "win"
    assert verdict(ci, 1.0, lower_is_better=False) == "loss"


def test_same_distribution_is_no_clear_difference() -> None:
    data = random.Random(3)
    a = _exp_clusters(data, 500, 1.0)
    b = _exp_clusters(data, 500, 1.0)
    ci = paired_bootstrap([(a, b)], percentile_stat(90), ratio, random.Random(4), replicates=400)
    assert ci is not None and ci.low < 1.0 < ci.high
    assert verdict(ci, 1.0, lower_is_better=True) == "no clear difference"


def test_coverage_of_the_95_percent_interval_is_near_95() -> None:
    """Many experiments with a known truth: the interval holds it about 95% of the time."""
    data, boot = random.Random(5), random.Random(6)
    hits = 0
    trials = 80
    for _ in range(trials):
        # hit rate: Bernoulli(0.6) tokens of 10-token prompts vs Bernoulli(0.4)
        a = {
            f"s{i}": [(float(sum(data.random() < 0.6 for _ in range(10))), 10.0)]
            for i in range(150)
        }
        b = {
            f"s{i}": [(float(sum(data.random() < 0.4 for _ in range(10))), 10.0)]
            for i in range(150)
        }
        ci = paired_bootstrap([(a, b)], ratio_of_sums(0, 1), difference, boot, replicates=200)
        assert ci is not None
        hits += ci.low <= 0.2 <= ci.high
    assert 0.85 <= hits / trials <= 1.0


def test_clusters_are_resampled_whole() -> None:
    """Ten sessions of 100 identical requests: the interval is as wide as 10 draws
    make it, not as narrow as 1000 independent requests would."""
    data = random.Random(7)
    a: dict[str, list[tuple[float, ...]]] = {}
    for i in range(10):
        v = data.expovariate(1.0)
        a[f"s{i}"] = [(v,)] * 100
    b = {k: [(1.0,)] for k in a}
    ci = paired_bootstrap([(a, b)], percentile_stat(50), ratio, random.Random(8), replicates=400)
    assert ci is not None
    values = sorted(v[0][0] for v in a.values())
    assert ci.high - ci.low > 0.3 * (values[-2] - values[1])


def test_across_seeds_the_figure_is_the_median_of_the_per_seed_figures() -> None:
    data = random.Random(9)
    runs = []
    for mean_a in (0.5, 0.6, 0.7):
        runs.append((_exp_clusters(data, 800, mean_a), _exp_clusters(data, 800, 1.0)))
    ci = paired_bootstrap(runs, percentile_stat(90), ratio, random.Random(10), replicates=300)
    assert ci is not None
    one = [
        paired_bootstrap([r], percentile_stat(90), ratio, random.Random(11), replicates=10)
        for r in runs
    ]
    per_seed = sorted(c.estimate for c in one if c is not None)
    assert ci.estimate == per_seed[1]
    assert ci.low < 0.6 < ci.high and ci.high < 1.0


def test_undefined_figures_give_no_interval() -> None:
    a = {"s0": [(1.0, 0.0)]}
    b = {"s0": [(1.0, 0.0)]}
    assert paired_bootstrap([(a, b)], ratio_of_sums(0, 1), ratio, random.Random(0)) is None
    with pytest.raises(ValueError, match="no runs"):
        paired_bootstrap([], ratio_of_sums(0, 1), ratio, random.Random(0))


def test_same_rng_same_interval() -> None:
    data = random.Random(12)
    a, b = _exp_clusters(data, 100, 1.0), _exp_clusters(data, 100, 1.5)
    one = paired_bootstrap([(a, b)], percentile_stat(90), ratio, random.Random(13), replicates=50)
    two = paired_bootstrap([(a, b)], percentile_stat(90), ratio, random.Random(13), replicates=50)
    assert one == two


def test_verdict_needs_the_interval_to_exclude_the_neutral_value() -> None:
    assert verdict(Interval(0.8, 0.7, 0.95, 0.95, 100), 1.0, True) == "win"
    assert verdict(Interval(0.8, 0.7, 1.05, 0.95, 100), 1.0, True) == "no clear difference"
    assert verdict(Interval(0.04, 0.01, 0.07, 0.95, 100), 0.0, False) == "win"
    assert verdict(Interval(-0.04, -0.07, -0.01, 0.95, 100), 0.0, False) == "loss"
    assert verdict(None, 1.0, True) == "n/a"


def test_ratio_and_difference_handle_missing_values() -> None:
    assert ratio(1.0, 0.0) is None and ratio(None, 1.0) is None and ratio(1.0, 4.0) == 0.25
    assert difference(None, 1.0) is None and difference(0.5, 0.25) == 0.25


def test_steady_drops_requests_sent_during_warm_up() -> None:
    rs = [RequestResult("s", 0, "standard", t) for t in (0.0, 0.9, 1.0, 5.0)]
    assert [r.sent_at for r in steady(rs, 1.0)] == [1.0, 5.0]
    assert len(steady(rs, 0.0)) == 4


def test_too_few_clusters_give_no_interval() -> None:
    data = random.Random(14)
    a, b = _exp_clusters(data, 12, 1.0), _exp_clusters(data, 12, 3.0)
    stat = percentile_stat(99)
    assert paired_bootstrap([(a, b)], stat, ratio, random.Random(0), min_clusters=30) is None
    assert paired_bootstrap([(a, b)], stat, ratio, random.Random(0), replicates=20) is not None
