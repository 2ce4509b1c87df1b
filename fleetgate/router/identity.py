"""Who may ask for what: API keys, a trusted upstream gateway, per-tenant limits.

Configured by the router YAML's ``identity:`` section
(:class:`~fleetgate.router.config.IdentitySection`). Three independent parts:

* **API keys** (``identity.api_keys``): a keys file, typically a mounted
  Kubernetes Secret, maps each key to a tenant, the highest class it may use and
  its default class. Keys are kept only as SHA-256 digests in memory; the file is
  re-read when it changes (:class:`KeyFile`, polled by the app), so keys rotate
  without a restart. A request must carry ``Authorization: Bearer <key>`` (or
  ``x-api-key``): without a valid key it gets 401. Its tenant is the key's (the
  ``x-fleetgate-tenant`` header is ignored), its class the one it asks for
  (header or body) up to the key's highest class: above it, 403, or the highest
  class when ``above_max_class: lower``; no class asked for: the key's default.
* **Trusted gateway** (``identity.trusted_gateway``): the tenant and priority
  headers are honoured only on requests that come through the configured gateway
  (a shared secret header, or a source address in the given CIDRs). From anyone
  else they are ignored (default tenant, default class); with API keys on too,
  a gateway request needs no key and every other request does.
* **Per-tenant limits** (``identity.tenant_limits``): requests per second (token
  bucket with a burst) and requests in progress; beyond, 429 + ``Retry-After``.
  A tenant's state is dropped once its bucket is full and nothing is in progress,
  so the memory is bounded by the active tenants.

With no ``identity:`` section every client may name any tenant and any class
(the behaviour of earlier releases; docs/deploy.md says what that means).

Pure apart from :meth:`KeyFile.poll` (reads one file); time comes in as ``now``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import ipaddress
import logging
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from fleetgate.router.config import (
    ApiKeyEntry,
    ConfigError,
    IdentitySection,
    KeysFileDoc,
    TenantLimit,
    describe_validation_error,
)
from fleetgate.router.priority.config import PriorityClass, PriorityConfig

log = logging.getLogger("fleetgate.router.identity")


class IdentityError(Exception):
    """A request refused by the identity layer: answered with ``status``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        retry_after: float | None = None,
        headers: Sequence[tuple[bytes, bytes]] = (),
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.retry_after = retry_after
        self.headers = list(headers)


@dataclasses.dataclass(frozen=True, slots=True)
class Grant:
    """What one request may do, decided before its body is parsed."""

    trusted_headers: bool
    """Honour ``x-fleetgate-tenant`` / ``x-fleetgate-priority`` / body ``priority``."""
    tenant: str | None = None
    """The tenant (an API key's); None: the header's when trusted, else the default."""
    max_class: str | None = None
    default_class: str | None = None
    lower: bool = False
    """Above ``max_class``: lower to it instead of 403."""

    def apply(self, classes: PriorityConfig, cls: PriorityClass, requested: bool) -> PriorityClass:
        """The class the request runs in (raises 403 above the allowed class)."""
        if not requested and self.default_class is not None:
            cls = classes.get(self.default_class)
        if self.max_class is None:
            return cls
        top = classes.get(self.max_class)
        if cls.level <= top.level:
            return cls
        if self.lower:
            return top
        raise IdentityError(
            403,
            f"this API key may use priority classes up to {top.name!r}, not {cls.name!r}",
            param="x-fleetgate-priority",
        )


OPEN = Grant(trusted_headers=True)
UNTRUSTED = Grant(trusted_headers=False)


@dataclasses.dataclass(frozen=True, slots=True)
class KeyRecord:
    tenant: str
    max_class: str
    default_class: str | None


def key_digest(key: str | bytes) -> bytes:
    raw = key.encode() if isinstance(key, str) else key
    return hashlib.sha256(raw).digest()


