"""``fleetgate demo``: the one-command tour, fleetgate side by side with a baseline.

Starts an emulated mixed fleet (3 vLLM + 2 TensorRT-LLM engines modelling
Llama-3.1-8B on H100s, 8 concurrent sequences each, ``fleetgate sim``) and the
fleetgate router as loopback subprocesses and drives the ``flood`` workload
through it: a ``batch`` flood sized from the fleet's 40 slots (twice the slots
at once, then more), ``critical`` requests in bursts through it and
``standard`` multi-turn chat over shared system prompts, each request with its
``x-fleetgate-priority`` class. Then it runs the identical schedule on a fresh
identical fleet behind the baseline, by default a plain round-robin load
balancer that does not know the classes (what a Kubernetes Service gives).
It prints the two side by side (TTFT objective met per class, preemptions and
whether the resumed answers equal an unloaded replay, the engines' own
prefix-cache hit rate, where the critical work ran) and writes a PNG and the
summary under ``~/.cache/fleetgate/demo/`` (``--out``), never into the checkout.

Everything binds 127.0.0.1; no GPU, no cluster, no network. The emulator runs
at time scale 8 (wall seconds per modelled second) so that a laptop keeps up;
reported latencies are modelled seconds. It reuses the benchmark harness
(``fleetgate_tools.bench``): same fleet files, same load generator, same summaries.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from fleetgate.cli import CliError
from fleetgate_tools.bench import contenders as cmod
from fleetgate_tools.bench import runner, scenarios
from fleetgate_tools.bench.scenarios import Scenario
from fleetgate_tools.bench.stats import RequestResult
from fleetgate_tools.bench.summary import RunRecord, RunSummary, summarise_run
from fleetgate_tools.bench.workloads import FLOOD_BATCH_ROUND_S
from fleetgate_tools.paths import cache_dir

ENGINES = 5
TIME_SCALE = 8.0
WORKLOAD = "flood"
CLASSES = ("critical", "standard", "batch")
#: --baseline value -> bench contender
BASELINES = {
    "round-robin": "round-robin-no-classes",
    "fleetgate-round-robin": "fleetgate-round-robin",
    "fleetgate-no-preemption": "fleetgate-no-preemption",
}
#: bench contender -> (short label for tables and legends, what it is)
BASELINE_LABELS = {
    "round-robin-no-classes": (
        "round robin",
        "a plain load balancer: endpoints take turns, priority classes not sent, "
        "each engine serves first come, first served",
    ),
    "fleetgate-round-robin": (
        "fleetgate round-robin",
        "fleetgate's class queue and preemption, round-robin placement",
    ),
    "fleetgate-no-preemption": (
        "no preemption",
        "fleetgate with its class queue but without preemption",
    ),
}
#: unloaded replays of answers besides every preempted one, and their concurrency
TWIN_SAMPLE = 8
TWIN_IN_FLIGHT = 40


#: short label -> what it is (the plot's header)
BASELINE_ABOUT = dict(BASELINE_LABELS.values())


def default_out() -> Path:
    return cache_dir() / "demo"


def build_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--duration",
        type=float,
        default=30.0,
        help="wall seconds of traffic per router (default 30: two runs, about 1.5 minutes "
        "with start-up, the backlog and the answer check)",
    )
    parser.add_argument(
        "--baseline",
        choices=[*BASELINES, "none"],
        default="round-robin",
        help="what fleetgate is compared with (default round-robin: a plain load balancer "
        "that does not know the priority classes)",
    )
    parser.add_argument("--compare", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="directory for fleetgate-demo.png and fleetgate-demo.txt "
        "(default ~/.cache/fleetgate/demo, or $FLEETGATE_CACHE/demo)",
    )
    parser.add_argument("--plot", type=Path, default=None, help="PNG path (default OUT/...)")


class Progress:
    """One run's progress on ``out``: start-up, the traffic bar, the backlog, the check.

    The bar covers the ``total_s`` wall seconds in which requests are sent. Work
    still in flight after that (the batch backlog the fleet works through) and the
    unloaded replay of answers are shown as their own phases, with what they wait for.
    On a tty one line is redrawn; otherwise a line per phase and a few in between.
    """

    def __init__(self, label: str, total_s: float, out: TextIO, width: int = 30) -> None:
        self.label, self.total_s, self.out, self.width = label, total_s, out, width
        self.start = time.monotonic()
        self.phase = "starting"
        self.phase_at: dict[str, float] = {"starting": self.start}
        self.sent = 0
        self.done = 0
        self.errors = 0
        self.tty = out.isatty()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._ticker: threading.Thread | None = None
        self._last_line = ""

    def __enter__(self) -> Progress:
        self._ticker = threading.Thread(target=self._tick, daemon=True)
        self._ticker.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join()
        self.finish()

    def _tick(self) -> None:
        period = 1.0 if self.tty else max(self.total_s / 5, 2.0)
        while not self._stop.wait(period):
            self.draw(time.monotonic())

    def set_phase(self, phase: str) -> None:
        with self._lock:
            self.phase = phase
            self.phase_at.setdefault(phase, time.monotonic())
        self.draw(time.monotonic(), force=True)

    def on_send(self) -> None:
        self.sent += 1

    def update(self, result: RequestResult) -> None:
        self.done += 1
        self.errors += 0 if result.ok else 1

    def line(self, now: float) -> str:
        head = f"{self.label:<10}"
        if self.phase == "starting":
            return f"{head} starting {ENGINES} emulated engines and the router ..."
        if self.phase == "checking":
            return (
                f"{head} checking answers: preempted ones and a sample replayed on the idle "
                f"fleet ({now - self.phase_at['checking']:.0f} s)"
            )
        if self.phase == "stopping":
            return f"{head} stopping"
        elapsed = now - self.phase_at.get("sending", now)
        in_flight = max(0, self.sent - self.done)
        counts = f"{self.done} answered, {in_flight} in flight, {self.errors} errors"
        if elapsed <= self.total_s:
            frac = min(1.0, elapsed / self.total_s) if self.total_s > 0 else 1.0
            filled = int(frac * self.width)
            bar = "#" * filled + "." * (self.width - filled)
            return f"{head} [{bar}] {elapsed:3.0f}/{self.total_s:.0f} s of traffic, {counts}"
        return (
            f"{head} traffic sent; the fleet works through the backlog: {counts} "
            f"(+{elapsed - self.total_s:.0f} s)"
        )

    def draw(self, now: float, force: bool = False) -> None:
        with self._lock:
            text = self.line(now)
            if self.tty:
                self.out.write("\r" + text.ljust(len(self._last_line)))
            elif force or text != self._last_line:
                self.out.write(text + "\n")
            self._last_line = text
            self.out.flush()

    def timings(self, now: float) -> str:
        """Where the run's wall time went, e.g. ``start-up 6 s, traffic 30 s, ...``."""
        marks = sorted(self.phase_at.items(), key=lambda kv: kv[1]) + [("end", now)]
        spans: dict[str, float] = {}
        for (name, t0), (_, t1) in zip(marks, marks[1:], strict=False):
            spans[name] = t1 - t0
        parts = [f"start-up {spans.get('starting', 0.0):.0f} s"]
        if "sending" in spans:
            sending = spans["sending"]
            parts.append(f"traffic {min(sending, self.total_s):.0f} s")
            if sending > self.total_s + 0.5:
                parts.append(f"backlog {sending - self.total_s:.0f} s")
        if "checking" in spans:
            parts.append(f"answer check {spans['checking']:.0f} s")
        return ", ".join(parts)

    def finish(self) -> None:
        now = time.monotonic()
        with self._lock:
            text = (
                f"{self.label:<10} done in {now - self.start:.0f} s ({self.timings(now)}): "
                f"{self.done} requests, {self.errors} errors"
            )
            if self.tty:
                self.out.write("\r" + text.ljust(len(self._last_line)) + "\n")
            else:
                self.out.write(text + "\n")
            self.out.flush()


