"""``fleetgate bench run WORKLOAD[,WORKLOAD...] [options]``: side-by-side router benchmarks.

For every repeat, load factor and contender (in that nesting, so that slow
drift of a shared machine hits every contender alike) one run starts a fresh
emulated fleet and the contender as subprocesses on free loopback ports,
replays the identical seeded schedule (seed + repeat index: every contender
sees the same arrivals within a repeat) and stops both. Results are medians
over repeats with (min-max) spread, written as JSON (``--json``) and as a
Markdown report with PNG plots (``--report DIR``; default a new directory
``~/.cache/fleetgate/bench/<UTC time>``, never the committed ``bench/results``).
An existing report or JSON file is not overwritten without ``--force``: checked
before anything runs.
Peer routers are installed on first use into ``~/.cache/fleetgate/peers``; a
peer that cannot be installed or started is recorded with its exact error and
the other contenders still run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from fleetgate.cli import CliError
from fleetgate_tools.bench import contenders as cmod
from fleetgate_tools.bench import infperf_run, peers, report, runner, scenarios
from fleetgate_tools.bench.summary import RunRecord, RunSummary, aggregate, summarise_run
from fleetgate_tools.paths import cache_dir


def build_parser(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True)
    p = sub.add_parser("run", help="run workloads against contenders and report")
    p.add_argument("workload", help=f"comma-separated: {', '.join(scenarios.LOADS)}")
    p.add_argument("--engines", type=int, default=4, help="emulated engines (default 4)")
    p.add_argument(
        "--duration", type=float, default=60.0, help="wall seconds of arrivals per run (60)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument(
        "--contenders",
        default="fleetgate",
        help=f"comma-separated or 'all': {', '.join(cmod.CONTENDERS)}",
    )
    p.add_argument(
        "--time-scale",
        type=float,
        default=None,
        help="emulator wall seconds per modelled second (default 2 x engines)",
    )
    p.add_argument(
        "--load-factors", default="1", help="comma-separated multiples of the base rate (1)"
    )
    p.add_argument("--mixed", action="store_true", help="alternate TensorRT-LLM and vLLM engines")
    p.add_argument("--json", type=Path, help="write every run and the medians as JSON")
    p.add_argument(
        "--report",
        type=Path,
        default=None,
        help="Markdown + PNG directory (default a new ~/.cache/fleetgate/bench/<UTC time>)",
    )
    p.add_argument("--force", action="store_true", help="overwrite an existing report or JSON file")
    p.add_argument("--no-report", action="store_true", help="skip the Markdown/PNG report")
    p.add_argument(
        "--report-name",
        default=None,
        help="report file name (default: the workloads); also prefixes the PNGs",
    )
    p.add_argument("--peers-dir", type=Path, default=None, help="peer venvs root")
    p.add_argument(
        "--source",
        type=Path,
        default=None,
        help="run the emulator and fleetgate router from this package copy (PYTHONPATH), "
        "e.g. a git archive of the commit under test",
    )
    infperf_run.build_parser(
        sub.add_parser("infperf", help="cross-check our loadgen's figures with inference-perf")
    )


@dataclasses.dataclass(frozen=True)
class Settings:
    workloads: list[str]
    contenders: list[cmod.Contender]
    engines: int
    duration_s: float
    seed: int
    repeats: int
    time_scale: float
    load_factors: list[float]
    mixed: bool


def resolve(args: argparse.Namespace) -> Settings:
    workloads = [w.strip() for w in args.workload.split(",") if w.strip()]
    for w in workloads:
        if w not in scenarios.LOADS:
            raise CliError(f"unknown workload {w!r}; known: {', '.join(scenarios.LOADS)}")
    if not workloads:
        raise CliError("give a workload")
    try:
        chosen = cmod.parse_contenders(args.contenders)
    except cmod.UnknownContender as e:
        raise CliError(str(e)) from None
    if not 1 <= args.engines <= 64:
        raise CliError("--engines must be 1-64")
    if args.duration <= 0 or args.duration > 3600:
        raise CliError("--duration must be in (0, 3600] seconds")
    if not 1 <= args.repeats <= 20:
        raise CliError("--repeats must be 1-20")
    try:
        factors = [float(x) for x in args.load_factors.split(",") if x.strip()]
    except ValueError:
        raise CliError(f"--load-factors {args.load_factors!r}: expected numbers") from None
    if not factors or any(f <= 0 for f in factors):
        raise CliError("--load-factors must be positive numbers")
    name = args.report_name
    if name is not None and (not name or "/" in name or name.startswith(".")):
        raise CliError(f"--report-name {name!r}: a plain file name, without '/'")
    scale = args.time_scale if args.time_scale is not None else 2.0 * args.engines
    if scale <= 0:
        raise CliError("--time-scale must be > 0")
    return Settings(
        workloads,
        chosen,
        args.engines,
        args.duration,
        args.seed,
        args.repeats,
        scale,
        factors,
        args.mixed,
    )


def summary_dict(s: RunSummary) -> dict[str, Any]:
    return dataclasses.asdict(s)


def execute(
    settings: Settings, peers_root: Path, work: Path, source: Path | None = None
) -> list[tuple[RunRecord, Any]]:
    unavailable = peers.prepare(settings.contenders, peers_root)
    out: list[tuple[RunRecord, Any]] = []
    total = (
        len(settings.workloads)
        * settings.repeats
        * len(settings.load_factors)
        * len(settings.contenders)
    )
    n = 0
    for w in settings.workloads:
        for rep in range(settings.repeats):
            for lf in settings.load_factors:
                sc = scenarios.make(
                    w,
                    engines=settings.engines,
                    duration_s=settings.duration_s,
                    time_scale=settings.time_scale,
                    seed=settings.seed + rep,
                    load_factor=lf,
                    mixed=settings.mixed,
                )
                for c in settings.contenders:
                    n += 1
                    t0 = time.monotonic()
                    if c.kind in unavailable:
                        rec = RunRecord(
                            w,
                            c.name,
                            rep,
                            lf,
                            sc.duration_s,
                            sc.time_scale,
                            [],
                            [],
                            None,
                            error=unavailable[c.kind],
                        )
                    else:
                        run_dir = work / f"{w}-r{rep}-x{lf:g}-{c.name}"
                        rec = runner.run_one(
                            sc, c, rep, run_dir, peers_root=peers_root, source=source
                        )
                    s = summarise_run(rec, sc.objective)
                    p90 = f"{s.ttft_p90:.3f}" if s.ttft_p90 is not None else "n/a"
                    status = rec.error or (
                        f"{s.requests} requests, {s.errors} errors, TTFT p90 {p90} s"
                    )
                    print(
                        f"bench: [{n}/{total}] {w} x{lf:g} {c.name} repeat {rep}: {status} "
                        f"({time.monotonic() - t0:.0f} s)",
                        file=sys.stderr,
                        flush=True,
                    )
                    out.append((rec, s))
    return out


def notes_for(settings: Settings) -> list[str]:
    kinds = "alternating TensorRT-LLM and vLLM" if settings.mixed else "vLLM"
    return [
        f"{settings.engines} emulated {kinds} engines (Llama-3.1-8B on H100 profiles, reduced "
        f"KV cache), time scale {settings.time_scale:g} wall s per modelled s: all latencies and "
        "rates are in MODELLED seconds; router overhead is divided by the time scale too and is "
        "shown separately as router CPU seconds.",
        f"{settings.duration_s:g} wall s of arrivals per run, {settings.repeats} repeat(s) "
        f"(seeds {settings.seed}..{settings.seed + settings.repeats - 1}); a fresh fleet per run.",
        "hit rate and imbalance come from the ENGINES' /metrics counters (before/after); "
        "imbalance = max/mean of per-engine generated tokens; goodput = requests per modelled "
        "second meeting their class's TTFT objective.",
    ] + [f"not available: {k} ({v})." for k, v in cmod.UNAVAILABLE.items()]


def command_line(args: argparse.Namespace, settings: Settings) -> str:
    """The exact command (defaults spelled out) that reproduces this run."""
    parts = [
        "fleetgate bench run",
        ",".join(settings.workloads),
        f"--engines {settings.engines}",
        f"--duration {settings.duration_s:g}",
        f"--seed {settings.seed}",
        f"--repeats {settings.repeats}",
        f"--time-scale {settings.time_scale:g}",
        f"--load-factors {','.join(f'{f:g}' for f in settings.load_factors)}",
        f"--contenders {','.join(c.name for c in settings.contenders)}",
    ]
    if settings.mixed:
        parts.append("--mixed")
    if args.source is not None:
        parts.append(f"--source {shlex.quote(str(args.source))}")
    if args.json:
        parts.append(f"--json {shlex.quote(str(args.json))}")
    if not args.no_report:
        parts.append(f"--report {shlex.quote(str(args.report))}")
        if args.report_name:
            parts.append(f"--report-name {shlex.quote(args.report_name)}")
    return " ".join(parts)


def default_report_dir(now: float | None = None) -> Path:
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now))
    return cache_dir() / "bench" / stamp


def report_name(args: argparse.Namespace, settings: Settings) -> str:
    return args.report_name or ("-".join(settings.workloads) + ("-mixed" if settings.mixed else ""))


def existing_outputs(args: argparse.Namespace, settings: Settings) -> list[Path]:
    """Files this run would overwrite: the JSON, the report and its plots."""
    found: list[Path] = []
    if args.json is not None and args.json.exists():
        found.append(args.json)
    if not args.no_report and args.report.is_dir():
        md = args.report / f"{report_name(args, settings)}.md"
        if md.exists():
            found.append(md)
        prefix = f"{args.report_name}-" if args.report_name else ""
        found += [
            args.report / f"{prefix}{w}.png"
            for w in settings.workloads
            if (args.report / f"{prefix}{w}.png").exists()
        ]
    return found


def run(args: argparse.Namespace) -> int:
    if args.action == "infperf":
        return infperf_run.run(args)
    settings = resolve(args)
    if args.report is None:
        args.report = default_report_dir()
    clobber = existing_outputs(args, settings)
    if clobber and not args.force:
        shown = ", ".join(str(p) for p in clobber[:4]) + (" ..." if len(clobber) > 4 else "")
        raise CliError(
            f"would overwrite {shown}: pass --force, or another --report / --json / --report-name"
        )
    if args.source is not None and not (args.source / "fleetgate" / "__init__.py").exists():
        raise CliError(f"--source {args.source}: no fleetgate package there")
    peers_root = args.peers_dir or peers.default_root()
    command = command_line(args, settings)
    with tempfile.TemporaryDirectory(prefix="fleetgate-bench-") as tmp:
        pairs = execute(settings, peers_root, Path(tmp), args.source)
    summaries = [s for _, s in pairs]
    aggs = aggregate(summaries)
    if args.json:
        doc = {
            "command": command,
            "settings": {
                "workloads": settings.workloads,
                "contenders": [c.name for c in settings.contenders],
                "engines": settings.engines,
                "duration_s": settings.duration_s,
                "seed": settings.seed,
                "repeats": settings.repeats,
                "time_scale": settings.time_scale,
                "load_factors": settings.load_factors,
                "mixed": settings.mixed,
            },
            "runs": [summary_dict(s) for s in summaries],
            "medians": [dataclasses.asdict(a) for a in aggs],
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=1))
    if not args.no_report:
        name = report_name(args, settings)
        prefix = f"{args.report_name}-" if args.report_name else ""
        plots = report.write_plots(aggs, args.report, prefix)
        md = report.render_markdown(
            aggs,
            title=f"fleetgate bench: {', '.join(settings.workloads)}",
            command=command,
            notes=notes_for(settings),
            plots=[str(p) for p in plots],
        )
        path = args.report / f"{name}.md"
        path.write_text(md)
        print(f"bench: report {path}", file=sys.stderr)
    for line in report.table(aggs):
        print(line)
    # peers that could not run are reported; only "nothing ran at all" fails
    return 0 if any(a.failed < a.repeats for a in aggs) else 1
