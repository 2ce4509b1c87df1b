"""The pure autoscaling decision, with plain numbers and a clock we move by hand."""

from __future__ import annotations

import dataclasses

import pytest
from routerdemand import RouterDemand

from fleetgate.operator import autoscale
from fleetgate.operator.autoscale import (
    Demand,
    Policy,
    State,
    choose_victims,
    decide,
    demand_for,
    parse_router_metrics,
    plan_drain,
)

MODEL = "m"


def policy(**kw: object) -> Policy:
    base: dict[str, object] = {
        "min_replicas": 1,
        "max_replicas": 10,
        "cold_start": 30.0,
        "target_in_flight": 4.0,
        "up_window": 0.0,
        "down_window": 60.0,
    }
    base.update(kw)
    return Policy(**base)  # type: ignore[arg-type]


def run(p: Policy, steps: list[tuple[float, Demand]], current: int) -> list[tuple[int, str]]:
    """Feed demand samples at the given times; the replicas follow each decision."""
    state = State()
    out = []
    for now, d in steps:
        dec = decide(p, d, current, current, now, state)
        state, current = dec.state, dec.desired
        out.append((current, dec.reason))
    return out


# -- parsing the router's own exposition ---------------------------------------------


def test_router_metrics_parse_into_the_demand_of_one_service() -> None:
    a, b = RouterDemand(), RouterDemand()
    a.set_in_flight({"ns/p1": 3, "ns/p2": 1, "ns/other-model-pod": 7})
    b.set_in_flight({"ns/p1": 2})
    a.set_queue(MODEL, 4, "critical")
    b.set_queue(MODEL, 1)
    a.set_queue("other", 9)
    b.set_held(MODEL, 2)
    prev = {"a": parse_router_metrics(a.text()), "b": parse_router_metrics(b.text())}
    a.arrive(MODEL, 30)
    b.arrive(MODEL, 10, "critical")
    a.arrive("other", 1000)
    b.ttft(MODEL, "critical", met=18, missed=2)
    now = {"a": parse_router_metrics(a.text()), "b": parse_router_metrics(b.text())}
    d = demand_for(
        now, prev, 10.0, model=MODEL, endpoints=["ns/p1", "ns/p2"], ttft_class="critical"
    )
    assert d.in_flight == 6  # 3 + 1 + 2: the other model's pod is not ours
    assert d.queued == 4  # b's 1 queued is one of its 2 held (held requests sit in the queue)
    assert d.held == 2
    assert d.arrival_rate == pytest.approx(4.0)  # (30 + 10) / 10 s, summed over routers
    assert (d.ttft_met, d.ttft_total) == (18, 20)
    assert d.in_flight_by_endpoint == {"ns/p1": 5, "ns/p2": 1}


def test_held_requests_in_the_class_queue_are_counted_once() -> None:
    """A router with class queues queues its held requests too: 6 held of 8 queued are
    6 held and 2 queued (the run at 1f15897 counted them twice: 1 -> 3 replicas on 6
    held). A split by class takes each class's held ones from its own queue."""
    r = RouterDemand()
    r.set_queue(MODEL, 6, "standard")
    r.set_queue(MODEL, 2, "critical")
    r.set_held(MODEL, 5, "standard")
    r.set_held(MODEL, 1, "critical")
    snaps = {"r": parse_router_metrics(r.text())}
    d = demand_for(snaps, None, 0.0, model=MODEL, endpoints=[])
    assert (d.queued, d.held, d.load) == (2, 6, 8)
    std = demand_for(snaps, None, 0.0, model=MODEL, endpoints=[], classes=lambda c: c == "standard")
    assert (std.queued, std.held) == (1, 5)
    older = {"r": dataclasses.replace(snaps["r"], held_by_class={})}  # no class on held
    std = demand_for(older, None, 0.0, model=MODEL, endpoints=[], classes=lambda c: c == "standard")
    assert std.queued == pytest.approx(1.5)  # 6 x (1 - 6/8): held shared by queue depth
    only_held = RouterDemand()  # a router without class queues exports no depth
    only_held.set_held(MODEL, 3)
    d = demand_for({"r": parse_router_metrics(only_held.text())}, None, 0.0, model=MODEL,
                   endpoints=[])  # fmt: skip
    assert (d.queued, d.held) == (0, 3)


def test_completions_of_the_services_endpoints_give_the_completion_rate() -> None:
    a, b = RouterDemand(), RouterDemand()
    a.complete(MODEL, "ns/p1", 5)
    prev = {"a": parse_router_metrics(a.text()), "b": parse_router_metrics(b.text())}
    a.complete(MODEL, "ns/p1", 12)
    a.complete(MODEL, "ns/p2", 3, status="500")  # an error frees the slot too
    a.complete(MODEL, "ns/other-model-pod", 100)
    a.complete(MODEL, "none", 50, status="503")  # never reached an engine
    b.complete(MODEL, "ns/p1", 5)
    now = {"a": parse_router_metrics(a.text()), "b": parse_router_metrics(b.text())}
    d = demand_for(now, prev, 2.0, model=MODEL, endpoints=["ns/p1", "ns/p2"])
    assert d.completion_rate == pytest.approx(10.0)  # (12 + 3 + 5) / 2 s
    first = demand_for(now, None, 0.0, model=MODEL, endpoints=["ns/p1"])
    assert first.completion_rate is None


def test_a_router_restart_resets_only_its_own_counters() -> None:
    a = RouterDemand()
    a.arrive(MODEL, 100)
    prev = {"a": parse_router_metrics(a.text())}
    fresh = RouterDemand()
    fresh.arrive(MODEL, 5)
    d = demand_for({"a": parse_router_metrics(fresh.text())}, prev, 5.0, model=MODEL, endpoints=[])
    assert d.arrival_rate == pytest.approx(1.0)


def test_without_arrivals_the_rate_comes_from_dispatches() -> None:
    """A router that does not export fleetgate_arrivals_total for the model (before the
    scale-from-zero work) still gives a rate: its dispatches."""
    a = RouterDemand()
    prev = {"a": parse_router_metrics(a.text())}
    a.classes.dispatches.labels(MODEL, "standard").inc(12)
    now = {"a": parse_router_metrics(a.text())}
    d = demand_for(now, prev, 4.0, model=MODEL, endpoints=[])
    assert d.arrival_rate == pytest.approx(3.0)
    assert not d.idle


def test_first_scrape_has_no_rate() -> None:
    a = RouterDemand()
    a.arrive(MODEL, 100)
    d = demand_for({"a": parse_router_metrics(a.text())}, None, 0.0, model=MODEL, endpoints=[])
    assert d.arrival_rate is None


