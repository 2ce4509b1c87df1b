"""The router configuration's sections for who may ask for what: engine priority,
priority classes and the identity layer (API keys, a trusted gateway, tenant limits).
``fleetgate.router.config`` puts them together in ``RouterConfig``."""

from __future__ import annotations

import ipaddress
from typing import Any, Literal

from pydantic import (
    Field,
    field_validator,
    model_validator,
)

from fleetgate.router.config_sections import _Strict
from fleetgate.router.priority.config import PriorityConfig


class EnginePriority(_Strict):
    """Which endpoints get the engine's own priority field (``priority.engine_priority``).

    vLLM's API documents a non-zero ``priority`` as an error unless the engine runs
    ``--scheduling-policy priority`` (the emulator and operator-made vLLM do); the real
    vLLM 0.32 accepts it under FCFS and ignores it (200 for priority 1 and -3 on both
    endpoints, checked on 2026-12-07), so the field only orders a priority queue. Turn it
    off per pool or endpoint for engines that run FCFS, or a release that rejects it.
    """

    default: bool = True
    pools: dict[str, bool] = Field(default_factory=dict)
    endpoints: dict[str, bool] = Field(default_factory=dict)

    def enabled(self, pool: str, endpoint: str) -> bool:
        if endpoint in self.endpoints:
            return self.endpoints[endpoint]
        return self.pools.get(pool, self.default)


class PrioritySection(PriorityConfig):
    """The ``priority:`` section: classes, admission queue and preemption.

    Every field of :class:`~fleetgate.router.priority.config.PriorityConfig`, plus
    ``engine_priority`` and ``preemption`` (alias of ``preemption_enabled``, the
    ablation switch).
    """

    engine_priority: EnginePriority = EnginePriority()

    @model_validator(mode="before")
    @classmethod
    def _preemption_alias(cls, data: Any) -> Any:
        if isinstance(data, dict) and "preemption" in data:
            if "preemption_enabled" in data:
                raise ValueError("give 'preemption' or 'preemption_enabled', not both")
            data = dict(data)
            data["preemption_enabled"] = data.pop("preemption")
        return data


class ApiKeys(_Strict):
    """``identity.api_keys``: every request needs a key from ``keys_file``."""

    keys_file: str | None = None
    """A YAML/JSON file ``{keys: [{key | key_sha256, tenant, max_class, default_class,
    name}]}``, typically a mounted Secret; re-read when it changes. Required (the Helm
    chart sets it from ``router.identity.apiKeysSecret``)."""
    reload_s: float = Field(5.0, gt=0)
    """How often the file is checked for a change."""
    above_max_class: Literal["reject", "lower"] = "reject"
    """A request above its key's ``max_class``: ``reject`` (403) or ``lower`` it."""

    @model_validator(mode="after")
    def _has_file(self) -> ApiKeys:
        if not self.keys_file:
            raise ValueError(
                "keys_file is required (a path; the chart: router.identity.apiKeysSecret)"
            )
        return self


class TrustedGateway(_Strict):
    """``identity.trusted_gateway``: the tenant/priority headers are honoured only on
    requests from this gateway (either test passes: the secret header, or a source
    address in ``source_cidrs``)."""

    secret_header: str = "x-fleetgate-gateway-secret"
    secret_file: str | None = None
    """File holding the shared secret the gateway sends in ``secret_header``."""
    source_cidrs: tuple[str, ...] = ()
    """Addresses of the gateway (e.g. its pods' CIDR). Behind a load balancer that
    does not keep client addresses, use the secret instead."""

    @field_validator("source_cidrs")
    @classmethod
    def _cidrs(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for c in value:
            try:
                ipaddress.ip_network(c, strict=False)
            except ValueError:
                raise ValueError(f"{c!r} is not an IP network (CIDR)") from None
        return value

    @model_validator(mode="after")
    def _some_test(self) -> TrustedGateway:
        if self.secret_file is None and not self.source_cidrs:
            raise ValueError("give secret_file or source_cidrs (or both)")
        return self


class TenantLimit(_Strict):
    requests_per_s: float | None = Field(None, gt=0, allow_inf_nan=False)
    """Sustained requests per second (token bucket); null: no rate limit."""
    burst: int | None = Field(None, ge=1)
    """Bucket size (requests at once after a quiet spell); default max(1, rate)."""
    max_concurrent: int | None = Field(None, ge=1)
    """Requests in progress at once; null: no limit."""


class TenantLimits(_Strict):
    """``identity.tenant_limits``: beyond a limit, 429 + Retry-After."""

    default: TenantLimit | None = None
    """For every tenant not listed in ``tenants``; null: unlimited."""
    tenants: dict[str, TenantLimit] = Field(default_factory=dict)


class IdentitySection(_Strict):
    """The ``identity:`` section (fleetgate/router/identity.py, docs/deploy.md)."""

    api_keys: ApiKeys | None = None
    trusted_gateway: TrustedGateway | None = None
    tenant_limits: TenantLimits = TenantLimits()


class ApiKeyEntry(_Strict):
    """One entry of the keys file."""

    key: str | None = Field(None, min_length=16)
    key_sha256: str | None = Field(None, pattern=r"^[0-9a-fA-F]{64}$")
    """The key's SHA-256 in hex, for a file that should not hold the key itself."""
    tenant: str = Field(min_length=1, max_length=128)
    max_class: str
    default_class: str | None = None
    name: str | None = None
    """A label for logs and errors (never the key)."""

    @model_validator(mode="after")
    def _one_key(self) -> ApiKeyEntry:
        if (self.key is None) == (self.key_sha256 is None):
            raise ValueError("give exactly one of key, key_sha256")
        return self


class KeysFileDoc(_Strict):
    keys: tuple[ApiKeyEntry, ...] = ()
