"""The engines' own command lines, served by the emulator (one engine per process).

::

    fleetgate sim vllm serve MODEL [vLLM flags]               # vLLM's CLI
    fleetgate sim vllm api_server --model MODEL [vLLM flags]  # its api_server module
    fleetgate sim trtllm-serve [serve] MODEL [trtllm-serve flags]

These accept exactly what fleetgate's operator writes into an engine container
(``fleetgate/engines/vllm.py`` and ``trtllm.py``), so the emulator image (the
Dockerfile's ``emulator`` target, whose ``vllm``, ``trtllm-serve`` and
``vllm.entrypoints.openai.api_server`` run this module) can stand in for the
engine image of an ``InferenceService``.

* Flags that shape the emulation configure it: context length, batch and token
  limits, KV block size and count, queue policy, prefix caching, chunked
  prefill, ``--enable-prompt-tokens-details``, and for TensorRT-LLM the
  ``--extra_llm_api_options`` YAML (``kv_cache_config``, ``scheduler_config``).
* Real engine flags with nothing to emulate (GPU memory fraction, parallelism,
  revision, backend, ...) are accepted and listed once in the log as such.
* Unknown flags are accepted too and listed once in the log: an emulator should
  not refuse a command line that a newer engine would take.
* Emulator settings that no engine flag carries come from the environment:
  ``FLEETGATE_SIM_PROFILE`` (default: the Llama-3.1-8B/H100 profile of the
  engine kind, the 70B/4xH100 one when the model name says 70B),
  ``FLEETGATE_SIM_TIME_SCALE`` (default 1) and ``FLEETGATE_SIM_SEED``.
* The engines' defaults apply: port 8000; vLLM binds all addresses and
  trtllm-serve ``localhost`` unless ``--host`` says otherwise.
  ``FLEETGATE_SIM_BIND_HOST`` replaces the address (logged). With
  ``FLEETGATE_TEST_MODE=1`` only loopback addresses are bound: a non-loopback
  ``--host`` becomes 127.0.0.1 (logged), so tests run the operator's exact
  ``--host 0.0.0.0`` line without listening on a real interface.

SIGTERM/SIGINT: uvicorn stops accepting, lets open responses finish (5 s at
most) and the process exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import json
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from fleetgate.cli import CliError
from fleetgate.sim.fleet import EngineSpec, FleetError, build_engine, default_model_factory

__all__ = ["ENGINE_COMMANDS", "EngineLaunch", "default_profile", "engine_spec", "main", "parse"]

log = logging.getLogger("fleetgate.sim.entrypoints")

#: ``fleetgate sim <word> ...`` words that start one engine from its own command line.
ENGINE_COMMANDS = ("vllm", "trtllm-serve")

DEFAULT_PORT = 8000
DRAIN_TIMEOUT_S = 5
ENV_PROFILE = "FLEETGATE_SIM_PROFILE"
ENV_TIME_SCALE = "FLEETGATE_SIM_TIME_SCALE"
ENV_SEED = "FLEETGATE_SIM_SEED"
ENV_BIND_HOST = "FLEETGATE_SIM_BIND_HOST"


def default_profile(kind: str, model: str) -> str:
    """The realistic timing profile for an engine kind and a model name."""
    size = "llama70b-4xh100" if "70b" in model.lower() else "llama8b-h100"
    return f"{kind}-{size}"


@dataclass(frozen=True)
class EngineLaunch:
    """What an engine command line asks of the emulator."""

    kind: str
    model: str
    host: str
    port: int
    overrides: Mapping[str, object] = field(default_factory=dict)
    """Profile overrides (field names or :data:`~fleetgate.sim.core.timing.ALIASES`)."""
    prompt_tokens_details: bool = False
    max_num_queued_reqs: int | None = None
    kv_events_config: str | None = None
    """vLLM ``--kv-events-config`` JSON (KV-cache events over ZeroMQ), as given; for
    TensorRT-LLM the options file's ``kv_cache_config.kv_events_config`` as JSON."""
    lora_modules: tuple[str, ...] = ()
    """vLLM ``--lora-modules NAME=PATH ...`` (with ``--enable-lora``): the adapters'
    model names (the paths are not read)."""
    ignored: tuple[str, ...] = ()
    """Real engine flags (and config keys) accepted with no effect on the emulation."""
    unknown: tuple[str, ...] = ()
    """Flags (with their values) the emulator does not know."""


