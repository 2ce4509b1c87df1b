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
* ``report.request_lifecycle``: ``per_request`` with the request body (for its
  prompt), ``info`` (the engine's ``usage``) and ``computed_metrics`` (its TTFT
  and latency), no response bodies or chunks; ``use_server_output_tokens``.
  Our figures are computed from these per-request records exactly as from our
  loadgen's (:func:`results_from_per_request`, then the same steady-state
  summary, warm-up and paired bootstrap as ``fleetgate bench run``), so the
  two tools differ only in the traffic they send, not in the statistics.

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
import hashlib
import ipaddress
import json
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from fleetgate.sim.core import tokenizer as simtok
from fleetgate_tools.bench import scenarios, workloads
from fleetgate_tools.bench.stats import RequestResult, median_and_spread, percentile, steady
from fleetgate_tools.bench.summary import RunRecord, summarise_run

NAME = "inference-perf"
VERSION = "0.7.0"
PER_REQUEST_FILE = "per_request_lifecycle_metrics.json"
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
                "per_request": True,
                "per_request_fields": {
                    "request": True,
                    "response": False,
                    "info": True,
                    "response_chunks": False,
                    "computed_metrics": True,
                },
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


def _get(doc: Any, *path: str) -> Any:
    for key in path:
        if not isinstance(doc, Mapping):
            return None
        doc = doc.get(key)
    return doc


def _prompt_key(entry: Mapping[str, Any]) -> str | None:
    """A short hash of the request's prompt (its shared prefix + question)."""
    raw = entry.get("request")
    try:
        body = json.loads(raw) if isinstance(raw, str) else raw
    except ValueError:
        return None
    prompt = _get(body, "prompt")
    if not isinstance(prompt, str):
        return None
    return hashlib.sha1(prompt.encode("utf-8", "surrogatepass")).hexdigest()[:12]


def results_from_per_request(
    entries: Sequence[Mapping[str, Any]], time_scale: float, priority_class: str = "standard"
) -> list[RequestResult]:
    """inference-perf's ``per_request_lifecycle_metrics.json`` as our RequestResults.

    One result per entry, in dispatch order; ``sent_at`` is modelled seconds since
    its first dispatch (``start_time`` is ``time.perf_counter``), TTFT and
    end-to-end latency come from its own ``computed_metrics`` divided by
    ``time_scale``; output, prompt and cached tokens are the engine's own
    ``usage`` (``server_usage``). The session id is the prompt's hash, so that
    the same seed's runs pair request by request across contenders (its
    generator is seeded; every prompt is used once). ITL stays empty: the tool
    re-tokenizes each streamed chunk, which gives zero gaps (see the module doc).
    Raises ValueError on a foreign document.
    """
    if time_scale <= 0:
        raise ValueError("time_scale must be > 0")
    if not isinstance(entries, Sequence) or not all(isinstance(e, Mapping) for e in entries):
        raise ValueError("not an inference-perf per-request report")
    try:
        ordered = sorted(entries, key=lambda e: float(e["start_time"]))
    except (KeyError, TypeError, ValueError):
        raise ValueError("not an inference-perf per-request report (no start_time)") from None
    if not ordered:
        return []
    t0 = float(ordered[0]["start_time"])
    out: list[RequestResult] = []
    for i, e in enumerate(ordered):
        sid = _prompt_key(e) or f"request-{i}"
        r = RequestResult(sid, 0, priority_class, (float(e["start_time"]) - t0) / time_scale)
        usage = _get(e, "info", "response_metrics", "server_usage") or {}
        error = e.get("error")
        metrics = e.get("computed_metrics")
        if error or not isinstance(metrics, Mapping):
            kind = _get(error, "error_type") or "error"
            r.error = f"{kind}: {_get(error, 'error_msg') or ''}"[:200]
            out.append(r)
            continue
        r.status = 200
        ttft, e2e = metrics.get("time_to_first_token"), metrics.get("request_latency")
        r.ttft = float(ttft) / time_scale if ttft is not None else None
        r.e2e = float(e2e) / time_scale if e2e is not None else None
        tokens = usage.get("completion_tokens", metrics.get("output_tokens"))
        r.output_tokens = int(tokens or 0)
        if usage.get("prompt_tokens") is not None:
            r.prompt_tokens = int(usage["prompt_tokens"])
            cached = _get(usage, "prompt_tokens_details", "cached_tokens")
            r.cached_tokens = int(cached) if cached is not None else None
        out.append(r)
    return out


