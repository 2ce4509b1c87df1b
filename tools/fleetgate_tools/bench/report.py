"""Markdown tables, goal checks and PNG plots from aggregated runs.

:func:`render_markdown` is pure (aggregates in, text out). :func:`write_plots`
draws with matplotlib's Agg backend (no display needed): per workload one PNG
with TTFT p90 against offered load per contender, the engines' prefix hit rate
and per-class TTFT-objective attainment. Every figure is a median over repeats;
tables show ``median (min-max)`` when there was more than one repeat.

Goal checks (from the issue) compare fleetgate's default configuration with the
best *peer* (vllm-router / sglang-router contenders) at the highest load factor
run; a goal that is missed says so, and one that cannot be checked (no peer
ran, a figure is missing) says why.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from pathlib import Path

from fleetgate_tools.bench.compare import Comparison, Figure
from fleetgate_tools.bench.summary import Aggregate, median

COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("requests", "requests", "{:.0f}"),
    ("errors", "errors", "{:.0f}"),
    ("ttft_p50", "TTFT p50 (s)", "{:.3f}"),
    ("ttft_p90", "TTFT p90 (s)", "{:.3f}"),
    ("ttft_p99", "TTFT p99 (s)", "{:.3f}"),
    ("itl_p50", "ITL p50 (ms)", "ms"),
    ("output_tokens_per_s", "output tok/s", "{:.0f}"),
    ("goodput", "goodput (req/s)", "{:.2f}"),
    ("hit_rate", "engine hit rate", "{:.1%}"),
    ("usage_hit_rate", "usage hit rate", "{:.1%}"),
    ("imbalance", "imbalance", "{:.2f}"),
    ("router_cpu_s", "router CPU (s)", "{:.1f}"),
)
CLASS_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("requests", "requests", "{:.0f}"),
    ("errors", "errors", "{:.0f}"),
    ("ttft_p50", "TTFT p50 (s)", "{:.3f}"),
    ("ttft_p99", "TTFT p99 (s)", "{:.3f}"),
    ("ttft_objective_attainment", "attainment", "{:.1%}"),
    ("tokens_per_s", "completed tok/s", "{:.0f}"),
)


def _fmt(value: float, fmt: str) -> str:
    if fmt == "ms":
        return f"{value * 1000:.1f}"
    return fmt.format(value)


def cell(a: Aggregate, key: str, fmt: str) -> str:
    spread = a.metrics.get(key)
    if spread is None:
        return "n/a"
    mid, lo, hi = spread
    text = _fmt(mid, fmt)
    if a.repeats - a.failed > 1 and not math.isclose(lo, hi):
        text += f" ({_fmt(lo, fmt)}-{_fmt(hi, fmt)})"
    return text


def is_peer(name: str) -> bool:
    return not name.startswith("fleetgate")


def classes_of(aggs: Sequence[Aggregate]) -> list[str]:
    names = {k.split(".", 1)[0] for a in aggs for k in a.metrics if "." in k}
    names.discard("extra")
    return sorted(names)


def table(aggs: Sequence[Aggregate]) -> list[str]:
    head = "| contender | " + " | ".join(c[1] for c in COLUMNS) + " |"
    lines = [head, "|" + "---|" * (len(COLUMNS) + 1)]
    for a in aggs:
        if a.failed == a.repeats:
            lines.append(f"| {a.contender} | did not run: {'; '.join(a.errors)} |")
            continue
        cells = [cell(a, k, f) for k, _, f in COLUMNS]
        lines.append(f"| {a.contender} | " + " | ".join(cells) + " |")
    return lines


def class_table(aggs: Sequence[Aggregate]) -> list[str]:
    classes = classes_of(aggs)
    if len(classes) < 2:
        return []
    head = "| contender | class | " + " | ".join(c[1] for c in CLASS_COLUMNS) + " |"
    lines = [head, "|" + "---|" * (len(CLASS_COLUMNS) + 2)]
    for a in aggs:
        if a.failed == a.repeats:
            continue
        for cls in classes:
            cells = [cell(a, f"{cls}.{k}", f) for k, _, f in CLASS_COLUMNS]
            lines.append(f"| {a.contender} | {cls} | " + " | ".join(cells) + " |")
    return lines


def extra_table(aggs: Sequence[Aggregate]) -> list[str]:
    keys = sorted({k for a in aggs for k in a.metrics if k.startswith("extra.")})
    if not keys:
        return []
    names = [k.removeprefix("extra.") for k in keys]
    lines = ["| contender | " + " | ".join(names) + " |", "|" + "---|" * (len(keys) + 1)]
    for a in aggs:
        if a.failed == a.repeats:
            continue
        lines.append(f"| {a.contender} | " + " | ".join(cell(a, k, "{:.3g}") for k in keys) + " |")
    return lines


def _interval_text(
    comparisons: Sequence[Comparison], contender: str, baseline: str, lf: float, name: str
) -> str:
    """`` (95% CI [low, high])`` of ``name`` for contender vs baseline, or ``""``."""
    for c in comparisons:
        if (c.contender, c.baseline, c.load_factor) == (contender, baseline, lf):
            f = c.figure(name)
            if f is not None and f.interval is not None:
                k, fmt = (100.0, "{:+.1f}") if name.endswith("_diff") else (1.0, "{:.2f}")
                ci = f.interval
                return (
                    f" ({ci.level:.0%} CI [{fmt.format(ci.low * k)}, {fmt.format(ci.high * k)}]"
                    f"{' points' if k == 100.0 else ''}, {f.verdict})"
                )
    return ""


def goal_lines(
    workload: str, aggs: Sequence[Aggregate], comparisons: Sequence[Comparison] = ()
) -> list[str]:
    """The issue's goals for ``workload``, checked on the highest load factor; with
    ``comparisons``, each ratio carries its bootstrap interval."""
    ran = [a for a in aggs if a.failed < a.repeats]
    if not ran:
        return ["- no contender ran"]
    top = max(a.load_factor for a in ran)
    at = [a for a in ran if a.load_factor == top]
    fg = next((a for a in at if a.contender == "fleetgate"), None)
    peers = [a for a in at if is_peer(a.contender)]
    if fg is None:
        return ["- goals not checked: the default fleetgate contender did not run"]
    if not peers:
        return ["- goals not checked: no peer router ran"]
    out: list[str] = []

    def verdict(ok: bool | None) -> str:
        return "not checkable" if ok is None else ("**met**" if ok else "**missed**")

    if workload in ("shared-prefix", "chat-multiturn", "agentic"):
        p90 = [(median(a, "ttft_p90"), a.contender) for a in peers]
        best = min(((v, n) for v, n in p90 if v is not None), default=None)
        mine = median(fg, "ttft_p90")
        ok = None if best is None or mine is None else mine <= 0.7 * best[0]
        if best is not None and mine is not None:
            ci = _interval_text(comparisons, "fleetgate", best[1], top, "ttft_p90_ratio")
            out.append(
                f"- TTFT p90 <= 0.7x best peer ({best[1]} {best[0]:.3f} s): fleetgate "
                f"{mine:.3f} s = {mine / best[0]:.2f}x{ci} -> {verdict(ok)}"
            )
        else:
            out.append(f"- TTFT p90 <= 0.7x best peer: {verdict(None)}")
        hits = [(median(a, "hit_rate"), a.contender) for a in peers]
        best_hit = max(((v, n) for v, n in hits if v is not None), default=None)
        mine_hit = median(fg, "hit_rate")
        if best_hit is not None and mine_hit is not None:
            ci = _interval_text(comparisons, "fleetgate", best_hit[1], top, "hit_rate_diff")
            if ci:
                ci = " usage hit rate difference" + ci
            out.append(
                f"- hit rate >= best peer ({best_hit[1]} {best_hit[0]:.1%}): fleetgate "
                f"{mine_hit:.1%}{ci} -> {verdict(mine_hit >= best_hit[0])}"
            )
        imb = median(fg, "imbalance")
        if imb is not None:
            out.append(f"- imbalance <= 1.3: fleetgate {imb:.2f} -> {verdict(imb <= 1.3)}")
    if workload in ("priority-storm", "mixed-engine"):
        crit = median(fg, "critical.ttft_objective_attainment")
        best_peer = max(
            (
                (v, a.contender)
                for a in peers
                if (v := median(a, "critical.ttft_objective_attainment")) is not None
            ),
            default=None,
        )
        if crit is not None:
            peer_text = f"; best peer {best_peer[1]} {best_peer[0]:.1%}" if best_peer else ""
            out.append(
                f"- critical TTFT objective met for >= 99%: fleetgate {crit:.1%}{peer_text} "
                f"-> {verdict(crit >= 0.99)}"
            )
        nopre = next((a for a in at if a.contender == "fleetgate-no-preemption"), None)

        mine_b = median(fg, "batch.tokens_per_s")
        base_b = median(nopre, "batch.tokens_per_s") if nopre else None
        if mine_b is not None and base_b:
            out.append(
                f"- batch goodput >= 80% of the no-preemption run: {mine_b:.0f} vs "
                f"{base_b:.0f} completed batch tokens/s = {mine_b / base_b:.0%} "
                f"-> {verdict(mine_b >= 0.8 * base_b)}"
            )
        else:
            out.append(
                "- batch goodput >= 80% of the no-preemption run: not checkable "
                "(fleetgate-no-preemption did not run)"
            )
    if workload == "mixed-engine":
        gp = median(fg, "goodput")
        best_gp = max(
            ((v, a.contender) for a in peers if (v := median(a, "goodput")) is not None),
            default=None,
        )
        if gp is not None and best_gp is not None:
            out.append(
                f"- goodput above every peer (best {best_gp[1]} {best_gp[0]:.2f}/s): fleetgate "
                f"{gp:.2f}/s -> {verdict(gp > best_gp[0])}"
            )
    return out


HEADLINE: tuple[tuple[str, str, str], ...] = (
    ("ttft_p50", "TTFT p50 (s)", "{:.3f}"),
    ("ttft_p90", "TTFT p90 (s)", "{:.3f}"),
    ("ttft_p99", "TTFT p99 (s)", "{:.3f}"),
    ("hit_rate", "engine hit rate", "{:.1%}"),
    ("imbalance", "imbalance", "{:.2f}"),
    ("goodput", "goodput (req/s)", "{:.2f}"),
    ("critical.ttft_objective_attainment", "critical met", "{:.1%}"),
    ("errors", "errors", "{:.0f}"),
    ("router_cpu_s", "router CPU (s)", "{:.1f}"),
)


def headline_table(aggs: Sequence[Aggregate]) -> list[str]:
    """fleetgate (default) and every peer, per workload, at each one's top load factor."""
    head = "| workload | contender | " + " | ".join(c[1] for c in HEADLINE) + " |"
    lines = [head, "|" + "---|" * (len(HEADLINE) + 2)]
    for w in dict.fromkeys(a.workload for a in aggs):
        mine = [a for a in aggs if a.workload == w]
        top = max(a.load_factor for a in mine)
        for a in mine:
            if a.load_factor != top or not (a.contender == "fleetgate" or is_peer(a.contender)):
                continue
            if a.failed == a.repeats:
                lines.append(f"| {w} | {a.contender} | did not run |" + " |" * (len(HEADLINE) - 1))
                continue
            cells = [cell(a, k, f) for k, _, f in HEADLINE]
            name = f"**{a.contender}**" if a.contender == "fleetgate" else a.contender
            lines.append(f"| {w} | {name} | " + " | ".join(cells) + " |")
    return lines


