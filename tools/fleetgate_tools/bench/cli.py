"""``fleetgate bench run WORKLOAD[,WORKLOAD...] [options]``: side-by-side router benchmarks.

For every workload (its time scale given, or calibrated with ``--time-scale
auto``), seed, load factor and contender (in that nesting, so that slow drift
of a shared machine hits every contender alike) one run starts a fresh
emulated fleet and the contender (``--router-replicas`` processes behind the
round-robin front) as subprocesses on free loopback ports, replays the
identical seeded schedule (every contender sees the same arrivals for a seed)
for ``--duration`` MODELLED seconds and stops both. Figures leave out the
``--warmup``. Results are medians over seeds with (min-max) spread, and every
contender is compared with the best peer with bootstrap intervals
(:mod:`fleetgate_tools.bench.compare`), written as JSON (``--json``) and as a
Markdown report with PNG plots (``--report DIR``; default a new directory
``~/.cache/fleetgate/bench/<UTC time>``, never the committed ``bench/results``).
An existing report or JSON file is not overwritten without ``--force``: checked
before anything runs.
Peer routers are installed on first use into ``~/.cache/fleetgate/peers``; a
peer that cannot be installed or started is recorded with its exact error and
the other contenders still run (so is ``fleetgate-events`` on a router that
does not take the KV-event config yet).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import shlex
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fleetgate.cli import CliError
from fleetgate_tools.bench import compare, infperf_run, peers, report, runner, scenarios
from fleetgate_tools.bench import contenders as cmod
from fleetgate_tools.bench.ceiling import hit_rate, lru_hits, prompt_blocks, ttft_quantile
from fleetgate_tools.bench.summary import RunRecord, RunSummary, aggregate, summarise_run
from fleetgate_tools.paths import cache_dir


def build_parser(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True)
    p = sub.add_parser("run", help="run workloads against contenders and report")
    p.add_argument("workload", help=f"comma-separated: {', '.join(scenarios.LOADS)}")
    p.add_argument("--engines", type=int, default=4, help="emulated engines (default 4)")
    p.add_argument(
        "--duration",
        type=float,
        default=None,
        help="MODELLED seconds of arrivals per run (60); before the steady-state rules "
        "this was wall seconds: --wall-duration keeps that meaning",
    )
    p.add_argument(
        "--wall-duration",
        type=float,
        default=None,
        help="wall seconds of arrivals per run (the old --duration): modelled = wall / scale",
    )
    p.add_argument(
        "--warmup",
        default="10%",
        help="left out of every figure: modelled seconds, or a percentage of the "
        "arrival window (default 10%%)",
    )
    p.add_argument("--seed", type=int, default=None, help="first seed (0); with --repeats")
    p.add_argument("--repeats", type=int, default=None, help="seeds seed..seed+N-1 (1)")
    p.add_argument(
        "--seeds", default=None, help="comma-separated seeds, one repeat each (e.g. 0,1,2)"
    )
    p.add_argument(
        "--router-replicas",
        default="1",
        help="contender processes behind a round-robin TCP front (1); several values "
        "(1,2) run every contender at each, named NAME@2r for 2",
    )
    p.add_argument(
        "--bootstrap",
        type=int,
        default=1000,
        help="bootstrap replicates of each confidence interval (1000; 0 = none)",
    )
    p.add_argument(
        "--contenders",
        default="fleetgate",
        help=f"comma-separated or 'all': {', '.join(cmod.CONTENDERS)}",
    )
    p.add_argument(
        "--time-scale",
        default=None,
        help="emulator wall seconds per modelled second (default 2 x engines), or 'auto': "
        "from a short calibration run, the smallest scale keeping the run's processes "
        "under 70%% of the machine's CPU",
    )
    p.add_argument(
        "--load-factors", default="1", help="comma-separated multiples of the base rate (1)"
    )
    p.add_argument("--mixed", action="store_true", help="alternate TensorRT-LLM and vLLM engines")
    p.add_argument(
        "--references",
        action="store_true",
        help="print each workload's hit-rate ceiling, pooled-LRU reference and TTFT floors "
        "for these flags (computed from the requests, nothing started) and exit",
    )
    p.add_argument("--json", type=Path, help="write every run and the medians as JSON")
    p.add_argument(
        "--requests",
        type=Path,
        default=None,
        help="write every request (session, turn, TTFT, prompt and cached tokens, endpoint) "
        "and every engine's counter deltas as JSON lines, one run after another",
    )
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
    """Modelled seconds of arrivals (``--wall-duration``: set per workload from its scale)."""
    seeds: list[int]
    time_scale: float | None
    """None: ``auto`` (calibrated per workload)."""
    load_factors: list[float]
    mixed: bool
    warmup: tuple[float, bool] = (10.0, True)
    """(value, is a percentage of the arrival window)."""
    router_replicas: tuple[int, ...] = (1,)
    """Replica counts to run every contender at (several: names get ``@<n>r``)."""
    wall_duration_s: float | None = None
    """``--wall-duration``: wall seconds of arrivals (the old ``--duration``)."""
    bootstrap: int = 1000

    def contender_name(self, contender: cmod.Contender, replicas: int) -> str:
        """``NAME`` or, when several replica counts run and this one is > 1, ``NAME@<n>r``."""
        if len(self.router_replicas) > 1 and replicas > 1:
            return f"{contender.name}@{replicas}r"
        return contender.name

    @property
    def repeats(self) -> int:
        return len(self.seeds)

    @property
    def seed(self) -> int:
        return self.seeds[0]

    def modelled_s(self, scale: float) -> float:
        if self.wall_duration_s is not None:
            return self.wall_duration_s / scale
        return self.duration_s

    def warmup_s(self, modelled_s: float) -> float:
        value, percent = self.warmup
        return modelled_s * value / 100.0 if percent else value


def parse_warmup(text: str) -> tuple[float, bool]:
    try:
        return scenarios.parse_warmup(text)
    except ValueError as e:
        raise CliError(str(e)) from None


def parse_seeds(args: argparse.Namespace) -> list[int]:
    if args.seeds is not None:
        if args.seed is not None or args.repeats is not None:
            raise CliError("give --seeds, or --seed with --repeats, not both")
        try:
            return scenarios.parse_seed_list(args.seeds)
        except ValueError as e:
            raise CliError(str(e)) from None
    first = 0 if args.seed is None else args.seed
    repeats = 1 if args.repeats is None else args.repeats
    if not 1 <= repeats <= 20:
        raise CliError("--repeats must be 1-20")
    return list(range(first, first + repeats))


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
    if args.duration is not None and args.wall_duration is not None:
        raise CliError("give --duration (modelled seconds) or --wall-duration, not both")
    duration = 60.0 if args.duration is None else args.duration
    if args.wall_duration is not None and not 0 < args.wall_duration <= 36000:
        raise CliError("--wall-duration must be in (0, 36000] seconds")
    if not 0 < duration <= 3600:
        raise CliError("--duration must be in (0, 3600] modelled seconds")
    seeds = parse_seeds(args)
    try:
        factors = [float(x) for x in args.load_factors.split(",") if x.strip()]
    except ValueError:
        raise CliError(f"--load-factors {args.load_factors!r}: expected numbers") from None
    if not factors or any(f <= 0 for f in factors):
        raise CliError("--load-factors must be positive numbers")
    name = args.report_name
    if name is not None and (not name or "/" in name or name.startswith(".")):
        raise CliError(f"--report-name {name!r}: a plain file name, without '/'")
    scale: float | None
    if args.time_scale is None:
        scale = 2.0 * args.engines
    elif str(args.time_scale).strip().lower() == "auto":
        scale = None
    else:
        try:
            scale = float(args.time_scale)
        except ValueError:
            raise CliError(f"--time-scale {args.time_scale!r}: a number or 'auto'") from None
        if scale <= 0:
            raise CliError("--time-scale must be > 0")
    try:
        replicas = tuple(int(x) for x in str(args.router_replicas).split(",") if x.strip())
    except ValueError:
        raise CliError(f"--router-replicas {args.router_replicas!r}: integers like 1,2") from None
    if (
        not replicas
        or len(set(replicas)) != len(replicas)
        or any(not 1 <= r <= 4 for r in replicas)
    ):
        raise CliError("--router-replicas must be distinct numbers 1-4")
    if not 0 <= args.bootstrap <= 100000:
        raise CliError("--bootstrap must be 0-100000")
    warmup = parse_warmup(args.warmup)
    if not warmup[1] and args.wall_duration is None and warmup[0] >= duration:
        raise CliError(f"--warmup {warmup[0]:g} s must be shorter than --duration {duration:g} s")
    return Settings(
        workloads,
        chosen,
        args.engines,
        duration,
        seeds,
        scale,
        factors,
        args.mixed,
        warmup=warmup,
        router_replicas=replicas,
        wall_duration_s=args.wall_duration,
        bootstrap=args.bootstrap,
    )


def summary_dict(s: RunSummary) -> dict[str, Any]:
    return dataclasses.asdict(s)


def _calibration_contender(settings: Settings) -> cmod.Contender:
    """The contender of the calibration run: the first fleetgate one (its emulator
    CPU share is the highest, docs/bench.md), else the first."""
    return next((c for c in settings.contenders if c.kind == "fleetgate"), settings.contenders[0])


def _one(
    settings: Settings,
    sc: scenarios.Scenario,
    c: cmod.Contender,
    replicas: int,
    rep: int,
    seed: int,
    warmup: float,
    unavailable: dict[str, str],
    work: Path,
    peers_root: Path,
    source: Path | None,
    progress: str,
) -> tuple[RunRecord, Any]:
    """One run (or the record of a contender that cannot run) and its summary."""
    name = settings.contender_name(c, replicas)
    t0 = time.monotonic()
    if c.kind in unavailable:
        rec = RunRecord(
            sc.name,
            name,
            rep,
            sc.load_factor,
            sc.duration_s,
            sc.time_scale,
            [],
            [],
            None,
            error=unavailable[c.kind],
            warmup_s=warmup,
        )
    else:
        run_dir = work / f"{sc.name}-s{seed}-x{sc.load_factor:g}-{name}"
        rec = runner.run_one(
            sc,
            c,
            rep,
            run_dir,
            peers_root=peers_root,
            source=source,
            warmup_s=warmup,
            router_replicas=replicas,
        )
        rec.contender = name
    rec.extra.setdefault("seed", seed)
    s = summarise_run(rec, sc.objective)
    p90 = f"{s.ttft_p90:.3f}" if s.ttft_p90 is not None else "n/a"
    status = rec.error or f"{s.requests} steady requests, {s.errors} errors, TTFT p90 {p90} s"
    print(
        f"bench: {progress} {sc.name} x{sc.load_factor:g} {name} seed {seed}: {status} "
        f"({time.monotonic() - t0:.0f} s)",
        file=sys.stderr,
        flush=True,
    )
    return rec, s


def request_lines(rec: RunRecord) -> list[dict[str, Any]]:
    """One run as JSON-able records: a ``run`` line, an ``engine`` line per engine (its
    counter deltas over the steady state) and a ``request`` line per request (every
    request, warm-up included: ``sent_at`` says which; no token timings or text)."""
    head = {
        "workload": rec.workload,
        "contender": rec.contender,
        "seed": rec.extra.get("seed"),
        "load_factor": rec.load_factor,
    }
    out: list[dict[str, Any]] = [
        {"record": "run", **head, "warmup_s": rec.warmup_s, "error": rec.error}
    ]
    out += [{"record": "engine", **head, **dataclasses.asdict(e)} for e in rec.engines]
    for r in rec.results:
        fields = dataclasses.asdict(r)
        fields.pop("itl")
        fields.pop("text")
        out.append({"record": "request", **head, **fields})
    return out


def write_requests(path: Path, records: Sequence[RunRecord]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for rec in records:
            for line in request_lines(rec):
                f.write(json.dumps(line) + "\n")


def execute(
    settings: Settings,
    peers_root: Path,
    work: Path,
    source: Path | None = None,
    scales: dict[str, float] | None = None,
    calibrations: dict[str, dict[str, Any]] | None = None,
) -> list[tuple[RunRecord, Any]]:
    """Every run; ``scales`` receives the time scale used per workload (and
    ``calibrations`` the calibration figures, for ``--time-scale auto``)."""
    unavailable = peers.prepare(settings.contenders, peers_root)
    scales = {} if scales is None else scales
    calibrations = {} if calibrations is None else calibrations
    out: list[tuple[RunRecord, Any]] = []
    total = (
        len(settings.workloads)
        * settings.repeats
        * len(settings.load_factors)
        * len(settings.contenders)
        * len(settings.router_replicas)
    )
    n = 0
    for w in settings.workloads:
        scale = settings.time_scale
        if scale is None:
            cal_scale = 2.0 * settings.engines
            probe = scenarios.make(
                w,
                engines=settings.engines,
                modelled_s=settings.modelled_s(cal_scale),
                time_scale=cal_scale,
                seed=settings.seed,
                load_factor=max(settings.load_factors),
                mixed=settings.mixed,
            )
            contender = _calibration_contender(settings)
            print(
                f"bench: calibrating the time scale of {w} with {contender.name} "
                f"at {cal_scale:g} ...",
                file=sys.stderr,
                flush=True,
            )
            try:
                scale, figures = runner.calibrate_time_scale(
                    probe,
                    contender,
                    work / f"{w}-calibration",
                    peers_root=peers_root,
                    source=source,
                    router_replicas=max(settings.router_replicas),
                )
            except ValueError as e:
                raise CliError(str(e)) from None
            calibrations[w] = figures
            print(
                f"bench: {w}: {figures['calibration_cpu_s']:g} CPU s in "
                f"{figures['calibration_wall_s']:g} wall s of arrivals on "
                f"{figures['cores']} cores at scale {cal_scale:g} -> time scale {scale:g}",
                file=sys.stderr,
                flush=True,
            )
        scales[w] = scale
        modelled = settings.modelled_s(scale)
        warmup = settings.warmup_s(modelled)
        if warmup >= modelled:
            raise CliError(
                f"{w}: the warm-up ({warmup:g} modelled s) is not shorter than the "
                f"arrival window ({modelled:g} modelled s)"
            )
        for rep, seed in enumerate(settings.seeds):
            for lf in settings.load_factors:
                sc = scenarios.make(
                    w,
                    engines=settings.engines,
                    modelled_s=modelled,
                    time_scale=scale,
                    seed=seed,
                    load_factor=lf,
                    mixed=settings.mixed,
                )
                for c in settings.contenders:
                    for replicas in settings.router_replicas:
                        n += 1
                        out.append(
                            _one(settings, sc, c, replicas, rep, seed, warmup, unavailable,
                                 work, peers_root, source, f"[{n}/{total}]")
                        )  # fmt: skip
    return out


def notes_for(
    settings: Settings,
    scales: dict[str, float] | None = None,
    calibrations: dict[str, dict[str, Any]] | None = None,
) -> list[str]:
    kinds = "alternating TensorRT-LLM and vLLM" if settings.mixed else "vLLM"
    scales = scales or {}
    shown = sorted(set(scales.values())) or (
        [settings.time_scale] if settings.time_scale is not None else []
    )
    scale_text = ", ".join(f"{v:g}" for v in shown) or "auto"
    out = [
        f"{settings.engines} emulated {kinds} engines (Llama-3.1-8B on H100 profiles, reduced "
        f"KV cache), time scale {scale_text} wall s per modelled s: all latencies and "
        "rates are in MODELLED seconds; router overhead is divided by the time scale too and is "
        "shown separately as router CPU seconds.",
    ]
    for w in settings.workloads:
        if w in scales:
            m = settings.modelled_s(scales[w])
            out.append(
                f"{w}: {m:g} modelled s of arrivals = {m * scales[w]:g} wall s at time scale "
                f"{scales[w]:g}; the first {settings.warmup_s(m):g} modelled s are warm-up, "
                "left out of every figure but router CPU."
            )
        if calibrations and w in calibrations:
            c = calibrations[w]
            out.append(
                f"{w}: time scale chosen by calibration: {c['calibration_cpu_s']:g} CPU s "
                f"(emulator + router + front + load generator; idle "
                f"{c.get('idle_machine_cpu_share', 0.0):.1%} of the machine) in "
                f"{c['calibration_wall_s']:g} "
                f"wall s of arrivals on {c['cores']} cores at scale {c['calibration_scale']:g} -> "
                f"{c['chosen_scale']:g} keeps them under "
                f"{scenarios.TARGET_CPU_SHARE:.0%} of the machine; the calibration's TTFT p90 "
                f"(modelled, first seconds, no warm-up left out): "
                f"{c.get('calibration_ttft_p90') or float('nan'):.3f} s."
            )
    out += ceiling_notes(settings, scales)
    out += [
        f"{settings.repeats} seed(s) ({', '.join(str(s) for s in settings.seeds)}); a fresh "
        "fleet per run; tables show the median over seeds with (min-max).",
        "hit rate and imbalance come from the ENGINES' /metrics counters (from the end of "
        "the warm-up to the end); usage hit rate = the answers' cached_tokens / prompt_tokens; "
        "imbalance = max/mean of per-engine generated tokens; goodput = requests per modelled "
        "second meeting their class's TTFT objective.",
    ]
    if settings.router_replicas != (1,):
        counts = ", ".join(str(r) for r in settings.router_replicas)
        out.append(
            f"every contender ran as {counts} process(es) (NAME@<n>r when several counts run) "
            "behind a round-robin "
            "TCP front (per connection); router CPU is their sum."
        )
    return out + [f"not available: {k} ({v})." for k, v in cmod.UNAVAILABLE.items()]


def ceiling_notes(settings: Settings, scales: dict[str, float]) -> list[str]:
    """The hit-rate ceiling and the pooled-LRU reference of each single-request
    workload (``ceiling.py``) over the run's seeds and load factors."""
    from fleetgate.router.config import TokenizerSpec
    from fleetgate.router.tokenizer_files import load_tokenizer

    tok = load_tokenizer("emulator", TokenizerSpec(kind="emulator"))

    def span(values: list[float | None], fmt: str = ".1%") -> str | None:
        found = [v for v in values if v is not None]
        if not found:
            return None
        lo, hi = format(min(found), fmt), format(max(found), fmt)
        return lo if lo == hi else f"{lo}-{hi}"

    out = []
    for w in settings.workloads:
        if w not in scales:
            continue
        m = settings.modelled_s(scales[w])
        runs = [
            scenarios.make(
                w, engines=settings.engines, time_scale=scales[w], seed=seed,
                modelled_s=m, load_factor=lf, mixed=settings.mixed,
            )
            for lf in settings.load_factors
            for seed in settings.seeds
        ]  # fmt: skip
        warm = settings.warmup_s(m)
        rates: dict[str, list[float | None]] = {"ceiling": [], "pooled": []}
        floors: dict[str, list[float | None]] = {"ceiling": [], "pooled": []}
        for sc in runs:
            requests = prompt_blocks(sc.sessions(), tok, answer_seconds=sc.lone_answer_seconds)
            if requests is None:
                continue
            for ref, capacity in (("ceiling", None), ("pooled", sc.cache_tokens() // 16)):
                hits = lru_hits(requests, warm, capacity)
                rates[ref].append(hit_rate(hits))
                floors[ref].append(ttft_quantile(hits, sc.lone_prefill_seconds))
        ceiling = span(rates["ceiling"])
        if ceiling is None:
            continue
        out.append(
            f"{w}: hit-rate ceiling {ceiling} (one unbounded cache holding every earlier "
            f"prompt's 16-token blocks: no router beats it); one LRU cache the size of the "
            f"whole fleet's KV cache {span(rates['pooled'])} (about what a perfect split of "
            "the prefixes over the engines would give)."
        )
        out.append(
            f"{w}: unloaded TTFT p90 floor (each prompt alone on an idle engine of the "
            "fleet's fastest kind, the emulator's cost model, prefilling what the cache "
            "lacks): "
            f"{_seconds(span(floors['ceiling'], '.3f'))} with the ceiling's hits (no router "
            f"goes below it), {_seconds(span(floors['pooled'], '.3f'))} with the pooled "
            "LRU's (a TTFT goal under this asks a placement to beat LRU)."
        )
    return out


def print_references(settings: Settings) -> int:
    """``bench run --references``: the references of ``ceiling_notes`` without a run.
    They depend on modelled seconds only, so an ``auto`` time scale needs no
    calibration (``--wall-duration`` then reads at scale 2 x engines, the default)."""
    scale = settings.time_scale or 2.0 * settings.engines
    notes = ceiling_notes(settings, {w: scale for w in settings.workloads})
    for w in settings.workloads:
        if not any(n.startswith(f"{w}:") for n in notes):
            notes.append(
                f"{w}: no references (a prompt could not be rendered and tokenized with "
                "the emulator's tokenizer)"
            )
    print("\n".join(notes))
    return 0


def _seconds(span_text: str | None) -> str:
    return "n/a" if span_text is None else f"{span_text} s"


def command_line(args: argparse.Namespace, settings: Settings) -> str:
    """The exact command (defaults spelled out) that reproduces this run."""
    value, percent = settings.warmup
    parts = [
        "fleetgate bench run",
        ",".join(settings.workloads),
        f"--engines {settings.engines}",
        (
            f"--wall-duration {settings.wall_duration_s:g}"
            if settings.wall_duration_s is not None
            else f"--duration {settings.duration_s:g}"
        ),
        f"--warmup {value:g}{'%' if percent else ''}",
        f"--seeds {','.join(str(s) for s in settings.seeds)}",
        f"--time-scale {'auto' if settings.time_scale is None else f'{settings.time_scale:g}'}",
        f"--load-factors {','.join(f'{f:g}' for f in settings.load_factors)}",
        f"--contenders {','.join(c.name for c in settings.contenders)}",
    ]
    if settings.router_replicas != (1,):
        parts.append(f"--router-replicas {','.join(str(r) for r in settings.router_replicas)}")
    if settings.bootstrap != 1000:
        parts.append(f"--bootstrap {settings.bootstrap}")
    if settings.mixed:
        parts.append("--mixed")
    if args.source is not None:
        parts.append(f"--source {shlex.quote(str(args.source))}")
    if args.json:
        parts.append(f"--json {shlex.quote(str(args.json))}")
    if args.requests:
        parts.append(f"--requests {shlex.quote(str(args.requests))}")
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
    """Files this run would overwrite: the JSON, the requests file, the report and its plots."""
    found: list[Path] = []
    for path in (args.json, args.requests):
        if path is not None and path.exists():
            found.append(path)
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
    if args.references:
        return print_references(settings)
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
    if args.duration is not None:
        print(
            "bench: --duration is MODELLED seconds of arrivals (it was wall seconds before "
            "the steady-state rules; --wall-duration keeps the old meaning)",
            file=sys.stderr,
        )
    command = command_line(args, settings)
    scales: dict[str, float] = {}
    calibrations: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="fleetgate-bench-") as tmp:
        pairs = execute(settings, peers_root, Path(tmp), args.source, scales, calibrations)
    summaries = [s for _, s in pairs]
    aggs = aggregate(summaries)
    comparisons = (
        compare.compare([r for r, _ in pairs], random.Random(0), replicates=settings.bootstrap)
        if settings.bootstrap > 0
        else []
    )
    if args.requests:
        write_requests(args.requests, [r for r, _ in pairs])
    if args.json:
        doc = {
            "command": command,
            "settings": {
                "workloads": settings.workloads,
                "contenders": [c.name for c in settings.contenders],
                "engines": settings.engines,
                "duration_s": {w: settings.modelled_s(v) for w, v in scales.items()},
                "wall_duration_s": {w: settings.modelled_s(v) * v for w, v in scales.items()},
                "warmup_s": {
                    w: settings.warmup_s(settings.modelled_s(v)) for w, v in scales.items()
                },
                "seeds": settings.seeds,
                "repeats": settings.repeats,
                "time_scale": scales,
                "time_scale_calibration": calibrations,
                "load_factors": settings.load_factors,
                "mixed": settings.mixed,
                "router_replicas": list(settings.router_replicas),
                "bootstrap": settings.bootstrap,
            },
            "runs": [summary_dict(s) for s in summaries],
            "medians": [dataclasses.asdict(a) for a in aggs],
            "comparisons": [compare.as_dict(c) for c in comparisons],
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
            notes=notes_for(settings, scales, calibrations),
            plots=[str(p) for p in plots],
            comparisons=comparisons,
        )
        path = args.report / f"{name}.md"
        path.write_text(md)
        print(f"bench: report {path}", file=sys.stderr)
    for line in report.table(aggs):
        print(line)
    for line in report.comparison_table(comparisons):
        print(line)
    # peers that could not run are reported; only "nothing ran at all" fails
    return 0 if any(a.failed < a.repeats for a in aggs) else 1
