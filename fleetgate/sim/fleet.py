"""Many emulated engines in ONE process and ONE event loop.

``async with run_fleet(specs, host="127.0.0.1", port=18100) as fleet:`` starts
one :class:`~fleetgate.sim.driver.EngineDriver` task and one uvicorn listener
per engine on consecutive ports (``port=0``: each engine gets an ephemeral
port; a spec's own ``port`` wins), and stops everything on exit: drivers
first (open streams end with an in-band error), then the listeners together.

Design choices (measured in ``bench/bench_sim.py``):

* uvicorn ``Server`` objects are driven by :meth:`uvicorn.Server.startup` /
  ``shutdown`` with sockets bound here (clear "port in use" errors, port 0 for
  tests) and a single shared 1 s ticker that refreshes their ``date`` headers,
  instead of one ``Server.serve`` main loop per port (16 loops polling at 10 Hz,
  each also grabbing SIGINT).
* Only loopback hosts are accepted (:func:`check_loopback`): the emulator is a
  test tool and must never listen on a real interface.

The fleet file format is :class:`FleetFile` (pydantic, ``extra="forbid"``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib
import ipaddress
import socket
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any, Literal, cast

import uvicorn
from pydantic import BaseModel, ConfigDict, Field

from fleetgate.engines import get_adapter
from fleetgate.sim.core import tokenizer as core_tokenizer
from fleetgate.sim.core.api import EngineModel
from fleetgate.sim.generation import EngineOptions, SimEngine
from fleetgate.sim.trtllm import build_trtllm
from fleetgate.sim.vllm import build_vllm
from fleetgate.sim.vllm.app import KvEventSink

__all__ = [
    "EngineSpec",
    "Fleet",
    "FleetFile",
    "FleetError",
    "ModelFactory",
    "RunningEngine",
    "SharedTokenizer",
    "check_loopback",
    "free_port_run",
    "run_fleet",
]

VLLM_VERSION = "0.33.0"
#: TensorRT-LLM main: the release whose request models accept ``priority``.
TRTLLM_VERSION = "main"

ModelFactory = Callable[[str, str, Mapping[str, Any], int], EngineModel]
"""``(engine kind, profile name, overrides, seed) -> EngineModel``."""


class FleetError(Exception):
    """A fleet that cannot start (bad host, port in use, bad spec): one-line message."""


class EngineSpec(BaseModel):
    """One engine of a fleet file."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["vllm", "trtllm"]
    profile: str = "test"
    model: str | None = Field(default=None, min_length=1)
    """Served model name; defaults to the fleet's ``model``."""
    port: int | None = Field(default=None, ge=0, le=65535)
    overrides: dict[str, Any] = Field(default_factory=dict)
    """Passed to the engine-model factory (e.g. ``num_gpu_blocks``, ``max_num_seqs``)."""
    enable_prompt_tokens_details: bool = True
    version: str | None = Field(default=None, min_length=1)
    """Reported by ``/version`` (and in vLLM's ``system_fingerprint``); default
    ``0.33.0`` for vLLM, ``main`` for TensorRT-LLM. For TensorRT-LLM it also selects
    the emulated release (``1.0.0``, ``1.2.0rc3``, ``main``...): request validation,
    ``/metrics`` semantics and the ``trtllm_*`` families follow that release."""
    max_num_queued_reqs: int | None = Field(default=None, ge=0)
    """vLLM admission control (503 when this many requests already wait)."""
    kv_events: bool = False
    """KV-cache events. vLLM: published over ZeroMQ (vLLM 0.32's wire, topic
    ``kv-events``) on an ephemeral loopback port, with a replay socket
    (:attr:`RunningEngine.kv_events`). TensorRT-LLM: as its ``version``'s release line
    does (:func:`trtllm_kv_transport`): main streams them over ZeroMQ in TensorRT-LLM's
    own wire (same ports and topic as vLLM's), 1.3 and older keep them for
    ``POST /kv_cache_events``."""
    kv_event_buffer: int = Field(default=4096, ge=1)
    """TensorRT-LLM's ``kv_cache_config.event_buffer_max_size`` when events are on."""
    lora_modules: list[str] = Field(default_factory=list, max_length=64)
    """vLLM ``--lora-modules``: LoRA adapters served under these model names beside
    the base model (listed with ``parent``, their blocks hashed apart from the base
    model's and published with ``lora_name``). vLLM engines only."""
    seed: int | None = None