#: (figure, column title, points: show x100) of the comparison table.
COMPARISON_FIGURES: tuple[tuple[str, str, bool], ...] = (
    ("ttft_p50_ratio", "TTFT p50 ratio", False),
    ("ttft_p90_ratio", "TTFT p90 ratio", False),
    ("ttft_p99_ratio", "TTFT p99 ratio", False),
    ("hit_rate_diff", "usage hit rate diff (points)", True),
    ("error_rate_diff", "error rate diff (points)", True),
)


def figure_cell(f: Figure | None, points: bool) -> str:
    """``estimate [low-high] verdict`` (+ ``seeds min..max`` over several seeds)."""
    if f is None or (f.interval is None and not f.per_seed):
        return "n/a"
    k = 100.0 if points else 1.0
    fmt = "{:+.1f}" if points else "{:.2f}"
    if f.interval is None:
        # too few sessions (or an undefined replicate figure): the estimate, no verdict
        return f"{fmt.format(statistics.median(f.per_seed) * k)} (no interval)"
    ci = f.interval
    text = f"{fmt.format(ci.estimate * k)} [{fmt.format(ci.low * k)}, {fmt.format(ci.high * k)}]"
    if len(f.per_seed) > 1:
        text += f" seeds {fmt.format(min(f.per_seed) * k)}..{fmt.format(max(f.per_seed) * k)}"
    mark = {"win": " **win**", "loss": " **loss**"}.get(f.verdict, "")
    return text + mark


