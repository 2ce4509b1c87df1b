"""One benchmark run: fresh emulated fleet + one contender + the load, then stop.

``run_one(scenario, contender, repeat, ...)``:

1. writes the scenario's fleet file and starts ``fleetgate sim --fleet`` as a
   subprocess on free loopback ports (a fresh fleet per run: empty caches,
   identical engine seeds);
2. writes the contender's config (fleetgate) and starts it on a free loopback
   port (``router_replicas`` > 1: that many, behind the round-robin front of
   :mod:`fleetgate_tools.bench.rrproxy`); waits until ``GET /v1/models``
   answers 200 through it. ``fleetgate-events``: the fleet publishes KV events
   and the config is checked against the router's model first
   (:class:`EventsUnsupported` when the router does not take it);
3. (fleetgate only) probes whether the router takes priority class names in
   ``x-fleetgate-priority`` or still only integer levels, and maps classes to
   levels (critical 5, batch -5) in the latter case;
4. scrapes every engine's /metrics (adapters in ``fleetgate.engines``), reads
   the contender's CPU seconds, replays the scenario's sessions (identical for
   every contender: built from the seed), scrapes again at the end of the
   warm-up (the start of the steady window) and at the end, and reads CPU
   again; deadlines are modelled time x the time scale (:func:`deadlines`);
5. for ``priority-storm``-like workloads, reads preemption/resume counters
   from the router's /metrics if it exposes them and replays a bounded sample
   of completed requests without load ("twin run") to count mismatching texts;
6. stops the contender and the fleet (always, ``finally``).

Latencies in the returned record are modelled seconds (wall / time scale).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
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
from fleetgate_tools.bench.scenarios import (
    CALIBRATION_MODELLED_S,
    MODEL,
    Scenario,
    choose_time_scale,
    wall_sessions,
)
from fleetgate_tools.bench.stats import RequestResult, percentile
from fleetgate_tools.bench.summary import EngineWindow, RunRecord

#: Integer levels used when the router does not take class names yet.
CLASS_LEVELS = {"critical": 5, "standard": 0, "batch": -5}
TWIN_SAMPLE = 16

_ENGINE_LINE = re.compile(
    r"engine=(\S+) url=(\S+) model=(\S+)(?: kv_events=(\S+) kv_replay=(\S+))?"
)
#: Modelled seconds the load may take to drain after the last arrival (at least;
#: half the arrival window when that is longer), before ``unfinished at deadline``.
DRAIN_MODELLED_S = 10.0
#: ``--time-scale auto``: wall seconds the calibration run measures the idle CPU.
IDLE_PROBE_S = 3.0


@dataclasses.dataclass
class Fleet:
    proc: procs.Proc
    engines: list[tuple[str, str]]
    """(kind, url) in fleet order."""
    kv_events: list[tuple[str | None, str | None]] = dataclasses.field(default_factory=list)
    """Per engine, the (PUB, replay) ZeroMQ endpoints it printed (None: events off)."""


def start_fleet(
    scenario: Scenario,
    run_dir: Path,
    startup_s: float = 60.0,
    env: dict[str, str] | None = None,
    kv_events: bool = False,
) -> Fleet:
    """Start the emulated fleet; every engine binds a port the kernel picks (port 0) and
    prints its URL. Ports picked free here and bound later by the emulator could be taken
    in between: a 16-engine run with KV events lost its contender so at 1827003
    ('Address already in use')."""
    n = scenario.engines
    ports = [0] * n
    fleet_file = run_dir / "fleet.yaml"
    fleet_file.write_text(
        yaml.safe_dump(scenario.fleet_file(ports, kv_events=kv_events), sort_keys=False)
    )
    proc = procs.start(
        "fleetgate sim",
        [sys.executable, "-m", "fleetgate", "sim", "--fleet", str(fleet_file)],
        run_dir / "sim.log",
        env,
    )
    found: list[tuple[str, str]] = []
    events: list[tuple[str | None, str | None]] = []

    def ready() -> bool:
        text = proc.log.read_text(errors="replace")
        lines = list(_ENGINE_LINE.finditer(text))
        found[:] = [(m[1], m[2]) for m in lines]
        events[:] = [(m[4], m[5]) for m in lines]
        return len(found) >= n

    try:
        procs.wait_until(proc, ready, startup_s, "printing its engines")
    except procs.ProcessError:
        proc.stop()
        raise
    return Fleet(proc, list(found), list(events))


@dataclasses.dataclass
class Routers:
    """The contender: one router process, or ``replicas`` behind the round-robin front."""

    processes: list[procs.Proc]
    urls: list[str]
    """Each replica's own URL (its /metrics)."""
    url: str
    """Where the load goes: the only replica, or the front."""
    proxy: procs.Proc | None = None

    def cpu(self) -> float | None:
        values = [p.cpu() for p in self.processes]
        return None if any(v is None for v in values) else sum(v or 0.0 for v in values)

    def log_text(self) -> str:
        return "".join(p.log.read_text(errors="replace") for p in self.processes)

    def stop(self) -> None:
        if self.proxy is not None:
            self.proxy.stop()
        for p in self.processes:
            p.stop()