def test_unparsable_metrics_are_an_error() -> None:
    with pytest.raises(ValueError):
        parse_router_metrics("fleetgate_queue_depth{model= 1\n")


# -- the decision -------------------------------------------------------------------


def test_in_flight_above_target_scales_up_with_the_reason() -> None:
    dec = decide(policy(), Demand(in_flight=20, queued=8.4), 2, 2, 100.0, State())
    assert dec.desired == 8  # ceil(28.4 / 4)
    assert dec.reason == "ScaledUp: in-flight 14.2/replica > target 4"


def test_one_sample_within_the_noise_of_what_the_replicas_hold_adds_none() -> None:
    """Before the service time is measured the load is one sample. At the heavy trace's
    first tick (3 req/s of ~0.5 s requests: 1.5 in flight on average, target 2) a
    sample of 3 asked for a second replica, removed 13 s later; a Poisson count with
    the held mean 2 is 3 or more one time in three. A sample beyond 2 standard
    deviations (2 + 2 x 1.41 = 4.83 here) is no such noise; a surge far beyond it; and
    a request waiting in the router is a shortage, not noise."""
    p = policy(target_in_flight=2.0, cold_start=15.0)
    for load in (3.0, 4.0):
        dec = decide(p, Demand(in_flight=load, arrival_rate=3.0), 1, 1, 1.0, State())
        assert dec.desired == 1, dec.reason
        assert dec.reason == (
            f"Steady: in-flight {load:g}/replica ~ target 2; one sample, within the noise of 2"
        )
    dec = decide(p, Demand(in_flight=4.0, queued=1.0, arrival_rate=3.0), 1, 1, 1.0, State())
    assert (dec.desired, dec.reason) == (3, "ScaledUp: in-flight 5/replica > target 2")
    # what two replicas hold (4) is less noisy in relative terms: 4 + 2 x 2 = 8
    assert decide(p, Demand(in_flight=8.0), 2, 2, 1.0, State()).desired == 2
    assert decide(p, Demand(in_flight=9.0), 2, 2, 1.0, State()).desired == 5


def test_a_credit_is_load_other_replicas_run_and_the_target_sizes_for_the_rest() -> None:
    p = policy(target_in_flight=4.0)
    alone = decide(p, Demand(in_flight=8.0, queued=2.0), 2, 2, 1.0, State())
    assert (alone.desired, alone.need) == (3, 10.0)
    shared = decide(p, Demand(in_flight=8.0, queued=2.0), 2, 2, 1.0, State(), credit=3.0)
    assert (shared.desired, shared.need) == (2, 7.0)
    assert shared.reason.endswith("; 3 of it on the latency role's room")
    # more room than load: the need is 0, and minReplicas holds
    spare = decide(p, Demand(in_flight=1.0), 1, 1, 1.0, State(), credit=5.0)
    assert (spare.desired, spare.need) == (1, 0.0)


def test_max_replicas_caps() -> None:
    dec = decide(policy(max_replicas=3), Demand(in_flight=100), 1, 1, 0.0, State())
    assert dec.desired == 3


def test_a_ramp_scales_up_before_the_load_arrives() -> None:
    """20 s flat at 10 req/s, then arrivals rising 1 req/s every second, with a 16 s
    cold start: the forecast adds replicas ahead of a decision that looks at the
    current load only."""
    p = policy(cold_start=16.0)
    flat = policy(cold_start=0.0)
    state_t, state_f = State(), State()
    cur_t = cur_f = 2
    ups: list[tuple[int, int, str]] = []
    for i in range(-20, 21):
        rate = 10.0 + max(0, i)  # req/s
        d = Demand(in_flight=0.5 * rate, arrival_rate=rate)  # 0.5 s in the engine each
        dt_ = decide(p, d, cur_t, cur_t, float(i), state_t)
        df = decide(flat, d, cur_f, cur_f, float(i), state_f)
        state_t, cur_t = dt_.state, dt_.desired
        state_f, cur_f = df.state, df.desired
        ups += [(i, dec.desired, dec.reason) for dec in (dt_, df) if dec.changed]
    # Both wait for a sample beyond the noise of what 2 replicas hold (8 + 2 x 2.83).
    # The ramp is seen 6 s in (16 req/s, 8 in flight): its rate now plus 16 s of its
    # rise is x2 (capped), 16 in flight, 4 replicas. The load alone asks at 18 s
    # (14 in flight).
    assert ups == [
        (6, 4, "ScaledUp: in-flight 4/replica (arrivals x2.00 in 16s) > target 4"),
        (18, 4, "ScaledUp: in-flight 7/replica > target 4"),
    ]


def test_a_burst_at_the_end_of_the_window_is_no_ramp_but_a_rise_that_lasts_is() -> None:
    """A critical class at ~3.8 req/s with 8 requests sent at once (the heavy trace's
    peak): the burst's tick read as the top of a ramp and forecast x4.2 in a cold start
    (a second TensorRT-LLM replica on 4 of 6 mixed runs at cca9caf)."""
    p = policy(cold_start=16.0, target_in_flight=4.5)
    noise = [4, 3, 5, 4, 3, 4, 2, 5, 4, 3, 4, 5, 3, 4, 4, 3, 5, 4, 3, 4]
    flat = State(rates=tuple((float(t), float(r)) for t, r in enumerate(noise)))
    burst = decide(p, Demand(in_flight=1.5, arrival_rate=12.0), 1, 1, 20.0, flat)
    assert "arrivals x" not in burst.reason, burst.reason
    assert burst.desired == 1
    # the same high tick twice is a rise, read at the second
    rise = dataclasses.replace(flat, rates=(*flat.rates, (20.0, 12.0)))
    again = decide(p, Demand(in_flight=1.5, arrival_rate=12.0), 1, 1, 21.0, rise)
    assert "arrivals x" in again.reason, again.reason


def test_a_trickle_whose_only_arrivals_are_a_spike_has_no_ramp() -> None:
    """At 0.6 req/s a 20 s window can hold one tick of 2 arrivals among zeros: a spike
    by the window's median (0); without it nothing arrived (bench_trend at c6dc428
    divided by zero there)."""
    rates = [(float(t), 0.0) for t in range(20)] + [(20.0, 2.0)]
    assert autoscale._ramp(rates, 20.0) is None
    p = policy(cold_start=16.0)
    state = State(rates=tuple(rates[:-1]))
    dec = decide(p, Demand(in_flight=1.0, arrival_rate=2.0), 1, 1, 20.0, state)
    assert dec.desired == 1 and "arrivals x" not in dec.reason