def comparison_table(comparisons: Sequence[Comparison]) -> list[str]:
    """Every contender against its baseline with 95% intervals; empty without any."""
    if not comparisons:
        return []
    level = next((f.interval.level for c in comparisons for f in c.figures if f.interval), 0.95)
    head = (
        "| workload | load | contender | vs | seeds | "
        + " | ".join(t for _, t, _ in COMPARISON_FIGURES)
        + " |"
    )
    lines = [
        f"Ratios and differences with {level:.0%} bootstrap intervals [low, high] "
        "(win/loss only when the interval excludes 1, or 0 for a difference):",
        "",
        head,
        "|" + "---|" * (len(COMPARISON_FIGURES) + 5),
    ]
    for c in comparisons:
        cells = [figure_cell(c.figure(n), pts) for n, _, pts in COMPARISON_FIGURES]
        lines.append(
            f"| {c.workload} | x{c.load_factor:g} | {c.contender} | {c.baseline} | {c.seeds} | "
            + " | ".join(cells)
            + " |"
        )
    return lines


def render_markdown(
    aggs: Sequence[Aggregate],
    *,
    title: str,
    command: str,
    notes: Sequence[str] = (),
    plots: Sequence[str] = (),
    comparisons: Sequence[Comparison] = (),
) -> str:
    lines = [f"# {title}", "", "Command:", "", "```", command, "```", ""]
    lines += [f"- {n}" for n in notes]
    if notes:
        lines.append("")
    workloads = list(dict.fromkeys(a.workload for a in aggs))
    for w in workloads:
        mine = [a for a in aggs if a.workload == w]
        factors = sorted({a.load_factor for a in mine})
        lines += [f"## {w}", ""]
        for lf in factors:
            at = [a for a in mine if a.load_factor == lf]
            if len(factors) > 1:
                lines += [f"### load factor {lf:g}", ""]
            lines += table(at) + [""]
            ct = class_table(at)
            if ct:
                lines += ["Per class:", ""] + ct + [""]
            et = extra_table(at)
            if et:
                lines += ["Other figures:", ""] + et + [""]
        cmp = comparison_table([c for c in comparisons if c.workload == w])
        if cmp:
            lines += cmp + [""]
        lines += ["Goals:", ""] + goal_lines(w, mine, comparisons) + [""]
        for p in plots:
            if Path(p).stem.endswith(w):  # no workload name ends another's
                lines += [f"![{w}]({Path(p).name})", ""]
    return "\n".join(lines).rstrip() + "\n"


