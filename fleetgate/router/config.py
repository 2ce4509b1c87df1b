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
from typing import Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from fleetgate.engines import UnknownEngineError, get_adapter
from fleetgate.router.k8s_targets import KubernetesDiscoveryConfig
from fleetgate.router.priority.config import PriorityConfig
from fleetgate.router.served import EngineVersionError, check_version


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class Backend(_Strict):
    engine: str
    """``vllm`` or ``trtllm`` (any adapter name or alias)."""
    url: str
    name: str | None = None
    """Endpoint id in metrics and logs; defaults to ``host:port``."""
    metrics_source: str | None = None
    """Which of the adapter's ``metrics_sources`` to poll (default: its first)."""
    capacity: int | None = Field(None, ge=1)
    """Concurrent sequences (vLLM ``max_num_seqs``, TRT max batch size), used when the
    engine's metrics do not carry it (vLLM's do not)."""
    version: str | None = None
    """Engine release, for engines whose request fields and metrics differ by release
    (TensorRT-LLM: ``1.0.0``, ``1.2.0rc3``, ``main``...; ``fleetgate.router.served``)."""
    served_model: str | None = Field(None, min_length=1)
    """The model name clients use, when the engine lists another (trtllm-serve lists
    its model path): shown by ``/v1/models`` and in answers in its place."""

    @field_validator("engine")
    @classmethod
    def _known_engine(cls, value: str) -> str:
        try:
            return get_adapter(value).name
        except UnknownEngineError as e:
            raise ValueError(str(e.args[0])) from None

    @field_validator("version")
    @classmethod
    def _supported_version(cls, value: str | None, info: ValidationInfo) -> str | None:
        engine = info.data.get("engine")
        if value is None or engine is None:
            return value
        try:
            return check_version(engine, value)
        except EngineVersionError as e:
            raise ValueError(str(e)) from None

    @field_validator("url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"must be an http(s) URL with a host, got {value!r}")
        return value.rstrip("/")

    @property
    def endpoint_id(self) -> str:
        if self.name:
            return self.name
        parts = urlsplit(self.url)
        return f"{parts.hostname}:{parts.port or (443 if parts.scheme == 'https' else 80)}"


class Pool(_Strict):
    name: str = "default"
    backends: tuple[Backend, ...] = ()


class Weights(_Strict):
    prefix: float = Field(3.0, ge=0)
    load: float = Field(2.0, ge=0)
    kv: float = Field(1.0, ge=0)
    speed: float = Field(1.0, ge=0)
    """``engine-speed`` scorer: urgent requests (priority > 0) to the fastest engines,
    batch (< 0) to the slower; neutral for priority 0 and homogeneous fleets
    (``scheduling.plugins.EngineSpeedScorer``; the default is justified on
    ``scheduling.pipeline.PipelineWeights``). 0 turns it off."""


class Scheduling(_Strict):
    weights: Weights = Weights()
    picker: Literal["max-score", "round-robin"] = "max-score"
    """``max-score``: highest weighted score wins (seeded random tie-break).
    ``round-robin``: take turns over the endpoints the filters kept, ignoring
    scores and weights (``fleetgate.router.scheduling.plugins.RoundRobinPicker``).
    Same values as ``scheduling.plugins.PickerName`` (a test keeps them equal)."""
    seed: int = 0
    """Seed of the picker's tie-break random generator."""
    chunk_bytes: int = Field(128, ge=16)
    """Prefix chunk size in rendered bytes (~32 tokens of English)."""
    bytes_per_token: float = Field(4.0, gt=0)
    """Used to estimate prompt tokens without a tokenizer."""
    index_capacity: int = Field(65536, ge=1)
    """Chain hashes remembered per endpoint (LRU)."""
    cold_choices: int | Literal["all"] | None = None
    """Candidates for a prefix no endpoint holds (among those with the least prefill
    backlog, in rendezvous order); the least loaded wins (power of d choices). ``all``:
    every endpoint. 1: plain rendezvous, so router replicas that share no state put a
    new prefix on the same engine. Unset (default): ``all`` when ``router_replicas``
    is 1, else 1 (:meth:`effective_cold_choices`)."""
    router_replicas: int = Field(1, ge=1)
    """Router replicas sharing the traffic (the Helm chart sets it from
    ``router.replicas``). With more than one, new prefixes are placed by rendezvous so
    that replicas agree without sharing state."""
    load_bound: float | None = Field(None, ge=0)
    """Spill when an affinity target's work exceeds ``(1 + load_bound) x`` the pool mean.
    Unset (default): 1.0 when ``router_replicas`` is 1, else 0.25
    (:meth:`effective_load_bound`)."""
    load_bound_tokens: int | None = Field(2048, ge=1)
    """Hit-weighted load bound: an affinity target's bound is ``load_bound x min(1,
    saved / load_bound_tokens)``, ``saved`` being the prompt tokens its cache holds
    beyond the endpoint holding the least (what a spill would prefill again). A hot
    long document keeps its engine up to the full bound; a short conversation
    history spills near the mean. ``null``: ``load_bound`` for every prefix."""
    slack_requests: float = Field(2.0, ge=0)
    queue_work: float = Field(1.0, gt=0)
    prefill_slack: float | None = Field(0.25, ge=0)
    """Prefill-cost rule: affinity (or a rendezvous place) is kept only where the prompt
    tokens to prefill before this request's first token (the router's own backlog there
    plus this prompt's uncached part) are at most ``(1 + prefill_slack) x`` the cheapest
    endpoint's plus ``prefill_slack_tokens``. ``null`` turns the rule off."""
    prefill_slack_tokens: int = Field(512, ge=0)
    default_capacity: int = Field(64, ge=1)
    """Concurrent sequences assumed when neither metrics nor the backend say."""
    default_max_tokens: int = Field(256, ge=1)
    """KV need assumed for requests that do not say ``max_tokens``."""
    fresh_for_s: float = Field(0.5, gt=0)
    stale_after_s: float = Field(3.0, gt=0)

    @field_validator("cold_choices")
    @classmethod
    def _positive_choices(cls, v: int | str | None) -> int | str | None:
        if isinstance(v, int) and v < 1:
            raise ValueError("cold_choices must be >= 1, 'all', or unset")
        return v

    def effective_load_bound(self) -> float:
        """The affinity scorer's ``load_bound``.

        One router places every new prefix on the least loaded of the cheapest
        endpoints, so balance comes from placement and a hot prefix may stay put up
        to twice the mean load (a spill costs a second full prefill of it). Replicas
        place new prefixes by rendezvous, which does not balance, so the bound is
        tighter. docs/bench.md has the runs behind both figures.
        """
        if self.load_bound is not None:
            return self.load_bound
        return 1.0 if self.router_replicas == 1 else 0.25

    def effective_cold_choices(self) -> int | None:
        """The scorer's ``cold_choices``: a count, or None for every endpoint."""
        if self.cold_choices == "all":
            return None
        if self.cold_choices is None:
            return None if self.router_replicas == 1 else 1
        return self.cold_choices


class Scrape(_Strict):
    interval_s: float = Field(0.2, gt=0)
    timeout_s: float = Field(1.0, gt=0)


class Health(_Strict):
    interval_s: float = Field(1.0, gt=0)
    timeout_s: float = Field(1.0, gt=0)
    models_refresh_s: float = Field(15.0, gt=0)
    eject_after_failures: int = Field(3, ge=1)
    """Consecutive connect errors / 5xx that eject an endpoint (passive)."""
    eject_base_s: float = Field(2.0, gt=0)
    eject_max_s: float = Field(60.0, gt=0)


class Timeouts(_Strict):
    connect_s: float = Field(2.0, gt=0)
    first_byte_s: float = Field(300.0, gt=0)
    """Headers from the engine (queueing + prefill for a stream)."""
    idle_s: float = Field(120.0, gt=0)
    """Longest gap between two body chunks."""
    total_s: float = Field(1800.0, gt=0)


class Limits(_Strict):
    max_body_bytes: int = Field(16 * 1024 * 1024, ge=1024)
    max_attempts: int = Field(3, ge=1)
    """Endpoints tried per request (connect error / 5xx before the first byte)."""
    connections_per_endpoint: int = Field(512, ge=1)
    retry_after_s: int = Field(1, ge=0)


class Discovery(_Strict):
    kind: Literal["static", "kubernetes"] = "static"
    """``static``: only ``pools``; ``kubernetes``: also the engines the operator runs."""
    kubernetes: KubernetesDiscoveryConfig = KubernetesDiscoveryConfig()
    """Where to watch and what to select (used when ``kind`` is ``kubernetes``)."""


class EnginePriority(_Strict):
    """Which endpoints get the engine's own priority field (``priority.engine_priority``).

    vLLM rejects a non-zero ``priority`` unless it runs ``--scheduling-policy
    priority`` (the emulator and operator-made vLLM do); turn it off per pool or
    endpoint for engines that run FCFS.
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
    priority: PrioritySection | None = None
    """Admission queue and preemption over priority classes. Absent: requests are
    admitted at once (no queue, no preemption) but still get a class (the default
    classes) for their objective, metrics and engine priority; ``priority: {}`` turns
    the queue on with the default classes (the Helm chart's default)."""

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
    """``ENGINE=URL`` from ``--backend``."""
    engine, sep, url = flag.partition("=")
    if not sep or not engine or not url:
        raise ConfigError(
            f"--backend {flag!r}: expected ENGINE=URL, e.g. vllm=http://127.0.0.1:8000"
        )
    try:
        return Backend(engine=engine, url=url)
    except ValidationError as e:
        raise ConfigError(f"--backend {flag!r}: {_describe(e)}") from None


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
