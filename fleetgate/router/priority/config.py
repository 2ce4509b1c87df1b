"""Priority classes: configuration, validation and per-request resolution.

A *priority class* is a named bundle of scheduling policy (level, TTFT
objective, shedding, queue limits, preemption rights) configured in the router
YAML under ``priority:`` (see :class:`PriorityConfig`). Every request belongs to
exactly one class, resolved by :func:`resolve_class`:

1. the ``x-fleetgate-priority`` header: a class name (case-insensitive), or a
   value of :attr:`PriorityConfig.body_priority_map` (the only way an integer
   means a class: ``{"5": "critical"}``);
2. else the OpenAI-style ``priority`` body field, looked up in
   :attr:`PriorityConfig.body_priority_map` (keys are the field's value as a
   string, so ``3`` and ``"3"`` are the same key) and, failing that, as a class
   name; an unmapped ``0`` (vLLM's default value) counts as not set;
3. else :attr:`PriorityConfig.default_class` (``standard``).

When both are given the header wins and the body value is not even looked at.
An unknown name raises :class:`UnknownPriorityClass`, which carries the HTTP
status (400) and an OpenAI/vLLM-shaped error body
(``{"error": {"message", "type", "param", "code"}}``, the envelope a real vLLM 0.32
answers a string ``priority`` with; recording ``err_priority_string.json``).

Levels are integers in ``[LEVEL_MIN, LEVEL_MAX]`` from
:mod:`fleetgate.engines.base`; higher is more urgent and ``0`` is standard. The
router never forwards the client's ``priority`` field: it replaces it with the
engine adapter's ``priority_fields(level)`` (vLLM ``priority`` int where lower
is sooner; TensorRT-LLM a float in [0, 1] where higher is sooner), see
:func:`engine_priority_body`.

Invariants (checked at load time): class names are unique DNS-label-like
strings, levels are unique (so "strictly lower class" and queue order are
total), every mapped class exists.

Pure: no I/O, no clock.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from fleetgate.engines.base import LEVEL_MAX, LEVEL_MIN
from fleetgate.router.priority.saturation import SaturationThresholds

PRIORITY_HEADER = "x-fleetgate-priority"
TENANT_HEADER = "x-fleetgate-tenant"
DEFAULT_TENANT = "default"
_TENANT_MAX_LEN = 128


class PriorityError(Exception):
    """Base of the request errors raised here; each knows its HTTP answer."""

    status: int = 400
    param: str | None = None
    err_type: str = "BadRequestError"

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if param is not None:
            self.param = param

    def openai_body(self) -> dict[str, Any]:
        """The OpenAI/vLLM error envelope for this error."""
        return {
            "error": {
                "message": self.message,
                "type": self.err_type,
                "param": self.param,
                "code": self.status,
            }
        }


class UnknownPriorityClass(PriorityError):
    """The request named a class (by header or body) that is not configured."""


class InvalidTenant(PriorityError):
    """The tenant header is empty after trimming, too long or not printable."""


class PriorityClass(BaseModel):
    """One priority class.

    ``preempt_after_fraction``: a queued request of this class may preempt
    in-flight work of a strictly lower class once it has waited this fraction of
    its ``ttft_objective_s``; ``None`` means it never preempts.
    ``max_preemptions_per_request``: how often one request of this class may be
    preempted (0 = never a victim).
    ``retry_after_s`` goes into the ``Retry-After`` header of 429/503 answers.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(pattern=r"^[a-z0-9]([a-z0-9_.-]{0,61}[a-z0-9])?$")
    level: int = Field(ge=LEVEL_MIN, le=LEVEL_MAX)
    ttft_objective_s: float = Field(gt=0, allow_inf_nan=False)
    sheddable: bool = False
    max_queue_time_s: float = Field(gt=0, allow_inf_nan=False)
    max_queued: int = Field(ge=1)
    preempt_after_fraction: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    max_preemptions_per_request: int = Field(default=0, ge=0)
    retry_after_s: int = Field(default=1, ge=0)

    @property
    def preempt_after_s(self) -> float | None:
        """Wait (seconds) after which a queued request of this class may preempt."""
        if self.preempt_after_fraction is None:
            return None
        return self.preempt_after_fraction * self.ttft_objective_s

    def reject_status(self) -> int:
        """429 for sheddable classes, 503 for the others (issue: 'Priority classes')."""
        return 429 if self.sheddable else 503


DEFAULT_CLASSES: tuple[PriorityClass, ...] = (
    PriorityClass(
        name="critical",
        level=8,
        ttft_objective_s=0.5,
        max_queue_time_s=10.0,
        max_queued=1000,
        preempt_after_fraction=0.25,
    ),
    PriorityClass(
        name="standard",
        level=0,
        ttft_objective_s=2.0,
        max_queue_time_s=30.0,
        max_queued=1000,
        preempt_after_fraction=0.5,
        max_preemptions_per_request=1,
    ),
    PriorityClass(
        name="batch",
        level=-5,
        ttft_objective_s=60.0,
        max_queue_time_s=600.0,
        max_queued=10000,
        max_preemptions_per_request=3,
        retry_after_s=5,
    ),
    PriorityClass(
        name="sheddable",
        level=-10,
        ttft_objective_s=10.0,
        sheddable=True,
        max_queue_time_s=10.0,
        max_queued=1000,
        max_preemptions_per_request=2,
        retry_after_s=2,
    ),
)