def write_plots(aggs: Sequence[Aggregate], out_dir: Path, prefix: str = "") -> list[Path]:
    """One PNG per workload, ``<prefix><workload>.png``; returns the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for w in dict.fromkeys(a.workload for a in aggs):
        mine = [a for a in aggs if a.workload == w and a.failed < a.repeats]
        if not mine:
            continue
        names = list(dict.fromkeys(a.contender for a in mine))
        top = max(a.load_factor for a in mine)
        at_top = {a.contender: a for a in mine if a.load_factor == top}
        fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
        ax = axes[0]
        if len({a.load_factor for a in mine}) == 1:
            # one load level: TTFT p90 per contender, whiskers = min-max over repeats
            spreads = [at_top[n].metrics.get("ttft_p90") if n in at_top else None for n in names]
            mids = [sp[0] if sp else 0.0 for sp in spreads]
            lo = [sp[0] - sp[1] if sp else 0.0 for sp in spreads]
            hi = [sp[2] - sp[0] if sp else 0.0 for sp in spreads]
            colors = ["C1" if is_peer(n) else "C0" for n in names]
            ax.barh(names, mids, xerr=[lo, hi], color=colors, capsize=3)
            ax.set_xlabel("TTFT p90 (modelled s), median and min-max of repeats")
            ax.set_title(f"{w}: TTFT p90 at load x{top:g}")
            ax.tick_params(axis="y", labelsize=7)
        for n in names if len({a.load_factor for a in mine}) > 1 else ():
            pts = sorted((a.load_factor, median(a, "ttft_p90")) for a in mine if a.contender == n)
            xs = [x for x, y in pts if y is not None]
            ys = [y for _, y in pts if y is not None]
            ax.plot(xs, ys, marker="o", label=n, linestyle="-" if is_peer(n) else "--")
        if len({a.load_factor for a in mine}) > 1:
            ax.set_xlabel("offered load (x the workload's base rate)")
            ax.set_ylabel("TTFT p90 (modelled s)")
            ax.set_title(f"{w}: TTFT p90 vs load")
            ax.legend(fontsize=7)
        ax = axes[1]
        hits = [median(at_top[n], "hit_rate") if n in at_top else None for n in names]
        ax.barh(
            names, [h or 0.0 for h in hits], color=["C1" if is_peer(n) else "C0" for n in names]
        )
        ax.set_xlabel("engine-reported prefix hit rate")
        ax.set_xlim(0, 1)
        ax.set_title(f"hit rate (load x{top:g})")
        ax.tick_params(axis="y", labelsize=7)
        ax = axes[2]
        classes = classes_of(mine)
        width = 0.8 / max(1, len(classes))
        for i, cls in enumerate(classes):
            vals = [
                median(at_top[n], f"{cls}.ttft_objective_attainment") or 0.0 if n in at_top else 0.0
                for n in names
            ]
            ax.barh([j + i * width for j in range(len(names))], vals, height=width, label=cls)
        ax.set_yticks([j + width * (len(classes) - 1) / 2 for j in range(len(names))], names)
        ax.tick_params(axis="y", labelsize=7)
        ax.set_xlim(0, 1)
        ax.set_xlabel("TTFT objective attainment")
        ax.set_title("per-class attainment")
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = out_dir / f"{prefix}{w}.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        written.append(path)
    return written