# -- figures of one run ----------------------------------------------------------------


def _fmt(v: float | None, spec: str = ".3f") -> str:
    return "n/a" if v is None else format(v, spec)


def engine_names(record: RunRecord) -> dict[str, str]:
    """``host:port`` -> ``vLLM 1`` / ``TRT-LLM 1`` in fleet order (the same in every run)."""
    counts: dict[str, int] = {}
    out: dict[str, str] = {}
    for e in record.engines:
        counts[e.kind] = counts.get(e.kind, 0) + 1
        kind = {"vllm": "vLLM", "trtllm": "TRT-LLM"}.get(e.kind, e.kind)
        out[e.url.split("://", 1)[-1]] = f"{kind} {counts[e.kind]}"
    return out


def trt_share(record: RunRecord, cls: str) -> float | None:
    """Share of a class's answered requests that began on a TensorRT-LLM engine."""
    kinds = {e.url.split("://", 1)[-1]: e.kind for e in record.engines}
    placed = [
        kinds[r.endpoint]
        for r in record.results
        if r.priority_class == cls and r.ok and r.endpoint in kinds
    ]
    return sum(1 for k in placed if k == "trtllm") / len(placed) if placed else None


def cached_share(record: RunRecord, cls: str) -> float | None:
    """Prompt tokens a class's answers report as cached, over their prompt tokens."""
    rs = [
        r
        for r in record.results
        if r.priority_class == cls and r.ok and r.prompt_tokens and r.cached_tokens is not None
    ]
    total = sum(r.prompt_tokens or 0 for r in rs)
    return sum(r.cached_tokens or 0 for r in rs) / total if total else None