class FleetFile(BaseModel):
    """``fleetgate sim --fleet FILE.yaml``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(default="meta-llama/Llama-3.1-8B-Instruct", min_length=1)
    time_scale: float | None = Field(default=None, ge=0)
    seed: int | None = None
    engines: list[EngineSpec] = Field(min_length=1)


def check_loopback(host: str) -> None:
    """Refuse anything but a 127.0.0.0/8 or ::1 literal (or ``localhost``)."""
    if host == "localhost":
        return
    try:
        ok = ipaddress.ip_address(host).is_loopback
    except ValueError:
        ok = False
    if not ok:
        raise FleetError(
            f"--host {host!r} is not a loopback address; the emulator only binds 127.0.0.0/8 or ::1"
        )


class SharedTokenizer:
    """The shared emulator tokenizer (``fleetgate.sim.core.tokenizer``) as an object."""

    vocab_size = core_tokenizer.VOCAB_SIZE

    def encode(self, text: str) -> list[int]:
        return core_tokenizer.encode(text)

    def decode(self, token_ids: Sequence[int]) -> str:
        return core_tokenizer.decode(token_ids)

    def render_chat(
        self, messages: Sequence[dict[str, object]], add_generation_prompt: bool = True
    ) -> list[int]:
        return core_tokenizer.encode_chat(messages, add_generation_prompt=add_generation_prompt)


def default_model_factory() -> ModelFactory:
    """sim-core's factory (``fleetgate.sim.core.timing.build_engine_model``)."""
    module = importlib.import_module("fleetgate.sim.core.timing")
    return cast(ModelFactory, module.build_engine_model)


@dataclasses.dataclass(slots=True)
class RunningEngine:
    kind: str
    model: str
    host: str
    port: int
    engine: SimEngine
    app: Any
    server: uvicorn.Server
    kv_events: str | None = None
    """``tcp://host:port`` of the KV-event PUB socket (None = events off)."""
    kv_replay: str | None = None
    """``tcp://host:port`` of its replay ROUTER socket."""

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"


@dataclasses.dataclass(slots=True)
class Fleet:
    engines: list[RunningEngine]


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY on accepted connections only when
    # the socket's proto says TCP; with proto 0 every keep-alive response waited ~40 ms
    # for the client's delayed ACK (measured by the router overhead bench).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise FleetError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def build_engine(
    spec: EngineSpec,
    model_name: str,
    factory: ModelFactory,
    time_scale: float,
    seed: int,
    created: float,
    kv_events: Sequence[KvEventSink] = (),
) -> tuple[SimEngine, Any]:
    """One engine (model, driver, metrics, ASGI app); nothing started yet.

    ``kv_events``: where the engine publishes its KV-cache events over ZeroMQ (vLLM;
    TensorRT-LLM's streaming publisher: one per attention-DP rank). Empty: off, or
    TensorRT-LLM's HTTP drain."""
    try:
        model = factory(spec.kind, spec.profile, spec.overrides, seed)
    except ValueError as e:
        raise FleetError(f"engine {spec.kind}/{spec.profile}: {e}") from None
    stats = model.stats()
    options = EngineOptions(
        kind=spec.kind,
        model_name=model_name,
        model_root=f"/models/{model_name}",
        max_model_len=model.max_model_len,
        block_size=model.block_size,
        num_gpu_blocks=stats.blocks_total,
        max_num_seqs=stats.max_running,
        enable_prompt_tokens_details=spec.enable_prompt_tokens_details,
        max_num_queued_reqs=spec.max_num_queued_reqs,
        version=spec.version or (VLLM_VERSION if spec.kind == "vllm" else TRTLLM_VERSION),
        num_gpu_blocks_override=(
            stats.blocks_total if {"num_gpu_blocks", "num_blocks"} & set(spec.overrides) else None
        ),
        prefix_caching=bool(getattr(getattr(model, "config", None), "prefix_caching", True)),
        user_specified_block_size=bool({"block_size", "tokens_per_block"} & set(spec.overrides)),
        lora_modules=tuple(spec.lora_modules),
    )
    if spec.lora_modules and spec.kind != "vllm":
        raise FleetError(f"engine {spec.kind}: lora_modules is a vLLM option")
    adapter = get_adapter(spec.kind)
    if spec.kind == "vllm":
        sink = kv_events[0] if kv_events else None
        return build_vllm(
            options, model, SharedTokenizer(), time_scale, adapter.error_body, created, sink
        )
    try:
        return build_trtllm(
            options,
            model,
            SharedTokenizer(),
            time_scale,
            adapter.error_body,
            spec.kv_event_buffer if spec.kv_events and not kv_events else None,
            kv_events,
        )
    except ValueError as e:
        raise FleetError(f"engine {spec.kind}: {e}") from None


