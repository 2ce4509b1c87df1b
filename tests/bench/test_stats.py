from __future__ import annotations

import pytest

from fleetgate_tools.bench.loadgen import require_loopback
from fleetgate_tools.bench.stats import (
    RequestResult,
    goodput,
    imbalance,
    percentile,
    summarise_class,
)


@pytest.mark.parametrize(
    ("values", "q", "expected"),
    [
        pytest.param([], 50, None, id="empty"),
        pytest.param([3.0], 99, 3.0, id="single"),
        pytest.param([1.0, 2.0, 3.0, 4.0], 50, 2.0, id="median-nearest-rank"),
        pytest.param(list(range(1, 101)), 99, 99, id="p99"),
        pytest.param(list(range(1, 101)), 100, 100, id="max"),
    ],
)
def test_percentile(values: list[float], q: float, expected: float | None) -> None:
    assert percentile(values, q) == expected


def _r(ttft: float | None, status: int = 200, tokens: int = 10) -> RequestResult:
    r = RequestResult("s", 0, "critical", 0.0, status=status, ttft=ttft, output_tokens=tokens)
    r.itl = [0.01, 0.02]
    return r


def test_attainment_counts_errors_as_misses() -> None:
    results = [_r(0.1), _r(0.2), _r(0.9), _r(None, status=503)]
    s = summarise_class("critical", results, ttft_objective_s=0.5)
    assert s.requests == 4 and s.errors == 1
    assert s.ttft_objective_attainment == pytest.approx(0.5)
    assert s.output_tokens == 30
    assert s.ttft_p50 == 0.2


def test_class_tokens_per_s_spans_first_send_to_last_finish() -> None:
    a = RequestResult("a", 0, "batch", 1.0, status=200, ttft=0.1, e2e=2.0, output_tokens=30)
    b = RequestResult("b", 0, "batch", 2.0, status=200, ttft=0.1, e2e=3.0, output_tokens=50)
    failed = RequestResult("c", 0, "batch", 0.0, status=503, e2e=9.0, output_tokens=99)
    s = summarise_class("batch", [a, b, failed], ttft_objective_s=10.0)
    # the failed request neither adds tokens nor stretches the span: 80 tokens in 1..5 s
    assert s.tokens_per_s == pytest.approx(80 / 4.0)
    # the same work finishing later is less goodput
    late = RequestResult("b", 0, "batch", 2.0, status=200, ttft=0.1, e2e=7.0, output_tokens=50)
    assert summarise_class("batch", [a, late], 10.0).tokens_per_s == pytest.approx(80 / 8.0)
    assert summarise_class("batch", [failed], 10.0).tokens_per_s is None


def test_goodput_and_imbalance() -> None:
    assert goodput([_r(0.1), _r(1.0), _r(None, 500)], 0.5, 10.0) == pytest.approx(0.1)
    assert imbalance([10, 10, 10, 10]) == 1.0
    assert imbalance([40, 0, 0, 0]) == 4.0
    assert imbalance([]) is None


@pytest.mark.parametrize("url", ["http://10.0.0.1:8000", "http://example.com", "http://0.0.0.0:1"])
def test_loadgen_refuses_non_loopback(url: str) -> None:
    with pytest.raises(ValueError, match="loopback"):
        require_loopback(url)


def test_loadgen_accepts_loopback() -> None:
    require_loopback("http://127.0.0.1:8000")
    require_loopback("http://127.3.2.1:8000")
    require_loopback("http://localhost:8000")