class EventsUnsupported(ValueError):
    """The fleetgate router under test does not take the KV-event config."""


def start_routers(
    contender: cmod.Contender,
    fleet: Fleet,
    run_dir: Path,
    scenario: Scenario,
    peers_root: Path | None,
    *,
    replicas: int = 1,
    startup_s: float = 60.0,
    env: dict[str, str] | None = None,
    priority_classes: bool = False,
) -> Routers:
    """``replicas`` processes of ``contender`` and, for more than one, the
    round-robin front (:mod:`fleetgate_tools.bench.rrproxy`) before them."""
    started: list[procs.Proc] = []
    urls: list[str] = []
    try:
        for i in range(replicas):
            proc, url = start_contender(
                contender,
                fleet,
                run_dir,
                scenario,
                peers_root,
                startup_s,
                env,
                priority_classes,
                replicas=replicas,
                index=i,
            )
            started.append(proc)
            urls.append(url)
        if replicas == 1:
            return Routers(started, urls, urls[0])
        (port,) = procs.free_ports(1)
        argv = [sys.executable, "-m", "fleetgate_tools.bench.rrproxy", "--port", str(port)]
        for u in urls:
            argv += ["--upstream", u.removeprefix("http://")]
        # the harness's own interpreter and path: ``--source`` holds only ``fleetgate``
        proxy = procs.start("rrproxy", argv, run_dir / "rrproxy.log")
        front = f"http://127.0.0.1:{port}"
        try:
            procs.wait_until(
                proxy, lambda: _models_ready(front), startup_s, "serving /v1/models", poll_s=0.25
            )
        except procs.ProcessError:
            proxy.stop()
            raise
        return Routers(started, urls, front, proxy)
    except BaseException:
        for p in started:
            p.stop()
        raise