# ------------------------------------------------------------------------ parsing
def _size(text: str) -> int:
    """vLLM's integer flags also take ``32k`` (x1000) and ``32K`` (x1024)."""
    units = {"k": 1000, "m": 1000**2, "g": 1000**3, "K": 1024, "M": 1024**2, "G": 1024**3}
    try:
        if text and text[-1] in units:
            return int(float(text[:-1]) * units[text[-1]])
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors as :class:`CliError` (exit code 2)."""

    def error(self, message: str) -> Any:
        raise CliError(f"{self.prog}: {message}")


def _normalise(argv: Sequence[str], sep: str) -> list[str]:
    """``--a_b=c`` -> ``--a-b``, ``c`` (vLLM, sep '-') or ``--a_b``, ``c`` (TRT, sep '_')."""
    out: list[str] = []
    other = "_" if sep == "-" else "-"
    for arg in argv:
        if arg.startswith("--") and len(arg) > 2:
            name, eq, value = arg.partition("=")
            out.append("--" + name[2:].replace(other, sep))
            if eq:
                out.append(value)
        else:
            out.append(arg)
    return out


def _group_unknown(extra: Sequence[str]) -> tuple[str, ...]:
    """``['--a', '1', '--b']`` -> ``('--a 1', '--b')``."""
    out: list[str] = []
    for item in extra:
        if item.startswith("-") and not _is_number(item) or not out:
            out.append(item)
        else:
            out[-1] += f" {item}"
    return tuple(out)


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _ignored(ns: argparse.Namespace, names: Sequence[str], sep: str) -> tuple[str, ...]:
    out = []
    for name in names:
        value = getattr(ns, name)
        if value is None or value is False:
            continue
        flag = "--" + name.replace("_", sep)
        out.append(flag if value is True else f"{flag} {value}")
    return tuple(out)


#: vLLM flags the operator may write (or users commonly add) that change nothing here.
_VLLM_NO_EFFECT = (
    "gpu_memory_utilization",
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "data_parallel_size",
    "revision",
    "dtype",
    "trust_remote_code",
    "enforce_eager",
    "download_dir",
    "tokenizer",
    "quantization",
    "kv_cache_dtype",
    "swap_space",
    "seed",
    "max_lora_rank",
    "max_loras",
)


def _vllm_parser(prog: str, positional: bool) -> _Parser:
    p = _Parser(prog=prog, add_help=True, allow_abbrev=False)
    if positional:
        p.add_argument("model_tag", nargs="?", help="model (or --model)")
    p.add_argument("--model")
    p.add_argument("--served-model-name", nargs="+")
    p.add_argument("--host")
    p.add_argument("--port", type=int, default=DEFAULT_PORT)
    p.add_argument("--max-model-len", type=_size)
    p.add_argument("--max-num-seqs", type=int)
    p.add_argument("--max-num-batched-tokens", type=_size)
    p.add_argument("--block-size", type=int)
    p.add_argument("--num-gpu-blocks-override", type=int)
    p.add_argument("--scheduling-policy", choices=("fcfs", "priority"))
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction)
    p.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction)
    p.add_argument("--enable-prompt-tokens-details", action="store_true")
    p.add_argument("--max-num-queued-reqs", type=int)
    p.add_argument("--kv-events-config")
    p.add_argument("--enable-lora", action="store_true")
    p.add_argument("--lora-modules", nargs="+", default=[])
    for name in _VLLM_NO_EFFECT:
        flag = "--" + name.replace("_", "-")
        if name in ("trust_remote_code", "enforce_eager"):
            p.add_argument(flag, action="store_true", default=None)
        else:
            p.add_argument(flag)
    return p


def _lora_name(module: str) -> str:
    """An adapter's model name from vLLM's ``NAME=PATH`` or its JSON form
    (``{"name": ..., "path": ...}``)."""
    if module.lstrip().startswith("{"):
        try:
            name = json.loads(module).get("name")
        except (ValueError, AttributeError):
            name = None
        if not isinstance(name, str) or not name:
            raise CliError(f"--lora-modules: no name in {module!r}")
        return name
    name, sep, _path = module.partition("=")
    if not sep or not name:
        raise CliError(f"--lora-modules: expected NAME=PATH, got {module!r}")
    return name


def parse_vllm(argv: Sequence[str]) -> EngineLaunch:
    """``serve MODEL ...`` (vLLM's CLI) or ``api_server --model MODEL ...``."""
    if not argv or argv[0] not in ("serve", "api_server"):
        got = argv[0] if argv else "nothing"
        raise CliError(f"vllm: only 'vllm serve MODEL ...' is emulated (got {got!r})")
    serve = argv[0] == "serve"
    prog = "vllm serve" if serve else "python3 -m vllm.entrypoints.openai.api_server"
    ns, extra = _vllm_parser(prog, serve).parse_known_args(_normalise(argv[1:], "-"))
    model = (getattr(ns, "model_tag", None) if serve else None) or ns.model
    if not model:
        raise CliError(f"{prog}: no model given (positional MODEL or --model)")
    served = ns.served_model_name[0] if ns.served_model_name else model
    adapters = tuple(_lora_name(m) for m in ns.lora_modules)
    if adapters and not ns.enable_lora:
        raise CliError(f"{prog}: --lora-modules needs --enable-lora")
    overrides: dict[str, object] = {}
    for flag, key in (
        ("max_model_len", "max_model_len"),
        ("max_num_seqs", "max_num_seqs"),
        ("max_num_batched_tokens", "max_num_batched_tokens"),
        ("block_size", "block_size"),
        ("num_gpu_blocks_override", "num_gpu_blocks"),
        ("scheduling_policy", "scheduling_policy"),
        ("enable_prefix_caching", "enable_prefix_caching"),
        ("enable_chunked_prefill", "enable_chunked_prefill"),
    ):
        value = getattr(ns, flag)
        if value is not None:
            overrides[key] = value
    return EngineLaunch(
        kind="vllm",
        model=served,
        host=ns.host or "0.0.0.0",
        port=ns.port,
        overrides=overrides,
        prompt_tokens_details=ns.enable_prompt_tokens_details,
        max_num_queued_reqs=ns.max_num_queued_reqs,
        kv_events_config=ns.kv_events_config,
        lora_modules=adapters,
        ignored=_ignored(ns, _VLLM_NO_EFFECT, "-"),
        unknown=_group_unknown(extra),
    )


#: trtllm-serve options with nothing to emulate.
_TRT_NO_EFFECT = (
    "backend",
    "tp_size",
    "pp_size",
    "ep_size",
    "cluster_size",
    "gpus_per_node",
    "kv_cache_free_gpu_memory_fraction",
    "max_beam_width",
    "num_postprocess_workers",
    "revision",
    "tokenizer",
    "log_level",
    "reasoning_parser",
    "trust_remote_code",
)

#: ``--extra_llm_api_options`` keys -> profile fields (``section.key`` for nested ones).
_TRT_CONFIG_KEYS = {
    "max_batch_size": "max_batch_size",
    "max_num_tokens": "max_num_tokens",
    "max_seq_len": "max_model_len",
    "enable_chunked_prefill": "enable_chunked_prefill",
    "enable_chunked_context": "enable_chunked_context",
    "kv_cache_config.enable_block_reuse": "enable_block_reuse",
    "kv_cache_config.tokens_per_block": "tokens_per_block",
    # KV-cache events for POST /kv_cache_events (not a profile field: see engine_spec)
    "kv_cache_config.event_buffer_max_size": "event_buffer_max_size",
    # the streaming ZeroMQ publisher (not a profile field: served by main())
    "kv_cache_config.kv_events_config": "kv_events_config",
    "scheduler_config.capacity_scheduler_policy": "capacity_scheduler_policy",
    "scheduler_config.waiting_queue_policy": "waiting_queue_policy",
    # attention DP: --tp_size ranks (not a profile field: see parse_trtllm)
    "enable_attention_dp": "enable_attention_dp",
    "attention_dp_config.enable_kv_cache_aware_routing": "adp_cache_routing",
}
#: Keys of that file that the emulator accepts and has nothing to do with.
_TRT_CONFIG_NO_EFFECT = {
    "kv_cache_config.free_gpu_memory_fraction",
    "kv_cache_config.max_tokens",
    "kv_cache_config.use_kv_cache_manager_v2",
    "enable_iter_perf_stats",
    "return_perf_metrics",
    "backend",
    "attention_dp_config.enable_balance",
    "attention_dp_config.timeout_iters",
    "attention_dp_config.batching_wait_iters",
    "attention_dp_config.kv_cache_routing_load_balance_weight",
}


def _trt_parser() -> _Parser:
    p = _Parser(prog="trtllm-serve", add_help=True, allow_abbrev=False)
    p.add_argument("model")
    p.add_argument("--host", default="localhost")
    p.add_argument("--port", type=int, default=DEFAULT_PORT)
    p.add_argument("--max_batch_size", type=int)
    p.add_argument("--max_num_tokens", type=int)
    p.add_argument("--max_seq_len", type=int)
    p.add_argument("--extra_llm_api_options", type=Path)
    for name in _TRT_NO_EFFECT:
        if name == "trust_remote_code":
            p.add_argument("--" + name, action="store_true", default=None)
        else:
            p.add_argument("--" + name)
    return p


def _flatten(data: Mapping[str, Any]) -> Iterator[tuple[str, Any]]:
    """Top-level keys, and ``section.key`` inside the sections the emulator reads."""
    for key, value in data.items():
        if key in ("kv_cache_config", "scheduler_config", "attention_dp_config") and isinstance(
            value, Mapping
        ):
            for sub, sub_value in value.items():
                yield f"{key}.{sub}", sub_value
        else:
            yield str(key), value


def read_llm_api_options(path: Path) -> tuple[dict[str, object], list[str], list[str]]:
    """(overrides, accepted keys without effect, unknown keys) of the options YAML."""
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as e:
        raise CliError(f"--extra_llm_api_options {path}: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise CliError(
            f"--extra_llm_api_options {path}: not valid YAML: {str(e).splitlines()[0]}"
        ) from None
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise CliError(f"--extra_llm_api_options {path}: expected a mapping at the top level")
    overrides: dict[str, object] = {}
    ignored: list[str] = []
    unknown: list[str] = []
    for key, value in _flatten(data):
        if key in _TRT_CONFIG_KEYS:
            overrides[_TRT_CONFIG_KEYS[key]] = value
        elif key in _TRT_CONFIG_NO_EFFECT:
            ignored.append(f"{key}={value}")
        else:
            unknown.append(f"{key}={value}")
    return overrides, ignored, unknown


def parse_trtllm(argv: Sequence[str]) -> EngineLaunch:
    """``[serve] MODEL --host H --port P ... --extra_llm_api_options FILE``."""
    args = list(argv)
    if args and args[0] == "serve":
        args = args[1:]
    ns, extra = _trt_parser().parse_known_args(_normalise(args, "_"))
    overrides: dict[str, object] = {}
    ignored = list(_ignored(ns, _TRT_NO_EFFECT, "_"))
    unknown = list(_group_unknown(extra))
    if ns.extra_llm_api_options is not None:
        from_file, file_ignored, file_unknown = read_llm_api_options(ns.extra_llm_api_options)
        overrides.update(from_file)
        ignored += [f"{ns.extra_llm_api_options}: {k}" for k in file_ignored]
        unknown += [f"{ns.extra_llm_api_options}: {k}" for k in file_unknown]
    # command-line flags win over the file, as in trtllm-serve
    for flag, key in (
        ("max_batch_size", "max_batch_size"),
        ("max_num_tokens", "max_num_tokens"),
        ("max_seq_len", "max_model_len"),
    ):
        value = getattr(ns, flag)
        if value is not None:
            overrides[key] = value
    if overrides.pop("enable_attention_dp", False):
        # each of the tensor-parallel GPUs is a rank with its own scheduler and KV cache
        try:
            overrides["attention_dp_ranks"] = int(ns.tp_size or 1)
        except ValueError:
            raise CliError(f"--tp_size {ns.tp_size!r}: expected an integer") from None
        ignored = [i for i in ignored if not i.startswith("--tp_size")]
    elif "adp_cache_routing" in overrides:
        overrides.pop("adp_cache_routing")  # without attention DP there is one rank
    events_config = overrides.pop("kv_events_config", None)
    if events_config is not None and not isinstance(events_config, Mapping):
        raise CliError(
            f"kv_cache_config.kv_events_config: expected a mapping, not {events_config!r}"
        )
    return EngineLaunch(
        kind="trtllm",
        model=ns.model,
        host=ns.host,
        port=ns.port,
        overrides=overrides,
        kv_events_config=json.dumps(dict(events_config)) if events_config else None,
        prompt_tokens_details=True,
        ignored=tuple(ignored),
        unknown=tuple(unknown),
    )


def parse(argv: Sequence[str]) -> EngineLaunch:
    """``argv`` starts with one of :data:`ENGINE_COMMANDS`."""
    if not argv or argv[0] not in ENGINE_COMMANDS:
        raise CliError(f"expected one of {', '.join(ENGINE_COMMANDS)}")
    if argv[0] == "vllm":
        return parse_vllm(argv[1:])
    return parse_trtllm(argv[1:])


def engine_spec(launch: EngineLaunch, profile: str) -> EngineSpec:
    """The emulated engine for ``launch`` with the timing profile ``profile``."""
    overrides = dict(launch.overrides)
    if (
        launch.kind == "vllm"
        and overrides.get("enable_chunked_prefill") is False
        and "max_num_batched_tokens" not in overrides
    ):
        # vLLM without chunked prefill schedules whole prompts: its per-step token
        # budget then defaults to max_model_len
        from fleetgate.sim.core.timing import resolve_profile

        overrides["max_num_batched_tokens"] = overrides.get(
            "max_model_len", resolve_profile(profile).max_model_len
        )
    # trtllm-serve keeps KV-cache events when the options file sizes their buffer; vLLM's
    # --kv-events-config is served by main() (it binds sockets).
    buffer = overrides.pop("event_buffer_max_size", None)
    try:
        kv_buffer = int(buffer) if buffer is not None else 0  # type: ignore[call-overload]
    except (TypeError, ValueError):
        raise CliError(f"kv_cache_config.event_buffer_max_size: not a number: {buffer!r}") from None
    return EngineSpec(
        kind="vllm" if launch.kind == "vllm" else "trtllm",
        profile=profile,
        overrides=overrides,
        enable_prompt_tokens_details=launch.prompt_tokens_details,
        max_num_queued_reqs=launch.max_num_queued_reqs,
        kv_events=launch.kind != "vllm" and kv_buffer > 0,
        kv_event_buffer=max(kv_buffer, 1),
        lora_modules=list(launch.lora_modules),
    )


# ------------------------------------------------------------------------ serving
def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bind_host(host: str, environ: Mapping[str, str]) -> str:
    """The address to bind: ``$FLEETGATE_SIM_BIND_HOST`` or ``host``; loopback in test mode."""
    test_mode = environ.get("FLEETGATE_TEST_MODE") == "1"
    override = environ.get(ENV_BIND_HOST)
    if override:
        if test_mode and not _is_loopback(override):
            raise CliError(f"${ENV_BIND_HOST}={override}: not a loopback address (test mode)")
        log.warning("$%s: binding %s instead of --host %s", ENV_BIND_HOST, override, host)
        return override
    if test_mode and not _is_loopback(host):
        log.warning("FLEETGATE_TEST_MODE=1: binding 127.0.0.1 instead of --host %s", host)
        return "127.0.0.1"
    return "127.0.0.1" if host == "localhost" else host


def _env_float(environ: Mapping[str, str], name: str, default: float) -> float:
    try:
        value = float(environ.get(name, default))
    except ValueError:
        raise CliError(f"${name}={environ[name]!r}: not a number") from None
    if value < 0:
        raise CliError(f"${name}={value}: must be >= 0")
    return value


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise CliError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def main(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> int:
    """Parse an engine command line, build one emulated engine and serve it."""
    env = os.environ if environ is None else environ
    if not logging.getLogger().handlers:
        logging.basicConfig(
            level=logging.INFO,
            format="%(asctime)s %(levelname)s %(name)s: %(message)s",
            stream=sys.stderr,
        )
    launch = parse(argv)
    profile = env.get(ENV_PROFILE) or default_profile(launch.kind, launch.model)
    time_scale = _env_float(env, ENV_TIME_SCALE, 1.0)
    seed = int(_env_float(env, ENV_SEED, 0))
    if not 0 <= launch.port <= 65535:
        raise CliError(f"--port {launch.port} is out of range")
    spec = engine_spec(launch, profile)
    host = bind_host(launch.host, env)
    sock = _listen(host, launch.port)
    publishers = _kv_publishers(launch, env, host)
    try:
        engine, app = build_engine(
            spec, launch.model, default_model_factory(), time_scale, seed, time.time(), publishers
        )
    except FleetError as e:
        for publisher in publishers:
            publisher.close()
        raise CliError(str(e)) from None
    options = engine.options
    log.info(
        "emulating %s (profile %s, time scale %g): model %s, max_model_len %d, "
        "%d KV blocks of %d tokens, max %d running",
        launch.kind,
        profile,
        time_scale,
        launch.model,
        options.max_model_len,
        options.num_gpu_blocks,
        options.block_size,
        options.max_num_seqs,
    )
    if launch.ignored:
        log.info("accepted, no effect on the emulation: %s", "; ".join(launch.ignored))
    if launch.unknown:
        log.warning("unknown to the emulator, ignored: %s", "; ".join(launch.unknown))
    url_host = f"[{host}]" if ":" in host else host
    print(
        f"engine={launch.kind} url=http://{url_host}:{sock.getsockname()[1]} model={launch.model}",
        flush=True,
    )
    import asyncio

    try:
        asyncio.run(_serve(engine, app, sock))
    finally:
        for publisher in publishers:
            publisher.close()
    return 0


def _kv_publishers(launch: EngineLaunch, env: Mapping[str, str], host: str) -> list[Any]:
    """The KV-event publishers when vLLM's ``--kv-events-config`` (or TensorRT-LLM's
    ``kv_cache_config.kv_events_config``, same fields) turns events on: one, or one per
    attention-DP rank (rank r on the endpoints' ports + r); none when events are off.

    A ``tcp://*:P`` endpoint binds ``host`` (the HTTP socket's address) unless that is
    a wildcard itself. TensorRT-LLM's publisher writes its own wire and always binds."""
    if not launch.kv_events_config:
        return []
    from fleetgate.sim.vllm.kv_events import KvEventPublisher, parse_kv_events_config

    config = parse_kv_events_config(launch.kv_events_config)
    if not config.active:
        return []
    wildcard = None if host in ("0.0.0.0", "::", "") else host
    publishers: list[Any] = []
    if launch.kind == "trtllm":
        from fleetgate.sim.trtllm.kv_events import trtllm_kv_publisher

        ranks = int(str(launch.overrides.get("attention_dp_ranks", 1)))
        try:
            for rank in range(ranks):
                publishers.append(trtllm_kv_publisher(config, env, wildcard, rank))
        except (CliError, ValueError) as e:
            for p in publishers:
                p.close()
            raise CliError(str(e)) from None
    else:
        publishers.append(KvEventPublisher(config, env, wildcard))
    log.info(
        "KV-cache events: %s (topic %r), replay %s%s",
        config.endpoint,
        config.topic,
        config.replay_endpoint,
        f", {len(publishers)} attention-DP ranks (ports + rank)" * (len(publishers) > 1),
    )
    return publishers


async def _serve(engine: Any, app: Any, sock: socket.socket) -> None:
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's graceful drain on SIGTERM/SIGINT, then exit 0 (no re-raised signal)."""

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            handled = (signal.SIGINT, signal.SIGTERM)
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    config = uvicorn.Config(
        app,
        lifespan="off",
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=DRAIN_TIMEOUT_S,
        http="httptools",
    )
    await engine.driver.start()
    try:
        await Server(config).serve(sockets=[sock])
    finally:
        await engine.driver.stop()
        sock.close()
