"""Router configuration: one pydantic model, loaded from YAML and/or CLI flags.

Every model forbids unknown keys, so a typo is an error that names the field
(``scheduling.weights.prefx: Extra inputs are not permitted``). Defaults are
what ``fleetgate router --backend ...`` runs with.

Example::

    test_mode: false
    pools:
      - name: chat
        backends:
          - {engine: vllm, url: "http://10.0.0.5:8000"}
          - {engine: trtllm, url: "http://10.0.0.6:8000"}
    scheduling: {weights: {prefix: 3, load: 2, kv: 1, speed: 1}, seed: 0}
    scrape: {interval_s: 0.2}
"""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml
from pydantic import (
    Field,
    ValidationError,
    model_validator,
)

from fleetgate.router.config_policy import (
    ApiKeyEntry as ApiKeyEntry,
)
from fleetgate.router.config_policy import (
    ApiKeys as ApiKeys,
)
from fleetgate.router.config_policy import (
    EnginePriority as EnginePriority,
)
from fleetgate.router.config_policy import (
    IdentitySection as IdentitySection,
)
from fleetgate.router.config_policy import (
    KeysFileDoc as KeysFileDoc,
)
from fleetgate.router.config_policy import (
    PrioritySection as PrioritySection,
)
from fleetgate.router.config_policy import (
    TenantLimit as TenantLimit,
)
from fleetgate.router.config_policy import (
    TenantLimits as TenantLimits,
)
from fleetgate.router.config_policy import (
    TrustedGateway as TrustedGateway,
)
from fleetgate.router.config_runtime import (
    DEFAULT_STREAM_IDLE_S as DEFAULT_STREAM_IDLE_S,
)
from fleetgate.router.config_runtime import (
    Health as Health,
)
from fleetgate.router.config_runtime import (
    Limits as Limits,
)
from fleetgate.router.config_runtime import (
    Scrape as Scrape,
)
from fleetgate.router.config_runtime import (
    Timeouts as Timeouts,
)
from fleetgate.router.config_sections import (
    Backend as Backend,
)
from fleetgate.router.config_sections import (
    BackendKvEvents as BackendKvEvents,
)
from fleetgate.router.config_sections import (
    Discovery as Discovery,
)
from fleetgate.router.config_sections import (
    KvEventsSection as KvEventsSection,
)
from fleetgate.router.config_sections import (
    ModelEntry as ModelEntry,
)
from fleetgate.router.config_sections import (
    Pool as Pool,
)
from fleetgate.router.config_sections import (
    Scheduling as Scheduling,
)
from fleetgate.router.config_sections import (
    TokenizerSpec as TokenizerSpec,
)
from fleetgate.router.config_sections import (
    Weights as Weights,
)
from fleetgate.router.config_sections import (
    _Strict as _Strict,
)
from fleetgate.router.priority.config import PriorityConfig


