"""Cross-check our TTFT figures with a public load generator: ``inference-perf``.

A public load generator next to our own (:mod:`fleetgate_tools.bench.loadgen`)
makes the figures checkable. ``fleetgate bench infperf shared-prefix
--contenders ...`` runs, per contender, our loadgen and then ``inference-perf``
(kubernetes-sigs, PyPI, pinned :data:`VERSION`) each against a FRESH fleet built
by :mod:`fleetgate_tools.bench.runner` from the same
:class:`~fleetgate_tools.bench.scenarios.Scenario`, and prints both sets of
figures side by side, in modelled seconds.

What inference-perf 0.7.0 is told (its config schema, read from its source:
``inference_perf/config/*``; report layout from ``inference_perf/reportgen/base.py``):

* ``api: {type: completion, streaming: true}``: its ``shared_prefix`` generator
  emits ``/v1/completions`` prompts (prefix + question in one ``prompt``) for
  text; our loadgen sends chat. Both routers and engines serve both routes.
* ``data.shared_prefix``: the scenario's number of document groups, a fixed
  shared-prefix length and a uniform question length, calibrated (below) so
  that the EMULATOR counts about as many prompt tokens as for our workload;
  ``output_len`` = our ``max_tokens`` (``ignore_eos`` is on in both).
* ``load: {type: poisson, stages: [{rate, duration}]}``: as many requests as
  our seeded schedule has, over our arrival window, in wall seconds (the
  emulator runs ``time_scale`` wall s per modelled s). It stops by itself;
  ``request_timeout`` and ``stage_teardown_grace_seconds`` bound the tail like
  our loadgen's deadline, and the process group is killed if it overruns.
* ``server: {type: vllm, base_url: http://127.0.0.1:PORT, model_name}`` (the
  name given, so it does not ask ``/v1/models``); no ``metrics`` section (no
  Prometheus queries), storage only ``local_storage`` (no GCS/S3).
* ``report.request_lifecycle``: summary only, percentiles 50/90/99,
  ``use_server_output_tokens`` (the emulator's exact ``completion_tokens``).

Network rule: the config names only the router's loopback URL (checked), and
the process runs with ``HF_HUB_OFFLINE=1``, ``TRANSFORMERS_OFFLINE=1``,
``HF_DATASETS_OFFLINE=1``, Hub telemetry off, OpenTelemetry tracing off (its
default, set explicitly) and no proxy variables. The tokenizer is a local copy
of ``~/.cache/fleetgate/models/tiny-llama``
(:func:`fleetgate_tools.bench.infperf_run.prepare_tokenizer`).

Token counts differ between the two tools: inference-perf builds prompts from
random ids of the tiny-llama tokenizer (a 2048-entry vocabulary, so the text
is mostly digits and byte pieces) and counts with it; the emulator counts with
its own tokenizer (``fleetgate/sim/core/tokenizer.py``: a digit costs one
token). :func:`fleetgate_tools.bench.infperf_run.calibrate_ratio` measures emulator
tokens per tiny-llama token on text made by inference-perf's own generator, and
lengths are divided by it. The prompt tokens per request that the engines'
/metrics counted are printed for both tools so the match can be checked.
inference-perf's ITL re-tokenizes each streamed chunk with tiny-llama (several
tokens per chunk share one timestamp, giving zero gaps), so its TPOT, not its
ITL, is the figure to compare with our ITL.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from fleetgate.sim.core import tokenizer as simtok
from fleetgate_tools.bench import scenarios, workloads
from fleetgate_tools.bench.stats import percentile
from fleetgate_tools.bench.summary import RunRecord, summarise_run

NAME = "inference-perf"
VERSION = "0.7.0"
SUMMARY_FILE = "summary_lifecycle_metrics.json"
_PROXY_VARS = ("http_proxy", "https_proxy", "all_proxy", "ftp_proxy")


# ------------------------------------------------------ environment (pure)


def require_loopback(url: str) -> None:
    """inference-perf may only ever be pointed at 127.0.0.0/8 (or localhost)."""
    host = urlsplit(url).hostname or ""
    try:
        if host == "localhost" or ipaddress.ip_address(host).is_loopback:
            return
    except ValueError:
        pass
    raise ValueError(f"inference-perf only targets loopback addresses, not {url!r}")


def offline_env(base: Mapping[str, str]) -> dict[str, str]:
    """``base`` without proxies/OTLP/cloud credentials, with every offline switch on."""
    env = {
        k: v
        for k, v in base.items()
        if k.lower() not in _PROXY_VARS
        and not k.startswith(("OTEL_", "AWS_", "GOOGLE_", "HF_TOKEN"))
        and k != "PYTHONPATH"
    }
    env.update(
        {
            "NO_PROXY": "127.0.0.1,localhost",
            "no_proxy": "127.0.0.1,localhost",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1",
            "HF_HUB_DISABLE_TELEMETRY": "1",
            "HF_HUB_DISABLE_IMPLICIT_TOKEN": "1",
            "DO_NOT_TRACK": "1",
            "OTEL_TRACES_ENABLED": "false",
            "OTEL_SDK_DISABLED": "true",
            "TOKENIZERS_PARALLELISM": "false",
            "OMP_NUM_THREADS": "1",
        }
    )
    return env


def tokenizer_config_for_counting(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """tiny-llama's tokenizer_config with ``model_max_length`` lifted: inference-perf
    truncates counts at it (2048), which would make long prefixes unreachable."""
    out = dict(cfg)
    out["model_max_length"] = max(int(out.get("model_max_length") or 0), 1 << 20)
    return out


# ------------------------------------------------------- workload mapping (pure)


@dataclasses.dataclass(frozen=True, slots=True)
class Plan:
    """One inference-perf run of a scenario; lengths in EMULATOR tokens."""

    rate: float
    """Requests per wall second."""
    duration_s: int
    """Wall seconds of arrivals."""
    requests: int
    """As many as our seeded schedule has."""
    groups: int
    prompts_per_group: int
    prefix_tokens: int
    question_min: int
    question_max: int
    output_tokens: int
    seed: int
    time_scale: float


def _prefix_and_question(content: str) -> tuple[str, str]:
    doc, sep, question = content.partition("\n\nQuestion: ")
    if not sep:
        raise ValueError("not a shared-prefix prompt (no '\\n\\nQuestion: ')")
    return doc, sep + question


def plan_for(scenario: scenarios.Scenario) -> Plan:
    """The inference-perf equivalent of a ``shared-prefix`` scenario.

    Groups = the documents the scenario's sessions use; prefix length = their
    mean emulator token count; questions = the min..max of ours; arrivals = as
    many requests as our seeded schedule has, over our window (wall seconds), at
    Poisson-like times drawn by inference-perf (its timer is not seeded).
    """
    if scenario.load.generator != "shared-prefix":
        raise ValueError(
            f"inference-perf cross-check maps only the shared-prefix workload, "
            f"not {scenario.name!r}"
        )
    sessions = scenario.sessions()
    if not sessions:
        raise ValueError("the scenario has no sessions (duration too short)")
    docs: dict[str, int] = {}
    questions: list[int] = []
    for s in sessions:
        doc, question = _prefix_and_question(s.turns[0].content)
        group = s.session_id.split("-", 1)[0]
        if group not in docs:
            docs[group] = len(simtok.encode(doc))
        questions.append(len(simtok.encode(question)))
    p = scenario.params()
    groups = workloads.shared_prefix_groups(p)
    duration = max(1, round(scenario.duration_s * scenario.time_scale))
    n = len(sessions)
    return Plan(
        # inference-perf sends exactly int(rate x duration) requests (its
        # loadgen/load_generator.py): the count of OUR seeded schedule
        rate=(n + 0.5) / duration,
        duration_s=duration,
        requests=n,
        groups=groups,
        # each prompt is used once; its groups are shuffled like our random doc pick
        prompts_per_group=max(1, math.ceil(n / groups)),
        prefix_tokens=round(sum(docs.values()) / len(docs)),
        question_min=min(questions),
        question_max=max(questions),
        output_tokens=sessions[0].turns[0].max_tokens,
        seed=scenario.seed,
        time_scale=scenario.time_scale,
    )


def build_config(
    plan: Plan,
    base_url: str,
    model: str,
    tokenizer_path: Path,
    report_dir: Path,
    ratio: float,
) -> dict[str, Any]:
    """inference-perf 0.7.0 config (a dict for ``-c FILE``); ``ratio`` = emulator
    tokens per tokenizer token (:func:`calibrate_ratio`)."""
    require_loopback(base_url)
    if ratio <= 0:
        raise ValueError("ratio must be > 0")

    def hf(n: int) -> int:
        return max(1, round(n / ratio))

    q_lo, q_hi = hf(plan.question_min), max(hf(plan.question_min), hf(plan.question_max))
    wall_budget = plan.duration_s
    return {
        "api": {"type": "completion", "streaming": True},
        "data": {
            "type": "shared_prefix",
            "shared_prefix": {
                "num_groups": plan.groups,
                "num_prompts_per_group": plan.prompts_per_group,
                "system_prompt_len": hf(plan.prefix_tokens),
                "question_len": {
                    "type": "uniform",
                    "min": q_lo,
                    "max": q_hi,
                    "mean": (q_lo + q_hi) / 2,
                },
                "output_len": plan.output_tokens,
                "seed": plan.seed,
            },
        },
        "load": {
            "type": "poisson",
            "stages": [{"rate": plan.rate, "duration": plan.duration_s}],
            "interval": 0,
            "num_workers": 1,
            "worker_max_concurrency": 512,
            "request_timeout": wall_budget + 60.0,
            "stage_teardown_grace_seconds": wall_budget * 0.5 + 20.0,
            "base_seed": plan.seed,
        },
        "server": {
            "type": "vllm",
            "model_name": model,
            "base_url": base_url,
            "ignore_eos": True,
        },
        "tokenizer": {"pretrained_model_name_or_path": str(tokenizer_path), "load_timeout": 60.0},
        "report": {
            "request_lifecycle": {
                "summary": True,
                "per_stage": False,
                "per_request": False,
                "per_adapter": False,
                "percentiles": [50, 90, 99],
                "use_server_output_tokens": True,
            },
            "prometheus": {"summary": False, "per_stage": False},
        },
        "storage": {"local_storage": {"path": str(report_dir)}},
    }


def hard_deadline_s(plan: Plan) -> float:
    """When the run is killed: arrivals + teardown grace + start-up and report slack."""
    return plan.duration_s * 1.5 + 20.0 + 120.0


# ------------------------------------------------------------ report (pure)


@dataclasses.dataclass(frozen=True, slots=True)
class Figures:
    """One tool's figures for one contender; times in MODELLED seconds."""

    tool: str
    contender: str
    requests: int
    errors: int
    ttft_p50: float | None
    ttft_p90: float | None
    ttft_p99: float | None
    itl_p50: float | None
    tpot_p50: float | None
    output_tokens_per_s: float | None
    """Output tokens / (last end - first start), modelled seconds."""
    prompt_tokens_mean: float | None
    """As the emulator counted them (``usage.prompt_tokens``)."""
    hit_rate: float | None
    """Engines' prefix-cache hit tokens / query tokens over the run."""
    router_cpu_s: float | None = None
    error_kinds: dict[str, int] = dataclasses.field(default_factory=dict)
    error: str | None = None