def parse_keys(text: str, classes: PriorityConfig, where: str) -> dict[bytes, KeyRecord]:
    """The keys file's entries by SHA-256 digest; :class:`ConfigError` naming the entry."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{where}: invalid YAML: {e}") from None
    try:
        doc = KeysFileDoc.model_validate(data if data is not None else {})
    except ValidationError as e:
        raise ConfigError(f"{where}: {describe_validation_error(e)}") from None
    names = {c.name for c in classes.classes}
    out: dict[bytes, KeyRecord] = {}
    for i, entry in enumerate(doc.keys):
        label = f"{where}: keys[{i}]" + (f" ({entry.name})" if entry.name else "")
        for field in ("max_class", "default_class"):
            value = getattr(entry, field)
            if value is not None and value not in names:
                raise ConfigError(
                    f"{label}.{field}: unknown priority class {value!r} "
                    f"(known: {', '.join(sorted(names))})"
                )
        if entry.default_class is not None and (
            classes.get(entry.default_class).level > classes.get(entry.max_class).level
        ):
            raise ConfigError(f"{label}.default_class: above its max_class {entry.max_class!r}")
        digest = _entry_digest(entry)
        if digest in out:
            raise ConfigError(f"{label}: the same key is listed twice")
        out[digest] = KeyRecord(entry.tenant, entry.max_class, entry.default_class)
    return out


def _entry_digest(entry: ApiKeyEntry) -> bytes:
    if entry.key is not None:
        return key_digest(entry.key)
    assert entry.key_sha256 is not None
    return bytes.fromhex(entry.key_sha256)


class KeyFile:
    """The API keys, re-read when the file changes (a Secret update swaps a symlink)."""

    def __init__(self, path: str, classes: PriorityConfig) -> None:
        self.path = path
        self.classes = classes
        self.keys: dict[bytes, KeyRecord] = {}
        self._stamp: tuple[int, int, int] | None = None
        self.loads = 0
        self.poll(strict=True)

    def poll(self, *, strict: bool = False) -> bool:
        """Reload if the file changed. A bad new file keeps the keys in force (logged);
        ``strict`` (start-up): raise :class:`ConfigError` instead. True if reloaded."""
        try:
            st = os.stat(self.path)
            stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
            if stamp == self._stamp:
                return False
            text = Path(self.path).read_text()
            keys = parse_keys(text, self.classes, f"identity.api_keys.keys_file {self.path}")
        except (OSError, ConfigError) as e:
            msg = e if isinstance(e, ConfigError) else f"cannot read {self.path}: {e.strerror}"
            if strict:
                raise ConfigError(str(msg)) from None
            log.error("API keys not reloaded, the previous keys stay in force: %s", msg)
            self._stamp = None if isinstance(e, OSError) else stamp
            return False
        self.keys, self._stamp = keys, stamp
        self.loads += 1
        log.info("API keys loaded from %s: %d keys", self.path, len(keys))
        return True

    def lookup(self, key: str | bytes) -> KeyRecord | None:
        return self.keys.get(key_digest(key))


class Gatekeeper:
    """Decides a request's :class:`Grant` from its headers and source address."""

    def __init__(self, section: IdentitySection | None, classes: PriorityConfig) -> None:
        self.section = section
        self.keys: KeyFile | None = None
        self.lower = False
        self.secret_header: bytes | None = None
        self.secret: bytes | None = None
        self.networks: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = []
        self.gateway = False
        if section is None:
            return
        if section.api_keys is not None:
            assert section.api_keys.keys_file is not None  # the config requires it
            self.keys = KeyFile(section.api_keys.keys_file, classes)
            self.lower = section.api_keys.above_max_class == "lower"
        gw = section.trusted_gateway
        if gw is not None:
            self.gateway = True
            self.networks = [ipaddress.ip_network(c, strict=False) for c in gw.source_cidrs]
            if gw.secret_file is not None:
                try:
                    self.secret = Path(gw.secret_file).read_bytes().strip()
                except OSError as e:
                    raise ConfigError(
                        f"identity.trusted_gateway.secret_file: cannot read "
                        f"{gw.secret_file}: {e.strerror}"
                    ) from None
                if not self.secret:
                    raise ConfigError("identity.trusted_gateway.secret_file: the file is empty")
                self.secret_header = gw.secret_header.lower().encode()

    @property
    def active(self) -> bool:
        return self.section is not None and (self.keys is not None or self.gateway)

    def dropped_headers(self) -> frozenset[bytes]:
        """Credentials that must not reach an engine."""
        out = {b"authorization", b"x-api-key"} if self.keys is not None else set()
        if self.secret_header is not None:
            out.add(self.secret_header)
        return frozenset(out)

    def grant(self, headers: Sequence[tuple[bytes, bytes]], client: Any) -> Grant:
        if not self.active:
            return OPEN
        if self.gateway and self._from_gateway(headers, client):
            return OPEN
        if self.keys is None:
            return UNTRUSTED
        key = _presented_key(headers)
        if key is None:
            raise IdentityError(
                401,
                "an API key is required (Authorization: Bearer <key>)",
                headers=[(b"www-authenticate", b'Bearer realm="fleetgate"')],
            )
        record = self.keys.lookup(key)
        if record is None:
            raise IdentityError(
                401,
                "invalid API key",
                headers=[(b"www-authenticate", b'Bearer realm="fleetgate", error="invalid_token"')],
            )
        return Grant(
            trusted_headers=True,
            tenant=record.tenant,
            max_class=record.max_class,
            default_class=record.default_class,
            lower=self.lower,
        )

    def _from_gateway(self, headers: Sequence[tuple[bytes, bytes]], client: Any) -> bool:
        if self.secret is not None:
            for k, v in headers:
                if k == self.secret_header and hmac.compare_digest(v.strip(), self.secret):
                    return True
        if self.networks and client:
            try:
                addr = ipaddress.ip_address(client[0])
            except (ValueError, TypeError, IndexError):
                return False
            return any(addr in net for net in self.networks)
        return False