def start_contender(
    contender: cmod.Contender,
    fleet: Fleet,
    run_dir: Path,
    scenario: Scenario,
    peers_root: Path | None,
    startup_s: float = 60.0,
    env: dict[str, str] | None = None,
    priority_classes: bool = False,
    *,
    replicas: int = 1,
    index: int = 0,
) -> tuple[procs.Proc, str]:
    port, metrics_port = procs.free_ports(2)
    config_path = None
    name = contender.name if replicas == 1 else f"{contender.name}-{index}"
    if contender.kind == "fleetgate":
        config_path = run_dir / f"{name}.yaml"
        events = None
        if contender.kv_events:
            events = [
                cmod.kv_events_backend(kind, pub, replay)
                for (kind, _), (pub, replay) in zip(fleet.engines, fleet.kv_events, strict=True)
            ]
        config = cmod.fleetgate_config(
            contender,
            fleet.engines,
            scenario.seed,
            priority_classes,
            capacities=[scenario.capacity(kind) for kind, _ in fleet.engines],
            time_scale=scenario.time_scale,
            kv_events=events,
            router_replicas=replicas,
        )
        if contender.kv_events and env is None:
            # the router in this interpreter; with --source the router's start fails
            # instead, and its log says why
            why = cmod.events_support_error(config)
            if why is not None:
                raise EventsUnsupported(why)
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
        name,
        argv,
        run_dir / f"{name}.log",
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
_SOURCE = re.compile(r'source="([^"]+)"')


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
    ``decisions_<reason>`` keys: how often affinity held, spilled or placed a new prefix;
    and by the cache view that spoke for the pick, as ``decisions_by_<source>``
    (``events``: the exact KV index; ``approximate``); with the admission queue, how
    queued requests left it (``fleetgate_queue_dispatches_total``), as
    ``queue_dispatch_<how>``."""
    out: dict[str, float] = {}
    for labels, value in _DECISION.findall(metrics_text):
        for pattern, prefix in ((_REASON, "decisions_"), (_SOURCE, "decisions_by_")):
            m = pattern.search(labels)
            if m:
                key = prefix + m.group(1).replace("-", "_")
                out[key] = out.get(key, 0.0) + float(value)
    for labels, value in _QUEUE_DISPATCH.findall(metrics_text):
        m = _HOW.search(labels)
        if m:
            key = "queue_dispatch_" + m.group(1).replace("-", "_")
            out[key] = out.get(key, 0.0) + float(value)
    for labels, value in _PRED_ERR.findall(metrics_text):
        le, source = _LE.search(labels), _SOURCE.search(labels)
        if le and source:
            key = f"{_PRED_ERR_KEY}{source.group(1)}|{le.group(1)}"
            out[key] = out.get(key, 0.0) + float(value)
    return out


_QUEUE_DISPATCH = re.compile(r"^fleetgate_queue_dispatches_total\{([^}]*)\}\s+(\S+)$", re.M)
_HOW = re.compile(r'how="([^"]+)"')
_PRED_ERR = re.compile(r"^fleetgate_cache_prediction_error_ratio_bucket\{([^}]*)\}\s+(\S+)$", re.M)
_LE = re.compile(r'le="([^"]+)"')
_PRED_ERR_KEY = "prediction_error_bucket|"


def prediction_error_medians(counts: dict[str, Any]) -> dict[str, float]:
    """Pop the prediction-error histogram buckets out of ``counts`` (cumulative counts
    over the window, from :func:`decision_counts` differences) and return the median of
    |predicted - actual cached tokens| / prompt tokens per view, as
    ``prediction_error_p50_<source>``, interpolated linearly inside its bucket (as
    Prometheus's ``histogram_quantile`` does)."""
    buckets: dict[str, list[tuple[float, float]]] = {}
    for key in [k for k in counts if k.startswith(_PRED_ERR_KEY)]:
        source, le = key.removeprefix(_PRED_ERR_KEY).split("|", 1)
        buckets.setdefault(source, []).append((float(le), float(counts.pop(key))))
    out: dict[str, float] = {}
    for source, pairs in buckets.items():
        pairs.sort()
        total = pairs[-1][1]
        if total <= 0:
            continue
        lo_edge, lo_count = 0.0, 0.0
        for edge, count in pairs:
            if count >= total / 2:
                if edge == float("inf"):
                    value = lo_edge
                elif count == lo_count:
                    value = edge
                else:
                    value = lo_edge + (edge - lo_edge) * (total / 2 - lo_count) / (count - lo_count)
                out[f"prediction_error_p50_{source}"] = round(value, 4)
                break
            lo_edge, lo_count = edge, count
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


async def _all_decisions(
    client: httpx.AsyncClient, urls: list[str], contender: cmod.Contender
) -> dict[str, float]:
    """Decision counts summed over every replica."""
    out: dict[str, float] = {}
    for u in urls:
        for key, n in (await _decisions(client, u, contender)).items():
            out[key] = out.get(key, 0.0) + n
    return out


async def _all_counters(client: httpx.AsyncClient, urls: list[str]) -> dict[str, float]:
    out: dict[str, float] = {}
    for u in urls:
        for key, n in (await router_counters(client, u)).items():
            out[key] = out.get(key, 0.0) + n
    return out


def deadlines(scenario: Scenario, extra_drain_s: float = 0.0) -> tuple[float, float, float]:
    """(arrival window, load deadline, per-request timeout) in WALL seconds.

    The drain after the last arrival is modelled time (:data:`DRAIN_MODELLED_S`
    or half the arrival window, whichever is longer) times the time scale, plus
    20 wall seconds for start-up noise: a slow emulator (a large scale) gets
    proportionally longer, so requests are not cut off for running in slow motion.
    """
    scale = scenario.time_scale
    wall = scenario.duration_s * scale
    drain = max(DRAIN_MODELLED_S, 0.5 * scenario.duration_s) * scale
    return wall, wall + drain + 20.0 + extra_drain_s, wall + drain + 60.0


async def _drive(
    scenario: Scenario,
    contender: cmod.Contender,
    fleet: Fleet,
    routers: Routers,
    on_result: Callable[[RequestResult], None] | None,
    hooks: Hooks,
    warmup_s: float = 0.0,
    idle_probe_s: float = 0.0,
) -> tuple[list[RequestResult], list[EngineWindow], float | None, dict[str, Any]]:
    wall, deadline, request_timeout = deadlines(scenario, hooks.extra_drain_s)
    url = routers.url
    sessions = scenario.sessions()
    classes = any(s.priority_class for s in sessions)
    idle_share: float | None = None
    async with httpx.AsyncClient(timeout=10.0, trust_env=False) as client:
        mapping: Callable[[str], str | None] | None = None
        if not contender.classes:
            mapping = _no_header
        elif contender.kind == "fleetgate" and classes:
            mapping = await priority_mapping(client, url)
        if idle_probe_s > 0:
            # what the processes use per WALL second without load (time-scale calibration)
            i0, s0, t_idle = routers.cpu(), fleet.proc.cpu(), time.monotonic()
            p0 = routers.proxy.cpu() if routers.proxy is not None else 0.0
            await asyncio.sleep(idle_probe_s)
            i1, s1 = routers.cpu(), fleet.proc.cpu()
            p1 = routers.proxy.cpu() if routers.proxy is not None else 0.0
            if None not in (i0, i1, s0, s1, p0, p1):
                idle_cpu = (i1 or 0) - (i0 or 0) + (s1 or 0) - (s0 or 0) + (p1 or 0) - (p0 or 0)
                idle_share = idle_cpu / (time.monotonic() - t_idle) / (os.cpu_count() or 1)
        before = await scrape(client, fleet.engines)
        counters_before = await _all_counters(client, routers.urls) if classes else {}
        decisions_before = await _all_decisions(client, routers.urls, contender)
        cpu0, sim0, wall0 = routers.cpu(), fleet.proc.cpu(), time.monotonic()
        proxy0 = routers.proxy.cpu() if routers.proxy is not None else None
        gen0 = time.process_time()
        if hooks.on_phase is not None:
            hooks.on_phase("sending")
        warm: asyncio.Task[tuple[list[LoadSnapshot], dict[str, float]]] | None = None
        if warmup_s > 0:

            async def at_warmup() -> tuple[list[LoadSnapshot], dict[str, float]]:
                # the engines' counters at the end of the warm-up start the steady window
                await asyncio.sleep(warmup_s * scenario.time_scale)
                return (
                    await scrape(client, fleet.engines),
                    await _all_decisions(client, routers.urls, contender),
                )

            warm = asyncio.create_task(at_warmup())
        try:
            results = await loadgen.run_sessions(
                url,
                MODEL,
                wall_sessions(sessions, scenario.time_scale),
                deadline_s=deadline,
                send_until_s=wall,
                request_timeout_s=request_timeout,
                on_result=on_result,
                keep_text=classes,
                priority_header=mapping,
                on_send=hooks.on_send,
            )
        finally:
            if warm is not None and not warm.done():
                # the load ended before the warm-up did (every session finished early)
                warm.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await warm
        warmup_scraped = warm is not None and not warm.cancelled()
        if warm is not None and warmup_scraped:
            before, decisions_before = warm.result()
        cpu1, sim1, wall1 = routers.cpu(), fleet.proc.cpu(), time.monotonic()
        proxy1 = routers.proxy.cpu() if routers.proxy is not None else None
        gen1 = time.process_time()
        after = await scrape(client, fleet.engines)
        extra: dict[str, Any] = {}
        for key, n in (await _all_decisions(client, routers.urls, contender)).items():
            extra[key] = n - decisions_before.get(key, 0.0)
        extra.update(prediction_error_medians(extra))
        elapsed = max(wall1 - wall0, 1e-9)
        extra["wall_s"] = round(elapsed, 2)
        extra["router_replicas"] = len(routers.processes)
        if warm is not None and not warmup_scraped:
            extra["warmup_scrape"] = "missed: counters cover the whole run"
        used = gen1 - gen0
        if sim0 is not None and sim1 is not None:
            # > ~0.8 means the emulator itself was short of CPU (time scale too small)
            extra["sim_cpu_share"] = round((sim1 - sim0) / elapsed, 3)
            used += sim1 - sim0
        # the load generator's own process (same caveat as the emulator's)
        extra["loadgen_cpu_share"] = round((gen1 - gen0) / elapsed, 3)
        if cpu0 is not None and cpu1 is not None:
            extra["router_cpu_share"] = round((cpu1 - cpu0) / elapsed, 3)
            used += cpu1 - cpu0
        if proxy0 is not None and proxy1 is not None:
            extra["proxy_cpu_s"] = round(proxy1 - proxy0, 2)
            used += proxy1 - proxy0
        # every process of the run together, as a share of the machine
        extra["machine_cpu_share"] = round(used / elapsed / (os.cpu_count() or 1), 3)
        extra["cpu_seconds"] = round(used, 2)
        if idle_share is not None:
            extra["idle_machine_cpu_share"] = round(idle_share, 4)
        if classes:
            extra["priority_header"] = (
                "class names"
                if mapping is None
                else "not sent"
                if mapping is _no_header
                else "integer levels"
            )
            counters = await _all_counters(client, routers.urls)
            for key in ("preemptions", "resumes", "resume_refed_tokens"):
                if key in counters:
                    extra[key] = counters[key] - counters_before.get(key, 0.0)
            preempted = None
            if contender.kind == "fleetgate":
                preempted = preempted_ids(routers.log_text())
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


def empty_record(
    scenario: Scenario,
    contender: str,
    repeat: int,
    warmup_s: float,
    workload: str | None = None,
    error: str | None = None,
) -> RunRecord:
    """The record of one run before it has results (``workload``: the scenario's name)."""
    return RunRecord(
        workload=workload or scenario.name,
        contender=contender,
        repeat=repeat,
        load_factor=scenario.load_factor,
        duration_s=scenario.duration_s,
        time_scale=scenario.time_scale,
        engines=[],
        results=[],
        router_cpu_s=None,
        error=error,
        warmup_s=warmup_s,
    )


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
    warmup_s: float = 0.0,
    router_replicas: int = 1,
    idle_probe_s: float = 0.0,
) -> RunRecord:
    """One contender on one fresh fleet; a start-up failure becomes ``record.error``.

    ``source``: run the emulator and the fleetgate router from this copy of the
    package (PYTHONPATH), e.g. a ``git archive`` of a commit, so that a
    benchmark measures a fixed version while the working tree changes.
    ``warmup_s``: modelled seconds at the start left out of the figures.
    ``router_replicas``: that many contender processes behind the round-robin front.
    ``idle_probe_s``: first measure the processes' CPU for that many wall seconds
    without load (``extra["idle_machine_cpu_share"]``).
    """
    if not 0 <= warmup_s < scenario.duration_s:
        raise ValueError("the warm-up must be shorter than the arrival window")
    env = {"PYTHONPATH": str(source)} if source is not None else None
    run_dir.mkdir(parents=True, exist_ok=True)
    record = empty_record(scenario, contender.name, repeat, warmup_s)
    hooks = hooks or Hooks()
    fleet: Fleet | None = None
    routers: Routers | None = None
    try:
        if hooks.on_phase is not None:
            hooks.on_phase("starting")
        fleet = start_fleet(scenario, run_dir, env=env, kv_events=contender.kv_events)
        classes = any(s.priority_class for s in scenario.sessions())
        routers = start_routers(
            contender,
            fleet,
            run_dir,
            scenario,
            peers_root,
            replicas=router_replicas,
            env=env,
            priority_classes=classes,
        )
        results, engines, cpu, extra = asyncio.run(
            _drive(scenario, contender, fleet, routers, on_result, hooks, warmup_s, idle_probe_s)
        )
        record.results, record.engines, record.router_cpu_s = results, engines, cpu
        record.extra = extra
    except (procs.ProcessError, httpx.HTTPError, OSError, ValueError) as e:
        record.error = f"{type(e).__name__}: {e}"[:600]
    finally:
        if hooks.on_phase is not None:
            hooks.on_phase("stopping")
        if routers is not None:
            routers.stop()
        if fleet is not None:
            fleet.proc.stop()
    return record