@contextlib.asynccontextmanager
async def run_fleet(
    specs: Sequence[EngineSpec],
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    model: str = "meta-llama/Llama-3.1-8B-Instruct",
    time_scale: float = 1.0,
    seed: int = 0,
    factory: ModelFactory | None = None,
) -> AsyncIterator[Fleet]:
    """Start ``specs`` on consecutive ports from ``port`` (0 = ephemeral each)."""
    check_loopback(host)
    make = factory if factory is not None else default_model_factory()
    created = time.time()
    running: list[RunningEngine] = []
    sockets: list[socket.socket] = []
    publishers: list[Any] = []
    ticker: asyncio.Task[None] | None = None
    try:
        for i, spec in enumerate(specs):
            want = spec.port if spec.port is not None else (port + i if port else 0)
            sock = _bind(host, want)
            sockets.append(sock)
            name = spec.model or model
            ranked = _kv_publishers(spec, host)
            publishers += ranked
            engine, app = build_engine(
                spec,
                name,
                make,
                time_scale,
                spec.seed if spec.seed is not None else seed + i,
                created,
                ranked,
            )
            publisher = ranked[0] if ranked else None
            config = uvicorn.Config(
                app,
                lifespan="off",
                log_level="warning",
                access_log=False,
                timeout_graceful_shutdown=2,
                http="httptools",
            )
            server = uvicorn.Server(config)
            config.load()
            server.lifespan = config.lifespan_class(config)
            await server.on_tick(0)
            await engine.driver.start()
            await server.startup(sockets=[sock])
            server.started = True
            running.append(
                RunningEngine(
                    spec.kind,
                    name,
                    host,
                    sock.getsockname()[1],
                    engine,
                    app,
                    server,
                    kv_events=publisher.endpoint if publisher is not None else None,
                    kv_replay=publisher.replay_endpoint if publisher is not None else None,
                )
            )
        ticker = asyncio.get_running_loop().create_task(_tick([r.server for r in running]))
        yield Fleet(running)
    finally:
        if ticker is not None:
            ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await ticker
        for r in running:
            await r.engine.driver.stop()
        await asyncio.gather(
            *(r.server.shutdown(sockets=[s]) for r, s in zip(running, sockets, strict=False))
        )
        for s in sockets[len(running) :]:
            s.close()
        for p in publishers:
            p.close()


def trtllm_kv_transport(spec: EngineSpec) -> str | None:
    """How an emulated TensorRT-LLM spec publishes KV events: its release line's way
    (``zmq`` on main, ``http-drain`` on 1.3; 1.0-1.2 have no verified way, so the drain
    the emulator has always offered), None when events are off."""
    if not spec.kv_events or spec.kind != "trtllm":
        return None
    from fleetgate.engines.trtllm.versions import release_for

    return release_for(spec.version or TRTLLM_VERSION).kv_events or "http-drain"


def _kv_publishers(spec: EngineSpec, host: str) -> list[Any]:
    """Loopback KV-event publishers for a spec with ZeroMQ events on (vLLM, and
    TensorRT-LLM on a line that streams them; otherwise it keeps its events for
    ``POST /kv_cache_events``): one on ephemeral ports, or one per attention-DP rank
    (``overrides.attention_dp_ranks``) on a run of free ports, rank r on base + r."""
    if not spec.kv_events:
        return []
    if spec.kind == "trtllm" and trtllm_kv_transport(spec) != "zmq":
        return []
    if ":" in host:
        raise FleetError("kv_events: needs an IPv4 loopback host")
    from fleetgate.sim.vllm.kv_events import KvEventPublisher, KvEventsConfig

    ranks = int(str(spec.overrides.get("attention_dp_ranks", 1)))
    if ranks > 1:
        base = free_port_run(host, 2 * ranks)
        pub, replay = f"{base}", f"{base + ranks}"
    else:
        pub = replay = "*"  # '*' as the port: bind an ephemeral one
    config = KvEventsConfig(
        enable_kv_cache_events=True,
        endpoint=f"tcp://{host}:{pub}",
        replay_endpoint=f"tcp://{host}:{replay}",
        topic="kv-events",
    )
    if spec.kind == "trtllm":
        from fleetgate.sim.trtllm.kv_events import trtllm_kv_publisher

        return [trtllm_kv_publisher(config, {}, rank=r) for r in range(ranks)]
    return [KvEventPublisher(config, {})]


def free_port_run(host: str, n: int) -> int:
    """A base port with ``n`` consecutive ports free on ``host`` right now."""
    for _ in range(100):
        probe = socket.socket()
        probe.bind((host, 0))
        base = int(probe.getsockname()[1])
        probe.close()
        if base + n > 65535:
            continue
        socks: list[socket.socket] = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind((host, p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise FleetError(f"no {n} consecutive free ports on {host}")


async def _tick(servers: list[uvicorn.Server]) -> None:
    counter = 0
    while True:
        await asyncio.sleep(1.0)
        counter += 10
        for server in servers:
            await server.on_tick(counter)
