"""``fleetgate sim``: run emulated vLLM / TensorRT-LLM engines on loopback.

``fleetgate sim --vllm N --trtllm M --port P [--host 127.0.0.1] [--profile NAME]
[--fleet FILE.yaml] [--time-scale X] [--seed S] [--model NAME]`` starts N vLLM
then M TensorRT-LLM engines on consecutive ports from P, prints one flushed line
per engine ``engine=vllm url=http://127.0.0.1:18100 model=<name>``, then serves
until SIGINT/SIGTERM and exits 0. With ``--fleet`` the engines come from the
YAML file (:class:`~fleetgate.sim.fleet.FleetFile`); ``--vllm``/``--trtllm``
add to them. Bad flags or files raise :class:`~fleetgate.cli.CliError` (one line,
exit 2) naming the field; a non-loopback ``--host`` is refused.

The default ``--profile auto`` emulates every engine with its own kind's
Llama-3.1-8B/H100 profile (``vllm-llama8b-h100``, ``trtllm-llama8b-h100``: 128k
context, H100-sized KV caches and step times); ``test`` is a tiny profile for
unit tests (512-token context, 64 KV blocks, 1 ms steps).

``fleetgate sim vllm serve MODEL ...`` and ``fleetgate sim trtllm-serve MODEL
...`` instead run ONE engine from the engine's own command line (the one the
operator writes): see :mod:`fleetgate.sim.entrypoints`.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from pathlib import Path

import yaml
from pydantic import ValidationError

from fleetgate.cli import CliError
from fleetgate.engines.trtllm.kv_events import KV_EVENTS_PATH as TRTLLM_KV_EVENTS_PATH
from fleetgate.sim.entrypoints import ENGINE_COMMANDS, default_profile
from fleetgate.sim.fleet import (
    EngineSpec,
    FleetError,
    FleetFile,
    check_loopback,
    run_fleet,
    trtllm_kv_transport,
)

DEFAULT_MODEL = "meta-llama/Llama-3.1-8B-Instruct"


def build_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "engine_command",
        nargs=argparse.REMAINDER,
        metavar="{vllm serve MODEL | trtllm-serve MODEL} ...",
        help="run one engine from its own command line (what the operator writes; "
        "e.g. vllm serve meta-llama/Llama-3.1-8B-Instruct --port 8000): its flags "
        "configure the emulation, unknown ones are logged and ignored",
    )
    parser.add_argument("--vllm", type=int, default=0, help="number of vLLM engines")
    parser.add_argument("--trtllm", type=int, default=0, help="number of TensorRT-LLM engines")
    parser.add_argument("--port", type=int, default=18100, help="first port (default 18100)")
    parser.add_argument("--host", default="127.0.0.1", help="loopback address to bind")
    parser.add_argument(
        "--profile",
        default="auto",
        help="timing profile: auto (default: each engine kind's Llama-3.1-8B/H100 profile), "
        "vllm-llama8b-h100, trtllm-llama8b-h100, vllm-llama70b-4xh100, "
        "trtllm-llama70b-4xh100, or test (tiny and fast: for unit tests only)",
    )
    parser.add_argument("--fleet", type=Path, help="YAML fleet file")
    parser.add_argument(
        "--write-tokenizer",
        type=Path,
        metavar="DIR",
        help="write the emulator's tokenizer as tokenizer.json + tokenizer_config.json "
        "(Hugging Face format: what the router's scheduling.tokenizers kind hf reads) "
        "into DIR and exit",
    )
    parser.add_argument("--time-scale", type=float, default=None, help="wall s per model s")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument(
        "--model",
        "--model-name",
        dest="model",
        default=None,
        help=f"served model name ({DEFAULT_MODEL})",
    )
    group = parser.add_argument_group("engine options (for --vllm/--trtllm engines)")
    group.add_argument("--max-model-len", type=int, help="context length (profile override)")
    group.add_argument("--max-num-seqs", type=int, help="max running requests per engine")
    group.add_argument("--num-gpu-blocks", type=int, help="KV cache blocks per engine")
    group.add_argument("--block-size", type=int, help="tokens per KV block")
    group.add_argument(
        "--vllm-version", help="version vLLM engines report (default 0.33.0; fixtures: 0.32.0)"
    )
    group.add_argument(
        "--trtllm-version",
        help="TensorRT-LLM release the --trtllm engines emulate (default main; 1.0.0, "
        "1.2.0rc3, 1.3.0...): request fields, metrics and how KV events are published",
    )
    group.add_argument(
        "--trtllm-attention-dp",
        type=int,
        metavar="RANKS",
        help="TensorRT-LLM engines run attention data parallelism over RANKS ranks, each "
        "with the per-engine limits and KV cache given here and its own KV events (ports "
        "base + rank; printed as kv_ranks=RANKS)",
    )
    group.add_argument(
        "--trtllm-adp-routing",
        choices=("load", "cache"),
        default="load",
        help="how such an engine places a request on a rank: by load (TensorRT-LLM's "
        "default) or by cached prefix (attention_dp_config.enable_kv_cache_aware_routing)",
    )
    group.add_argument(
        "--max-num-queued-reqs", type=int, help="vLLM admission limit: 503 beyond it"
    )
    group.add_argument("--scheduling-policy", choices=("fcfs", "priority"), help="queue policy")
    group.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any timing-profile field, e.g. --set mean_output_tokens=64 (repeatable)",
    )
    group.add_argument(
        "--kv-events",
        action="store_true",
        help="KV-cache events: vLLM publishes over ZeroMQ (vLLM 0.32 wire) on ephemeral "
        "loopback ports, printed as kv_events=... kv_replay=...; so does TensorRT-LLM main "
        "(its own streaming wire); TensorRT-LLM 1.3 and older keep them for "
        "POST /kv_cache_events (printed kv_events=http-drain:/kv_cache_events). "
        "Append the printed options to the router's --backend: "
        "--backend vllm=URL,kv_events=tcp://...,kv_replay=tcp://...",
    )
    group.add_argument(
        "--lora-modules",
        nargs="+",
        default=[],
        metavar="NAME[=PATH]",
        type=lambda v: v.split("=", 1)[0],
        help="vLLM engines: LoRA adapters served under these model names (vLLM's "
        "NAME=PATH syntax; the path is not read), listed with their parent, their KV "
        "blocks hashed apart from the base model's and published with lora_name",
    )
    group.add_argument(
        "--no-prompt-tokens-details",
        dest="prompt_tokens_details",
        action="store_false",
        help="vLLM: usage.prompt_tokens_details null (as without --enable-prompt-tokens-details)",
    )


def load_fleet_file(path: Path) -> FleetFile:
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as e:
        raise CliError(f"--fleet {path}: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise CliError(f"--fleet {path}: not valid YAML: {str(e).splitlines()[0]}") from None
    try:
        return FleetFile.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "(top level)"
        raise CliError(f"--fleet {path}: field {where}: {err['msg']}") from None


def cli_overrides(args: argparse.Namespace) -> dict[str, object]:
    """Profile overrides from the engine-option flags (names as in sim-core's ``Profile``)."""
    out: dict[str, object] = {}
    for flag, field in (
        ("max_model_len", "max_model_len"),
        ("max_num_seqs", "max_running"),
        ("num_gpu_blocks", "num_blocks"),
        ("block_size", "block_size"),
        ("scheduling_policy", "queue_policy"),
    ):
        value = getattr(args, flag)
        if value is not None:
            out[field] = value
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise CliError(f"--set {item!r}: expected KEY=VALUE")
        out[key.strip()] = value.strip()
    return out


def resolve(args: argparse.Namespace) -> tuple[list[EngineSpec], str, float, int]:
    if args.vllm < 0 or args.trtllm < 0:
        raise CliError("--vllm and --trtllm must be >= 0")
    if not 0 <= args.port <= 65535:
        raise CliError(f"--port {args.port} is out of range")
    if args.time_scale is not None and args.time_scale < 0:
        raise CliError("--time-scale must be >= 0")
    try:
        check_loopback(args.host)
    except FleetError as e:
        raise CliError(str(e)) from None
    specs: list[EngineSpec] = []
    model, time_scale, seed = DEFAULT_MODEL, 1.0, 0
    if args.fleet is not None:
        fleet = load_fleet_file(args.fleet)
        specs.extend(fleet.engines)
        model = fleet.model
        time_scale = fleet.time_scale if fleet.time_scale is not None else time_scale
        seed = fleet.seed if fleet.seed is not None else seed
    overrides = cli_overrides(args)
    details = args.prompt_tokens_details
    if args.max_num_queued_reqs is not None and args.max_num_queued_reqs < 0:
        raise CliError("--max-num-queued-reqs must be >= 0")
    trt_overrides = dict(overrides)
    if args.trtllm_attention_dp is not None:
        if args.trtllm_attention_dp < 1:
            raise CliError("--trtllm-attention-dp must be >= 1")
        trt_overrides["attention_dp_ranks"] = args.trtllm_attention_dp
        trt_overrides["adp_cache_routing"] = args.trtllm_adp_routing == "cache"
    for kind, count in (("vllm", args.vllm), ("trtllm", args.trtllm)):
        profile = args.profile
        if profile == "auto":
            profile = default_profile(kind, args.model or model)
        specs += [
            EngineSpec(
                kind=kind,
                profile=profile,
                overrides=trt_overrides if kind == "trtllm" else overrides,
                enable_prompt_tokens_details=details,
                max_num_queued_reqs=args.max_num_queued_reqs,
                version=args.vllm_version if kind == "vllm" else args.trtllm_version,
                kv_events=bool(args.kv_events),
                lora_modules=list(args.lora_modules) if kind == "vllm" else [],
            )
            for _ in range(count)
        ]
    if not specs:
        raise CliError("nothing to run: give --vllm N, --trtllm M or --fleet FILE")
    if args.model is not None:
        model = args.model
    if args.time_scale is not None:
        time_scale = args.time_scale
    if args.seed is not None:
        seed = args.seed
    return specs, model, time_scale, seed


async def serve(args: argparse.Namespace) -> int:
    specs, model, time_scale, seed = resolve(args)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        async with run_fleet(
            specs, args.host, args.port, model=model, time_scale=time_scale, seed=seed
        ) as fleet:
            for spec, e in zip(specs, fleet.engines, strict=True):
                kv = f" kv_events={e.kv_events} kv_replay={e.kv_replay}" if e.kv_events else ""
                if trtllm_kv_transport(spec) == "http-drain":
                    kv = f" kv_events=http-drain:{TRTLLM_KV_EVENTS_PATH}"
                ranks = int(str(spec.overrides.get("attention_dp_ranks", 1)))
                if kv and ranks > 1:
                    cache = str(spec.overrides.get("adp_cache_routing")).lower() in ("true", "1")
                    kv += f" kv_ranks={ranks} kv_rank_choice={'cache' if cache else 'load'}"
                elif ranks > 1:
                    kv += f" schedulers={ranks}"  # no events: the ranks as schedulers
                print(f"engine={e.kind} url={e.url} model={e.model}{kv}", flush=True)
            await stop.wait()
    except FleetError as e:
        raise CliError(str(e)) from None
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    return 0


def write_tokenizer(out: Path) -> int:
    """The emulator's tokenizer files into ``out`` (the same bytes as the shipped copy)."""
    from fleetgate.sim.core.tokenizer_file import tokenizer_files

    try:
        out.mkdir(parents=True, exist_ok=True)
        for name, text in tokenizer_files().items():
            (out / name).write_text(text, encoding="utf-8")
    except OSError as e:
        raise CliError(f"--write-tokenizer {out}: {e.strerror or e}") from None
    print(f"wrote {', '.join(tokenizer_files())} to {out}", flush=True)
    return 0


def run(args: argparse.Namespace) -> int:
    if args.write_tokenizer is not None:
        return write_tokenizer(args.write_tokenizer)
    if args.engine_command:
        if args.engine_command[0] not in ENGINE_COMMANDS:
            raise CliError(
                f"unknown engine command {args.engine_command[0]!r}; "
                f"expected {' or '.join(ENGINE_COMMANDS)} (or flags such as --vllm N)"
            )
        from fleetgate.sim import entrypoints

        return entrypoints.main(args.engine_command)
    resolve(args)  # validate before starting a loop
    rc = asyncio.run(serve(args))
    sys.stdout.flush()
    return rc