@dataclasses.dataclass(frozen=True, slots=True)
class Figures:
    """One tool's steady-state figures for one contender and seed; MODELLED seconds."""

    tool: str
    contender: str
    seed: int
    requests: int
    """Steady requests (sent after the warm-up)."""
    errors: int
    ttft_p50: float | None
    ttft_p90: float | None
    ttft_p99: float | None
    tpot_p50: float | None
    """(end-to-end - TTFT) / (output tokens - 1), per request (both tools alike)."""
    output_tokens_per_s: float | None
    """Output tokens / (last end - first start) of the steady requests (inference-perf's way)."""
    prompt_tokens_mean: float | None
    """As the engines counted them (``usage.prompt_tokens``)."""
    hit_rate: float | None
    """Sum of ``usage`` cached tokens / prompt tokens of the steady requests."""
    router_cpu_s: float | None = None
    warmup_requests: int = 0
    error: str | None = None


def figures_of(record: RunRecord, tool: str, objective: Callable[[str], float]) -> Figures:
    """One run's steady-state :class:`Figures`, the same definitions for both tools."""
    if record.error is not None:
        return Figures(
            tool, record.contender, record.repeat, 0, 0, None, None, None, None, None, None,
            None, error=record.error,
        )  # fmt: skip
    s = summarise_run(record, objective)
    done = [r for r in steady(record.results, record.warmup_s) if r.ok and r.e2e is not None]
    span = (
        max(r.sent_at + (r.e2e or 0.0) for r in done) - min(r.sent_at for r in done)
        if done
        else 0.0
    )
    tpots = [
        ((r.e2e or 0.0) - (r.ttft or 0.0)) / (r.output_tokens - 1)
        for r in done
        if r.ttft is not None and r.output_tokens > 1
    ]
    prompts = [r.prompt_tokens for r in done if r.prompt_tokens]
    return Figures(
        tool=tool,
        contender=record.contender,
        seed=record.repeat,
        requests=s.requests,
        errors=s.errors,
        ttft_p50=s.ttft_p50,
        ttft_p90=s.ttft_p90,
        ttft_p99=s.ttft_p99,
        tpot_p50=percentile(tpots, 50),
        output_tokens_per_s=sum(r.output_tokens for r in done) / span if span > 0 else None,
        prompt_tokens_mean=sum(prompts) / len(prompts) if prompts else None,
        hit_rate=s.usage_hit_rate,
        router_cpu_s=record.router_cpu_s,
        warmup_requests=s.warmup_requests,
    )


def fmt(v: float | None, fmt: str) -> str:
    return "n/a" if v is None else format(v, fmt)


def _spread(values: Sequence[float | None], spec: str, k: float = 1.0) -> str:
    """``median`` of the seeds' values, with ``(min-max)`` when there are several."""
    known = [v * k for v in values if v is not None]
    spread = median_and_spread(known)
    if spread is None:
        return "n/a"
    mid, low, high = (format(v, spec) for v in spread)
    return mid if len(known) == 1 else f"{mid} ({low}-{high})"


def table(rows: Sequence[Figures]) -> list[str]:
    """Markdown rows, one per (contender, tool): medians over seeds (min-max)."""
    out = [
        "| contender | load generator | seeds | steady requests | errors | TTFT p50 s | "
        "TTFT p90 s | TTFT p99 s | TPOT p50 ms | output tok/s | prompt tok | hit rate | "
        "router CPU s |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    groups: dict[tuple[str, str], list[Figures]] = {}
    for r in rows:
        groups.setdefault((r.contender, r.tool), []).append(r)
    for (contender, tool), figs in groups.items():
        ok = [f for f in figs if f.error is None]
        if not ok:
            out.append(f"| {contender} | {tool} | error: {figs[0].error} |" + " |" * 10)
            continue
        out.append(
            f"| {contender} | {tool} | {len(ok)} | {sum(f.requests for f in ok)} | "
            f"{sum(f.errors for f in ok)} | {_spread([f.ttft_p50 for f in ok], '.3f')} | "
            f"{_spread([f.ttft_p90 for f in ok], '.3f')} | "
            f"{_spread([f.ttft_p99 for f in ok], '.3f')} | "
            f"{_spread([f.tpot_p50 for f in ok], '.1f', 1000.0)} | "
            f"{_spread([f.output_tokens_per_s for f in ok], '.0f')} | "
            f"{_spread([f.prompt_tokens_mean for f in ok], '.0f')} | "
            f"{_spread([f.hit_rate for f in ok], '.3f')} | "
            f"{_spread([f.router_cpu_s for f in ok], '.1f')} |"
        )
        for f in figs:
            if f.error is not None:
                out.append(f"| {contender} | {tool} | seed {f.seed} error: {f.error} |" + " |" * 10)
    return out


def ratio_from_texts(texts: Sequence[str], tokens_each: int) -> float:
    """Emulator tokens per tokenizer token over ``texts`` of ``tokens_each`` tokens."""
    if not texts or tokens_each <= 0:
        raise ValueError("calibration needs texts of a positive token length")
    return sum(len(simtok.encode(t)) for t in texts) / (len(texts) * tokens_each)
