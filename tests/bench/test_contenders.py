"""Contender command lines: loopback only, the right flags, configs the router accepts."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleetgate.router.config import PrioritySection, Scheduling, parse_config
from fleetgate_tools.bench import contenders as cmod

BACKENDS = [("vllm", "http://127.0.0.1:18100"), ("trtllm", "http://127.0.0.1:18101")]


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


@pytest.mark.parametrize("name", sorted(cmod.CONTENDERS))
def test_every_contender_binds_loopback_and_targets_only_the_fleet(name: str) -> None:
    c = cmod.CONTENDERS[name]
    argv = cmod.command(
        c,
        port=30001,
        metrics_port=30002,
        backends=BACKENDS,
        config_path=Path("/tmp/x.yaml"),
        peers_root=Path("/peers"),
    )
    assert _flag(argv, "--host") == "127.0.0.1"
    assert _flag(argv, "--port") == "30001"
    if c.kind == "fleetgate":
        assert argv[1:4] == ["-m", "fleetgate", "router"]
        assert _flag(argv, "--config") == "/tmp/x.yaml"
    else:
        # the peers' own Prometheus listener must not bind 0.0.0.0 either
        assert _flag(argv, "--prometheus-host") == "127.0.0.1"
        assert _flag(argv, "--prometheus-port") == "30002"
        assert _flag(argv, "--policy") == c.policy
        i = argv.index("--worker-urls")
        assert argv[i + 1 : i + 3] == [u for _, u in BACKENDS]
        assert argv[0].startswith(f"/peers/{c.kind}-{cmod.PEER_VERSIONS[c.kind]}/bin/")


def test_peer_policies_are_the_ones_the_issue_names() -> None:
    peers = {(c.kind, c.policy) for c in cmod.CONTENDERS.values() if c.kind != "fleetgate"}
    assert peers == {
        ("vllm-router", "cache_aware"),
        ("vllm-router", "power_of_two"),
        ("vllm-router", "round_robin"),
        ("sglang-router", "cache_aware"),
    }


@pytest.mark.parametrize(
    "name", [n for n, c in cmod.CONTENDERS.items() if c.kind == "fleetgate" and not c.kv_events]
)
def test_fleetgate_configs_validate_against_the_router_model(name: str) -> None:
    c = cmod.CONTENDERS[name]
    config = parse_config(cmod.fleetgate_config(c, BACKENDS, seed=3))
    assert config.test_mode
    assert [b.url for _, b in config.backends()] == [u for _, u in BACKENDS]
    assert config.scheduling.seed == 3
    w = config.scheduling.weights
    expected = c.weights if c.weights is not None else (3.0, 2.0, 1.0)
    assert (w.prefix, w.load, w.kv) == expected
    # Single-scorer ablations leave the engine-speed scorer off; default weights keep it.
    assert w.speed == (0.0 if c.weights is not None else 1.0)
    assert config.scheduling.picker == (c.picker or "max-score")
    assert config.scheduling.cold_choices == c.cold_choices
    assert config.scheduling.effective_cold_choices() == c.cold_choices  # None: all
    assert config.scheduling.load_bound == c.load_bound
    assert config.scheduling.effective_load_bound() == (c.load_bound or 1.0)
    wait = c.affinity_wait_s
    if wait == "default":
        wait = PrioritySection().affinity_wait_s
    if c.admission:
        assert config.priority == PrioritySection(affinity_wait_s=wait), (
            "the admission queue on for every workload"
        )
    else:
        assert config.priority is None, "no classes unless the workload sends them"
    with_classes = parse_config(cmod.fleetgate_config(c, BACKENDS, 3, priority_classes=True))
    expected_section = PrioritySection(preemption_enabled=c.preemption, affinity_wait_s=wait)
    if c.classes:
        assert with_classes.priority == expected_section
    else:
        assert with_classes.priority is None, "a class-blind baseline gets no priority section"


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("", "at least one"),
        ("fleetgate,nope", "unknown contender 'nope'"),
        ("fleetgate,fleetgate", "twice"),
    ],
)
def test_parse_contenders_errors(text: str, match: str) -> None:
    with pytest.raises(cmod.UnknownContender, match=match):
        cmod.parse_contenders(text)


def test_parse_contenders_all_and_order() -> None:
    assert [c.name for c in cmod.parse_contenders("all")] == list(cmod.DEFAULT_SET)
    more = cmod.parse_contenders("all, fleetgate-lb1")
    assert [c.name for c in more] == [*cmod.DEFAULT_SET, "fleetgate-lb1"]
    with pytest.raises(cmod.UnknownContender, match="twice"):
        cmod.parse_contenders("all,fleetgate")
    got = cmod.parse_contenders(" vllm-router-round_robin , fleetgate ")
    assert [c.name for c in got] == ["vllm-router-round_robin", "fleetgate"]


def test_fleetgate_config_gives_capacities_and_scales_class_times() -> None:
    """The router gets each engine's slot limit (as discovery would) and wall-clock objectives."""
    from fleetgate.router.priority.config import DEFAULT_CLASSES, PriorityConfig

    c = cmod.CONTENDERS["fleetgate"]
    raw = cmod.fleetgate_config(
        c, BACKENDS, 3, priority_classes=True, capacities=[8, None], time_scale=8.0
    )
    config = parse_config(raw)
    assert [b.capacity for _, b in config.backends()] == [8, None]
    assert config.priority is not None
    classes = PriorityConfig.model_validate(config.priority).classes
    assert [k.name for k in classes] == [k.name for k in DEFAULT_CLASSES]
    for got, base in zip(classes, DEFAULT_CLASSES, strict=True):
        assert got.ttft_objective_s == base.ttft_objective_s * 8
        assert got.max_queue_time_s == base.max_queue_time_s * 8
        assert got.preempt_after_fraction == base.preempt_after_fraction
        assert got.level == base.level
        assert got.max_preemptions_per_request == base.max_preemptions_per_request
    with pytest.raises(ValueError, match="1 capacities for 2 backends"):
        cmod.fleetgate_config(c, BACKENDS, 3, capacities=[8])


