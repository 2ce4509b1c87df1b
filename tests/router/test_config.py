"""Router config (YAML, pydantic) and the ``fleetgate router`` CLI's one-line errors.

We test these aspects:
* a typo or bad value is an error naming the field path;
* ``--backend ENGINE=URL`` parsing and merging into the default pool;
* duplicate endpoints, non-loopback backends in test mode, missing backends;
* the CLI exits 2 with one line for each user error.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fleetgate.cli import main
from fleetgate.router.app import build_fleet, pipeline_for
from fleetgate.router.config import (
    ConfigError,
    RouterConfig,
    load_config,
    parse_backend_flag,
    parse_config,
    with_backends,
)
from fleetgate.router.scheduling.plugins.prefix_affinity import PrefixAffinityScorer


@pytest.mark.parametrize(
    ("data", "where"),
    [
        pytest.param(
            {"scheduling": {"weights": {"prefx": 1}}}, "scheduling.weights.prefx", id="typo"
        ),
        pytest.param(
            {"scheduling": {"weights": {"load": -1}}}, "scheduling.weights.load", id="neg"
        ),
        pytest.param({"scrape": {"interval_s": 0}}, "scrape.interval_s", id="zero-interval"),
        pytest.param(
            {"pools": [{"backends": [{"engine": "sglang", "url": "http://127.0.0.1:1"}]}]},
            "pools.0.backends.0.engine",
            id="unknown-engine",
        ),
        pytest.param(
            {"pools": [{"backends": [{"engine": "vllm", "url": "127.0.0.1:1"}]}]},
            "pools.0.backends.0.url",
            id="url-without-scheme",
        ),
    ],
)
def test_errors_name_the_field(data: dict[str, object], where: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(data)
    assert str(err.value).startswith(where), str(err.value)


def test_yaml_file_and_backend_flags(tmp_path: Path) -> None:
    path = tmp_path / "router.yaml"
    path.write_text(
        "pools:\n"
        "  - name: default\n"
        "    backends:\n"
        "      - {engine: vllm, url: 'http://127.0.0.1:18100/', capacity: 16}\n"
        "scheduling: {seed: 7, weights: {prefix: 4}}\n"
    )
    config = with_backends(load_config(path), ["trtllm=http://127.0.0.1:18101"])
    assert config.scheduling.seed == 7 and config.scheduling.weights.prefix == 4
    backends = config.backends()
    assert [(p, b.engine, b.url) for p, b in backends] == [
        ("default", "vllm", "http://127.0.0.1:18100"),
        ("default", "trtllm", "http://127.0.0.1:18101"),
    ]
    assert backends[0][1].endpoint_id == "127.0.0.1:18100"
    (tmp_path / "bad.yaml").write_text("pools: [\n")
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_config(tmp_path / "bad.yaml")
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")


@pytest.mark.parametrize(
    "flag", ["vllm", "=http://127.0.0.1:1", "vllm=", "nope=http://127.0.0.1:1", "vllm=ftp://x"]
)
def test_bad_backend_flags(flag: str) -> None:
    with pytest.raises(ConfigError, match="--backend"):
        parse_backend_flag(flag)


def test_duplicates_and_loopback() -> None:
    dup = with_backends(RouterConfig(), ["vllm=http://127.0.0.1:1", "vllm=http://127.0.0.1:1"])
    with pytest.raises(ConfigError, match="duplicate endpoint"):
        dup.backends()
    remote = with_backends(RouterConfig(test_mode=True), ["vllm=http://192.0.2.1:8000"])
    with pytest.raises(ConfigError, match="not a loopback"):
        remote.check_loopback()
    named = with_backends(RouterConfig(test_mode=True), ["vllm=http://engine.local:8000"])
    with pytest.raises(ConfigError, match="not a loopback"):
        named.check_loopback()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        pytest.param(["--port", "18200"], "no backends", id="no-backends"),
        pytest.param(["--port", "18200", "--backend", "x=y"], "--backend", id="bad-backend"),
        pytest.param(["--port", "0", "--backend", "vllm=http://127.0.0.1:1"], "--port", id="port"),
        pytest.param(
            ["--port", "18200", "--config", "/nonexistent/router.yaml"], "cannot read", id="config"
        ),
        pytest.param(
            ["--port", "18200", "--backend", "vllm=http://192.0.2.1:1"],
            "not a loopback",
            id="test-mode",
        ),
    ],
)
def test_cli_user_errors(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["router", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("fleetgate router: error:") and message in err
    assert len(err.splitlines()) == 1


def test_cli_kubernetes_discovery_settings_are_checked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "router.yaml"
    path.write_text("discovery: {kind: kubernetes, kubernetes: {sourc: pods}}\n")
    assert main(["router", "--port", "18201", "--config", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "discovery.kubernetes.sourc" in err and len(err.splitlines()) == 1
    with pytest.raises(ConfigError, match="discovery.kind"):
        parse_config({"discovery": {"kind": "consul"}})


def test_cli_bad_kubeconfig_for_discovery_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from fleetgate.cli import main

    broken = tmp_path / "kubeconfig"
    broken.write_text("this is: [not a kubeconfig")
    cfg = tmp_path / "router.yaml"
    cfg.write_text(
        "discovery:\n  kind: kubernetes\n  kubernetes:\n"
        f"    kubeconfig: {broken}\n    source: pods\n"
    )
    assert main(["router", "--port", "18999", "--config", str(cfg)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("fleetgate router: error:"), err
    assert len(err.splitlines()) == 1, err


@pytest.mark.parametrize(
    ("scheduling", "effective"),
    [
        ({}, None),  # one router: every endpoint is a candidate for a new prefix
        ({"router_replicas": 2}, 1),  # replicas: rendezvous, so they agree
        ({"router_replicas": 3, "cold_choices": "all"}, None),
        ({"cold_choices": 2}, 2),
        ({"router_replicas": 2, "cold_choices": 2}, 2),
    ],
)
def test_cold_choices_follow_the_router_replica_count(
    scheduling: dict[str, object], effective: int | None
) -> None:
    config = parse_config({"pools": [], "scheduling": scheduling})
    assert config.scheduling.effective_cold_choices() == effective


@pytest.mark.parametrize(
    ("scheduling", "effective"),
    [
        ({}, 1.0),  # one router balances by placement: a hot prefix may reach 2x the mean
        ({"router_replicas": 2}, 0.25),  # rendezvous placement: the bound balances
        ({"router_replicas": 2, "load_bound": 0.5}, 0.5),
        ({"load_bound": 0}, 0.0),  # an explicit 0 is kept, not taken for unset
    ],
)
def test_load_bound_follows_the_router_replica_count(
    scheduling: dict[str, object], effective: float
) -> None:
    config = parse_config({"pools": [], "scheduling": scheduling})
    assert config.scheduling.effective_load_bound() == effective


@pytest.mark.parametrize(
    ("scheduling", "effective"),
    [
        ({}, 0.25),  # one router knows every prefill it queued
        ({"router_replicas": 2}, None),  # replicas each see their own: rendezvous instead
        ({"router_replicas": 2, "prefill_slack": 0.5}, 0.5),
        ({"router_replicas": 2, "prefill_slack": 0.25}, 0.25),  # explicit = the default
        ({"prefill_slack": None}, None),  # an explicit null still turns it off
    ],
)
def test_prefill_slack_follows_the_router_replica_count(
    scheduling: dict[str, object], effective: float | None
) -> None:
    config = parse_config({"pools": [], "scheduling": scheduling})
    assert config.scheduling.effective_prefill_slack() == effective


def test_load_bound_rejects_negative() -> None:
    with pytest.raises(ValueError, match="load_bound"):
        parse_config({"pools": [], "scheduling": {"load_bound": -0.1}})


def test_the_router_builds_its_affinity_scorer_from_the_scheduling_section() -> None:
    def scorer(scheduling: dict[str, object]) -> PrefixAffinityScorer:
        pipeline = pipeline_for(parse_config({"pools": [], "scheduling": scheduling}).scheduling)
        found = [w.scorer for w in pipeline.scorers if isinstance(w.scorer, PrefixAffinityScorer)]
        assert len(found) == 1
        return found[0]

    default = scorer({})
    assert (default.load_bound, default.bound_tokens, default.cold_choices) == (1.0, 1640, None)
    assert default.prefill_slack == 0.25
    replicas = scorer({"router_replicas": 2, "load_bound_tokens": None})
    assert (replicas.load_bound, replicas.bound_tokens, replicas.cold_choices) == (0.25, None, 1)
    assert replicas.prefill_slack is None


def test_load_bound_tokens_default_null_and_bad_values() -> None:
    assert parse_config({"pools": []}).scheduling.load_bound_tokens == 1640
    flat = {"pools": [], "scheduling": {"load_bound_tokens": None}}
    assert parse_config(flat).scheduling.load_bound_tokens is None
    with pytest.raises(ValueError, match="load_bound_tokens"):
        parse_config({"pools": [], "scheduling": {"load_bound_tokens": 0}})


@pytest.mark.parametrize("bad", [0, -1, "some", 1.5])
def test_cold_choices_rejects_other_values(bad: object) -> None:
    with pytest.raises(ConfigError, match="cold_choices"):
        parse_config({"pools": [], "scheduling": {"cold_choices": bad}})


def test_byte_chunk_keys_of_older_configs_still_load_as_token_chunks() -> None:
    """chunk_bytes / bytes_per_token (byte-sized chunks) became chunk_tokens; a config
    that used them keeps loading, with the same chunk size in tokens."""
    from fleetgate.router.config import Scheduling

    assert Scheduling.model_validate({"chunk_bytes": 256, "bytes_per_token": 4}).chunk_tokens == 64
    assert Scheduling.model_validate({"chunk_bytes": 64}).chunk_tokens == 16
    assert Scheduling.model_validate({"chunk_tokens": 8, "chunk_bytes": 256}).chunk_tokens == 8
    with pytest.raises(ValueError, match="bytes_per_token"):
        Scheduling.model_validate({"chunk_bytes": 256, "bytes_per_token": 0})


def test_models_that_scale_from_zero_and_their_bounds() -> None:
    cfg = parse_config(
        {
            "models": {
                "llama": {"scale_from_zero": True, "cold_start_s": 30, "pool": "chat"},
                "plain": {},
            },
            "limits": {"max_held_requests": 5, "hold_cold_start_factor": 2},
        }
    )
    assert (cfg.limits.max_held_requests, cfg.limits.hold_cold_start_factor) == (5, 2.0)
    assert cfg.limits.default_cold_start_s == 60.0
    fleet = build_fleet(cfg)
    assert list(fleet.standby) == ["llama"]  # only scale_from_zero models
    sb = fleet.standby["llama"]
    assert (sb.pool, sb.cold_start_s, sb.source) == ("chat", 30.0, "config")
    assert fleet.models(healthy_only=False, now=0.0) == ["llama"]  # no backend at all
    assert fleet.models(healthy_only=True, now=0.0) == []
    with pytest.raises(ConfigError, match=r"models.llama.cold_start_s"):
        parse_config({"models": {"llama": {"scale_from_zero": True, "cold_start_s": 0}}})
    with pytest.raises(ConfigError, match=r"models.llama.scale_from_zro"):
        parse_config({"models": {"llama": {"scale_from_zro": True}}})
    with pytest.raises(ConfigError, match=r"limits.hold_cold_start_factor"):
        parse_config({"limits": {"hold_cold_start_factor": 0}})


def test_a_slow_scrape_interval_keeps_loading_with_the_event_intervals_unset() -> None:
    """The event-feed intervals default to at least ``interval_s``; only an explicit
    shorter one is an error."""
    slow = parse_config({"scrape": {"interval_s": 60.0}}).scrape
    assert (slow.interval_with_events_s, slow.idle_interval_with_events_s) == (60.0, 60.0)
    default = parse_config({}).scrape
    assert (default.interval_with_events_s, default.idle_interval_with_events_s) == (0.5, 1.5)
    off = parse_config({"scrape": {"interval_with_events_s": None}}).scrape
    assert off.interval_with_events_s is None
    with pytest.raises(ConfigError, match="interval_with_events_s must be >= interval_s"):
        parse_config({"scrape": {"interval_s": 2.0, "interval_with_events_s": 1.0}})