class RouterConfig(_Strict):
    test_mode: bool = False
    """Refuse every non-loopback backend (also forced by FLEETGATE_TEST_MODE=1)."""
    pools: tuple[Pool, ...] = ()
    scheduling: Scheduling = Scheduling()
    scrape: Scrape = Scrape()
    health: Health = Health()
    timeouts: Timeouts = Timeouts()
    limits: Limits = Limits()
    discovery: Discovery = Discovery()
    kv_events: KvEventsSection = KvEventsSection()
    identity: IdentitySection | None = None
    """API keys, a trusted gateway, per-tenant limits. Absent: any client may name any
    tenant and class (docs/deploy.md)."""
    models: dict[str, ModelEntry] = Field(default_factory=dict)
    """Models by served name; ``scale_from_zero: true`` makes a model known (and its
    requests held, docs/router.md) while no backend serves it."""
    resume_streams: bool = True
    """Streams go through the splicer so that one cut short (its engine died, froze or
    was drained) resumes on another engine and the client sees one seamless answer.
    ``false``, only without a ``priority:`` section (preemption needs the splicer):
    streams are relayed as raw bytes, about 0.3 ms less router CPU and 0.4 ms less
    added TTFT per 16-token stream (docs/bench.md), and a stream whose engine dies
    ends with an error event instead of resuming."""
    priority: PrioritySection | None = None
    """Admission queue and preemption over priority classes. Absent: requests are
    admitted at once (no queue, no preemption) but still get a class (the default
    classes) for their objective, metrics and engine priority; ``priority: {}`` turns
    the queue on with the default classes (the Helm chart's default)."""

    @model_validator(mode="after")
    def _resume_with_preemption(self) -> RouterConfig:
        if not self.resume_streams and self.priority is not None:
            raise ValueError(
                "resume_streams: false needs no priority section (preemption resumes "
                "streams through the splicer)"
            )
        return self

    @model_validator(mode="after")
    def _scrape_within_saturation_age(self) -> RouterConfig:
        """A quiet endpoint's scrape must still count as fresh for the saturation check
        when work arrives (age up to the idle interval plus one tick). Only the slowdown
        the event feeds add is checked: a base ``interval_s`` slower than the limit was
        accepted before feeds existed (the check then reads such scrapes as unknown)."""
        idle = self.scrape.pace().idle_s
        limit = self.classes.saturation.max_scrape_age_s
        slower = idle is not None and idle > self.scrape.interval_s  # only what events add
        if slower and idle is not None and idle + self.scrape.interval_s > limit:
            raise ValueError(
                f"scrape.idle_interval_with_events_s ({idle}) + scrape.interval_s "
                f"({self.scrape.interval_s}) exceeds priority.saturation.max_scrape_age_s "
                f"({limit}): an idle endpoint would read as unknown when work arrives"
            )
        return self

    @property
    def classes(self) -> PriorityConfig:
        """The priority classes in force (the default ones without a section)."""
        return self.priority if self.priority is not None else _DEFAULT_CLASSES

    @property
    def engine_priority(self) -> EnginePriority:
        return self.priority.engine_priority if self.priority is not None else EnginePriority()

    @property
    def effective_test_mode(self) -> bool:
        return self.test_mode or os.environ.get("FLEETGATE_TEST_MODE") == "1"

    def backends(self) -> list[tuple[str, Backend]]:
        """(pool name, backend) for every backend, ids checked unique."""
        out: list[tuple[str, Backend]] = []
        seen: set[str] = set()
        for pool in self.pools:
            for b in pool.backends:
                if b.endpoint_id in seen:
                    raise ConfigError(f"pools: duplicate endpoint {b.endpoint_id!r}")
                seen.add(b.endpoint_id)
                out.append((pool.name, b))
        return out

    def check_loopback(self) -> None:
        """In test mode every backend must be a 127.0.0.0/8 (or ::1) literal."""
        if not self.effective_test_mode:
            return
        for _, b in self.backends():
            host = urlsplit(b.url).hostname or ""
            if not is_loopback_host(host):
                raise ConfigError(f"test mode: backend {b.url!r} is not a loopback address")


_DEFAULT_CLASSES = PriorityConfig()


class ConfigError(ValueError):
    """A configuration problem, as one line naming the field."""


def is_loopback_host(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def describe_validation_error(err: ValidationError) -> str:
    """A pydantic error as one line naming each field path."""
    return _describe(err)


def _describe(err: ValidationError) -> str:
    items = []
    for e in err.errors():
        where = ".".join(str(p) for p in e["loc"]) or "(top level)"
        items.append(f"{where}: {e['msg']}")
    return "; ".join(items)


def parse_config(data: Any) -> RouterConfig:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError("config must be a YAML mapping at the top level")
    try:
        return RouterConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_describe(e)) from None


def load_config(path: str | Path) -> RouterConfig:
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: invalid YAML: {e}") from None
    try:
        return parse_config(data)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None