def test_forecast_growth_is_capped() -> None:
    """A steep, steady rise (0 -> 10 req/s over 100 s, 100 s cold start) forecasts x11;
    the forecast at most doubles the load."""
    p = policy(cold_start=100.0)
    state = State(rates=tuple((10.0 * i, float(i)) for i in range(10)))
    dec = decide(p, Demand(in_flight=8, arrival_rate=10.0), 2, 2, 100.0, state)
    assert dec.desired == 4  # at most x2: ceil(16 / 4)
    assert "arrivals x2.00 in 100s" in dec.reason


def test_no_trend_from_a_short_history_or_from_noise() -> None:
    """The run at aacdde1 woke from zero and read the step 0 -> 3 req/s over three
    ticks as a slope that doubled the load (2 -> 3 replicas 1.3 s after the first was
    Ready). A trend now needs a history spanning max(cold start, 10 s) and a slope
    beyond two standard errors of a Poisson rate's noise."""
    p = policy(cold_start=4.0, target_in_flight=2.0)
    step = State(rates=((0.0, 0.0), (1.0, 0.0), (2.0, 3.0)))
    dec = decide(p, Demand(in_flight=6.0, arrival_rate=3.0), 1, 1, 3.0, step)
    assert dec.desired == 3, dec.reason  # ceil(6 / 2); the old slope 1.2/s: x2, 12 -> 6
    assert "arrivals x" not in dec.reason
    # 20 s of a flat 3 req/s stream as Poisson draws (least-squares slope +0.06/s, within
    # two standard errors of 0.06): no forecast (before: x1.05, 2.1 in flight -> 2)
    counts = [3, 2, 4, 1, 3, 5, 2, 3, 2, 4, 3, 1, 4, 3, 2, 5, 3, 4, 2, 4]
    flat = State(rates=tuple((float(t), float(c)) for t, c in enumerate(counts)))
    dec = decide(p, Demand(in_flight=2.0, arrival_rate=5.0), 1, 1, 20.0, flat)
    assert (dec.desired, "arrivals x" in dec.reason) == (1, False), dec.reason
    # the same span rising 3 -> 13 req/s is a trend
    rising = State(rates=tuple((float(t), 3.0 + t / 2) for t in range(20)))
    dec = decide(p, Demand(in_flight=2.0, arrival_rate=13.0), 1, 1, 20.0, rising)
    assert "arrivals x1.15 in 4s" in dec.reason  # (13 + 0.5 x 4) / 13


def test_spike_shorter_than_the_down_window_does_not_flap() -> None:
    p = policy(down_window=60.0)
    steps = [(0.0, Demand(in_flight=4))]
    steps += [(10.0, Demand(in_flight=16))]  # spike: up at once
    steps += [(20.0 + 10 * i, Demand(in_flight=4)) for i in range(5)]  # 20..60: held
    steps += [(80.0, Demand(in_flight=4))]  # the spike left the 60 s window at 70 s
    out = run(p, steps, current=1)
    assert [r for r, _ in out] == [1, 4, 4, 4, 4, 4, 4, 1]
    assert out[1][1].startswith("ScaledUp")
    assert out[2][1].startswith("Stabilizing: in-flight 1/replica < target 4; holding 4")
    assert out[-1][1] == "ScaledDown: in-flight 1/replica < target 4"


def test_flapping_input_with_an_up_window_keeps_replicas_still() -> None:
    p = policy(up_window=30.0, down_window=30.0)
    steps = [(5.0 * i, Demand(in_flight=16 if i % 2 else 8)) for i in range(12)]
    out = run(p, steps, current=2)
    assert {r for r, _ in out} == {2}


def test_kv_cache_target_uses_the_ratio_over_ready_replicas() -> None:
    p = policy(target_in_flight=None, target_kv=0.5)
    dec = decide(p, Demand(kv_usage=0.9), 3, 3, 0.0, State())
    assert dec.desired == 6  # ceil(3 * 0.9 / 0.5)
    assert dec.reason == "ScaledUp: KV cache 90% > target 50%"


def test_ttft_attainment_below_objective_adds_one_replica() -> None:
    p = policy(target_in_flight=None, ttft_class="critical", ttft_attainment=0.99)
    dec = decide(p, Demand(ttft_met=91, ttft_total=100), 3, 3, 0.0, State())
    assert dec.desired == 4
    assert dec.reason == "ScaledUp: critical TTFT attainment 91.0% < 99.0%"
    few = decide(p, Demand(ttft_met=1, ttft_total=5), 3, 3, 0.0, State())
    assert few.desired == 3  # 5 requests are no evidence (minRequests 20)


def test_idle_scales_to_zero_after_the_window_and_not_before() -> None:
    p = policy(min_replicas=0, idle_window=300.0, down_window=60.0)
    state = decide(p, Demand(in_flight=1, arrival_rate=0.5), 1, 1, 0.0, State()).state
    for t in range(10, 301, 50):  # idle since 10 s: held at 1 (min 0 does not mean 0)
        dec = decide(p, Demand(arrival_rate=0.0), 1, 1, float(t), state)
        assert dec.desired == 1, (t, dec.reason)
        state = dec.state
    assert state.idle_since == 10.0
    dec = decide(p, Demand(arrival_rate=0.0), 1, 1, 311.0, state)
    assert (dec.desired, dec.reason) == (0, "ScaledDown: idle 301s")
    busy = decide(p, Demand(queued=1, arrival_rate=0.0), 1, 1, 311.0, state)
    assert busy.desired == 1 and busy.state.idle_since is None


def test_zero_stays_zero_without_demand_and_held_requests_wake_it_at_once() -> None:
    p = policy(min_replicas=0, idle_window=60.0, up_window=120.0)
    still = decide(p, Demand(arrival_rate=0.0), 0, 0, 0.0, State(idle_since=-500.0))
    assert (still.desired, still.reason) == (0, "Steady: in-flight 0/replica ~ target 4")
    wake = decide(p, Demand(held=1), 0, 0, 1.0, still.state)
    assert (wake.desired, wake.reason) == (1, "ScaledUp: 1 requests held at 0 replicas")
    many = decide(p, Demand(held=13), 0, 0, 1.0, still.state)
    # not ceil(13 / 4): with no measured service time the backlog waits for the first
    # replica (see the held-while-starting tests below)
    assert (many.desired, many.reason) == (1, "ScaledUp: 13 requests held at 0 replicas")


# -- held requests while replicas start (the cold-start backlog) ---------------------


