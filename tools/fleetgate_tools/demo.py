"""``fleetgate demo [--duration SECONDS] [--compare]``: the one-command tour.

Starts an emulated mixed fleet (3 vLLM + 2 TensorRT-LLM engines modelling
Llama-3.1-8B on H100s, ``fleetgate sim``) and the fleetgate router as loopback
subprocesses, drives the ``mixed-traffic`` workload (standard multi-turn chat,
critical interactive requests with bursts, a batch flood) for ``--duration``
wall seconds with a progress bar, then prints a summary (per-class TTFT and
objective attainment, the engines' own prefix-cache hit rate, preemptions,
per-engine load) and writes a PNG. ``--compare`` runs the identical schedule
on a fresh identical fleet behind a baseline router (fleetgate with its
round-robin picker: scores ignored, endpoints take turns) and prints both side
by side.

Everything binds 127.0.0.1; no GPU, no cluster, no network. The emulator runs
at a time scale (wall seconds per modelled second) so that a laptop keeps up;
reported latencies are modelled seconds. It reuses the benchmark harness
(``fleetgate_tools.bench``): same fleet files, same load generator, same summaries.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import TextIO

from fleetgate.cli import CliError
from fleetgate_tools.bench import contenders as cmod
from fleetgate_tools.bench import runner, scenarios
from fleetgate_tools.bench.stats import RequestResult
from fleetgate_tools.bench.summary import RunRecord, RunSummary, summarise_run

ENGINES = 5
TIME_SCALE = 8.0
BASELINE = cmod.Contender(
    "baseline-round-robin", "fleetgate", picker="round-robin", description="round robin"
)


def build_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--duration", type=float, default=60.0, help="wall seconds of traffic (default 60)"
    )
    parser.add_argument("--compare", action="store_true", help="also run a baseline router")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--plot", type=Path, default=Path("fleetgate-demo.png"), help="PNG to write"
    )


class Progress:
    """A plain-terminal progress bar on ``out`` (carriage returns on a tty, else lines)."""

    def __init__(self, label: str, total_s: float, out: TextIO, width: int = 30) -> None:
        self.label, self.total_s, self.out, self.width = label, total_s, out, width
        self.start = time.monotonic()
        self.done = 0
        self.errors = 0
        self.last_draw = -1.0
        self.tty = out.isatty()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._ticker: threading.Thread | None = None

    def __enter__(self) -> Progress:
        """Redraw every second from a thread, so the bar moves while requests run."""
        self._ticker = threading.Thread(target=self._tick, daemon=True)
        self._ticker.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join()
        self.finish()

    def _tick(self) -> None:
        period = 1.0 if self.tty else max(self.total_s / 10, 1.0)
        while not self._stop.wait(period):
            self.draw(time.monotonic())

    def update(self, result: RequestResult) -> None:
        self.done += 1
        self.errors += 0 if result.ok else 1
        if self.tty and time.monotonic() - self.last_draw >= 0.2:
            self.draw(time.monotonic())

    def line(self, now: float) -> str:
        elapsed = now - self.start
        frac = min(1.0, elapsed / self.total_s) if self.total_s > 0 else 1.0
        filled = int(frac * self.width)
        bar = "#" * filled + "." * (self.width - filled)
        phase = "sending" if elapsed <= self.total_s else "finishing in-flight requests"
        return (
            f"{self.label:<10} [{bar}] {elapsed:5.0f}/{self.total_s:.0f} s  "
            f"{self.done} requests, {self.errors} errors ({phase})"
        )

    def draw(self, now: float) -> None:
        with self._lock:
            self.last_draw = now
            text = self.line(now)
            self.out.write(("\r" + text) if self.tty else (text + "\n"))
            self.out.flush()

    def finish(self) -> None:
        self.draw(time.monotonic())
        if self.tty:
            self.out.write("\n")
        self.out.flush()


def _fmt(v: float | None, spec: str = ".3f") -> str:
    return "n/a" if v is None else format(v, spec)


def summary_lines(label: str, record: RunRecord, s: RunSummary, objective: float) -> list[str]:
    lines = [f"== {label} =="]
    lines.append(
        f"{'class':<10} {'requests':>8} {'errors':>6} {'TTFT p50':>9} {'TTFT p99':>9} "
        f"{'objective':>9} {'met':>7}"
    )
    sc = scenarios.LOADS["mixed-traffic"]
    for c in s.classes:
        obj = sc.ttft_objective_s.get(c.priority_class, objective)
        att = c.ttft_objective_attainment
        lines.append(
            f"{c.priority_class:<10} {c.requests:>8} {c.errors:>6} {_fmt(c.ttft_p50):>9} "
            f"{_fmt(c.ttft_p99):>9} {obj:>8.2f}s {_fmt(att, '.1%'):>7}"
        )
    pre = s.engine_preemptions
    router_pre = s.extra.get("preemptions")
    lines.append(
        f"engine prefix-cache hit rate {_fmt(s.hit_rate, '.1%')}, "
        f"output {s.output_tokens_per_s:.0f} "
        f"tok/s, goodput {s.goodput:.2f} req/s, engine preemptions {_fmt(pre, '.0f')}, router "
        f"preemptions {_fmt(router_pre, '.0f') if router_pre is not None else 'not exposed'}"
    )
    gen = [e.generation_tokens or 0.0 for e in record.engines]
    total = sum(gen) or 1.0
    loads = ", ".join(
        f"{e.kind}@{e.url.rsplit(':', 1)[1]} {g / total:.0%}"
        for e, g in zip(record.engines, gen, strict=True)
    )
    lines.append(
        f"per-engine load (generated tokens): {loads}; imbalance {_fmt(s.imbalance, '.2f')}"
    )
    lines.append(f"router CPU {_fmt(s.router_cpu_s, '.1f')} s")
    if "twin_compared" in s.extra:
        lines.append(
            f"answers equal to an unloaded replay: "
            f"{s.extra['twin_compared'] - s.extra['mismatches']} of {s.extra['twin_compared']}"
            + (
                f" (of them preempted and resumed: "
                f"{s.extra['resumed_compared'] - s.extra['resumed_mismatches']} of "
                f"{s.extra['resumed_compared']} equal)"
                if "resumed_compared" in s.extra
                else ""
            )
        )
    return lines


def plot(runs: list[tuple[str, RunRecord, RunSummary]], path: Path) -> Path | None:
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    ax = axes[0]
    for label, record, _ in runs:
        for cls in sorted({r.priority_class for r in record.results}):
            ttfts = sorted(
                r.ttft for r in record.results if r.priority_class == cls and r.ttft is not None
            )
            if ttfts:
                ys = [(i + 1) / len(ttfts) for i in range(len(ttfts))]
                ax.step(ttfts, ys, where="post", label=f"{label} {cls}")
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (modelled s, log)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("TTFT by class")
    ax.legend(fontsize=7)
    ax = axes[1]
    width = 0.8 / len(runs)
    for i, (label, record, _) in enumerate(runs):
        gen = [e.generation_tokens or 0.0 for e in record.engines]
        names = [f"{e.kind}\n:{e.url.rsplit(':', 1)[1]}" for e in record.engines]
        ax.bar([j + i * width for j in range(len(gen))], gen, width=width, label=label)
        ax.set_xticks([j + width * (len(runs) - 1) / 2 for j in range(len(gen))], names)
    ax.set_ylabel("generated tokens")
    ax.set_title("per-engine load")
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def run(args: argparse.Namespace) -> int:
    if not 1 <= args.duration <= 1800:
        raise CliError("--duration must be 1-1800 seconds")
    sc = scenarios.make(
        "mixed-traffic",
        engines=ENGINES,
        duration_s=args.duration,
        time_scale=TIME_SCALE,
        seed=args.seed,
    )
    print(
        f"fleetgate demo: {ENGINES} emulated engines (3 vLLM + 2 TensorRT-LLM, Llama-3.1-8B on "
        f"H100 profiles) on 127.0.0.1, {len(sc.sessions())} sessions over {args.duration:g} s; "
        f"latencies are modelled seconds (time scale {TIME_SCALE:g})",
        flush=True,
    )
    contenders = [cmod.CONTENDERS["fleetgate"]] + ([BASELINE] if args.compare else [])
    runs: list[tuple[str, RunRecord, RunSummary]] = []
    with tempfile.TemporaryDirectory(prefix="fleetgate-demo-") as tmp:
        for c in contenders:
            with Progress(c.name, args.duration, sys.stderr) as bar:
                record = runner.run_one(sc, c, 0, Path(tmp) / c.name, on_result=bar.update)
            if record.error:
                raise CliError(f"{c.name}: {record.error}")
            runs.append((c.name, record, summarise_run(record, sc.objective)))
    for label, record, s in runs:
        print("\n".join(summary_lines(label, record, s, sc.objective("*"))), flush=True)
    written = plot(runs, args.plot)
    if written is None:
        print("plot skipped: matplotlib is not installed (pip install -e ./tools)")
    else:
        print(f"plot: {written}")
    return 0
