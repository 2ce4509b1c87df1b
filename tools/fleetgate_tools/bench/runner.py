"""One benchmark run: fresh emulated fleet + one contender + the load, then stop.

``run_one(scenario, contender, repeat, ...)``:

1. writes the scenario's fleet file and starts ``fleetgate sim --fleet`` as a
   subprocess on free loopback ports (a fresh fleet per run: empty caches,
   identical engine seeds);
2. writes the contender's config (fleetgate) and starts it on a free loopback
   port; waits until ``GET /v1/models`` answers 200 through it;
3. (fleetgate only) probes whether the router takes priority class names in
   ``x-fleetgate-priority`` or still only integer levels, and maps classes to
   levels (critical 5, batch -5) in the latter case;
4. scrapes every engine's /metrics (adapters in ``fleetgate.engines``), reads
   the contender's CPU seconds, replays the scenario's sessions (identical for
   every contender: built from the seed), scrapes and reads CPU again;
5. for ``priority-storm``-like workloads, reads preemption/resume counters
   from the router's /metrics if it exposes them and replays a bounded sample
   of completed requests without load ("twin run") to count mismatching texts;
6. stops the contender and the fleet (always, ``finally``).

Latencies in the returned record are modelled seconds (wall / time scale).
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import yaml

from fleetgate.engines import get_adapter
from fleetgate.engines.base import LoadSnapshot, MetricsSource
from fleetgate_tools import procs
from fleetgate_tools.bench import contenders as cmod
from fleetgate_tools.bench import loadgen
from fleetgate_tools.bench.scenarios import MODEL, Scenario, wall_sessions
from fleetgate_tools.bench.stats import RequestResult
from fleetgate_tools.bench.summary import EngineWindow, RunRecord

#: Integer levels used when the router does not take class names yet.
CLASS_LEVELS = {"critical": 5, "standard": 0, "batch": -5}
TWIN_SAMPLE = 16

_ENGINE_LINE = re.compile(r"engine=(\S+) url=(\S+) model=(\S+)")


@dataclasses.dataclass
class Fleet:
    proc: procs.Proc
    engines: list[tuple[str, str]]
    """(kind, url) in fleet order."""


def start_fleet(
    scenario: Scenario, run_dir: Path, startup_s: float = 60.0, env: dict[str, str] | None = None
) -> Fleet:
    n = scenario.engines
    ports = procs.free_ports(n)
    fleet_file = run_dir / "fleet.yaml"
    fleet_file.write_text(yaml.safe_dump(scenario.fleet_file(ports), sort_keys=False))
    proc = procs.start(
        "fleetgate sim",
        [sys.executable, "-m", "fleetgate", "sim", "--fleet", str(fleet_file)],
        run_dir / "sim.log",
        env,
    )
    found: list[tuple[str, str]] = []

    def ready() -> bool:
        text = proc.log.read_text(errors="replace")
        found[:] = [(m[1], m[2]) for m in _ENGINE_LINE.finditer(text)]
        return len(found) >= n

    try:
        procs.wait_until(proc, ready, startup_s, "printing its engines")
    except procs.ProcessError:
        proc.stop()
        raise
    return Fleet(proc, list(found))


def start_contender(
    contender: cmod.Contender,
    fleet: Fleet,
    run_dir: Path,
    scenario: Scenario,
    peers_root: Path | None,
    startup_s: float = 60.0,
    env: dict[str, str] | None = None,
    priority_classes: bool = False,
) -> tuple[procs.Proc, str]:
    port, metrics_port = procs.free_ports(2)
    config_path = None
    if contender.kind == "fleetgate":
        config_path = run_dir / f"{contender.name}.yaml"
        config = cmod.fleetgate_config(
            contender,
            fleet.engines,
            scenario.seed,
            priority_classes,
            capacities=[scenario.capacity(kind) for kind, _ in fleet.engines],
            time_scale=scenario.time_scale,
        )
        config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    argv = cmod.command(
        contender,
        port=port,
        metrics_port=metrics_port,
        backends=fleet.engines,
        config_path=config_path,
        peers_root=peers_root,
    )
    proc = procs.start(
        contender.name,
        argv,
        run_dir / f"{contender.name}.log",
        env if contender.kind == "fleetgate" else None,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        procs.wait_until(
            proc, lambda: _models_ready(url), startup_s, "serving /v1/models", poll_s=0.25
        )
    except procs.ProcessError:
        proc.stop()
        raise
    return proc, url


def _models_ready(url: str) -> bool:
    try:
        resp = httpx.get(url + "/v1/models", timeout=1.0, trust_env=False)
        return resp.status_code == 200 and bool(resp.json().get("data"))
    except (httpx.HTTPError, ValueError, AttributeError):
        return False


def metrics_source(kind: str) -> MetricsSource:
    """The non-draining Prometheus source of each engine (trtllm's JSON one drains)."""
    adapter = get_adapter(kind)
    for s in adapter.metrics_sources:
        if s.format == "prometheus" and not s.drains and s.port is None:
            return s
    raise ValueError(f"{kind}: no non-draining Prometheus metrics source")


async def scrape(client: httpx.AsyncClient, engines: list[tuple[str, str]]) -> list[LoadSnapshot]:
    async def one(kind: str, url: str) -> LoadSnapshot:
        source = metrics_source(kind)
        resp = await client.get(url + source.path)
        resp.raise_for_status()
        return get_adapter(kind).parse_metrics(source, resp.content, time.monotonic(), None)

    return list(await asyncio.gather(*(one(k, u) for k, u in engines)))


def _delta(after: float | None, before: float | None) -> float | None:
    if after is None or before is None:
        return None
    return after - before


def windows(
    engines: list[tuple[str, str]], before: list[LoadSnapshot], after: list[LoadSnapshot]
) -> list[EngineWindow]:
    return [
        EngineWindow(
            kind=k,
            url=u,
            prefix_query_tokens=_delta(a.prefix_query_tokens, b.prefix_query_tokens),
            prefix_hit_tokens=_delta(a.prefix_hit_tokens, b.prefix_hit_tokens),
            generation_tokens=_delta(a.generation_tokens, b.generation_tokens),
            prompt_tokens=_delta(a.prompt_tokens, b.prompt_tokens),
            preemptions=_delta(a.preemptions, b.preemptions),
        )
        for (k, u), b, a in zip(engines, before, after, strict=True)
    ]


async def priority_mapping(
    client: httpx.AsyncClient, url: str
) -> Callable[[str], str | None] | None:
    """None when the router accepts class names; else a class -> integer level map."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "ping"}],
        "max_tokens": 1,
    }
    resp = await client.post(
        url + "/v1/chat/completions", json=body, headers={"x-fleetgate-priority": "critical"}
    )
    if resp.status_code == 400 and "integer" in resp.text:
        return lambda cls: str(CLASS_LEVELS.get(cls, 0))
    return None


_COUNTER = re.compile(
    r"^(fleetgate_(?:preemptions|resumes|resume_refed_tokens)_total)(?:\{[^}]*\})?\s+(\S+)$",
    re.M,
)


async def router_counters(client: httpx.AsyncClient, url: str) -> dict[str, float]:
    """Sums of fleetgate_preemptions / _resumes / _resume_refed_tokens, if exposed.

    ``resume_refed_tokens`` is the wasted work of preemption: generated tokens sent
    back to an engine as prompt by continuations (recomputed unless still cached).
    """
    try:
        resp = await client.get(url + "/metrics")
    except httpx.HTTPError:
        return {}
    out: dict[str, float] = {}
    for key in ("preemptions", "resumes", "resume_refed_tokens"):
        # a labelled counter shows no sample before its first increment
        if f"# TYPE fleetgate_{key}_total counter" in resp.text or (
            f"# TYPE fleetgate_{key} counter" in resp.text
        ):
            out[key] = 0.0
    for name, value in _COUNTER.findall(resp.text):
        key = name.removeprefix("fleetgate_").removesuffix("_total")
        out[key] = out.get(key, 0.0) + float(value)
    return out


_DECISION = re.compile(r"^fleetgate_decisions_total\{([^}]*)\}\s+(\S+)$", re.M)
_REASON = re.compile(r'reason="([^"]+)"')


async def _decisions(
    client: httpx.AsyncClient, url: str, contender: cmod.Contender
) -> dict[str, float]:
    if contender.kind != "fleetgate":
        return {}
    try:
        return decision_counts((await client.get(url + "/metrics")).text)
    except httpx.HTTPError:
        return {}


def decision_counts(metrics_text: str) -> dict[str, float]:
    """fleetgate's scheduling decisions by reason (``fleetgate_decisions_total``), as
    ``decisions_<reason>`` keys: how often affinity held, spilled or placed a new prefix."""
    out: dict[str, float] = {}
    for labels, value in _DECISION.findall(metrics_text):
        m = _REASON.search(labels)
        if m:
            key = "decisions_" + m.group(1).replace("-", "_")
            out[key] = out.get(key, 0.0) + float(value)
    return out


_PREEMPT_LOG = re.compile(r"\bpreempt (\S+) for \S+:")


def preempted_ids(router_log: str) -> set[str]:
    """Request ids the fleetgate router logged as preempted (``admission.py``, INFO)."""
    return set(_PREEMPT_LOG.findall(router_log))


async def twin_mismatches(
    url: str,
    scenario: Scenario,
    results: list[RequestResult],
    timeout_s: float,
    priority_header: Callable[[str], str | None] | None,
    preempted: set[str] | None = None,
    *,
    sample: int = TWIN_SAMPLE,
    max_in_flight: int = 8,
) -> dict[str, Any]:
    """Replay completed single-turn requests unloaded and compare their texts.

    Every request in ``preempted`` (ids as :func:`loadgen.request_id` makes them)
    that completed is replayed, then up to ``sample`` others (batch first),
    so ``resumed_mismatches`` covers every resumed answer the run produced.
    """
    by_id = {s.session_id: s for s in scenario.sessions()}
    done = [
        r
        for r in results
        if r.ok and r.text is not None and r.turn == 0 and len(by_id[r.session_id].turns) == 1
    ]
    resumed = preempted or set()

    def was_preempted(r: RequestResult) -> bool:
        return loadgen.request_id(r.session_id, r.turn) in resumed

    done.sort(key=lambda r: (not was_preempted(r), r.priority_class != "batch", r.sent_at))
    n_resumed = sum(1 for r in done if was_preempted(r))
    chosen = done[: n_resumed + sample]
    sessions = [dataclasses.replace(by_id[r.session_id], start_s=0.0) for r in chosen]
    twins = await loadgen.run_sessions(
        url,
        MODEL,
        sessions,
        deadline_s=timeout_s,
        max_in_flight=max_in_flight,
        keep_text=True,
        priority_header=priority_header,
    )
    twin_text = {r.session_id: r.text for r in twins if r.ok}
    compared = [r for r in chosen if r.session_id in twin_text]
    out: dict[str, Any] = {
        "twin_compared": len(compared),
        "mismatches": sum(1 for r in compared if r.text != twin_text[r.session_id]),
    }
    if preempted is not None:
        comp_resumed = [r for r in compared if was_preempted(r)]
        out["resumed_compared"] = len(comp_resumed)
        out["resumed_mismatches"] = sum(
            1 for r in comp_resumed if r.text != twin_text[r.session_id]
        )
    return out


def _no_header(_cls: str) -> str | None:
    """A class-blind contender: no ``x-fleetgate-priority`` header at all."""
    return None


@dataclasses.dataclass(frozen=True)
class Hooks:
    """What a caller (``fleetgate demo``'s progress display) may follow of a run."""

    on_phase: Callable[[str], None] | None = None
    """Called with ``starting`` (fleet and router), ``sending`` (the load begins),
    ``checking`` (the unloaded replay of answers) and ``stopping``."""
    on_send: Callable[[], None] | None = None
    """Called as each request goes out."""
    twin_sample: int = TWIN_SAMPLE
    """Answers replayed unloaded besides every preempted one."""
    twin_in_flight: int = 8
    extra_drain_s: float = 0.0
    """Wall seconds more than the default (1.5 x the traffic + 20 s) for requests to
    finish: a workload whose backlog does not shrink with the duration (``flood``)."""


def _to_model_time(results: list[RequestResult], scale: float) -> None:
    for r in results:
        r.sent_at /= scale
        if r.ttft is not None:
            r.ttft /= scale
        if r.e2e is not None:
            r.e2e /= scale
        r.itl = [g / scale for g in r.itl]


async def _drive(
    scenario: Scenario,
    contender: cmod.Contender,
    fleet: Fleet,
    router: procs.Proc,
    url: str,
    on_result: Callable[[RequestResult], None] | None,
    hooks: Hooks,
) -> tuple[list[RequestResult], list[EngineWindow], float | None, dict[str, Any]]:
    wall = scenario.duration_s * scenario.time_scale
    sessions = scenario.sessions()
    classes = any(s.priority_class for s in sessions)
    async with httpx.AsyncClient(timeout=10.0, trust_env=False) as client:
        mapping: Callable[[str], str | None] | None = None
        if not contender.classes:
            mapping = _no_header
        elif contender.kind == "fleetgate" and classes:
            mapping = await priority_mapping(client, url)
        before = await scrape(client, fleet.engines)
        counters_before = await router_counters(client, url) if classes else {}
        decisions_before = await _decisions(client, url, contender)
        cpu0, sim0, wall0 = router.cpu(), fleet.proc.cpu(), time.monotonic()
        gen0 = time.process_time()
        if hooks.on_phase is not None:
            hooks.on_phase("sending")
        results = await loadgen.run_sessions(
            url,
            MODEL,
            wall_sessions(sessions, scenario.time_scale),
            deadline_s=wall * 1.5 + 20.0 + hooks.extra_drain_s,
            send_until_s=wall,
            request_timeout_s=wall + 60.0,
            on_result=on_result,
            keep_text=classes,
            priority_header=mapping,
            on_send=hooks.on_send,
        )
        cpu1, sim1, wall1 = router.cpu(), fleet.proc.cpu(), time.monotonic()
        gen1 = time.process_time()
        after = await scrape(client, fleet.engines)
        extra: dict[str, Any] = {}
        for key, n in (await _decisions(client, url, contender)).items():
            extra[key] = n - decisions_before.get(key, 0.0)
        if sim0 is not None and sim1 is not None:
            # > ~0.8 means the emulator itself was short of CPU (time scale too small)
            extra["sim_cpu_share"] = round((sim1 - sim0) / max(wall1 - wall0, 1e-9), 3)
        # the load generator's own process (same caveat as the emulator's)
        extra["loadgen_cpu_share"] = round((gen1 - gen0) / max(wall1 - wall0, 1e-9), 3)
        if classes:
            extra["priority_header"] = (
                "class names"
                if mapping is None
                else "not sent"
                if mapping is _no_header
                else "integer levels"
            )
            counters = await router_counters(client, url)
            for key in ("preemptions", "resumes", "resume_refed_tokens"):
                if key in counters:
                    extra[key] = counters[key] - counters_before.get(key, 0.0)
            preempted = None
            if contender.kind == "fleetgate":
                preempted = preempted_ids(router.log.read_text(errors="replace"))
            if hooks.on_phase is not None:
                hooks.on_phase("checking")
            extra.update(
                await twin_mismatches(
                    url,
                    scenario,
                    results,
                    wall + 60.0,
                    mapping,
                    preempted,
                    sample=hooks.twin_sample,
                    max_in_flight=hooks.twin_in_flight,
                )
            )
    kinds: dict[str, int] = {}
    for r in results:
        if r.error is not None or r.status != 200:
            key = f"{r.status} {(r.error or '')[:80]}"
            kinds[key] = kinds.get(key, 0) + 1
    if kinds:
        extra["error_kinds"] = kinds  # JSON only: which errors, how many
    cpu = cpu1 - cpu0 if cpu0 is not None and cpu1 is not None else None
    _to_model_time(results, scenario.time_scale)
    for r in results:
        r.text = None
    return results, windows(fleet.engines, before, after), cpu, extra


def run_one(
    scenario: Scenario,
    contender: cmod.Contender,
    repeat: int,
    run_dir: Path,
    *,
    peers_root: Path | None = None,
    on_result: Callable[[RequestResult], None] | None = None,
    source: Path | None = None,
    hooks: Hooks | None = None,
) -> RunRecord:
    """One contender on one fresh fleet; a start-up failure becomes ``record.error``.

    ``source``: run the emulator and the fleetgate router from this copy of the
    package (PYTHONPATH), e.g. a ``git archive`` of a commit, so that a
    benchmark measures a fixed version while the working tree changes.
    """
    env = {"PYTHONPATH": str(source)} if source is not None else None
    run_dir.mkdir(parents=True, exist_ok=True)
    record = RunRecord(
        workload=scenario.name,
        contender=contender.name,
        repeat=repeat,
        load_factor=scenario.load_factor,
        duration_s=scenario.duration_s,
        time_scale=scenario.time_scale,
        engines=[],
        results=[],
        router_cpu_s=None,
    )
    hooks = hooks or Hooks()
    fleet: Fleet | None = None
    router: procs.Proc | None = None
    try:
        if hooks.on_phase is not None:
            hooks.on_phase("starting")
        fleet = start_fleet(scenario, run_dir, env=env)
        classes = any(s.priority_class for s in scenario.sessions())
        router, url = start_contender(
            contender, fleet, run_dir, scenario, peers_root, env=env, priority_classes=classes
        )
        results, engines, cpu, extra = asyncio.run(
            _drive(scenario, contender, fleet, router, url, on_result, hooks)
        )
        record.results, record.engines, record.router_cpu_s = results, engines, cpu
        record.extra = extra
    except (procs.ProcessError, httpx.HTTPError, OSError, ValueError) as e:
        record.error = f"{type(e).__name__}: {e}"[:300]
    finally:
        if hooks.on_phase is not None:
            hooks.on_phase("stopping")
        if router is not None:
            router.stop()
        if fleet is not None:
            fleet.proc.stop()
    return record