def test_held_requests_during_a_cold_start_keep_the_starting_replica_only() -> None:
    """The bench's cold start from zero: arrivals rising, requests piling up held while
    the first replica starts. Before, 13 held (x the forecast) asked for 4 replicas that
    came up after the first had drained them; now the backlog waits for the replica
    already starting while nothing says how fast it drains."""
    p = policy(min_replicas=0, idle_window=60.0, cold_start=4.0)
    state, current = State(), 0
    for i in range(1, 17):  # 15 s of samples: a trend over MIN_TREND_SPAN_SECONDS
        d = Demand(held=float(i), arrival_rate=1.0 + 0.5 * i)  # rising: growth > 1
        dec = decide(p, d, current, 0, float(i), state)  # none Ready yet
        state, current = dec.state, dec.desired
        assert current == 1, (i, dec.reason)
    assert "16 held wait for the 1 starting (service time not measured yet)" in dec.reason
    assert "arrivals x" in dec.reason  # the forecast is there, it only spares the held


def test_the_backlog_released_after_a_start_from_zero_is_no_rate() -> None:
    """The bench's start from zero at aacdde1: 11 held while the first replica starts,
    then released to it (4 running, 7 queued) before any completion measured the service
    time. Read as load (x the start-up forecast) it asked for 3 replicas 1.3 s after
    Ready that idled for the scale-down window; it keeps the one replica asked for until
    the service time is measured, then Little's mean decides."""
    p = policy(min_replicas=0, idle_window=15.0, cold_start=4.0, target_in_flight=2.0)
    state = State()
    for t in (-3.0, -2.0, -1.0):  # the router up, nothing arriving yet
        state = decide(p, Demand(arrival_rate=0.0), 0, 0, t, state).state
    dec = decide(p, Demand(held=1.0, arrival_rate=1.7), 0, 0, 0.6, state)  # woken at once
    assert dec.desired == 1
    current = dec.desired
    for t, held in ((1.6, 4.0), (2.6, 7.0), (3.6, 11.0)):
        dec = decide(p, Demand(held=held, arrival_rate=3.0), current, 1, t, dec.state)
        assert dec.desired == 1, dec.reason
    released = Demand(in_flight=4.0, queued=7.0, arrival_rate=4.0, completion_rate=4.0)
    dec = decide(p, released, 1, 1, 4.6, dec.state)
    assert dec.desired == 1, dec.reason
    assert "backlog released to the 1 started from zero" in dec.reason
    # the next tick measures it: (0 + 4) / 2 + (4 + 3) / 2 in-flight seconds over 4 + 10
    # completions, 0.39 s; then Little's mean (3 req/s x 0.39 s) decides
    dec = decide(p, Demand(in_flight=3.0, arrival_rate=3.0, completion_rate=10.0), 1, 1,
                 5.6, dec.state)  # fmt: skip
    assert dec.state.service_time == pytest.approx((2.0 + 3.5) / 14)
    assert dec.desired == 1, dec.reason
    assert "mean in flight" in dec.reason
    assert not dec.state.woken


def test_a_woken_service_scales_on_what_still_runs_a_cold_start_after_the_release() -> None:
    """The e2e burst at e70fedb: woken from zero by one request, then 12 streams of 8 s
    requests on one replica (8 running, 4 queued). Ten completions take 8 s there, so
    the service time stayed unmeasured and the released-backlog rule kept 1 replica
    through the whole 15 s burst. A released backlog drains within a cold start (the
    held rule's premise); what still runs a cold start after the release is demand."""
    p = policy(min_replicas=0, max_replicas=3, idle_window=4.0, cold_start=4.0,
               target_in_flight=3.0)  # fmt: skip
    dec = decide(p, Demand(held=1.0, arrival_rate=1.0), 0, 0, 0.0, State())
    assert dec.desired == 1
    # the pod is Ready at once (kwok) while its engine starts: still held, not released
    dec = decide(p, Demand(held=1.0, arrival_rate=0.0), 1, 1, 0.5, dec.state)
    assert dec.state.woken and dec.state.released_at is None
    # the engine answers: released; the burst runs with no completion
    busy = Demand(in_flight=8.0, queued=4.0, arrival_rate=0.0, completion_rate=0.0)
    dec = decide(p, Demand(in_flight=1.0, arrival_rate=0.0, completion_rate=0.0), 1, 1, 3.5,
                 dec.state)  # fmt: skip
    assert dec.state.released_at == 3.5
    for t in (4.0, 5.0, 6.0, 7.0):
        dec = decide(p, busy, 1, 1, t, dec.state)
        assert dec.desired == 1, (t, dec.reason)
        assert "backlog released to the 1 started from zero" in dec.reason
    before = dec.state
    dec = decide(p, busy, 1, 1, 7.5, before)  # a cold start after the release
    assert dec.desired == 3, dec.reason  # ceil(12 / 3) = 4, capped at 3
    assert not dec.state.woken and dec.state.service_time is None
    # had the backlog drained within the cold start, nothing would have changed
    drained = Demand(in_flight=1.0, arrival_rate=0.3, completion_rate=1.0)
    assert decide(p, drained, 1, 1, 7.5, before).desired == 1


def test_held_requests_count_by_the_batches_a_replica_drains_in_a_cold_start() -> None:
    """Service time 5 s, cold start 30 s: a replica drains 6 batches of 4 in a cold
    start, so 60 held need 60 / 6 = 10 in flight, 3 replicas (before: ceil(60/4) = 15,
    capped at 10)."""
    p = policy(cold_start=30.0)
    measured = State(service_time=5.0)
    dec = decide(p, Demand(held=60.0), 1, 0, 0.0, measured)
    assert dec.desired == 3
    assert "60 held drain in 6 batches of 5s per cold start" in dec.reason
    # with the starting replica's engines already busy, those count in full
    busy = decide(p, Demand(held=60.0, in_flight=4.0, queued=4.0), 2, 1, 0.0, measured)
    # (the 4 queued are backlog too: ceil((4 + (60 + 4) / 6) / 4))
    assert busy.desired == 4
    # a short service time: the whole backlog fits the starting replica
    fast = decide(p, Demand(held=60.0), 1, 0, 0.0, State(service_time=0.4))
    assert fast.desired == 1  # 60 / 75 batches < 1 in flight
    # a service time longer than the cold start: one batch, every held request counts
    slow = decide(p, Demand(held=9.0), 1, 0, 0.0, State(service_time=100.0))
    assert slow.desired == 3  # ceil(9 / 4)


def test_held_requests_are_a_backlog_even_when_the_pods_say_ready() -> None:
    """A pod can be Ready before its engine answers (kwok's are at once; a readiness
    probe on the port, not the model, does the same): the router still holds, so the
    held requests still wait for those replicas. The bench's run at 11ac983 went
    1 -> 3 on 6 held this way."""
    p = policy(cold_start=4.0)
    dec = decide(p, Demand(held=6.0, arrival_rate=3.0), 1, 1, 0.0, State())
    assert dec.desired == 1, dec.reason
    measured = decide(p, Demand(held=6.0, in_flight=4.0), 2, 2, 0.0, State(service_time=0.5))
    assert measured.desired == 2  # ceil((4 + 6 / 8) / 4); counted in full: 3