def outcome(s: RunSummary, cls: str) -> tuple[int, int, float | None, float | None]:
    """(met, requests, TTFT p50, TTFT p99) of one class."""
    for c in s.classes:
        if c.priority_class == cls:
            met = round((c.ttft_objective_attainment or 0.0) * c.requests)
            return met, c.requests, c.ttft_p50, c.ttft_p99
    return 0, 0, None, None


def preemption_text(s: RunSummary) -> str:
    pre = s.extra.get("preemptions")
    if s.extra.get("priority_header") == "not sent":
        return "none (priority classes not sent)"
    if pre is None:
        return "not exposed"
    text = f"{pre:.0f}"
    if "resumes" in s.extra:
        text += f", {s.extra['resumes']:.0f} resumed"
    return text


def replay_text(s: RunSummary) -> str:
    if "twin_compared" not in s.extra:
        return "n/a"
    text = f"{s.extra['twin_compared'] - s.extra['mismatches']} of {s.extra['twin_compared']}"
    if s.extra.get("resumed_compared"):
        rc, rm = s.extra["resumed_compared"], s.extra["resumed_mismatches"]
        text += f" ({rc - rm} of {rc} resumed)"
    return text


Run = tuple[str, RunRecord, RunSummary]
"""(label, record, summary) of one router's run."""


def summary_table(runs: Sequence[Run], sc: Scenario) -> list[str]:
    """The runs side by side, one column per router."""
    rows: list[tuple[str, list[str]]] = []
    for cls in CLASSES:
        obj = sc.objective(cls)
        cells, lat = [], []
        for _, _, s in runs:
            met, n, p50, p99 = outcome(s, cls)
            cells.append(f"{met / n:.0%} ({met}/{n})" if n else "n/a")
            lat.append(f"{_fmt(p50, '.2f')} / {_fmt(p99, '.2f')} s")
        rows.append((f"{cls}: TTFT <= {obj:g} s met", cells))
        rows.append((f"  {cls} TTFT p50 / p99", lat))
    planned = sum(len(s.turns) for s in sc.sessions() if s.priority_class == "standard")
    rows.append(
        (
            f"chat turns sent (of {planned})",
            [
                str(sum(1 for r in rec.results if r.priority_class == "standard"))
                for _, rec, _ in runs
            ],
        )
    )
    rows.append(("errors", [str(s.errors) for _, _, s in runs]))
    rows.append(("router preemptions", [preemption_text(s) for _, _, s in runs]))
    rows.append(("answers = unloaded replay", [replay_text(s) for _, _, s in runs]))
    rows.append(("prefix-cache hit rate (engines)", [_fmt(s.hit_rate, ".1%") for _, _, s in runs]))
    rows.append(
        (
            "  standard prompt tokens cached",
            [_fmt(cached_share(r, "standard"), ".1%") for _, r, _ in runs],
        )
    )
    rows.append(
        (
            "critical begun on TensorRT-LLM",
            [_fmt(trt_share(r, "critical"), ".0%") for _, r, _ in runs],
        )
    )
    rows.append(("output tokens / s", [f"{s.output_tokens_per_s:.0f}" for _, _, s in runs]))
    rows.append(("per-engine load imbalance", [_fmt(s.imbalance, ".2f") for _, _, s in runs]))
    rows.append(("router CPU", [f"{_fmt(s.router_cpu_s, '.1f')} s" for _, _, s in runs]))
    first = max(len(name) for name, _ in rows)
    widths = [
        max(len(label), *(len(cells[i]) for _, cells in rows))
        for i, (label, _, _) in enumerate(runs)
    ]
    head = (
        " " * first
        + "  "
        + "  ".join(label.ljust(w) for (label, _, _), w in zip(runs, widths, strict=True))
    )
    lines = [head.rstrip()]
    for name, cells in rows:
        line = (
            name.ljust(first)
            + "  "
            + "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True))
        )
        lines.append(line.rstrip())
    for label, record, _ in runs:
        gen = [e.generation_tokens or 0.0 for e in record.engines]
        total = sum(gen) or 1.0
        names = engine_names(record)
        loads = ", ".join(
            f"{names[e.url.split('://', 1)[-1]]} {g / total:.0%}"
            for e, g in zip(record.engines, gen, strict=True)
        )
        lines.append(f"{label}: generated tokens per engine: {loads}")
    lines.append(
        "(a chat session's next turn goes out only within the traffic window: slower "
        "answers, fewer turns sent)"
    )
    return lines


