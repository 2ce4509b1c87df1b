"""Priority classes: validation, defaults, request resolution, engine fields."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from fleetgate.engines.base import LEVEL_MAX, LEVEL_MIN
from fleetgate.router.priority.config import (
    DEFAULT_CLASSES,
    InvalidTenant,
    PriorityClass,
    PriorityConfig,
    UnknownPriorityClass,
    engine_priority_body,
    resolve_class,
    resolve_tenant,
)


def _cls(**kw: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "name": "x",
        "level": 1,
        "ttft_objective_s": 1.0,
        "max_queue_time_s": 5.0,
        "max_queued": 10,
    }
    base.update(kw)
    return base


def test_defaults_are_the_four_issue_classes_in_level_order() -> None:
    cfg = PriorityConfig()
    assert [c.name for c in cfg.by_level_desc()] == ["critical", "standard", "batch", "sheddable"]
    assert cfg.default_class == "standard"
    assert cfg.get("standard").level == 0
    assert [c.sheddable for c in DEFAULT_CLASSES] == [False, False, False, True]
    assert all(LEVEL_MIN <= c.level <= LEVEL_MAX for c in DEFAULT_CLASSES)
    assert cfg.get("sheddable").reject_status() == 429
    assert cfg.get("batch").reject_status() == 503
    assert cfg.get("critical").preempt_after_s == pytest.approx(0.125)
    assert cfg.get("batch").preempt_after_s is None


@pytest.mark.parametrize(
    "override",
    [
        pytest.param({"level": LEVEL_MAX + 1}, id="level-too-high"),
        pytest.param({"level": LEVEL_MIN - 1}, id="level-too-low"),
        pytest.param({"ttft_objective_s": 0}, id="zero-ttft"),
        pytest.param({"ttft_objective_s": float("inf")}, id="inf-ttft"),
        pytest.param({"max_queue_time_s": -1}, id="negative-queue-time"),
        pytest.param({"max_queued": -1}, id="negative-max-queued"),
        pytest.param({"max_queued": 0}, id="zero-max-queued"),
        pytest.param({"preempt_after_fraction": 0}, id="zero-fraction"),
        pytest.param({"max_preemptions_per_request": -1}, id="negative-preemptions"),
        pytest.param({"name": "Has Space"}, id="bad-name"),
        pytest.param({"surprise": 1}, id="unknown-field"),
    ],
)
def test_class_validation_rejects(override: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        PriorityClass(**_cls(**override))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        pytest.param({"classes": ()}, "at least one", id="empty"),
        pytest.param(
            {"classes": (_cls(name="a"), _cls(name="a", level=2))}, "unique", id="dup-name"
        ),
        pytest.param({"classes": (_cls(name="a"), _cls(name="b"))}, "levels", id="dup-level"),
        pytest.param(
            {"classes": (_cls(name="a"),), "default_class": "b"}, "default_class", id="bad-default"
        ),
        pytest.param({"body_priority_map": {"1": "nope"}}, "unknown class", id="bad-map"),
        pytest.param({"tenant_weights": {"t": 0.0}}, "weight", id="zero-weight"),
    ],
)
def test_config_validation_rejects(kwargs: dict[str, Any], message: str) -> None:
    if "classes" in kwargs and "default_class" not in kwargs and kwargs["classes"]:
        kwargs = {**kwargs, "default_class": kwargs["classes"][0]["name"]}
    with pytest.raises(ValidationError, match=message):
        PriorityConfig(**kwargs)


def test_config_loads_from_yaml_shaped_dict() -> None:
    cfg = PriorityConfig.model_validate(
        {
            "classes": [_cls(name="gold", level=5), _cls(name="lead", level=-5, sheddable=True)],
            "default_class": "gold",
            "body_priority_map": {"-1": "gold", "high": "gold", "low": "lead"},
            "tenant_weights": {"acme": 3},
            "saturation": {"kv_usage_max": 0.8, "max_scrape_age_s": 0.5},
        }
    )
    assert cfg.saturation.kv_usage_max == 0.8 and cfg.saturation.waiting_max == 0
    assert cfg.get("lead").reject_status() == 429
    assert cfg.tenant_weight("acme") == 3.0
    assert cfg.tenant_weight("other") == 1.0
    with pytest.raises(KeyError):
        cfg.get("standard")


_CFG = PriorityConfig(body_priority_map={"-1": "critical", "urgent": "critical"})


@pytest.mark.parametrize(
    ("headers", "body", "expected"),
    [
        pytest.param({}, {}, "standard", id="missing-is-standard"),
        pytest.param({}, {"priority": None}, "standard", id="null-is-standard"),
        pytest.param({"x-fleetgate-priority": "batch"}, {}, "batch", id="header"),
        pytest.param({"X-Fleetgate-Priority": " Critical "}, {}, "critical", id="header-case"),
        pytest.param({}, {"priority": "batch"}, "batch", id="body-name"),
        pytest.param({}, {"priority": -1}, "critical", id="body-int-mapped"),
        pytest.param({}, {"priority": "-1"}, "critical", id="body-numeric-string-mapped"),
        pytest.param({}, {"priority": 0}, "standard", id="body-zero-is-unset"),
        pytest.param({}, {"priority": "0"}, "standard", id="body-zero-string-is-unset"),
        pytest.param({}, {"priority": "urgent"}, "critical", id="body-alias"),
        pytest.param(
            {"x-fleetgate-priority": "sheddable"},
            {"priority": "critical"},
            "sheddable",
            id="header-wins",
        ),
        pytest.param(
            {"x-fleetgate-priority": "batch"},
            {"priority": "no-such"},
            "batch",
            id="header-wins-over-bad-body",
        ),
    ],
)
def test_resolve_class(headers: dict[str, str], body: dict[str, Any], expected: str) -> None:
    assert resolve_class(_CFG, headers, body).name == expected


@pytest.mark.parametrize(
    ("headers", "body", "param"),
    [
        pytest.param({"x-fleetgate-priority": "gold"}, {}, "x-fleetgate-priority", id="header"),
        pytest.param({"x-fleetgate-priority": ""}, {}, "x-fleetgate-priority", id="empty-header"),
        pytest.param({}, {"priority": "gold"}, "priority", id="body-name"),
        pytest.param({}, {"priority": 7}, "priority", id="unmapped-int"),
        pytest.param({}, {"priority": True}, "priority", id="bool"),
        pytest.param({}, {"priority": 1.5}, "priority", id="float"),
        pytest.param({}, {"priority": ["critical"]}, "priority", id="list"),
    ],
)
def test_unknown_class_is_a_400_with_openai_body(
    headers: dict[str, str], body: dict[str, Any], param: str
) -> None:
    with pytest.raises(UnknownPriorityClass) as info:
        resolve_class(_CFG, headers, body)
    err = info.value
    assert err.status == 400
    out = err.openai_body()
    assert set(out) == {"error"}
    assert out["error"]["type"] == "BadRequestError"
    assert out["error"]["param"] == param
    assert out["error"]["code"] == 400
    assert "priority" in out["error"]["message"]


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        pytest.param({}, "default", id="missing"),
        pytest.param({"x-fleetgate-tenant": "acme"}, "acme", id="plain"),
        pytest.param({"X-FLEETGATE-TENANT": " acme "}, "acme", id="case-and-space"),
    ],
)
def test_resolve_tenant(headers: dict[str, str], expected: str) -> None:
    assert resolve_tenant(headers) == expected


@pytest.mark.parametrize("value", ["", "   ", "a" * 129, "bad\x00tenant"])
def test_bad_tenant_is_a_400(value: str) -> None:
    with pytest.raises(InvalidTenant) as info:
        resolve_tenant({"x-fleetgate-tenant": value})
    assert info.value.status == 400
    assert info.value.openai_body()["error"]["param"] == "x-fleetgate-tenant"


def test_zero_can_be_mapped_and_default_follows_config() -> None:
    cfg = PriorityConfig(default_class="batch", body_priority_map={"5": "critical"})
    assert resolve_class(cfg, {}, {"priority": 0}).name == "batch"
    assert resolve_class(cfg, {}, {}).name == "batch"
    assert resolve_class(cfg, {}, {"priority": 5}).name == "critical"
    cfg = PriorityConfig(body_priority_map={"0": "sheddable"})
    assert resolve_class(cfg, {}, {"priority": 0}).name == "sheddable"


def test_engine_priority_body_replaces_client_priority() -> None:
    body = {"model": "m", "prompt": "p", "priority": "critical"}
    assert engine_priority_body(body, {"priority": -8}) == {
        "model": "m",
        "prompt": "p",
        "priority": -8,
    }
    assert engine_priority_body(body, {}) == {"model": "m", "prompt": "p"}
    assert body["priority"] == "critical"  # input untouched