def test_service_time_is_measured_by_littles_law_on_ready_replicas() -> None:
    """In-flight seconds (the mean of a tick's two ends x its span) over completions,
    summed over the last 100 completions (at most 60 s), once there are 10."""
    p = policy()
    first = decide(p, Demand(in_flight=8.0), 2, 2, 0.0, State())  # no rate yet
    second = decide(p, Demand(in_flight=8.0, completion_rate=16.0), 2, 2, 1.0, first.state)
    assert second.state.service_time == pytest.approx(0.5)  # 8 x 1 s / 16
    third = decide(p, Demand(in_flight=4.0, completion_rate=8.0), 2, 2, 2.0, second.state)
    # the ratio of the sums, not the mean of ratios: (8 + 6) / (16 + 8)
    assert third.state.service_time == pytest.approx(14 / 24)
    none_ready = decide(p, Demand(in_flight=8.0, completion_rate=1.0), 2, 0, 3.0, third.state)
    assert none_ready.state.service_time == pytest.approx(14 / 24)  # no sample without Ready
    # a tick that starts from a full engine and an empty one reads the mean of both ends:
    # the first tick after a cold start (0 -> 4 running, 4 completions in the part of
    # the tick the replica served) reads 0.5 s, not 1 s
    woke = decide(p, Demand(in_flight=0.0), 1, 0, 0.0, State())
    woke = decide(p, Demand(in_flight=4.0, completion_rate=4.0), 1, 1, 1.0, woke.state)
    assert woke.state.service_samples == ((1.0, 2.0, 4.0),)
    assert woke.state.service_time is None  # 4 completions: not measured yet
    woke = decide(p, Demand(in_flight=4.0, completion_rate=6.0), 1, 1, 2.0, woke.state)
    assert woke.state.service_time == pytest.approx(6 / 10)
    # at a few requests per second the window reaches back to 100 completions (here
    # 25 s of ticks, older than the 15 s it was), beyond them the older ticks leave it
    slow = State(last_tick=0.0, last_in_flight=1.0)
    for t in range(1, 41):
        slow = decide(p, Demand(in_flight=1.0, completion_rate=4.0), 1, 1, float(t), slow).state
    assert slow.service_time == pytest.approx(0.25)
    slow = decide(p, Demand(in_flight=9.0, completion_rate=4.0), 1, 1, 41.0, slow).state
    assert slow.service_time == pytest.approx((24 * 1.0 + 5.0) / 100)  # 25 ticks x 4
    # ticks older than 60 s leave it whatever they hold
    later = decide(p, Demand(in_flight=1.0, completion_rate=20.0), 1, 1, 120.0, slow)
    assert later.state.service_samples == ((120.0, (9.0 + 1.0) / 2 * 79.0, 20.0 * 79.0),)


def test_in_flight_rule_uses_littles_law_once_the_service_time_is_measured() -> None:
    """Arrivals 4/s x 1 s on an engine = 4 in flight on average: one replica at target 4,
    even on a tick whose in-flight sample caught a burst of 11 (the sample alone asked
    for 3, and the scale-down window then kept them). A sustained rise of the rate
    still scales up, and a queue beyond the engines counts as a backlog drained within
    a cold start."""
    p = policy(cold_start=4.0, target_in_flight=4.0)
    state = State(service_time=1.0)
    current = 1
    for t in range(5):
        dec = decide(p, Demand(arrival_rate=4.0, in_flight=3.0), current, current, t, state)
        state, current = dec.state, dec.desired
    assert current == 1
    burst = decide(p, Demand(arrival_rate=4.0, in_flight=11.0), 1, 1, 5.0, state)
    assert burst.desired == 1, burst.reason
    assert "4 mean in flight (arrivals x 1s)" in burst.reason
    # without a measured service time the sample decides, as before
    unmeasured = decide(p, Demand(arrival_rate=4.0, in_flight=11.0), 1, 1, 5.0, State())
    assert unmeasured.desired == 3
    # the rate steps up to 12/s and stays: the window's mean follows within a tick
    # (ceil(12 x 1 / 4) = 3 at least; the rising trend's forecast may ask for more)
    dec = decide(p, Demand(arrival_rate=12.0, in_flight=8.0), 1, 1, 6.0, state)
    assert dec.desired >= 2, dec.reason
    for t in range(7, 12):
        dec = decide(p, Demand(arrival_rate=12.0, in_flight=8.0), current, current, t, state)
        state, current = dec.state, dec.desired
    assert current >= 3, dec.reason
    # 16 queued beyond the engines at 1 s per request and a 4 s cold start: 4 batches
    queued = decide(p, Demand(arrival_rate=4.0, queued=16.0), 1, 1, 0.0, State(service_time=1.0))
    assert queued.desired == 2  # ceil((4 + 16 / 4) / 4)


def test_the_arrival_history_of_a_service_at_zero_starts_at_its_wake() -> None:
    """Idle ticks at zero replicas (before the bench's trace starts) are no history: with
    them, the stream of 3 req/s that woke the service read, once 10 s were spanned, as a
    significant slope through the zeros (x2 at 8 s after the wake in the model of the
    bench: 1 -> 2 replicas)."""
    p = policy(min_replicas=0, idle_window=15.0, cold_start=4.0, target_in_flight=2.0)
    state, current = State(), 0
    for t in range(-5, 0):
        dec = decide(p, Demand(arrival_rate=0.0), current, current, float(t), state)
        state, current = dec.state, dec.desired
    assert state.rates == ()
    for t in range(12):
        d = Demand(in_flight=1.0, arrival_rate=3.0 + (t % 3) - 1, held=0.0 if t else 1.0)
        dec = decide(p, d, current, current, float(t), state)
        state, current = dec.state, dec.desired
        assert "arrivals x" not in dec.reason, (t, dec.reason)
    assert current == 1 and len(state.rates) == 12