def failed(contender: str, error: str) -> Figures:
    """The row of an inference-perf run that could not happen."""
    none = None
    return Figures(
        f"{NAME} {VERSION}", contender, 0, 0, none, none, none, none, none, none, none, none,
        error=error,
    )  # fmt: skip


def _stat(doc: Mapping[str, Any] | None, key: str, scale: float) -> float | None:
    if not doc or doc.get(key) is None:
        return None
    return float(doc[key]) / scale


def parse_summary(
    doc: Mapping[str, Any], contender: str, time_scale: float, hit: float | None = None
) -> Figures:
    """Figures from inference-perf's ``summary_lifecycle_metrics.json``.

    Wall seconds are divided by ``time_scale`` (rates multiplied) so they read
    like our loadgen's modelled seconds. Raises ValueError on a foreign document.
    """
    try:
        ok = doc["successes"]
        failed = doc["failures"]
        n_ok, n_failed = int(ok["count"]), int(failed["count"])
    except (KeyError, TypeError, ValueError):
        raise ValueError("not an inference-perf lifecycle summary") from None
    if time_scale <= 0:
        raise ValueError("time_scale must be > 0")
    lat = ok.get("latency") or {}
    ttft = lat.get("time_to_first_token")
    thr = ok.get("throughput") or {}
    out_rate = thr.get("output_tokens_per_sec")
    prompt = ok.get("prompt_tokens") or {}
    kinds = {
        str(label): int(v.get("count", 0)) if isinstance(v, Mapping) else int(v)
        for label, v in (failed.get("by_label") or {}).items()
    }
    return Figures(
        tool=f"{NAME} {VERSION}",
        contender=contender,
        requests=n_ok + n_failed,
        errors=n_failed,
        ttft_p50=_stat(ttft, "median", time_scale),
        ttft_p90=_stat(ttft, "p90", time_scale),
        ttft_p99=_stat(ttft, "p99", time_scale),
        itl_p50=_stat(lat.get("inter_token_latency"), "median", time_scale),
        tpot_p50=_stat(lat.get("time_per_output_token"), "median", time_scale),
        output_tokens_per_s=float(out_rate) * time_scale if n_ok and out_rate is not None else None,
        prompt_tokens_mean=float(prompt["mean"]) if prompt.get("mean") is not None else None,
        hit_rate=hit,
        error_kinds=kinds,
    )