def describe(sc: Scenario, duration_wall: float) -> list[str]:
    """What the run is: fleet, traffic, objectives (printed and in the PNG)."""
    sessions = sc.sessions()
    n = {c: sum(1 for s in sessions if s.priority_class == c) for c in CLASSES}
    turns = sum(len(s.turns) for s in sessions if s.priority_class == "standard")
    kinds = sc.engine_kinds()
    return [
        f"{kinds.count('vllm')} vLLM + {kinds.count('trtllm')} TensorRT-LLM emulated engines "
        f"(Llama-3.1-8B on H100 profiles, {sc.capacity('vllm')} concurrent sequences each: "
        f"{sc.slots()} slots), one router, all on 127.0.0.1",
        f"traffic: {n['batch']} batch requests ({2 * sc.slots()} at once, then more), "
        f"{n['critical']} critical (two bursts), {n['standard']} chat sessions "
        f"({turns} turns, a next turn only within the traffic window) as standard",
        f"{duration_wall:g} s of traffic = {sc.duration_s:g} modelled s (time scale "
        f"{sc.time_scale:g}), seed {sc.seed}; TTFT objectives in modelled s: "
        + ", ".join(f"{c} {sc.objective(c):g}" for c in CLASSES),
    ]


# -- the plot ---------------------------------------------------------------------------

COLOURS = ("#1f77b4", "#d62728", "#2ca02c")