def test_littles_mean_follows_a_stream_that_stops_and_not_its_noise() -> None:
    """The recent rate is the last 5 s of arrivals cut where they changed: when a peak of
    15 req/s stops, Little's mean reads 0 on the next tick (the 5 s mean read 12 x 0.4 s
    = 4.8 in flight, 3 replicas, and the scale-down window kept them 4 s longer); the
    ticks of a steady Poisson stream are not cut."""
    p = policy(cold_start=4.0, target_in_flight=2.0, down_window=0.0)
    peak = State(rates=tuple((float(t), 15.0) for t in range(10)), service_time=0.4)
    dec = decide(p, Demand(in_flight=6.0, arrival_rate=0.0), 3, 3, 10.0, peak)
    assert dec.recommendation == 1, dec.reason
    assert "0 mean in flight" in dec.reason
    quiet = State(rates=((0.0, 3.0), (1.0, 2.0), (2.0, 5.0), (3.0, 1.0), (4.0, 4.0)),
                  service_time=0.4)  # fmt: skip
    dec = decide(p, Demand(in_flight=1.0, arrival_rate=6.0), 1, 1, 5.0, quiet)
    assert "1.4 mean in flight" in dec.reason  # (2 + 5 + 1 + 4 + 6) / 5 x 0.4


def test_littles_mean_is_over_10_s_and_within_the_tolerance_keeps_the_replicas() -> None:
    """At 3 req/s x 0.54 s (the heavy trace's quiet phase) the mean is 1.6 in flight, one
    replica at target 2; a 5 s mean of the arrivals is +-26% and its Poisson highs
    read above 2 and added a replica (2e7a267: 1 -> 2 at 9.7 s and 22.9 s). Over 10 s,
    and with the HPA's 10% tolerance around what runs, they do not; a real rise does."""
    p = policy(cold_start=4.0, target_in_flight=2.0, down_window=0.0)
    ticks = [3.0, 2.0, 4.0, 3.0, 2.0, 3.0, 4.0, 5.0, 4.0, 4.0]  # the last 5 s: 4.0 req/s
    quiet = State(rates=tuple((float(t), r) for t, r in enumerate(ticks)), service_time=0.54)
    dec = decide(p, Demand(in_flight=2.0, arrival_rate=4.0), 1, 1, 10.0, quiet)
    assert "1.9 mean in flight" in dec.reason  # 10 s of 3.5 req/s x 0.54 (5 s: 4.2 x 0.54 = 2.3)
    assert dec.desired == 1, dec.reason
    # within 10% of one replica's target: noise, kept
    edge = State(rates=tuple((float(t), 4.0) for t in range(10)), service_time=0.54)
    dec = decide(p, Demand(in_flight=2.0, arrival_rate=4.0), 1, 1, 10.0, edge)
    assert (dec.desired, "2.2 mean in flight" in dec.reason) == (1, True), dec.reason
    # beyond it: scaled
    rising = dataclasses.replace(edge, rates=tuple((float(t), 4.5) for t in range(10)))
    dec = decide(p, Demand(in_flight=2.0, arrival_rate=4.5), 1, 1, 10.0, rising)
    assert dec.desired == 2, dec.reason


def test_restart_with_state_from_status_keeps_the_down_window() -> None:
    """A new operator that reads the recommendations from status does not scale down
    inside the window that the old one had started."""
    p = policy(down_window=60.0)
    before = run(p, [(0.0, Demand(in_flight=16)), (10.0, Demand(in_flight=4))], current=1)
    assert before[-1][0] == 4
    persisted = State(recommendations=((0.0, 4), (10.0, 1)))  # what status keeps
    after = decide(p, Demand(in_flight=4), 4, 4, 30.0, persisted)
    assert after.desired == 4
    forgetful = decide(p, Demand(in_flight=4), 4, 4, 30.0, State())
    assert forgetful.desired == 1  # what a restart without status would have done


def test_recommendations_keep_only_change_points_within_the_windows() -> None:
    p = policy(down_window=60.0)
    state = State()
    for t in range(0, 200, 5):
        state = decide(p, Demand(in_flight=4), 1, 1, float(t), state).state
    assert state.recommendations == ((0.0, 1),)


def test_victim_is_the_least_loaded_then_by_name() -> None:
    assert choose_victims([("p-a", 3), ("p-b", 0), ("p-c", 0)], 1) == ["p-b"]
    assert choose_victims([("p-a", 3), ("p-b", 0), ("p-c", 0)], 2) == ["p-b", "p-c"]
    assert choose_victims([("p-a", 3)], 2) == ["p-a"]
    assert choose_victims([], 1) == []


def test_a_replica_the_routers_do_not_find_serving_drains_first() -> None:
    """On kwok every pod is Ready at once, and a readiness probe on the port is Ready
    before the model: a1da059 (target 3, seed 0) drained the replica that had served
    all along while the one asked for 11 s before was still starting, and the routers
    held 11 requests for ~4 s. The routers' health probes say which endpoints serve."""
    a, b = RouterDemand(), RouterDemand()
    a.set_health({"ns/p-a": True, "ns/p-b": False})
    b.set_health({"ns/p-a": True, "ns/p-b": False, "ns/other": False})
    snaps = {"a": parse_router_metrics(a.text()), "b": parse_router_metrics(b.text())}
    assert snaps["a"].healthy == {"ns/p-a": True, "ns/p-b": False}
    d = demand_for(snaps, None, 0.0, model=MODEL, endpoints=["ns/p-a", "ns/p-b"])
    assert d.serving == frozenset({"ns/p-a"})
    # no router reports health: unknown, not "none serve"
    quiet = {"r": parse_router_metrics(RouterDemand().text())}
    assert demand_for(quiet, None, 0.0, model=MODEL, endpoints=["ns/p-a"]).serving is None
    # both idle: by name p-a would go; p-b does not serve, so it goes
    assert choose_victims([("p-a", 0), ("p-b", 0)], 1) == ["p-a"]
    assert choose_victims([("p-a", 0), ("p-b", 0)], 1, serving={"p-a"}) == ["p-b"]
    # busier but not serving still goes first (what it "runs" is not work)
    assert choose_victims([("p-a", 0), ("p-b", 2)], 1, serving={"p-a"}) == ["p-b"]
    step = plan_drain([], {"p-a": 0.0, "p-b": 0.0}, 1, now=10.0, timeout=60.0, serving={"p-a"})
    assert step.new == ("p-b",)
    assert plan_drain(step.draining, {"p-a": 0.0, "p-b": 0.0}, 1, now=11.0, timeout=60.0,
                      serving={"p-a"}).removed == (("p-b", 0.0),)  # fmt: skip