def loadgen_figures(record: RunRecord, objective: Callable[[str], float]) -> Figures:
    """Our loadgen's :class:`~fleetgate_tools.bench.summary.RunRecord` as :class:`Figures`,
    throughput with inference-perf's definition (tokens / first start..last end)."""
    s = summarise_run(record, objective)
    done = [r for r in record.results if r.ok and r.e2e is not None]
    span = (
        max(r.sent_at + (r.e2e or 0.0) for r in done) - min(r.sent_at for r in done)
        if done
        else 0.0
    )
    tokens = sum(r.output_tokens for r in done)
    itls = [g for r in done for g in r.itl]
    tpots = [
        ((r.e2e or 0.0) - (r.ttft or 0.0)) / (r.output_tokens - 1)
        for r in done
        if r.ttft is not None and r.output_tokens > 1
    ]
    return Figures(
        tool="fleetgate loadgen",
        contender=record.contender,
        requests=s.requests,
        errors=s.errors,
        ttft_p50=s.ttft_p50,
        ttft_p90=s.ttft_p90,
        ttft_p99=s.ttft_p99,
        itl_p50=percentile(itls, 50),
        tpot_p50=percentile(tpots, 50),
        output_tokens_per_s=tokens / span if span > 0 else None,
        prompt_tokens_mean=None,
        hit_rate=s.hit_rate,
        router_cpu_s=s.router_cpu_s,
        error_kinds=dict(s.extra.get("error_kinds") or {}),
        error=s.error,
    )