class PriorityConfig(BaseModel):
    """The ``priority:`` section of the router YAML."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    classes: tuple[PriorityClass, ...] = DEFAULT_CLASSES
    default_class: str = "standard"
    body_priority_map: dict[str, str] = Field(default_factory=dict)
    """OpenAI ``priority`` body value (as a string) -> class name. Unmapped ``0``
    (vLLM's default value, sent by clients that always fill the field) means
    "not set", i.e. :attr:`default_class`."""
    tenant_weights: dict[str, float] = Field(default_factory=dict)
    """Weighted-fair-queueing weight per ``x-fleetgate-tenant`` value."""
    default_tenant_weight: float = Field(default=1.0, gt=0, allow_inf_nan=False)
    preemption_enabled: bool = True
    max_resumes_per_request: int = Field(default=3, ge=0)
    """How often one request may be resumed after its engine failed (not counting
    preemptions, which each class caps); past it the router ends the answer with
    an error instead of looping on a request that kills engines."""
    saturation: SaturationThresholds = Field(default_factory=SaturationThresholds)
    affinity_wait_s: float | None = Field(default=10.0, gt=0, allow_inf_nan=False)
    """Affinity dispatch from the queue: a queued request whose engine (a holder of
    its prompt prefix, else the prefix's rendezvous target) is busy lets later
    requests of its class take a free engine they prefer, for at most this long
    after it was first passed over; after that it takes any free engine (long by
    default: an engine nobody in the window wants goes to the queued request that
    loses least by moving anyway, so the bound only guards against a holder that
    stays busy). ``null``:
    the queue is dispatched strictly in order, each request to the best engine that
    is free then (the behaviour before)."""
    affinity_window: int = Field(default=32, ge=1)
    """How many queued requests of the head's class one dispatch looks at to find one
    whose preferred engine is the free one."""

    @model_validator(mode="after")
    def _check(self) -> PriorityConfig:
        if not self.classes:
            raise ValueError("at least one priority class is required")
        names = [c.name for c in self.classes]
        if len(set(names)) != len(names):
            raise ValueError(f"priority class names must be unique, got {names}")
        levels = [c.level for c in self.classes]
        if len(set(levels)) != len(levels):
            raise ValueError(f"priority class levels must be unique, got {levels}")
        if self.default_class not in names:
            raise ValueError(f"default_class {self.default_class!r} is not one of {names}")
        for key, target in self.body_priority_map.items():
            if target not in names:
                raise ValueError(f"body_priority_map[{key!r}] -> unknown class {target!r}")
        for tenant, weight in self.tenant_weights.items():
            if not (weight > 0 and math.isfinite(weight)):
                raise ValueError(f"tenant weight for {tenant!r} must be > 0, got {weight}")
        return self

    def get(self, name: str) -> PriorityClass:
        """The class called ``name``; ``KeyError`` if absent."""
        for c in self.classes:
            if c.name == name:
                return c
        raise KeyError(name)

    def by_level_desc(self) -> tuple[PriorityClass, ...]:
        """Classes from most to least urgent."""
        return tuple(sorted(self.classes, key=lambda c: -c.level))

    def tenant_weight(self, tenant: str) -> float:
        return self.tenant_weights.get(tenant, self.default_tenant_weight)


def _header(headers: Mapping[str, str], name: str) -> str | None:
    """Case-insensitive header lookup that works on plain dicts too."""
    value = headers.get(name)
    if value is not None:
        return value
    for key, val in headers.items():
        if key.lower() == name:
            return val
    return None


def resolve_class(
    config: PriorityConfig, headers: Mapping[str, str], body: Mapping[str, Any]
) -> PriorityClass:
    """The class of one request (header, then body ``priority``, then default)."""
    names = {c.name: c for c in config.classes}
    header = _header(headers, PRIORITY_HEADER)
    if header is not None:
        key = header.strip().lower()
        if key in names:
            return names[key]
        mapped = config.body_priority_map.get(header.strip())
        if mapped is not None:
            return names[mapped]
        raise UnknownPriorityClass(
            f"unknown priority class {header.strip()!r} in header {PRIORITY_HEADER}; "
            f"known classes: {', '.join(sorted(names))}",
            param=PRIORITY_HEADER,
        )
    raw = body.get("priority")
    if raw is None:
        return names[config.default_class]
    if isinstance(raw, bool) or not isinstance(raw, int | str):
        raise UnknownPriorityClass(
            f"priority must be a class name or a mapped integer, got {type(raw).__name__}",
            param="priority",
        )
    key = str(raw).strip()
    mapped = config.body_priority_map.get(key)
    if mapped is not None:
        return names[mapped]
    if key.lower() in names:
        return names[key.lower()]
    if key == "0":
        return names[config.default_class]
    raise UnknownPriorityClass(
        f"unknown priority {raw!r}; use a class name ({', '.join(sorted(names))})"
        + (
            f" or a mapped value ({', '.join(sorted(config.body_priority_map))})"
            if config.body_priority_map
            else ""
        ),
        param="priority",
    )


def resolve_tenant(headers: Mapping[str, str]) -> str:
    """The WFQ tenant of a request (``x-fleetgate-tenant``, default ``default``)."""
    value = _header(headers, TENANT_HEADER)
    if value is None:
        return DEFAULT_TENANT
    tenant = value.strip()
    if not tenant or len(tenant) > _TENANT_MAX_LEN or not tenant.isprintable():
        raise InvalidTenant(
            f"{TENANT_HEADER} must be 1-{_TENANT_MAX_LEN} printable characters",
            param=TENANT_HEADER,
        )
    return tenant


def engine_priority_body(body: Mapping[str, Any], fields: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``body`` with the client's ``priority`` replaced by the engine's fields.

    ``fields`` is ``adapter.priority_fields(cls.level)``; the client's own value
    is a fleetgate class selector, never meaningful to the engine.
    """
    out = {k: v for k, v in body.items() if k != "priority"}
    out.update(fields)
    return out