def test_a_scale_down_drains_every_victim_at_once_and_removes_them_together() -> None:
    flight = {"p-a": 3.0, "p-b": 1.0, "p-c": 0.0, "p-d": 2.0}
    first = plan_drain([], flight, 2, now=100.0, timeout=60.0)
    assert first.new == ("p-c", "p-b")  # the least in flight
    assert first.draining == (("p-c", 100.0), ("p-b", 100.0))
    assert first.remove == 0  # just marked: wait a tick for the routers to see it
    # p-b still finishes its request: nobody goes yet, and p-c waits with it
    second = plan_drain(first.draining, flight, 2, now=101.0, timeout=60.0)
    assert (second.new, second.remove, second.busy) == ((), 0, (("p-b", 1.0),))
    done = plan_drain(second.draining, {**flight, "p-b": 0.0}, 2, now=102.0, timeout=60.0)
    assert done.remove == 2 and done.busy == () and done.released == ()
    assert done.removed == (("p-b", 0.0), ("p-c", 0.0))
    assert done.outcome() == "pod p-b drained, pod p-c drained"
    assert first.removed == second.removed == () and first.outcome() == ""


def test_a_drain_past_its_timeout_counts_as_drained() -> None:
    flight = {"p-a": 3.0, "p-b": 5.0}
    step = plan_drain([("p-a", 0.0)], flight, 1, now=59.0, timeout=60.0)
    assert (step.remove, step.busy) == (0, (("p-a", 3.0),))
    late = plan_drain([("p-a", 0.0)], flight, 1, now=60.0, timeout=60.0)
    assert late.remove == 1 and late.removed == (("p-a", 3.0),)
    assert late.outcome() == "pod p-a drain timeout, 3 in flight"


def test_demand_partly_back_releases_the_busiest_and_a_gone_pod_is_forgotten() -> None:
    flight = {"p-a": 4.0, "p-b": 0.0, "p-c": 2.0}
    step = plan_drain([("p-a", 5.0), ("p-b", 5.0), ("p-c", 5.0)], flight, 1, 9.0, 60.0)
    assert step.released == ("p-c", "p-a")
    assert step.draining == (("p-b", 5.0),) and step.remove == 1
    # p-x was removed (or deleted by someone): not draining, not released, not counted
    gone = plan_drain([("p-x", 5.0)], flight, 1, 9.0, 60.0)
    assert gone.released == () and gone.new == ("p-b",) and gone.remove == 0


def test_the_trend_is_read_over_the_recent_span_not_the_last_minute() -> None:
    """The heavy trace with a 15 s cold start (bench/results/autoscale-cold15.md): 40 s
    of flat traffic, then a ramp. A line through the last minute read a fraction of
    the ramp (x1.16 when the rate had doubled), the second replica was asked for when
    the first was already full, and the ramp's requests missed their objective. Over
    the last max(coldStart, 20 s) the slope is the ramp's, and the replica comes a
    cold start ahead."""
    p = policy(cold_start=16.0, target_in_flight=4.0)
    state, current, dec = State(service_time=0.45), 1, None
    asked = None
    for t in range(73):
        rate = 3.0 if t < 60 else 3.0 + 0.4 * (t - 59)  # 0.4 req/s per s from t = 60
        d = Demand(in_flight=rate * 0.45, arrival_rate=rate, completion_rate=rate)
        dec = decide(p, d, current, current, float(t), state)
        state, current = dec.state, dec.desired
        if t == 59:
            assert (current, "in 16s)" in dec.reason) == (1, False), dec.reason
        if current == 2 and asked is None:
            asked = (t, dec.reason)
    assert dec is not None and asked is not None
    # At 68 s (9 s into the ramp, 6.2 req/s; 12.6 a cold start later: 5.7 in flight, 2
    # replicas' worth): flat, then a rise fitted from its breakpoint, reads the rate now
    # (6.2) and the slope (0.4/s); 6.2 + 0.4 x 16 is capped at twice 6.2, x2.80 over the
    # 10 s recent mean (4.4) -> 5.6 in flight -> 2 replicas. A straight line through the
    # last 20 s (two standard errors) added to the recent mean over the cold start and
    # the mean's age asked at 70 s (x1.91); without the age at 72 s; fitted over the last
    # minute, 3.0 in flight at 72 s, 1 replica.
    assert current == 2, dec.reason
    assert asked[0] == 68, asked
    assert "arrivals x2.80 in 16s" in asked[1], asked


def test_traffic_after_a_pause_is_a_step_not_a_ramp() -> None:
    """The heavy trace starts at 3 req/s after the service sat idle at 1 replica. A line
    through the idle zeros and the first seconds of traffic read x1.5-x2 over the cold
    start, and a second replica came and went in the quiet phase (5 of 6 runs on
    2026-12-05, 12-28 replica-seconds each). The trend is read only since the traffic
    started; a ramp that follows is still seen once it has a span of its own."""
    p = policy(cold_start=16.0, target_in_flight=2.0)
    state, current = State(service_time=0.45), 1
    desired = []
    for t in range(100):
        if t < 30:
            rate = 0.0  # idle at minReplicas 1
        elif t < 70:
            rate = 3.0  # the quiet phase: 1.35 in flight, one replica
        else:
            rate = 3.0 + 0.4 * (t - 69)  # the ramp
        d = Demand(in_flight=rate * 0.45, arrival_rate=rate, completion_rate=rate)
        dec = decide(p, d, current, current, float(t), state)
        state, current = dec.state, dec.desired
        desired.append(current)
        if t == 40:  # before: x2.00, read through the zeros; a replica followed
            assert " in 16s)" not in dec.reason, dec.reason
    assert desired[30:70] == [1] * 40, desired
    assert max(desired[70:]) >= 2  # the ramp still asks for replicas
    ramp_up = next(t for t in range(70, 100) if desired[t] >= 2)
    assert ramp_up <= 78, desired  # about where a ramp after flat traffic is seen


def test_no_scale_down_while_requests_keep_waiting_in_the_routers() -> None:
    """Cold start 15 s, seed 1 (bench/results/autoscale-cold15.md run c): at the peak
    Little's mean read 7.5 in flight (15 req/s x 0.5 s) for 3 replicas of 4 slots, i.e.
    2, while requests waited in the router; one replica went, and came back 2 s later,
    after a cold start without it. Requests queued at every decision for 3 s keep the
    replicas; a request seen queued at one tick does not (the e2e trickle's drain)."""
    p = policy(cold_start=16.0, down_window=0.0)
    rates = tuple((float(t), 15.0) for t in range(17))
    start = State(service_time=0.5, rates=rates, last_tick=16.0, last_in_flight=12.0)
    busy = Demand(in_flight=12.0, queued=3.0, arrival_rate=15.0, completion_rate=24.0)
    state, dec = start, None
    for t in (17.0, 18.0, 19.0, 20.0):  # queued at every decision from 17 s
        dec = decide(p, busy, 3, 3, t, state)
        state = dec.state
        if t < 20.0:  # not yet 3 s: Little's mean decides (the window is 0 here)
            assert dec.desired == 2, (t, dec.reason)
    assert dec is not None
    assert (dec.desired, dec.recommendation) == (3, 3), dec.reason
    assert "requests queued for 3s: no scale-down" in dec.reason
    # one tick with requests queued after one without: a blip, the reading decides
    quiet = dataclasses.replace(busy, queued=0.0)
    state = decide(p, quiet, 3, 3, 21.0, state).state
    dec = decide(p, busy, 3, 3, 22.0, state)
    assert dec.desired == 2, dec.reason  # ceil(7.5 / 4)