def fmt(v: float | None, fmt: str) -> str:
    return "n/a" if v is None else format(v, fmt)


def table(rows: Sequence[Figures]) -> list[str]:
    """Markdown rows: one per (contender, tool)."""
    out = [
        "| contender | load generator | requests | errors | TTFT p50 s | TTFT p90 s | "
        "TTFT p99 s | ITL p50 ms | TPOT p50 ms | output tok/s | prompt tok | hit rate | "
        "router CPU s |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if r.error:
            out.append(f"| {r.contender} | {r.tool} | error: {r.error} |" + " |" * 10)
            continue
        ms = [None if v is None else v * 1000 for v in (r.itl_p50, r.tpot_p50)]
        out.append(
            f"| {r.contender} | {r.tool} | {r.requests} | {r.errors} | {fmt(r.ttft_p50, '.3f')} | "
            f"{fmt(r.ttft_p90, '.3f')} | {fmt(r.ttft_p99, '.3f')} | {fmt(ms[0], '.1f')} | "
            f"{fmt(ms[1], '.1f')} | {fmt(r.output_tokens_per_s, '.0f')} | "
            f"{fmt(r.prompt_tokens_mean, '.0f')} | {fmt(r.hit_rate, '.3f')} | "
            f"{fmt(r.router_cpu_s, '.1f')} |"
        )
    return out


def ratio_from_texts(texts: Sequence[str], tokens_each: int) -> float:
    """Emulator tokens per tokenizer token over ``texts`` of ``tokens_each`` tokens."""
    if not texts or tokens_each <= 0:
        raise ValueError("calibration needs texts of a positive token length")
    return sum(len(simtok.encode(t)) for t in texts) / (len(texts) * tokens_each)


def mean_prompt_tokens(engines: Sequence[Any], requests: int) -> float | None:
    """Prompt tokens the engines counted over a run, per request."""
    known = [e.prompt_tokens for e in engines if e.prompt_tokens is not None]
    if not known or len(known) != len(engines) or requests <= 0:
        return None
    return float(sum(known)) / requests