def test_scenario_capacity_follows_the_engine_shape() -> None:
    from fleetgate_tools.bench import scenarios

    sc = scenarios.make("priority-storm", engines=4, duration_s=1, time_scale=8, seed=0)
    assert sc.capacity("vllm") == scenarios.ENGINE_SHAPES["priority"]["vllm"]["max_num_seqs"]
    assert sc.capacity("trtllm") == scenarios.ENGINE_SHAPES["priority"]["trtllm"]["max_batch_size"]


def test_round_robin_ablation_is_the_real_picker_and_in_the_default_set() -> None:
    """The "round robin" contender runs the router's own round-robin picker."""
    from fleetgate.router.scheduling.pipeline import default_pipeline
    from fleetgate.router.scheduling.plugins.round_robin import RoundRobinPicker

    rr = cmod.CONTENDERS["fleetgate-round-robin"]
    assert rr.picker == "round-robin" and rr.weights is None
    assert "fleetgate-round-robin" in cmod.DEFAULT_SET
    assert "fleetgate-random" in cmod.CONTENDERS and "fleetgate-random" not in cmod.DEFAULT_SET
    raw = cmod.fleetgate_config(rr, BACKENDS, 3, capacities=[8, 8])
    assert raw["scheduling"] == {"seed": 3, "picker": "round-robin"}
    # the router app builds its pipeline from this field
    # (tests/router/scheduling/test_round_robin.py runs it end to end)
    picker = default_pipeline(picker=parse_config(raw).scheduling.picker).picker
    assert isinstance(picker, RoundRobinPicker)
    others = [
        c for c in cmod.CONTENDERS.values() if c.kind == "fleetgate" and c is not rr and c.classes
    ]
    assert all(c.picker is None for c in others)


def test_only_default_weight_contenders_route_by_engine_speed() -> None:
    with_speed = {
        n
        for n, c in cmod.CONTENDERS.items()
        if c.kind == "fleetgate"
        and not c.kv_events  # fleetgate-events: checked below, needs the KV-event router
        and parse_config(cmod.fleetgate_config(c, BACKENDS, seed=0)).scheduling.weights.speed > 0
    }
    assert with_speed == {
        "fleetgate",
        "fleetgate-round-robin",
        "round-robin-no-classes",  # its picker ignores every score
        "fleetgate-no-preemption",
        "fleetgate-admission",
        "fleetgate-cold2",
        "fleetgate-lb1",
        "fleetgate-lb025",
        "fleetgate-no-prefill-cost",
        "fleetgate-prefill-greedy",
        "fleetgate-rendezvous",
        "fleetgate-flat-bound",
        "fleetgate-approx",
        "fleetgate-fifo",
        "fleetgate-w1",
    }