def test_a_burst_in_the_newest_tick_is_no_new_rate_but_a_surge_that_lasts_is(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """At the heavy trace's peak (15 req/s of 0.5 s requests on 2 replicas of 4 slots) a
    critical burst (8 requests at once) in the newest tick, after a tick low by chance,
    cut the recent window to that tick: Little's mean read 16 in flight where it had read
    7.5, and a replica was asked for that came a cold start later, when the peak was
    nearly over (the closed loop, seed 65; on the cluster at 36138dd the mean jumped from
    7.6 to 12.5 within 4 s the same way on seeds 0 and 3). A rise cuts the window only
    once it has lasted RISE_CUT_SECONDS; a drop still cuts at once."""
    p = policy(cold_start=16.0, down_window=0.0)
    rates = (*((float(t), 15.0) for t in range(10)), (10.0, 12.0))
    start = State(service_time=0.5, rates=rates, last_tick=10.0, last_in_flight=7.5)

    def at(t: float, rate: float, state: State) -> tuple[int, str, State]:
        d = Demand(in_flight=7.5, arrival_rate=rate, completion_rate=15.0)
        dec = decide(p, d, 2, 2, t, state)
        return dec.desired, dec.reason, dec.state

    # 32 in one tick after 12: the window keeps the ticks before it, 16.1 req/s, 8.1 in
    # flight, what 2 replicas hold
    desired, reason, _ = at(11.0, 32.0, start)
    assert (desired, "; 8.1 mean in flight" in reason) == (2, True), reason
    with monkeypatch.context() as m:  # a rise that cuts at once, as before
        m.setattr(autoscale, "RISE_CUT_SECONDS", 0.0)
        desired, reason, _ = at(11.0, 32.0, start)
        assert (desired, "; 16 mean in flight" in reason) == (4, True), reason
    # 45 req/s: one tick is part of the window (8.7 in flight), two are the rate (22.5
    # in flight, 6 replicas)
    desired, reason, state = at(11.0, 45.0, start)
    assert (desired, "; 8.7 mean in flight" in reason) == (2, True), reason
    desired, reason, state = at(12.0, 45.0, state)
    assert (desired, "; 22.5 mean in flight" in reason) == (6, True), reason
    # a stream that stops reads 0 at the first empty tick
    desired, reason, _ = at(11.0, 0.0, start)
    assert (desired, "; 0 mean in flight" in reason) == (1, True), reason


# -- a stream that stops -------------------------------------------------------------


def _after_peak(silent_ticks: int, rate: float = 15.0) -> tuple[Policy, State]:
    """3 replicas through a peak of ``rate`` req/s (Little's mean 7.5 asked for 2, then
    3 at the last tick), then ``silent_ticks`` 1 s ticks without arrivals."""
    p = policy(cold_start=16.0, down_window=10.0)
    rates = tuple((float(t), rate) for t in range(11))
    rates += tuple((11.0 + k, 0.0) for k in range(silent_ticks - 1))
    recs = ((0.0, 2), (10.0, 3))  # the peak's last recommendation: 3
    return p, State(service_time=0.5, rates=rates, recommendations=recs, last_tick=10.0)


def test_a_stream_that_stops_scales_down_without_the_window() -> None:
    """The heavy trace's peak ends at once (15 req/s -> 0): the 10 s window kept its
    3 replicas idle for 10 s after the last request, 14 of its ~267 replica-seconds in
    the closed loop. A silence that a Poisson stream at the rate before it would keep
    with probability e^-6.9 is a stop, not a dip: the window's recommendations made
    while it ran no longer count."""
    p, state = _after_peak(1)
    idle = Demand(arrival_rate=0.0, completion_rate=0.0)
    dec = decide(p, idle, 3, 3, 11.0, state)  # 1 s at 15 req/s: 15 expected, none came
    assert (dec.desired, dec.recommendation) == (1, 1), dec.reason
    assert dec.reason.endswith("; arrivals stopped 1s ago (after 15 req/s): no window")
    # the same silence after 3 req/s is 3 expected arrivals: maybe a dip, the window holds
    p, state = _after_peak(1, rate=3.0)
    dec = decide(p, idle, 3, 3, 11.0, state)
    assert dec.desired == 3 and "Stabilizing" in dec.reason, dec.reason
    p, state = _after_peak(3, rate=3.0)  # 3 s at 3 req/s: 9 expected
    dec = decide(p, idle, 3, 3, 13.0, state)
    assert dec.desired == 1, dec.reason


def test_a_stop_needs_every_router_and_nothing_left_running() -> None:
    p, state = _after_peak(2)
    # a router that answered before did not answer this tick: its arrivals are unknown
    partial = Demand(arrival_rate=0.0, completion_rate=0.0, partial=True)
    dec = decide(p, partial, 3, 3, 12.0, state)
    assert dec.desired == 3, dec.reason
    # and the silence that spans that tick stays no evidence once it answers again
    dec = decide(p, Demand(arrival_rate=0.0, completion_rate=0.0), 3, 3, 13.0, dec.state)
    assert dec.desired == 3, dec.reason
    # requests still running (or queued) are demand: the window decides
    p, state = _after_peak(2)
    running = Demand(in_flight=1.0, arrival_rate=0.0, completion_rate=1.0)
    dec = decide(p, running, 3, 3, 12.0, state)
    assert dec.desired == 3, dec.reason


def test_a_router_that_did_not_answer_makes_the_demand_partial() -> None:
    a, b = RouterDemand(), RouterDemand()
    prev = {"a": parse_router_metrics(a.text()), "b": parse_router_metrics(b.text())}
    both = demand_for(prev, prev, 1.0, model=MODEL, endpoints=[])
    only_a = demand_for({"a": prev["a"]}, prev, 1.0, model=MODEL, endpoints=[])
    new_c = demand_for({**prev, "c": prev["a"]}, prev, 1.0, model=MODEL, endpoints=[])
    first = demand_for(prev, None, 0.0, model=MODEL, endpoints=[])
    assert [d.partial for d in (both, only_a, new_c, first)] == [False, True, False, False]
