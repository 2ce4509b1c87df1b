"""Install and run ``inference-perf`` against our benchmark fleets (I/O side).

The pure half (workload mapping, config, offline environment, report parsing)
is :mod:`fleetgate_tools.bench.infperf`; its docstring says what inference-perf is
told and why. This module:

* installs ``inference-perf==VERSION`` into
  ``~/.cache/fleetgate/peers/inference-perf-VERSION`` with a Python 3.12 venv
  (its ``Requires-Python`` is ``>=3.12``), reused once installed, exactly like
  :mod:`fleetgate_tools.bench.peers` does for the peer routers;
* copies the local tiny-llama tokenizer (no weights) and measures the
  emulator-tokens-per-tokenizer-token ratio on text from inference-perf's own
  generator (:func:`calibrate_ratio`);
* per contender, runs our loadgen via :func:`fleetgate_tools.bench.runner.run_one`
  and inference-perf on a fresh fleet + contender started by
  :func:`fleetgate_tools.bench.runner.start_fleet` / ``start_contender`` (the same
  fleet file, config and ports policy as ``fleetgate bench run``), scraping the
  engines' counters before and after for the prefix-cache hit rate;
* bounds every child: inference-perf runs in its own process group and is
  killed at :func:`fleetgate_tools.bench.infperf.hard_deadline_s`; fleet and router
  are always stopped (``finally``).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import yaml

from fleetgate.cli import CliError
from fleetgate_tools import procs
from fleetgate_tools.bench import compare, peers, report, runner, scenarios
from fleetgate_tools.bench import contenders as cmod
from fleetgate_tools.bench.infperf import (
    NAME,
    PER_REQUEST_FILE,
    VERSION,
    Figures,
    build_config,
    figures_of,
    fmt,
    hard_deadline_s,
    offline_env,
    plan_for,
    ratio_from_texts,
    results_from_per_request,
    table,
    tokenizer_config_for_counting,
)
from fleetgate_tools.bench.peers import PeerUnavailable, default_root, install_venv
from fleetgate_tools.bench.summary import RunRecord

LOADGEN = "fleetgate loadgen"

PYTHON312 = "/root/.pyenv/versions/3.12.1/bin/python3.12"
TOKENIZER = Path.home() / ".cache" / "fleetgate" / "models" / "tiny-llama"


# ---------------------------------------------------------------- install


def venv_dir(root: Path) -> Path:
    return root / f"{NAME}-{VERSION}"


def entry_point(root: Path) -> Path:
    return venv_dir(root) / "bin" / NAME


def find_python312(explicit: str | None = None) -> str:
    """The interpreter for the venv: inference-perf needs Python >= 3.12."""
    for cand in (explicit, os.environ.get("FLEETGATE_PYTHON312"), PYTHON312):
        if cand and Path(cand).exists():
            return cand
    found = shutil.which("python3.12")
    if found:
        return found
    raise PeerUnavailable(f"{NAME} needs Python 3.12: none found (set FLEETGATE_PYTHON312)")


def ensure(root: Path | None = None, python: str | None = None, timeout_s: float = 1200.0) -> Path:
    """The inference-perf venv under ``root`` (peers.py's pattern), installed when missing."""
    root = root or default_root()
    venv = venv_dir(root)
    if entry_point(root).exists():
        return venv
    root.mkdir(parents=True, exist_ok=True)
    install_venv(find_python312(python), venv, f"{NAME}=={VERSION}", entry_point(root), timeout_s)
    return venv


def prepare_tokenizer(src: Path, dst: Path) -> Path:
    """Copy the local tokenizer files (not the weights) with the lifted max length."""
    if not (src / "tokenizer.json").exists():
        raise FileNotFoundError(f"no tokenizer.json in {src}")
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix in (".json", ".jinja", ".model"):
            shutil.copyfile(f, dst / f.name)
    cfg_path = dst / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
    cfg_path.write_text(json.dumps(tokenizer_config_for_counting(cfg), indent=1))
    return dst


# ------------------------------------------------------------------- running

#: Runs inside the inference-perf venv: text from ITS generator, one JSON list.
_CALIBRATE = """
import json, sys
import numpy as np
from inference_perf.config import CustomTokenizerConfig
from inference_perf.utils.custom_tokenizer import CustomTokenizer
from inference_perf.datagen.datagen_utils import init_vocab_sampling
from inference_perf.datagen.datagen_utils import generate_random_exact_length_text as gen
path, n, k, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
tok = CustomTokenizer(CustomTokenizerConfig(pretrained_model_name_or_path=path))
_, _, valid = init_vocab_sampling(tok)
rng = np.random.default_rng(seed)
print(json.dumps([gen(rng, valid, tok, n)[0] for _ in range(k)]))
"""


def calibrate_ratio(
    venv: Path, tokenizer_path: Path, tokens: int = 400, samples: int = 4, seed: int = 0
) -> float:
    argv = [
        str(venv / "bin" / "python"),
        "-c",
        _CALIBRATE,
        str(tokenizer_path),
        str(tokens),
        str(samples),
        str(seed),
    ]
    try:
        done = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
            env=offline_env(os.environ),
            stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise RuntimeError(f"{NAME} calibration: {e}") from None
    if done.returncode != 0:
        last = " | ".join(done.stderr.strip().splitlines()[-3:])
        raise RuntimeError(f"{NAME} calibration: exit {done.returncode}: {last}")
    texts = json.loads(done.stdout.strip().splitlines()[-1])
    return ratio_from_texts([str(t) for t in texts], tokens)


def find_per_request(report_dir: Path) -> Path:
    hits = sorted(report_dir.rglob(PER_REQUEST_FILE))
    if not hits:
        raise FileNotFoundError(f"{NAME} wrote no {PER_REQUEST_FILE} under {report_dir}")
    return hits[0]


def start_offline(argv: Sequence[str], log: Path) -> procs.Proc:
    """:func:`fleetgate_tools.procs.start` with exactly :func:`offline_env`, not
    our environment plus it (OTLP endpoints, tokens, PYTHONPATH stay out)."""
    return procs.start(NAME, argv, log, offline_env(os.environ), inherit_env=False)


def run_tool(venv: Path, config: dict[str, Any], run_dir: Path, deadline_s: float) -> Path:
    """Run inference-perf once; its per-request report's path. Killed (process group)
    at the deadline."""
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg_path = run_dir / "inference-perf.yaml"
    cfg_path.write_text(yaml.safe_dump(config, sort_keys=False))
    proc = start_offline(
        [str(venv / "bin" / NAME), "-c", str(cfg_path), "--log-level", "INFO"],
        run_dir / "inference-perf.log",
    )
    try:
        proc.popen.wait(deadline_s)
    except subprocess.TimeoutExpired:
        proc.stop()
        raise procs.ProcessError(
            f"{NAME} still running after {deadline_s:.0f} s (killed): {procs.tail(proc.log)}"
        ) from None
    finally:
        proc.stop()  # no-op once exited; reaps leftovers of a killed run
    if proc.popen.returncode != 0:
        raise procs.ProcessError(
            f"{NAME} exited with code {proc.popen.returncode}: {procs.tail(proc.log)}"
        )
    return find_per_request(Path(config["storage"]["local_storage"]["path"]))


def tool_name() -> str:
    return f"{NAME} {VERSION}"


def workload_label(scenario: scenarios.Scenario, tool: str) -> str:
    """The record's workload: the comparison pairs runs of one tool only."""
    return f"{scenario.name} ({tool})"


def run_infperf(
    scenario: scenarios.Scenario,
    contender: cmod.Contender,
    run_dir: Path,
    venv: Path,
    tokenizer_path: Path,
    ratio: float,
    peers_root: Path | None,
    source: Path | None = None,
    warmup_s: float = 0.0,
) -> RunRecord:
    """inference-perf against ``contender`` on a fresh fleet of ``scenario``, as a
    :class:`RunRecord` of its per-request report (``warmup_s`` modelled seconds
    left out of the figures); ``source`` as in :func:`fleetgate_tools.bench.runner.run_one`."""
    env = {"PYTHONPATH": str(source)} if source is not None else None
    plan = plan_for(scenario)
    record = runner.empty_record(
        scenario, contender.name, scenario.seed, warmup_s, workload_label(scenario, tool_name())
    )
    fleet: runner.Fleet | None = None
    router: procs.Proc | None = None
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        fleet = runner.start_fleet(scenario, run_dir, env=env, kv_events=contender.kv_events)
        router, url = runner.start_contender(
            contender, fleet, run_dir, scenario, peers_root, env=env
        )
        engines = fleet.engines
        before = asyncio.run(_scrape(engines))
        cpu0 = router.cpu()
        config = build_config(plan, url, scenarios.MODEL, tokenizer_path, run_dir / "report", ratio)
        report = run_tool(venv, config, run_dir, hard_deadline_s(plan))
        cpu1 = router.cpu()
        after = asyncio.run(_scrape(engines))
        record.engines = runner.windows(engines, before, after)
        record.results = results_from_per_request(
            json.loads(report.read_text()), scenario.time_scale
        )
        record.router_cpu_s = cpu1 - cpu0 if cpu0 is not None and cpu1 is not None else None
    except (procs.ProcessError, httpx.HTTPError, OSError, ValueError) as e:
        record.error = f"{type(e).__name__}: {e}"[:300]
    finally:
        if router is not None:
            router.stop()
        if fleet is not None:
            fleet.proc.stop()
    return record


async def _scrape(engines: list[tuple[str, str]]) -> list[Any]:
    async with httpx.AsyncClient(timeout=10.0, trust_env=False) as client:
        return await runner.scrape(client, engines)


def run_loadgen(
    scenario: scenarios.Scenario,
    contender: cmod.Contender,
    run_dir: Path,
    peers_root: Path | None,
    source: Path | None = None,
    warmup_s: float = 0.0,
) -> RunRecord:
    """Our loadgen, exactly as ``fleetgate bench run`` runs it (``runner.run_one``)."""
    rec = runner.run_one(
        scenario,
        contender,
        scenario.seed,
        run_dir,
        peers_root=peers_root,
        source=source,
        warmup_s=warmup_s,
    )
    return dataclasses.replace(rec, workload=workload_label(scenario, LOADGEN))


# ------------------------------------------------------------------------ CLI


def build_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("workload", nargs="?", default="shared-prefix", help="only shared-prefix")
    p.add_argument("--contenders", default="fleetgate", help="comma-separated contender names")
    p.add_argument("--engines", type=int, default=4)
    p.add_argument(
        "--duration",
        type=float,
        default=15.0,
        help="MODELLED seconds of arrivals per run (15); before the steady-state rules "
        "this was wall seconds",
    )
    p.add_argument(
        "--warmup",
        default="10%",
        help="left out of every figure: modelled seconds, or a percentage of the "
        "arrival window (default 10%%)",
    )
    p.add_argument("--seeds", default="0", help="comma-separated seeds, one run each (0)")
    p.add_argument("--load-factor", type=float, default=1.0, help="multiple of the base rate")
    p.add_argument("--time-scale", type=float, default=None, help="default 2 x engines")
    p.add_argument(
        "--bootstrap",
        type=int,
        default=1000,
        help="bootstrap replicates of each confidence interval (1000; 0 = none)",
    )
    p.add_argument("--no-loadgen", action="store_true", help="skip our loadgen's runs")
    p.add_argument("--tokenizer", type=Path, default=TOKENIZER, help="local HF tokenizer dir")
    p.add_argument("--python312", default=None, help="interpreter for the inference-perf venv")
    p.add_argument("--peers-dir", type=Path, default=None, help="peer venvs root")
    p.add_argument(
        "--source",
        type=Path,
        default=None,
        help="run the emulator and fleetgate router from this package copy (as bench run)",
    )
    p.add_argument("--keep", type=Path, default=None, help="keep configs, logs, reports here")
    p.add_argument("--json", type=Path, default=None, help="write the figures as JSON")


def run(args: argparse.Namespace) -> int:
    try:
        chosen = cmod.parse_contenders(args.contenders)
    except cmod.UnknownContender as e:
        raise CliError(str(e)) from None
    if not 1 <= args.engines <= 64:
        raise CliError("--engines must be 1-64")
    if not 0 < args.duration <= 600:
        raise CliError("--duration must be in (0, 600] modelled seconds")
    if args.bootstrap < 0:
        raise CliError("--bootstrap must be >= 0")
    try:
        seeds = scenarios.parse_seed_list(args.seeds)
        value, percent = scenarios.parse_warmup(args.warmup)
    except ValueError as e:
        raise CliError(str(e)) from None
    warmup = args.duration * value / 100.0 if percent else value
    if warmup >= args.duration:
        raise CliError(f"--warmup {warmup:g} s must be shorter than --duration {args.duration:g} s")
    scale = args.time_scale if args.time_scale is not None else 2.0 * args.engines
    try:
        scs = [
            scenarios.make(
                args.workload,
                engines=args.engines,
                modelled_s=args.duration,
                time_scale=scale,
                seed=seed,
                load_factor=args.load_factor,
            )
            for seed in seeds
        ]
        for sc in scs:
            plan_for(sc)
    except ValueError as e:
        raise CliError(str(e)) from None
    if args.source is not None and not (args.source / "fleetgate" / "__init__.py").exists():
        raise CliError(f"--source {args.source}: no fleetgate package there")
    peers_root = args.peers_dir or default_root()
    print(f"bench: preparing {NAME} {VERSION} ...", file=sys.stderr, flush=True)
    try:
        venv = ensure(peers_root, args.python312)
    except PeerUnavailable as e:
        raise CliError(f"{NAME} unavailable: {e}") from None
    unavailable = peers.prepare(chosen, peers_root)
    work = args.keep or Path(tempfile.mkdtemp(prefix="fleetgate-infperf-"))
    try:
        tok = prepare_tokenizer(args.tokenizer, work / "tokenizer")
        ratio = calibrate_ratio(venv, tok)
    except (OSError, RuntimeError, ValueError) as e:
        raise CliError(f"{NAME} tokenizer: {e}") from None
    print(
        f"bench: {ratio:.3f} emulator tokens per tokenizer token; {args.duration:g} modelled s "
        f"({args.duration * scale:g} wall s) per run, the first {warmup:g} modelled s warm-up",
        file=sys.stderr,
    )
    records: list[tuple[RunRecord, str]] = []
    try:
        for sc in scs:
            for c in chosen:
                if c.kind in unavailable:
                    for tool in ([] if args.no_loadgen else [LOADGEN]) + [tool_name()]:
                        rec = _failed(sc, c, tool, unavailable[c.kind], warmup)
                        records.append((rec, tool))
                    continue
                run_dir = work / f"seed{sc.seed}-{c.name}"
                if not args.no_loadgen:
                    t0 = time.monotonic()
                    rec = run_loadgen(sc, c, run_dir / "loadgen", peers_root, args.source, warmup)
                    records.append((rec, LOADGEN))
                    _progress(figures_of(rec, LOADGEN, sc.objective), t0)
                t0 = time.monotonic()
                rec = run_infperf(
                    sc, c, run_dir / "infperf", venv, tok, ratio, peers_root, args.source, warmup
                )
                records.append((rec, tool_name()))
                _progress(figures_of(rec, tool_name(), sc.objective), t0)
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    rows = [figures_of(rec, tool, scs[0].objective) for rec, tool in records]
    comparisons = (
        compare.compare([r for r, _ in records], random.Random(0), replicates=args.bootstrap)
        if args.bootstrap
        else []
    )
    for line in table(rows) + [""] + report.comparison_table(comparisons):
        print(line)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        doc = {
            "command": "fleetgate " + shlex.join(sys.argv[1:]),
            "scenario": {
                "workload": scs[0].name,
                "engines": args.engines,
                "duration_modelled_s": args.duration,
                "warmup_modelled_s": warmup,
                "time_scale": scale,
                "seeds": seeds,
                "load_factor": args.load_factor,
            },
            "plans": {str(sc.seed): dataclasses.asdict(plan_for(sc)) for sc in scs},
            "ratio": ratio,
            "rows": [dataclasses.asdict(r) for r in rows],
            "comparisons": [compare.as_dict(c) for c in comparisons],
        }
        args.json.write_text(json.dumps(doc, indent=1))
    return 0 if any(r.error is None for r in rows) else 1


def _failed(
    sc: scenarios.Scenario, c: cmod.Contender, tool: str, error: str, warmup_s: float
) -> RunRecord:
    return runner.empty_record(sc, c.name, sc.seed, warmup_s, workload_label(sc, tool), error)


def _progress(f: Figures, t0: float) -> None:
    what = f.error or (
        f"seed {f.seed}: {f.requests} steady requests, {f.errors} errors, "
        f"TTFT p90 {fmt(f.ttft_p90, '.3f')} s, hit rate {fmt(f.hit_rate, '.3f')}"
    )
    print(
        f"bench: {f.contender} / {f.tool}: {what} ({time.monotonic() - t0:.0f} s)",
        file=sys.stderr,
        flush=True,
    )
