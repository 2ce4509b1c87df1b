"""The round-robin picker (``scheduling.picker: round-robin``) and its wiring.

We test these aspects:
* a fixed candidate set is cycled in endpoint-id order, whatever the scores;
* the candidate set changing between picks (ejected, returning, added, removed,
  replaced, disjoint per-model sets, empty, single) never crashes and stays fair;
* over random set changes, within every stretch of a fixed set the pick counts
  of its members differ by at most one;
* the ranking (retry order) is the turn order; the cursor is bounded and per instance;
* the pipeline reports ``picker:round-robin``; ``max-score`` stays the default;
* the config field, its one-line error, and the router app: requests rotate over
  the backends and a failing backend's turn is retried on the next in line.
"""

from __future__ import annotations

import random
import typing
from collections import Counter
from collections.abc import Sequence

import httpx
import pytest
from routerkit import router_config, serve

from fleetgate.router.app import build_router
from fleetgate.router.config import ConfigError, Scheduling, parse_config
from fleetgate.router.scheduling.pipeline import default_pipeline, make_picker
from fleetgate.router.scheduling.plugins.base import PickerName
from fleetgate.router.scheduling.plugins.max_score import MaxScorePicker
from fleetgate.router.scheduling.plugins.round_robin import RoundRobinPicker
from fleetgate.router.scheduling.types import (
    EndpointId,
    EndpointView,
    LoadEstimate,
    RequestView,
    ScoredEndpoint,
)


def scored(ids: str | Sequence[str], totals: Sequence[float] | None = None) -> list[ScoredEndpoint]:
    names = list(ids)
    values = list(totals) if totals is not None else [0.0] * len(names)
    return [ScoredEndpoint(EndpointId(n), t, ()) for n, t in zip(names, values, strict=True)]


def picks(picker: RoundRobinPicker, sets: Sequence[str | Sequence[str]]) -> list[str]:
    out: list[str] = []
    for s in sets:
        ordered, _ = picker.order(scored(s), random.Random(0))
        out.append(ordered[0].id)
    return out


# ------------------------------------------------------------------- picker


def test_fixed_set_cycles_in_id_order_ignoring_scores_and_input_order() -> None:
    p = RoundRobinPicker()
    got = []
    for i in range(7):
        # input order and totals change every call: neither matters
        ids = ["c", "a", "b"] if i % 2 else ["b", "c", "a"]
        totals = [float(i), 10.0 - i, 0.5]
        ordered, decided = p.order(scored(ids, totals), random.Random(i))
        assert decided is True
        got.append(ordered[0].id)
    assert got == ["a", "b", "c", "a", "b", "c", "a"]


@pytest.mark.parametrize(
    ("sets", "expected"),
    [
        pytest.param(
            ["abc", "abc", "ac", "ac", "abc", "abc"],
            ["a", "b", "c", "a", "b", "c"],
            id="next-in-line-ejected-then-back",
        ),
        pytest.param(
            ["abc", "bc", "bc", "abc", "abc"],
            ["a", "b", "c", "a", "b"],
            id="just-picked-removed",
        ),
        pytest.param(
            ["abc", "ac", "ac", "ac", "ac", "abc", "abc", "abc", "abc"],
            ["a", "c", "a", "c", "a", "b", "c", "a", "b"],
            id="returning-endpoint-gets-one-turn-not-a-burst",
        ),
        pytest.param(
            ["ac", "ac", "abc", "abc", "abc", "abc"],
            ["a", "c", "b", "a", "c", "b"],
            id="added-endpoint-next-then-queues",
        ),
        pytest.param(
            ["ab", "ab", "xy", "xy", "xy", "ab"],
            ["a", "b", "x", "y", "x", "a"],
            id="whole-set-replaced-and-back",
        ),
        pytest.param(["a", "a", "ab", "ab"], ["a", "a", "b", "a"], id="single-then-two"),
        pytest.param(
            [["a1", "a2"], ["b1", "b2"]] * 4,
            ["a1", "b1", "a2", "b2", "a1", "b1", "a2", "b2"],
            id="disjoint-per-model-sets-each-rotate",
        ),
        pytest.param(
            ["abcd", "bd", "abcd", "bd", "abcd", "abcd"],
            ["a", "b", "c", "d", "a", "b"],
            id="admission-subset-interleaved",
        ),
    ],
)
def test_endpoint_set_changes(sets: list[str | list[str]], expected: list[str]) -> None:
    assert picks(RoundRobinPicker(), sets) == expected