def _presented_key(headers: Sequence[tuple[bytes, bytes]]) -> bytes | None:
    for k, v in headers:
        if k == b"authorization":
            scheme, _, token = v.strip().partition(b" ")
            if scheme.lower() == b"bearer" and token.strip():
                return token.strip()
        elif k == b"x-api-key" and v.strip():
            return v.strip()
    return None


@dataclasses.dataclass(slots=True)
class _Bucket:
    tokens: float
    at: float
    active: int = 0


class TenantLimiter:
    """Requests per second (token bucket) and requests in progress, per tenant."""

    def __init__(self, default: TenantLimit | None, tenants: Mapping[str, TenantLimit]) -> None:
        self.default = default
        self.tenants = dict(tenants)
        self.state: dict[str, _Bucket] = {}
        self._sweep_at = 1024

    @property
    def active(self) -> bool:
        return self.default is not None or bool(self.tenants)

    def acquire(self, tenant: str, now: float) -> None:
        """Count one request in (raise 429 with ``Retry-After`` when over a limit)."""
        limit = self.tenants.get(tenant, self.default)
        if limit is None:
            return
        if len(self.state) >= self._sweep_at:
            self.sweep(now)
        b = self.state.get(tenant)
        burst = _burst(limit)
        if b is None:
            b = self.state[tenant] = _Bucket(tokens=burst, at=now)
        if limit.requests_per_s is not None:
            b.tokens = min(burst, b.tokens + (now - b.at) * limit.requests_per_s)
            b.at = now
            if b.tokens < 1.0:
                wait = (1.0 - b.tokens) / limit.requests_per_s
                self._tidy(tenant, b, burst)
                raise IdentityError(
                    429,
                    f"tenant {tenant[:64]!r} is over its rate of {limit.requests_per_s:g} "
                    "requests per second",
                    retry_after=max(1, math.ceil(wait)),
                )
        if limit.max_concurrent is not None and b.active >= limit.max_concurrent:
            raise IdentityError(
                429,
                f"tenant {tenant[:64]!r} has {b.active} requests in progress, its limit",
                retry_after=1,
            )
        if limit.requests_per_s is not None:
            b.tokens -= 1.0
        b.active += 1

    def release(self, tenant: str, now: float) -> None:
        b = self.state.get(tenant)
        if b is None:
            return
        b.active = max(0, b.active - 1)
        limit = self.tenants.get(tenant, self.default)
        if limit is None:
            del self.state[tenant]
            return
        burst = _burst(limit)
        if limit.requests_per_s is not None:
            b.tokens = min(burst, b.tokens + (now - b.at) * limit.requests_per_s)
            b.at = now
        self._tidy(tenant, b, burst)

    def sweep(self, now: float) -> None:
        """Drop every idle tenant whose bucket has refilled (run as the table grows)."""
        for tenant, b in list(self.state.items()):
            limit = self.tenants.get(tenant, self.default)
            if limit is None:
                del self.state[tenant]
                continue
            burst = _burst(limit)
            if limit.requests_per_s is not None:
                b.tokens = min(burst, b.tokens + (now - b.at) * limit.requests_per_s)
                b.at = now
            self._tidy(tenant, b, burst)
        self._sweep_at = max(1024, 2 * len(self.state))

    def _tidy(self, tenant: str, b: _Bucket, burst: float) -> None:
        """Forget a tenant whose bucket is full with nothing in progress (bounded state)."""
        if b.active == 0 and b.tokens >= burst:
            self.state.pop(tenant, None)


def _burst(limit: TenantLimit) -> float:
    if limit.burst is not None:
        return float(limit.burst)
    return float(max(1.0, limit.requests_per_s or 1.0))