def calibrate_time_scale(
    scenario: Scenario,
    contender: cmod.Contender,
    run_dir: Path,
    *,
    peers_root: Path | None = None,
    source: Path | None = None,
    router_replicas: int = 1,
) -> tuple[float, dict[str, Any]]:
    """``--time-scale auto``: a short run of ``scenario`` (its own time scale, the
    first :data:`~fleetgate_tools.bench.scenarios.CALIBRATION_MODELLED_S` modelled
    seconds) measures the CPU of every process of the run; the chosen scale keeps
    them under :data:`~fleetgate_tools.bench.scenarios.TARGET_CPU_SHARE` of the
    machine (:func:`~fleetgate_tools.bench.scenarios.choose_time_scale`)."""
    short = dataclasses.replace(
        scenario, duration_s=min(scenario.duration_s, CALIBRATION_MODELLED_S)
    )
    rec = run_one(
        short,
        contender,
        0,
        run_dir,
        peers_root=peers_root,
        source=source,
        router_replicas=router_replicas,
        idle_probe_s=IDLE_PROBE_S,
    )
    if rec.error is not None:
        raise ValueError(f"time-scale calibration with {contender.name} failed: {rec.error}")
    used, wall = rec.extra.get("cpu_seconds"), rec.extra.get("wall_s")
    if not used or not wall:
        raise ValueError("time-scale calibration measured no CPU")
    cores = os.cpu_count() or 1
    # CPU over the ARRIVAL window (not the drain after it, when little runs): the
    # share while the load is on, a little high rather than low
    window = min(float(wall), short.duration_s * short.time_scale)
    idle = float(rec.extra.get("idle_machine_cpu_share", 0.0))
    scale = choose_time_scale(short.time_scale, float(used), window, cores, idle_share=idle)
    return scale, {
        "calibration_scale": short.time_scale,
        "calibration_modelled_s": short.duration_s,
        "calibration_wall_s": round(window, 2),
        "calibration_cpu_s": used,
        "cores": cores,
        "idle_machine_cpu_share": idle,
        "chosen_scale": scale,
        # to compare with the real run's: latencies should not depend on the scale
        "calibration_ttft_p90": percentile([r.ttft for r in rec.results if r.ok and r.ttft], 90),
    }