def test_empty_candidates_do_not_move_the_cursor() -> None:
    p = RoundRobinPicker()
    assert picks(p, ["ab"]) == ["a"]
    assert p.order([], random.Random(0)) == ([], False)
    assert picks(p, ["ab"]) == ["b"]


def test_single_candidate_is_not_a_picker_decision() -> None:
    ordered, decided = RoundRobinPicker().order(scored("z"), random.Random(0))
    assert [s.id for s in ordered] == ["z"] and decided is False


def test_ranking_is_the_turn_order() -> None:
    p = RoundRobinPicker()
    picks(p, ["abcd", "abcd"])  # a, b picked
    ordered, _ = p.order(scored("dcba"), random.Random(0))
    # c and d never picked (id order), then a before b (a picked longer ago)
    assert [s.id for s in ordered] == ["c", "d", "a", "b"]
    assert p.last_picked() == {"a": 1, "b": 2, "c": 3}


def test_random_set_changes_keep_every_stretch_fair() -> None:
    """Within any run of picks over one unchanged set, member counts differ by <= 1."""
    rng = random.Random(20261129)
    universe = [f"e{i}" for i in range(6)]
    p = RoundRobinPicker()
    stretches = 0
    for _ in range(120):
        members = sorted(rng.sample(universe, rng.randint(1, len(universe))))
        length = rng.randint(1, 25)
        counts = Counter(picks(p, [members] * length))
        assert set(counts) <= set(members)
        got = [counts[m] for m in members]
        assert max(got) - min(got) <= 1, (members, counts)
        stretches += 1
    assert stretches == 120


def test_cursor_is_bounded_and_still_cycles() -> None:
    p = RoundRobinPicker(max_remembered=2)
    assert picks(p, ["abc"] * 6) == ["a", "b", "c", "a", "b", "c"]
    assert len(p.last_picked()) == 2
    with pytest.raises(ValueError, match="max_remembered"):
        RoundRobinPicker(max_remembered=0)


def test_cursor_is_per_instance() -> None:
    one, two = RoundRobinPicker(), RoundRobinPicker()
    assert picks(one, ["ab", "ab"]) == ["a", "b"]
    assert picks(two, ["ab"]) == ["a"]
    assert default_pipeline(picker="round-robin").picker is not (
        default_pipeline(picker="round-robin").picker
    )


def test_make_picker() -> None:
    assert isinstance(make_picker("max-score"), MaxScorePicker)
    assert isinstance(make_picker("round-robin"), RoundRobinPicker)
    with pytest.raises(ValueError, match="unknown picker 'rr'"):
        make_picker("rr")  # type: ignore[arg-type]


# ----------------------------------------------------------------- pipeline


def view(name: str, *, healthy: bool = True, match: int = 0, work: float = 0.0) -> EndpointView:
    return EndpointView(
        id=EndpointId(name),
        engine="vllm",
        models=frozenset({"m"}),
        healthy=healthy,
        ejected=False,
        load=LoadEstimate(work * 8, 8, work, 0.0, None, None, 16, 1.0, 0.0),
        prefix_match=match,
    )


def req() -> RequestView:
    return RequestView(model="m", chunks=4, prompt_tokens=128, max_tokens=16)


def test_pipeline_round_robin_decision() -> None:
    pipe = default_pipeline(picker="round-robin")
    # "b" holds the whole prefix and is idle: max-score would always pick it
    eps = [view("c", work=2.0), view("b", match=4), view("a", work=1.0)]
    got = []
    for _ in range(4):
        d = pipe.schedule(req(), eps, random.Random(0))
        assert d.decided_by == "picker:round-robin"
        assert len(d.scored) == 3 and len(d.ranking) == 3
        got.append((d.pick, d.reason, d.predicted_cached_chunks))
    assert got == [
        ("a", "spill", 0),
        ("b", "affinity-hit", 4),
        ("c", "spill", 0),
        ("a", "spill", 0),
    ]
    assert {default_pipeline().schedule(req(), eps, random.Random(s)).pick for s in range(5)} == {
        "b"
    }