def parse_backend_flag(flag: str) -> Backend:
    """``ENGINE=URL[,OPTION=VALUE...]`` from ``--backend``.

    Options (what ``fleetgate sim --kv-events`` prints, so its lines paste in):
    ``kv_events=tcp://HOST:PORT`` (ZeroMQ PUB, HOST the URL's), ``kv_replay=tcp://HOST:PORT``,
    ``kv_topic=TOPIC``, or ``kv_events=http-drain:/PATH`` (TensorRT-LLM); ``kv_ranks=N``
    and ``kv_rank_choice=load|cache`` (attention-DP ranks); ``schedulers=N`` (default: the
    ranks); ``name=ID``.
    """
    engine, sep, rest = flag.partition("=")
    url, *options = rest.split(",")
    if not sep or not engine or not url:
        raise ConfigError(
            f"--backend {flag!r}: expected ENGINE=URL, e.g. vllm=http://127.0.0.1:8000"
        )
    fields: dict[str, Any] = {"engine": engine, "url": url}
    kv: dict[str, Any] = {}
    for option in options:
        key, eq, value = option.partition("=")
        if not eq or not value:
            raise ConfigError(f"--backend {flag!r}: option {option!r} is not KEY=VALUE")
        if key == "name":
            fields["name"] = value
        elif key == "kv_events" and value.startswith("http-drain:"):
            kv.update(transport="http-drain", path=value.removeprefix("http-drain:"))
        elif key in ("kv_events", "kv_replay"):
            kv["port" if key == "kv_events" else "replay_port"] = _tcp_port(flag, url, value)
        elif key == "kv_topic":
            kv["topic"] = value
        elif key == "kv_ranks":
            kv["ranks"] = value
        elif key == "kv_rank_choice":
            kv["rank_choice"] = value
        elif key == "schedulers":
            fields["schedulers"] = value
        else:
            raise ConfigError(
                f"--backend {flag!r}: unknown option {key!r} (name, kv_events, kv_replay, "
                "kv_topic, kv_ranks, kv_rank_choice, schedulers)"
            )
    if kv:
        fields["kv_events"] = kv
    try:
        return Backend(**fields)
    except ValidationError as e:
        raise ConfigError(f"--backend {flag!r}: {_describe(e)}") from None


def _tcp_port(flag: str, url: str, value: str) -> int:
    """The port of ``tcp://HOST:PORT``, whose HOST must be the backend URL's."""
    parts = urlsplit(value)
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme != "tcp" or port is None:
        raise ConfigError(f"--backend {flag!r}: {value!r} is not tcp://HOST:PORT")
    if parts.hostname != urlsplit(url).hostname:
        raise ConfigError(
            f"--backend {flag!r}: {value!r}: events are read on the backend's own host "
            f"{urlsplit(url).hostname!r}"
        )
    return port


def with_backends(config: RouterConfig, flags: list[str]) -> RouterConfig:
    """Add ``--backend`` flags as (or into) the pool named ``default``."""
    if not flags:
        return config
    extra = tuple(parse_backend_flag(f) for f in flags)
    pools = list(config.pools)
    for i, pool in enumerate(pools):
        if pool.name == "default":
            pools[i] = pool.model_copy(update={"backends": pool.backends + extra})
            break
    else:
        pools.append(Pool(name="default", backends=extra))
    return config.model_copy(update={"pools": tuple(pools)})


def parse_tokenizer_flag(flag: str) -> tuple[str, TokenizerSpec]:
    """``MODEL=hf:DIR`` or ``MODEL=emulator`` from ``--tokenizer``."""
    model, sep, rest = flag.partition("=")
    kind, _, path = rest.partition(":")
    if not sep or not model or kind not in ("hf", "emulator"):
        raise ConfigError(
            f"--tokenizer {flag!r}: expected MODEL=hf:DIR or MODEL=emulator, "
            "e.g. llama=hf:/models/llama"
        )
    try:
        return model, TokenizerSpec(kind=kind, path=path or None)
    except ValidationError as e:
        raise ConfigError(f"--tokenizer {flag!r}: {_describe(e)}") from None


def with_tokenizers(config: RouterConfig, flags: list[str]) -> RouterConfig:
    """Add ``--tokenizer`` flags to ``scheduling.tokenizers`` (a flag wins over the file)."""
    if not flags:
        return config
    found = dict(config.scheduling.tokenizers)
    found.update(parse_tokenizer_flag(f) for f in flags)
    sched = config.scheduling.model_copy(update={"tokenizers": found})
    return config.model_copy(update={"scheduling": sched})