def build_figure(runs: Sequence[Run], sc: Scenario, duration_wall: float) -> Any:
    """The 2x2 figure (matplotlib ``Figure``); raises ImportError without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    fig = Figure(figsize=(13, 9.6))
    axes = fig.subplots(2, 2)
    names = [label for label, _, _ in runs]
    title = "fleetgate" if len(runs) == 1 else f"{names[0]} vs {names[1]}"
    fig.suptitle(
        f"fleetgate demo: {title} on a mixed vLLM + TensorRT-LLM fleet under a batch flood",
        fontsize=13,
        fontweight="bold",
    )
    lines = describe(sc, duration_wall)
    for label, _, _ in runs:
        about = BASELINE_ABOUT.get(label)
        if about:
            lines.append(f"{label}: {about}")
    lines += [
        f"{label}: router preemptions {preemption_text(s)}; answers equal to an unloaded "
        f"replay {replay_text(s)}"
        for label, _, s in runs
    ]
    fig.text(0.5, 0.95, "\n".join(lines), ha="center", va="top", fontsize=8.5, linespacing=1.4)

    # (a) objective met per class
    ax = axes[0][0]
    width = 0.8 / len(runs)
    for i, (label, _, s) in enumerate(runs):
        xs, ys, texts = [], [], []
        for j, cls in enumerate(CLASSES):
            met, n, _, _ = outcome(s, cls)
            xs.append(j + (i - (len(runs) - 1) / 2) * width)
            ys.append(100.0 * met / n if n else 0.0)
            texts.append(f"{ys[-1]:.0f}%\n{met} of {n}")
        bars = ax.bar(xs, ys, width=width, label=label, color=COLOURS[i % len(COLOURS)])
        ax.bar_label(bars, labels=texts, fontsize=7.5)
    ax.set_xticks(range(len(CLASSES)), [f"{c}\nTTFT <= {sc.objective(c):g} s" for c in CLASSES])
    ax.set_ylim(0, 125)
    ax.set_yticks(range(0, 101, 20))
    ax.set_ylabel("requests meeting the TTFT objective (%)")
    ax.set_title("TTFT objective met, per priority class")
    ax.legend(fontsize=8, loc="upper center", ncols=len(runs))

    # (b) critical TTFT over the run, with the batch backlog
    ax = axes[0][1]
    back = ax.twinx()
    objective = sc.objective("critical")
    for i, (label, record, _) in enumerate(runs):
        colour = COLOURS[i % len(COLOURS)]
        crit = [r for r in record.results if r.priority_class == "critical"]
        ok = [r for r in crit if r.ok and r.ttft is not None]
        ax.scatter(
            [r.sent_at for r in ok],
            [r.ttft for r in ok],
            s=12,
            color=colour,
            label=f"{label}: critical TTFT",
            zorder=3,
        )
        ts, ns = batch_outstanding(record)
        back.step(
            ts,
            ns,
            where="post",
            color=colour,
            alpha=0.4,
            linewidth=1.2,
            label=f"{label}: batch requests sent, not finished",
        )
    ax.axhline(objective, color="black", linestyle="--", linewidth=1)
    ax.text(0.0, objective * 1.08, f" objective {objective:g} s", fontsize=8, va="bottom")
    ax.axvline(sc.duration_s, color="grey", linestyle=":", linewidth=1)
    ax.text(
        sc.duration_s, 1.0, " traffic ends", transform=ax.get_xaxis_transform(),
        fontsize=8, va="top", color="grey",
    )  # fmt: skip
    ax.set_yscale("log")
    ax.set_xlabel("request sent at (modelled s)")
    ax.set_ylabel("critical TTFT (modelled s, log)")
    back.set_ylabel("batch requests sent, not finished (lines)")
    back.set_ylim(bottom=0)
    ax.set_zorder(back.get_zorder() + 1)
    ax.patch.set_visible(False)
    ax.set_title("Critical requests through the batch flood")
    handles = ax.get_legend_handles_labels()
    lines_ = back.get_legend_handles_labels()
    ax.legend(
        handles[0] + lines_[0], handles[1] + lines_[1], fontsize=7.5, loc="lower right",
        framealpha=0.9,
    )  # fmt: skip

    # (c) prefix cache and preemptions
    ax = axes[1][0]
    groups = ["engines' prefix-cache\nhit rate", "standard (chat) prompt\ntokens cached"]
    for i, (label, record, s) in enumerate(runs):
        vals = [s.hit_rate, cached_share(record, "standard")]
        xs = [j + (i - (len(runs) - 1) / 2) * width for j in range(len(groups))]
        ys = [100.0 * (v or 0.0) for v in vals]
        bars = ax.bar(xs, ys, width=width, label=label, color=COLOURS[i % len(COLOURS)])
        ax.bar_label(bars, labels=[_fmt(v, ".0%") for v in vals], fontsize=8)
    ax.set_xticks(range(len(groups)), groups)
    ax.set_ylim(0, 125)
    ax.set_yticks(range(0, 101, 20))
    ax.set_ylabel("% of prompt tokens")
    ax.set_title("Prefix cache: prompt tokens the engines did not recompute")
    ax.legend(fontsize=8, loc="upper center", ncols=len(runs))

    # (d) the mixed fleet: generated tokens per engine, named by kind and position
    ax = axes[1][1]
    for i, (label, record, _) in enumerate(runs):
        gen = [e.generation_tokens or 0.0 for e in record.engines]
        engine_label = engine_names(record)
        ticks = [engine_label[e.url.split("://", 1)[-1]] for e in record.engines]
        xs = [j + (i - (len(runs) - 1) / 2) * width for j in range(len(gen))]
        share = trt_share(record, "critical")
        ax.bar(
            xs,
            gen,
            width=width,
            color=COLOURS[i % len(COLOURS)],
            label=f"{label} (critical begun on TRT-LLM: {_fmt(share, '.0%')})",
        )
        ax.set_xticks(range(len(gen)), ticks)
    top = max((e.generation_tokens or 0.0 for _, r, _ in runs for e in r.engines), default=1.0)
    ax.set_ylim(0, top * 1.35 or 1.0)
    ax.set_ylabel("generated tokens")
    ax.set_title("Per-engine load (the TRT-LLM engines are the faster ones)")
    ax.legend(fontsize=8, loc="upper left")

    fig.tight_layout(rect=(0, 0, 1, 1 - 0.018 * (len(lines) + 3)))
    return fig


def batch_outstanding(record: RunRecord) -> tuple[list[float], list[int]]:
    """Batch requests sent and not finished over time (modelled s), for the plot."""
    events: list[tuple[float, int]] = []
    for r in record.results:
        if r.priority_class != "batch":
            continue
        events.append((r.sent_at, 1))
        events.append((r.sent_at + (r.e2e or 0.0), -1))
    events.sort()
    ts, ns, n = [0.0], [0], 0
    for t, d in events:
        n += d
        ts.append(t)
        ns.append(n)
    return ts, ns


def plot(runs: Sequence[Run], sc: Scenario, duration_wall: float, path: Path) -> Path | None:
    try:
        fig = build_figure(runs, sc, duration_wall)
    except ImportError:
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    return path


# -- the command ----------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    if not 1 <= args.duration <= 1800:
        raise CliError("--duration must be 1-1800 seconds")
    out_dir = args.out if args.out is not None else default_out()
    png = args.plot if args.plot is not None else out_dir / "fleetgate-demo.png"
    sc = scenarios.make(
        WORKLOAD, engines=ENGINES, duration_s=args.duration, time_scale=TIME_SCALE, seed=args.seed
    )
    contenders = [cmod.CONTENDERS["fleetgate"]]
    if args.baseline != "none":
        contenders.append(cmod.CONTENDERS[BASELINES[args.baseline]])
    header = describe(sc, args.duration)
    print(
        f"fleetgate demo: {len(contenders)} run(s) of {args.duration:g} s of traffic, each on a "
        f"fresh identical fleet with the identical schedule: "
        + ", ".join(c.name for c in contenders),
        flush=True,
    )
    for line in header:
        print(f"  {line}", flush=True)
    for c in contenders[1:]:
        short, about = BASELINE_LABELS[c.name]
        print(f"  baseline ({short}): {about}", flush=True)
    runs: list[Run] = []
    with tempfile.TemporaryDirectory(prefix="fleetgate-demo-") as tmp:
        for c in contenders:
            label = "fleetgate" if c.name == "fleetgate" else BASELINE_LABELS[c.name][0]
            with Progress(c.name, args.duration, sys.stderr) as bar:
                hooks = runner.Hooks(
                    on_phase=bar.set_phase,
                    on_send=bar.on_send,
                    twin_sample=TWIN_SAMPLE,
                    twin_in_flight=TWIN_IN_FLIGHT,
                    # the flood's 2 x slots backlog takes about two batch rounds whatever
                    # the duration: let short runs finish it rather than cut it off
                    extra_drain_s=4 * FLOOD_BATCH_ROUND_S * TIME_SCALE,
                )
                record = runner.run_one(
                    sc, c, 0, Path(tmp) / c.name, on_result=bar.update, hooks=hooks
                )
            if record.error:
                raise CliError(f"{c.name}: {record.error}")
            runs.append((label, record, summarise_run(record, sc.objective)))
    table = summary_table(runs, sc)
    print("\n".join(table), flush=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    text = out_dir / "fleetgate-demo.txt"
    text.write_text("\n".join(["fleetgate demo", *header, "", *table]) + "\n")
    written = plot(runs, sc, args.duration, png)
    if written is None:
        print("plot skipped: matplotlib is not installed (pip install -e ./tools)")
    else:
        print(f"plot: {written}")
    print(f"summary: {text}")
    return 0