def test_prefill_cost_contenders_set_exactly_their_rule() -> None:
    def sched(name: str) -> Scheduling:
        return parse_config(
            cmod.fleetgate_config(cmod.CONTENDERS[name], BACKENDS, seed=0)
        ).scheduling

    default = sched("fleetgate")
    assert (default.prefill_slack, default.prefill_slack_tokens) == (0.25, 512)
    off = sched("fleetgate-no-prefill-cost")
    assert off.prefill_slack is None and off.load_bound == default.load_bound
    greedy = sched("fleetgate-prefill-greedy")
    assert (greedy.prefill_slack, greedy.prefill_slack_tokens) == (0.0, 0)


def test_events_contender_gives_every_backend_its_event_endpoint_and_the_tokenizer() -> None:
    c = cmod.CONTENDERS["fleetgate-events"]
    events = [
        cmod.kv_events_backend("vllm", "tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558"),
        cmod.kv_events_backend("trtllm", None, None),
    ]
    config = cmod.fleetgate_config(c, BACKENDS, seed=1, kv_events=events, router_replicas=2)
    first, second = config["pools"][0]["backends"]
    assert first["kv_events"] == {
        "transport": "zmq",
        "format": "vllm-zmq-msgpack",
        "port": 5557,
        "replay_port": 5558,
        "topic": "kv-events",
    }
    assert second["kv_events"] == {
        "transport": "http-drain",
        "format": "trtllm-http-json",
        "path": "/kv_cache_events",
    }
    assert config["scheduling"]["tokenizers"] == {cmod.MODEL: {"kind": "emulator"}}
    assert config["scheduling"]["router_replicas"] == 2
    # TensorRT-LLM main prints its streaming publisher's sockets: read them as such
    streamed = cmod.kv_events_backend("trtllm", "tcp://127.0.0.1:6001", "tcp://127.0.0.1:6002")
    assert streamed == {
        "transport": "zmq",
        "format": "trtllm-zmq-msgpack",
        "port": 6001,
        "replay_port": 6002,
        "topic": "kv-events",
    }
    # an approximate contender never sends the event sections, even when known
    plain = cmod.fleetgate_config(cmod.CONTENDERS["fleetgate"], BACKENDS, 1, kv_events=events)
    assert all("kv_events" not in b for b in plain["pools"][0]["backends"])
    assert "tokenizers" not in plain["scheduling"]
    with pytest.raises(ValueError, match="every engine must publish"):
        cmod.fleetgate_config(c, BACKENDS, seed=1)
    with pytest.raises(ValueError, match="no KV-event endpoints"):
        cmod.kv_events_backend("vllm", None, None)


def test_events_support_error_names_what_the_router_rejects() -> None:
    from fleetgate.router.config import Backend, Scheduling

    c = cmod.CONTENDERS["fleetgate-events"]
    events = [cmod.kv_events_backend("vllm", "tcp://127.0.0.1:1", "tcp://127.0.0.1:2")] * 2
    config = cmod.fleetgate_config(c, BACKENDS, seed=1, kv_events=events)
    why = cmod.events_support_error(config)
    if "kv_events" not in Backend.model_fields:
        assert why is not None and "does not accept the KV-event config yet" in why
        assert "kv_events" in why
    elif "tokenizers" not in Scheduling.model_fields:
        assert why is not None and "tokenizers" in why
    else:  # both branches merged: the config must validate as written
        assert why is None


def test_router_timeouts_follow_the_time_scale() -> None:
    """Engine-side timeouts are modelled time: at scale 25 a stream may be silent for
    15 x 25 wall seconds (vLLM) before the router fails it over."""
    c = cmod.CONTENDERS["fleetgate"]
    cfg = cmod.fleetgate_config(c, BACKENDS, 3, time_scale=25.0)
    t = cfg["timeouts"]
    assert t["stream_idle_s"] == {"vllm": 375.0, "trtllm": 250.0}
    assert (t["first_byte_s"], t["idle_s"], t["total_s"]) == (7500.0, 3000.0, 45000.0)
    assert "connect_s" not in t
    # a /metrics or /health answer late by the emulator's wall clock is not a sick engine
    assert cfg["scrape"] == {"timeout_s": 25.0} and cfg["health"] == {"timeout_s": 25.0}
    unscaled = cmod.fleetgate_config(c, BACKENDS, 3)
    assert "timeouts" not in unscaled and "scrape" not in unscaled and "health" not in unscaled
    parsed = parse_config(cfg)  # the router takes it
    assert parsed.scrape.timeout_s == 25.0 and parsed.scrape.interval_s == 0.2
    assert parsed.health.timeout_s == 25.0 and parsed.health.interval_s == 1.0