def test_pipeline_filtered_endpoint_loses_its_turn_and_single_is_a_filter_call() -> None:
    pipe = default_pipeline(picker="round-robin")
    a, b, c = view("a"), view("b"), view("c")
    sick_b = view("b", healthy=False)
    seq = [[a, b, c], [a, sick_b, c], [a, sick_b, c], [a, b, c]]
    assert [pipe.schedule(req(), eps, random.Random(0)).pick for eps in seq] == ["a", "c", "a", "b"]
    d = pipe.schedule(req(), [a, sick_b], random.Random(0))
    assert d.pick == "a" and d.decided_by == "filter:healthy" and d.reason == "single"


def test_default_pipeline_keeps_max_score() -> None:
    pipe = default_pipeline()
    assert isinstance(pipe.picker, MaxScorePicker) and pipe.picker.decided_by == "picker:tie-break"
    short = RequestView(model="m", chunks=0, prompt_tokens=8, max_tokens=16)
    d = pipe.schedule(short, [view("a"), view("b")], random.Random(0))
    assert d.decided_by == "picker:tie-break" and d.reason == "fallback"


# ------------------------------------------------------------------- config


def test_config_picker_field() -> None:
    assert parse_config({}).scheduling.picker == "max-score"
    cfg = parse_config({"scheduling": {"picker": "round-robin"}})
    assert cfg.scheduling.picker == "round-robin"
    with pytest.raises(ConfigError, match=r"^scheduling\.picker: Input should be 'max-score'"):
        parse_config({"scheduling": {"picker": "round_robin"}})
    field = Scheduling.model_fields["picker"].annotation
    assert typing.get_args(field) == typing.get_args(PickerName)


# --------------------------------------------------------------- router app

A, B, C = "127.0.0.1:18201", "127.0.0.1:18202", "127.0.0.1:18203"
OK_BODY = {"id": "cmpl-1", "object": "text_completion", "model": "m",
           "choices": [{"index": 0, "text": "hi", "finish_reason": "length"}],
           "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}  # fmt: skip
LONG_PROMPT = "the same shared system prompt, long enough for several prefix chunks. " * 12


async def run_router(picker: str, failing: frozenset[str], n: int) -> tuple[list[str], str]:
    """``n`` sequential identical requests; the endpoints that answered and /metrics text."""
    calls: list[str] = []

    async def route(request: httpx.Request) -> httpx.Response:
        host = f"{request.url.host}:{request.url.port}"
        calls.append(host)
        if host in failing:
            raise httpx.ConnectError("connection refused", request=request)
        return httpx.Response(200, json=OK_BODY)

    cfg = router_config([("vllm", f"http://{h}") for h in (C, A, B)], scheduling={"picker": picker})
    app = build_router(cfg, transport=httpx.MockTransport(route), start_background=False)
    for e in app.state.router.fleet:
        e.healthy = True
        e.models = frozenset({"m"})
    answered = []
    async with serve(app) as url, httpx.AsyncClient(timeout=10) as c:
        for _ in range(n):
            body = {"model": "m", "prompt": LONG_PROMPT, "max_tokens": 1}
            resp = await c.post(url + "/v1/completions", json=body)
            assert resp.status_code == 200, resp.text
            answered.append(resp.headers["x-fleetgate-endpoint"])
        text = (await c.get(url + "/metrics")).text
    assert len(calls) >= n
    return answered, text


async def test_router_round_robin_rotates_over_backends() -> None:
    answered, text = await run_router("round-robin", frozenset(), 6)
    assert answered == [A, B, C, A, B, C]
    assert 'decided_by="picker:round-robin"' in text
    # the same prompt under max-score sticks to its affinity target
    sticky, _ = await run_router("max-score", frozenset(), 6)
    assert len(set(sticky)) == 1


async def test_router_round_robin_retries_the_next_in_line() -> None:
    # B refuses connections: its turns are retried on C (next in line) until B is ejected
    answered, text = await run_router("round-robin", frozenset({B}), 8)
    assert B not in answered
    counts = Counter(answered)
    assert set(counts) == {A, C}
    assert abs(counts[A] - counts[C]) <= 2
    assert (
        'fleetgate_endpoint_ejections_total{endpoint="127.0.0.1:18202",engine="vllm"} 1.0' in text
    )
