"""A day-shaped trace, shortened, through the router on the dev cluster (issue 15, 4).

    FLEETGATE_TEST_MODE=1 python bench/bench_autoscale.py [--scale 1.0] [--base-rate 1.0]
        [--contenders fleetgate-autoscale,static-peak,hpa-prometheus] [--pool vllm|mixed]
        [--seed 0] [--max-num-seqs 8] [--target-in-flight 4] [--min-replicas 0 [--warm-start]]
        [--hpa-metric vllm_num_requests_in_flight] [--hpa-target 4] [--hpa-sync-period 15]
        [--json OUT.json] [--plot OUT.png]

A real control plane (the dev cluster: etcd, kube-apiserver, controller manager,
scheduler, kwok), the operator and the router as ``fleetgate`` processes, and the
pod-engine launcher (tools/fleetgate_tools/devcluster/podengines.py) running an
emulated engine of the pod's kind on each kwok pod's IP after a modelled cold start
(counted from the pod's first listing). Per contender, a fresh namespace and, with
``--pool vllm`` (the default), one InferenceService (model ``llama-3.1-8b``,
``maxNumSeqs: --max-num-seqs``, 8 by default):

* ``fleetgate-autoscale``: ``spec.autoscaling`` {minReplicas ``--min-replicas`` (0),
  maxReplicas ``--peak-replicas``, targetInFlightPerReplica ``--target-in-flight`` (4),
  scaleToZeroAfterSeconds, coldStartSeconds}; it starts at minReplicas (with 0, the
  trace's cold request waits for zero; with 1, as the HPA, it meets a warm replica);
  ``--warm-start`` with minReplicas 0: one request before the trace wakes it, so the
  trace starts on one warm replica as the HPA's does (a day's quiet hours follow
  served traffic), and the idle phase scales it to zero before the cold request;
* ``static-peak``: ``replicas: --peak-replicas`` (sized for the peak), every engine
  up before the trace starts;
* ``hpa-prometheus``: the setup the ecosystem documents today. No ``spec.autoscaling``:
  Debian's Prometheus scrapes the engine pods' ``/metrics`` every second,
  prometheus-adapter (built from its Go module) serves ``--hpa-metric`` per pod as a
  custom metric, and an ``autoscaling/v2`` HPA on the InferenceService's scale
  subresource targets ``--hpa-target`` as an average per pod (default: vLLM's
  ``num_requests_running + num_requests_waiting``, 4 per replica, fleetgate's target;
  the queue alone, ``vllm_num_requests_waiting``, stays at 0 behind this router, which
  queues requests itself instead of overfilling an engine), minReplicas 1 (the HPA cannot scale to
  zero without the alpha HPAScaleToZero feature gate), maxReplicas ``--peak-replicas``,
  the same scale-down window as fleetgate's, the HPA's default scale-up policy; the
  HPA controller syncs every ``--hpa-sync-period`` seconds (default 15, the
  controller's documented default).
  tools/fleetgate_tools/devcluster/metricsstack.py; the dev cluster then serves
  aggregated APIs.

* ``timetable``: ``replicas`` set through the scale subresource at the trace times of
  ``--timetable`` (from ``--min-replicas``), e.g. the clairvoyant schedule the run prints
  (fleetgate_tools.bench.autoscale_oracle): does the simulated router's verdict hold on
  the cluster?

What each HPA setting means for fairness: the in-flight metric (running + waiting per
pod) is the one signal of vLLM's that grows behind this router, and its target equals
fleetgate's ``targetInFlightPerReplica``, so both aim at the same load per replica
(the engine's metric stops at its slots, since the router queues the rest itself,
so the target must be below ``--max-num-seqs`` or the HPA never scales up; the
bench refuses such a run); the
queue alone (what vendors document) never scales here and would only show the HPA
idle. The 15 s sync period is what a stock cluster runs: the HPA reacts up to 15 s
(plus Prometheus' 1 s scrape and the adapter's query) after the load moves, where
fleetgate's operator decides every second on the routers' own counters; that is the
architecture compared, not a handicap added by the bench. ``--hpa-sync-period 1``
shows the HPA at its fastest (a setting few clusters run: every HPA of the cluster
then queries the metrics API every second). minReplicas 1 gives the HPA a warm pod
all along, which costs it replica-seconds in the quiet and idle phases and spares it
the cold start from zero that fleetgate pays.

``--max-num-seqs`` sizes every engine's batch: with 8 slots one emulated engine (the
``vllm-llama8b-h100`` profile, ~0.4 s for 64 tokens) serves ~19 requests/s, so at
``--base-rate 3`` (peak ~16/s) a single replica meets the objectives and no
autoscaler has anything to do. A heavier trace needs fewer slots or more arrivals
(docs/bench.md names the setting that makes one replica miss and the peak replicas
meet).

With ``--pool mixed``, two InferenceServices of the same model in one routing pool:
``chat-trt`` (TensorRT-LLM 1.3, ``maxBatchSize: 8``, ``routing.role: latency``) and
``chat-vllm`` (vLLM, ``maxNumSeqs: 8``, role ``throughput``); the operator runs with
``--class-role standard=throughput``, so ``critical`` demand grows the TensorRT-LLM
service and ``standard`` the vLLM one (fleetgate/operator/pools.py), and the router's
``engine-speed`` scorer sends critical requests (priority 8) to the faster engine
(the emulated TensorRT-LLM decodes ~30% faster than vLLM). fleetgate-autoscale: each
``minReplicas 0``, ``maxReplicas --peak-replicas``; static-peak: ``ceil(N/3)``
TensorRT-LLM and ``N - ceil(N/3)`` vLLM replicas (N = ``--peak-replicas``, the same
pods as the all-vLLM static); hpa-prometheus: an HPA on each service, each on its
engine's metric (``--hpa-metric`` as TensorRT-LLM names it for ``chat-trt``:
``trtllm_num_requests_running + trtllm_num_requests_waiting`` from its
``/prometheus/metrics``, 1.3 and later), minReplicas 1 each; ``--warm-start`` wakes
both services (a critical and a standard request) and starts the trace once one
replica is healthy; ``--pool-consolidation`` runs the operator with that option (the
roles share their replicas: the latency role's room counts for the throughput role,
and one role serves both while demand is low); ``--pool-gpu-budget N`` gives the
operator a budget of N GPUs for the pool (one per replica: fleetgate-autoscale's
services together never ask more than N replicas; the latency role is served first).

The trace (durations x ``--scale``; open loop, Poisson arrivals, seeded):
quiet (base rate) 40 s, ramp (base -> 5 x base) 30 s, peak (5 x base, plus a burst of
8 critical requests every 10 s) 40 s, idle 30 s (long enough to scale to zero), then
one cold request. Requests are streamed chats, 64 output tokens, 80% ``standard`` and
20% ``critical`` (``x-fleetgate-priority``), plus the critical bursts.

Reported per contender: replica-seconds (live engine pods integrated over the trace),
TTFT-objective attainment and TTFT p50/p90/p99 per class (the router's default objectives: critical
0.5 s, standard 2 s; the cold request counted apart), failed requests (non-200 or an
incomplete stream), the cold request's TTFT, and a plot of replicas, demand (requests
in flight at the client) and TTFT over time; the cold request's path (request to the
pod's first listing, the modelled cold start, engine bound to first token) from the
launcher's log; per class, the share of requests each engine kind served. The cold
request of ``hpa-prometheus`` meets at least one warm replica (it never scales to
zero), so it is no cold start. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import math
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))

from fleetgate_tools.bench import autoscale_loop, autoscale_oracle  # noqa: E402 - after the path
from fleetgate_tools.bench.daytrace import Arrival, Phase, arrivals, trace  # noqa: E402
from fleetgate_tools.devcluster import (  # noqa: E402
    FAKE_NODE_TOLERATION,
    ClusterConfig,
    DevCluster,
    ensure_binaries,
    running_cluster,
)
from fleetgate_tools.devcluster.metricsstack import (  # noqa: E402
    ENGINE_METRICS,
    MetricsStack,
    ensure_adapter,
    hpa,
)

FLEETGATE = str(Path(sys.executable).parent / "fleetgate")
MODEL = "llama-3.1-8b"
NAME = "chat"
#: the router's default TTFT objectives per class (critical 0.5 s, standard 2 s)
OBJECTIVE_S = autoscale_oracle.OBJECTIVES_S
CONTENDERS = ("fleetgate-autoscale", "static-peak", "hpa-prometheus", "timetable")
POOLS = ("vllm", "mixed")
#: every engine pod of the bench's services (the operator labels them with their pool)
POD_SELECTOR = "fleetgate.dev/pool"


@dataclass
class Outcome:
    sent_s: float
    cls: str
    phase: str
    status: int
    ttft_s: float | None
    done_s: float
    error: str | None
    endpoint: str = ""
    """``x-fleetgate-endpoint``: ``namespace/pod`` of the engine that served it."""


async def one_request(
    client: httpx.AsyncClient, router: str, a: Arrival, t0: float, i: int
) -> Outcome:
    prompt = f"request {i} ({a.phase}): hello"
    body = {"model": MODEL, "stream": True, "max_tokens": 64, "ignore_eos": True,
            "messages": [{"role": "user", "content": prompt}]}  # fmt: skip
    sent = time.monotonic()
    ttft, status, error, endpoint = None, 0, None, ""
    try:
        async with client.stream(
            "POST", f"{router}/v1/chat/completions", json=body,
            headers={"x-fleetgate-priority": a.cls},
        ) as r:  # fmt: skip
            status = r.status_code
            endpoint = r.headers.get("x-fleetgate-endpoint", "")
            if status != 200:
                error = f"HTTP {status}"
                detail = (await r.aread()).decode(errors="replace")[:200]
                if a.phase == "warm":  # no trace request: say why it failed
                    error += f": {detail}"
            else:
                done = False
                async for line in r.aiter_lines():
                    if line == "data: [DONE]":
                        done = True
                    elif line.startswith("data: ") and ttft is None and '"content"' in line:
                        ttft = time.monotonic() - sent
                    elif line.startswith("data: ") and '"error"' in line:
                        error = "in-band error"
                if not done and error is None:
                    error = "incomplete stream"
    except httpx.HTTPError as e:
        error = type(e).__name__
    return Outcome(sent - t0, a.cls, a.phase, status, ttft, time.monotonic() - t0, error, endpoint)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Setup:
    """Router, operator and pod engines for one contender, as processes we started."""

    cluster: DevCluster
    ns: str
    work: Path
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        with open(self.work / f"{name}.log", "wb") as log:
            self.procs.append(subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                env={**os.environ, "FLEETGATE_TEST_MODE": "1", **(env or {})},
            ))  # fmt: skip

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(5)

    def live_pods(self) -> tuple[int, int]:
        """Live engine pods: all of them, and the TensorRT-LLM ones among them."""
        pods = self.cluster.kubectl_json("-n", self.ns, "get", "pods", "-l", POD_SELECTOR)["items"]
        live = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
        trt = [p for p in live if p["metadata"]["labels"].get("fleetgate.dev/engine") == "trtllm"]
        return len(live), len(trt)


def hpa_status(cluster: Any, ns: str, name: str) -> tuple[str | None, int | None, str | None]:
    """An HPA's last metric reading (per-pod average), desired replicas and last scale
    time, from its status."""
    st = cluster.kubectl_json("-n", ns, "get", "hpa", name).get("status", {})
    current = None
    for m in st.get("currentMetrics") or []:
        current = ((m.get("pods") or {}).get("current") or {}).get("averageValue")
    return current, st.get("desiredReplicas"), st.get("lastScaleTime")


def service_events(cluster: Any, ns: str, t0_wall: float) -> list[tuple[float, str, str, str]]:
    """The Events on the namespace's InferenceServices (the operator's decisions:
    ``ScaledUp``, ``ScaledDown``, ``Draining``, ``ScaleUpLimited``, ...) as (seconds
    since the trace started, service, reason, message), oldest first."""
    out = []
    for ev in cluster.kubectl_json("-n", ns, "get", "events").get("items", []):
        obj = ev.get("involvedObject") or {}
        stamp = ev.get("lastTimestamp") or ev.get("eventTime")
        if obj.get("kind") != "InferenceService" or not stamp:
            continue
        when = dt.datetime.fromisoformat(str(stamp).replace("Z", "+00:00")).timestamp()
        out.append((round(when - t0_wall, 1), str(obj.get("name")), str(ev.get("reason")),
                    str(ev.get("message"))))  # fmt: skip
    return sorted(out)


def engine_spec(kind: str, slots: int) -> tuple[dict[str, Any], str]:
    """The CRD engine block and routing role of a bench service of engine ``kind``,
    ``slots`` sequences per batch (vLLM ``maxNumSeqs``, TensorRT-LLM ``maxBatchSize``)."""
    if kind == "vllm":
        return ({"type": "vllm", "image": "vllm/vllm-openai:v0.32.0",
                 "vllm": {"maxNumSeqs": slots}}, "throughput")  # fmt: skip
    if kind == "trtllm":
        # 1.3: the release line whose /prometheus/metrics has the queue gauges the
        # hpa-prometheus contender scales on (and whose requests carry a priority)
        return ({"type": "tensorrt-llm", "image": "nvcr.io/nvidia/tensorrt-llm/release:1.3.0",
                 "tensorrtLlm": {"maxBatchSize": slots}}, "latency")  # fmt: skip
    raise ValueError(f"unknown engine kind {kind!r}")


def service_replicas(pool: str, peak: int) -> dict[str, tuple[str, int]]:
    """Service name -> (engine kind, static replicas) of a pool; the mixed static pool
    has as many pods as the all-vLLM one, a third (rounded up) on TensorRT-LLM."""
    if pool == "vllm":
        return {NAME: ("vllm", peak)}
    trt = math.ceil(peak / 3)
    return {f"{NAME}-trt": ("trtllm", trt), f"{NAME}-vllm": ("vllm", max(1, peak - trt))}


def hpa_metric_for(kind: str, metric: str) -> str:
    """``--hpa-metric`` (named as vLLM's) as engine ``kind`` publishes it:
    ``vllm_num_requests_in_flight`` -> ``trtllm_num_requests_in_flight``."""
    return f"{kind}_{metric.removeprefix('vllm_')}"


def inference_services(ns: str, contender: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    out = []
    for name, (kind, static) in service_replicas(args.pool, args.peak_replicas).items():
        engine, role = engine_spec(kind, args.max_num_seqs)
        spec: dict[str, Any] = {
            "model": {"uri": "hf://bench/chat", "name": MODEL},
            "engine": engine,
            # one service alone takes all the model's demand whatever its role
            "routing": {"pool": "default", "role": role if args.pool == "mixed" else "latency"},
        }
        cold = args.cold_start if kind == "vllm" else args.trtllm_cold_start
        if contender == "fleetgate-autoscale":
            spec["replicas"] = args.min_replicas
            spec["autoscaling"] = {
                "minReplicas": args.min_replicas, "maxReplicas": args.peak_replicas,
                "targetInFlightPerReplica": args.target_in_flight,
                "scaleDownStabilizationSeconds": max(1, round(10 * args.scale)),
                "scaleToZeroAfterSeconds": max(1, round(15 * args.scale)),
                "coldStartSeconds": max(1, round(cold + 1)), "drainTimeoutSeconds": 60,
            }  # fmt: skip
            if args.min_replicas > 0:  # the CRD refuses scale-to-zero settings then
                del spec["autoscaling"]["scaleToZeroAfterSeconds"]
        elif contender == "hpa-prometheus":
            spec["replicas"] = 1  # the HPA's minReplicas; it owns spec.replicas from then on
        elif contender == "timetable":
            spec["replicas"] = args.min_replicas  # then --timetable, by hand
        else:
            spec["replicas"] = static
        out.append({"apiVersion": "fleetgate.dev/v1alpha1", "kind": "InferenceService",
                    "metadata": {"name": name, "namespace": ns}, "spec": spec})  # fmt: skip
    return out


def launcher_starts(log: Path) -> list[dict[str, Any]]:
    """The pod-engine launcher's ``start`` events (one JSON object a line)."""
    out = []
    for line in log.read_text(errors="replace").splitlines():
        with contextlib.suppress(ValueError):
            event = json.loads(line)
            if isinstance(event, dict) and event.get("event") == "start":
                out.append(event)
    return out


async def wait_until(probe: Any, within: float, what: str) -> None:
    deadline = time.monotonic() + within
    while not await probe():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        await asyncio.sleep(0.3)


async def run_contender(
    cluster: DevCluster, contender: str, args: argparse.Namespace, work: Path
) -> dict[str, Any]:
    ns = f"bench-{uuid.uuid4().hex[:8]}"
    cluster.kubectl("create", "namespace", ns)
    setup = Setup(cluster, ns, work)
    stack = MetricsStack(cluster, [ns], work / "metrics") if contender == "hpa-prometheus" else None
    port = free_port()
    router = f"http://127.0.0.1:{port}"
    config = {
        "test_mode": True,
        "discovery": {"kind": "kubernetes", "kubernetes": {
            "source": "pods", "namespaces": [ns], "kubeconfig": str(cluster.kubeconfig)}},
        "priority": {},
        "limits": {"hold_cold_start_factor": 5},
    }  # fmt: skip
    (work / "router.yaml").write_text(yaml.safe_dump(config))
    rng = random.Random(args.seed)
    plan = arrivals(trace(args.scale, args.base_rate), rng)
    samples: list[tuple[float, int, int, int]] = []  # t, live pods, in flight, TRT-LLM pods
    # hpa-prometheus: each change of an HPA's status (t, the metric's per-pod average it
    # last read, desired replicas, its last scale time, the service it scales): when it
    # synced and what it saw
    hpa_log: list[tuple[float, str | None, int | None, str | None, str]] = []
    # fleetgate-autoscale: the operator's Events on the services (t, service, reason,
    # message), read once after the trace (no polling during it)
    operator_events: list[tuple[float, str, str, str]] = []
    t0_wall: float | None = None
    services = service_replicas(args.pool, args.peak_replicas)
    outcomes: list[Outcome] = []
    in_flight = 0
    try:
        setup.start("router", [FLEETGATE, "router", "--config", str(work / "router.yaml"),
                               "--port", str(port), "--host", "127.0.0.1"])  # fmt: skip
        setup.start(
            "operator",
            [FLEETGATE, "operator", "--kubeconfig", str(cluster.kubeconfig), "--namespace", ns,
             "--metrics-host", "127.0.0.1", "--metrics-port", "0", "--interval", "5",
             "--autoscale-interval", "1", "--router-metrics-url", f"{router}/metrics",
             *(["--class-role", "standard=throughput"] if args.pool == "mixed" else []),
             *(["--pool-consolidation"] if args.pool_consolidation else []),
             *(["--pool-gpu-budget", f"default={args.pool_gpu_budget}"]
               if args.pool_gpu_budget is not None else [])],
            env={"FLEETGATE_EXTRA_TOLERATIONS": json.dumps([FAKE_NODE_TOLERATION])},
        )  # fmt: skip
        setup.start(
            "podengines",
            [sys.executable, "-m", "fleetgate_tools.devcluster.podengines",
             "--kubeconfig", str(cluster.kubeconfig), "--namespace", ns,
             "--selector", POD_SELECTOR, "--cold-start", f"vllm={args.cold_start}",
             "--cold-start", f"trtllm={args.trtllm_cold_start}",
             "--logs", str(work / "engines")],
            env={"PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'tools'}"},
        )  # fmt: skip
        if stack is not None:
            stack.start()
        cluster.apply(*inference_services(ns, contender, args))
        if stack is not None:
            # one HPA per InferenceService, on its own engine's metric
            for name, (kind, _) in services.items():
                target = {"apiVersion": "fleetgate.dev/v1alpha1", "kind": "InferenceService",
                          "name": name}  # fmt: skip
                cluster.apply(hpa(
                    name, ns, target, metric=hpa_metric_for(kind, args.hpa_metric),
                    average_value=args.hpa_target, min_replicas=1,
                    max_replicas=args.peak_replicas,
                    scale_down_stabilization_s=max(1, round(10 * args.scale)),
                ))  # fmt: skip
        limits = httpx.Limits(max_connections=256)
        async with httpx.AsyncClient(timeout=120, limits=limits, trust_env=False) as client:

            async def healthy(n: int) -> bool:
                with contextlib.suppress(httpx.HTTPError):
                    text = (await client.get(f"{router}/metrics")).text
                    up = [
                        ln
                        for ln in text.splitlines()
                        if ln.startswith("fleetgate_endpoint_healthy{") and ln.endswith(" 1.0")
                    ]
                    return len(up) >= n  # fmt: skip
                return False

            statics = services.values()
            # every contender starts the trace with its starting replicas healthy (the
            # router holds requests only for a service scaling from zero)
            floor = args.min_replicas * len(services)
            want = {"fleetgate-autoscale": floor, "timetable": floor,
                    "hpa-prometheus": len(services)}.get(
                contender, sum(n for _, n in statics)
            )  # fmt: skip
            if contender == "fleetgate-autoscale" and args.warm_start and not want:
                # a day's quiet hours follow served traffic: a request of each class
                # wakes the services from zero (not counted; in the mixed pool critical
                # wakes the latency role, standard the throughput one), and the trace
                # starts on warm replicas, as the HPA's does; the idle phase still
                # scales them to zero
                await wait_until(lambda: healthy(0), 60, "router up")
                classes = ("critical", "standard") if args.pool == "mixed" else ("standard",)

                async def wake(cls: str) -> Outcome:
                    # the router holds a critical request 10 s at most (its class's
                    # queue bound), less than the cold start: a 503 says retry later,
                    # and the client does, as its Retry-After asks
                    for _ in range(6):
                        w = await one_request(client, router, Arrival(0, cls, "warm"), 0, -2)
                        if not (w.error or "").startswith("HTTP 503"):
                            break
                        await asyncio.sleep(1.0)
                    return w

                warm = await asyncio.gather(*(wake(cls) for cls in classes))
                failed = [w.error for w in warm if w.error is not None]
                if failed:
                    raise RuntimeError(f"a warm-up request failed: {failed}")
                # one replica serves now; in the mixed pool whether the other role's
                # stays (or drains, its classes served by the first) is the autoscaler's
                want = 1
            if want:
                await wait_until(lambda: healthy(want), 120, "starting replicas healthy")
            else:
                await wait_until(lambda: healthy(0), 60, "router up")
            t0, t0_wall = time.monotonic(), time.time()
            stop = asyncio.Event()

            async def sampler() -> None:
                while not stop.is_set():
                    with contextlib.suppress(Exception):
                        live, trt = await asyncio.to_thread(setup.live_pods)
                        samples.append((time.monotonic() - t0, live, in_flight, trt))
                    for name in services if stack is not None else ():
                        with contextlib.suppress(Exception):
                            seen = await asyncio.to_thread(hpa_status, cluster, ns, name)
                            last = [h for h in hpa_log if h[4] == name][-1:]
                            if not last or last[0][1:4] != seen:
                                hpa_log.append((time.monotonic() - t0, *seen, name))
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), 1.0)

            async def fire(a: Arrival, i: int) -> None:
                nonlocal in_flight
                await asyncio.sleep(max(0.0, t0 + a.t - time.monotonic()))
                in_flight += 1
                try:
                    outcomes.append(await one_request(client, router, a, t0, i))
                finally:
                    in_flight -= 1

            async def timetable() -> None:
                for at, n in args.timetable:
                    await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
                    # the scale subresource, as a person or an HPA would
                    await asyncio.to_thread(
                        cluster.kubectl, "-n", ns, "scale", "inferenceservice", NAME,
                        f"--replicas={n}",
                    )  # fmt: skip

            sampling = asyncio.get_running_loop().create_task(sampler())
            if contender == "timetable":
                scaling = asyncio.get_running_loop().create_task(timetable())
            await asyncio.gather(*(fire(a, i) for i, a in enumerate(plan)))
            end = sum(p.seconds for p in trace(args.scale, args.base_rate))
            await asyncio.sleep(max(0.0, t0 + end - time.monotonic()))
            # the cold request: at zero replicas for fleetgate (it must have got there)
            if contender == "fleetgate-autoscale" and args.min_replicas == 0:
                with contextlib.suppress(TimeoutError):
                    await wait_until(
                        lambda: asyncio.to_thread(lambda: setup.live_pods()[0] == 0), 60, "zero"
                    )
            cold_sent = time.time()
            outcomes.append(
                await one_request(client, router, Arrival(0, "standard", "cold"), t0, -1)
            )
            await asyncio.sleep(1.0)
            stop.set()
            await sampling
            if contender == "timetable":
                await scaling
            arrivals_text = (await client.get(f"{router}/metrics")).text
    finally:
        if contender == "fleetgate-autoscale" and t0_wall is not None:
            with contextlib.suppress(Exception):
                operator_events = service_events(cluster, ns, t0_wall)
        if stack is not None:
            hpa_obj = cluster.kubectl("-n", ns, "describe", "hpa", check=False).stdout
            (work / "hpa.txt").write_text(hpa_obj)
            stack.stop()
        setup.stop()
        cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)
    result = summarise(contender, outcomes, samples, arrivals_text, end)
    if stack is not None:
        result["hpa_status"] = hpa_log
    if contender == "fleetgate-autoscale":
        result["operator_events"] = operator_events
    result["cold_request"].update(cold_path(result["cold_request"], cold_sent, work))
    return result


def cold_path(cold: dict[str, Any], sent: float, work: Path) -> dict[str, Any]:
    """Where the cold request's TTFT went, from the launcher's first engine start after
    it was sent: request -> the pod first listed (operator decision, Deployment and
    ReplicaSet controllers, the launcher's poll), the modelled cold start, engine bound
    -> first token (the router's probe and dispatch, the engine's first token)."""
    starts = [e for e in launcher_starts(work / "podengines.log") if e["first_seen"] >= sent]
    if not starts or cold["ttft_s"] is None:
        return {}
    first = min(starts, key=lambda e: e["bind_at"])
    return {
        "engine": first["engine"],
        "modelled_cold_start_s": first["cold_start_s"],
        "to_pod_listed_s": round(first["first_seen"] - sent, 3),
        "bound_to_first_token_s": round(sent + cold["ttft_s"] - first["bind_at"], 3),
        "ttft_over_cold_start": round(cold["ttft_s"] / first["cold_start_s"], 3)
        if first["cold_start_s"]
        else None,
    }


def engine_kind(endpoint: str) -> str:
    """``ns/chat-trt-...`` -> ``trtllm``; every other pod of the bench is vLLM."""
    return "trtllm" if endpoint.split("/", 1)[-1].startswith(f"{NAME}-trt-") else "vllm"


PERCENTILES = (50, 90, 99)


def percentiles(values: list[float], qs: tuple[int, ...] = PERCENTILES) -> dict[str, float | None]:
    """Nearest-rank percentiles (``p50`` ...) of ``values``; ``inf`` (a request without a
    first token) ranks last and reads as None; None for no values."""
    ordered = sorted(values)
    out: dict[str, float | None] = {}
    for q in qs:
        if not ordered:
            out[f"p{q}"] = None
            continue
        v = ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]
        out[f"p{q}"] = None if math.isinf(v) else round(v, 4)
    return out


def summarise(
    contender: str,
    outcomes: list[Outcome],
    samples: list[tuple[float, int, int, int]],
    metrics: str,
    horizon_s: float,
) -> dict[str, Any]:
    """Replica-seconds over the trace itself, [0, horizon_s] (the same window for every
    contender: the wait for zero and the cold request after it are not counted)."""
    replica_s = sum(
        samples[k][1] * (min(samples[k + 1][0], horizon_s) - samples[k][0])
        for k in range(len(samples) - 1)
        if samples[k][0] < horizon_s
    )
    attainment: dict[str, Any] = {}
    for cls, objective in OBJECTIVE_S.items():
        mine = [o for o in outcomes if o.cls == cls and o.phase != "cold"]
        met = sum(1 for o in mine if o.error is None and o.ttft_s is not None
                  and o.ttft_s <= objective)  # fmt: skip
        served = [engine_kind(o.endpoint) for o in mine if o.endpoint]
        attainment[cls] = {
            "requests": len(mine),
            "met": met,
            "attainment": met / len(mine) if mine else None,
            "served_by": {k: served.count(k) for k in sorted(set(served))},
            # over the class's requests; a failed one (no first token) counts as infinite
            "ttft_s": percentiles(
                [o.ttft_s if o.error is None and o.ttft_s is not None else math.inf for o in mine]
            ),  # fmt: skip
        }
    cold = next(o for o in outcomes if o.phase == "cold")
    classes = [ln for ln in metrics.splitlines() if ln.startswith("fleetgate_arrivals_total{")]
    return {
        "contender": contender,
        "requests": len(outcomes),
        "failed": sum(1 for o in outcomes if o.error is not None),
        "errors": sorted({o.error for o in outcomes if o.error})[:10],
        "replica_seconds": round(replica_s, 1),
        "max_replicas": max((s[1] for s in samples), default=0),
        "max_trtllm_replicas": max((s[3] for s in samples), default=0),
        "attainment": attainment,
        "cold_request": {"ttft_s": cold.ttft_s, "error": cold.error},
        "router_arrivals": classes,
        "samples": samples,
        "outcomes": [asdict(o) for o in outcomes],
    }


def plot(
    results: list[dict[str, Any]], path: Path, phases: list[Phase], pool: str = "vllm"
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(10, 9), sharex=True)
    for r in results:
        t = [s[0] for s in r["samples"]]
        line = axes[0].step(t, [s[1] for s in r["samples"]], where="post", label=r["contender"])
        if pool == "mixed":
            axes[0].step(
                t,
                [s[3] for s in r["samples"]],
                where="post",
                ls="--",
                color=line[0].get_color(),
                label=f"{r['contender']}: TensorRT-LLM",
            )
        axes[1].plot(t, [s[2] for s in r["samples"]], label=r["contender"])
        for cls, marker in (("critical", "x"), ("standard", ".")):
            pts = [(o["sent_s"], o["ttft_s"]) for o in r["outcomes"]
                   if o["cls"] == cls and o["ttft_s"] is not None]  # fmt: skip
            if pts:
                axes[2].scatter(*zip(*pts, strict=True), s=8, marker=marker,
                                label=f"{r['contender']} {cls}")  # fmt: skip
    edge = 0.0
    for p in phases:
        for ax in axes:
            ax.axvline(edge, color="grey", lw=0.6, ls=":")
        axes[0].annotate(p.name, (edge + 0.5, 0.1), fontsize=7, color="grey")
        edge += p.seconds
    axes[0].set_ylabel("engine pods")
    axes[1].set_ylabel("requests in flight")
    axes[2].set_ylabel("TTFT (s)")
    axes[2].set_yscale("log")
    axes[2].set_xlabel("seconds into the trace")
    for ax in axes:
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    what = "vLLM" if pool == "vllm" else "TensorRT-LLM (latency) + vLLM (throughput)"
    fig.suptitle(f"Day-shaped trace (shortened), {what}: autoscaling vs static peak replicas")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def timetable_arg(text: str) -> list[tuple[float, int]]:
    """``--timetable``: ``'46.5:2,111:1'`` -> [(46.5, 2), (111.0, 1)]."""
    try:
        return autoscale_loop.parse_timetable(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def clairvoyant_reference(
    results: list[dict[str, Any]], args: argparse.Namespace
) -> dict[str, Any] | None:
    """The cheapest schedule a scaler told every arrival in advance could run on the
    first contender's arrivals and slot times (fleetgate_tools.bench.autoscale_oracle),
    printed against the static peak; None for the mixed pool (two engine speeds)."""
    if args.pool != "vllm" or not results:
        return None
    run = results[0]
    jobs, first = autoscale_oracle.jobs_from_outcomes(run["outcomes"])
    horizon = sum(p.seconds for p in trace(args.scale, args.base_rate))
    fleet = autoscale_oracle.Fleet(
        args.min_replicas, args.max_num_seqs, args.cold_start, first, autoscale_oracle.RANK
    )
    plan = autoscale_oracle.cheapest_common_schedule(
        [(jobs, fleet)], args.peak_replicas - args.min_replicas, OBJECTIVE_S,
        autoscale_oracle.GOALS, horizon,
    )  # fmt: skip
    static = args.peak_replicas * horizon
    if plan is None:
        print(f"\nclairvoyant reference ({run['contender']}'s arrivals): even the static peak "
              "misses the attainment goals in the simulated router")  # fmt: skip
        return {"from": run["contender"], "replica_seconds": None}
    spans = ", ".join(f"{r.up_s:.1f}-{r.down_s:.1f} s" for r in plan.extras) or "none"
    print(f"\nclairvoyant reference ({run['contender']}'s arrivals and slot times, goals "
          f"{autoscale_oracle.GOALS}): {plan.replica_seconds:.1f} replica-s = "
          f"{plan.replica_seconds / static:.2f}x static peak ({args.peak_replicas} x "
          f"{horizon:g} s); extra replicas asked-removed: {spans}")  # fmt: skip
    return {
        "from": run["contender"],
        "replica_seconds": round(plan.replica_seconds, 1),
        "x_static": round(plan.replica_seconds / static, 3),
        "extras": [[r.up_s, r.down_s] for r in plan.extras],
        "attainment": dict(plan.attainment),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", type=float, default=1.0, help="phase durations x this")
    parser.add_argument("--base-rate", type=float, default=1.0, help="quiet req/s (peak 5x)")
    parser.add_argument("--peak-replicas", type=int, default=3)
    parser.add_argument(
        "--target-in-flight",
        type=float,
        default=4,
        help="fleetgate-autoscale: targetInFlightPerReplica (engines have --max-num-seqs slots)",
    )
    parser.add_argument(
        "--max-num-seqs",
        type=int,
        default=8,
        help="sequences per engine batch (vLLM maxNumSeqs, TensorRT-LLM maxBatchSize)",
    )
    parser.add_argument(
        "--min-replicas",
        type=int,
        default=0,
        help="fleetgate-autoscale: minReplicas (0: scale to zero; 1: as the HPA, no cold start)",
    )
    parser.add_argument(
        "--warm-start",
        action="store_true",
        help="fleetgate-autoscale with --min-replicas 0: one request before the trace wakes "
        "the service, so the trace starts on one warm replica as the HPA's does (it still "
        "scales to zero in the idle phase, and the cold request meets zero)",
    )
    parser.add_argument("--cold-start", type=float, default=3.0, help="vLLM cold start (s)")
    parser.add_argument(
        "--trtllm-cold-start", type=float, default=None, help="TensorRT-LLM's (default: vLLM's)"
    )
    parser.add_argument("--pool", choices=POOLS, default="vllm",
                        help="vllm: one vLLM service; mixed: TensorRT-LLM (latency) + "
                        "vLLM (throughput) in one pool")  # fmt: skip
    parser.add_argument(
        "--pool-consolidation",
        action="store_true",
        help="mixed pool: the operator lets the roles share their replicas (its "
        "--pool-consolidation)",
    )
    parser.add_argument(
        "--pool-gpu-budget",
        type=int,
        default=None,
        help="the operator's GPU budget for the bench's pool (its --pool-gpu-budget "
        "default=N; one GPU per replica): fleetgate-autoscale never runs more pods",
    )
    parser.add_argument("--contenders", default=",".join(CONTENDERS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--hpa-metric",
        default="vllm_num_requests_in_flight",
        choices=sorted(m for m in ENGINE_METRICS if m.startswith("vllm_")),
        help="hpa-prometheus: per-pod metric (named as vLLM's; the mixed pool's "
        "TensorRT-LLM HPA uses its engine's: trtllm_num_requests_...)",
    )
    parser.add_argument(
        "--hpa-target",
        type=float,
        default=4.0,
        help="hpa-prometheus: target average of --hpa-metric per pod",
    )
    parser.add_argument(
        "--hpa-sync-period",
        type=float,
        default=15.0,
        help="hpa-prometheus: HPA controller sync period (s; the controller's default 15)",
    )
    parser.add_argument(
        "--timetable",
        type=timetable_arg,
        default=(),
        help="timetable: 'SECONDS:REPLICAS,...' in trace seconds, e.g. the clairvoyant "
        "schedule's '46.5:2,111:1' (all-vLLM pool; starts at --min-replicas)",
    )
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plot", type=Path)
    args = parser.parse_args()
    if os.environ.get("FLEETGATE_TEST_MODE") != "1":
        parser.error("set FLEETGATE_TEST_MODE=1 (everything binds loopback)")
    contenders = args.contenders.split(",")
    unknown = set(contenders) - set(CONTENDERS)
    if unknown:
        parser.error(f"unknown contenders {sorted(unknown)}; known: {CONTENDERS}")
    if args.warm_start and args.min_replicas != 0:
        parser.error("--warm-start is for --min-replicas 0 (minReplicas >= 1 starts warm)")
    if args.trtllm_cold_start is None:
        args.trtllm_cold_start = args.cold_start
    if "timetable" in contenders and (not args.timetable or args.pool != "vllm"):
        parser.error("timetable needs --timetable and the all-vLLM pool")
    if (
        not 0 < args.scale <= 10
        or args.base_rate <= 0
        or args.peak_replicas < 1
        or args.target_in_flight < 1
        or args.max_num_seqs < 1
        or not 0 <= args.min_replicas <= args.peak_replicas
    ):
        parser.error(
            "want 0 < --scale <= 10, --base-rate > 0, --peak-replicas >= 1, "
            "--target-in-flight >= 1, --max-num-seqs >= 1, 0 <= --min-replicas <= --peak-replicas"
        )
    if args.hpa_target <= 0 or args.hpa_sync_period <= 0:
        parser.error("want --hpa-target > 0 and --hpa-sync-period > 0")
    if "hpa-prometheus" in contenders and args.hpa_target >= args.max_num_seqs:
        # the router fills an engine only up to its slots, so the per-pod in-flight
        # average never exceeds them and the HPA would never scale up
        parser.error("want --hpa-target below --max-num-seqs (the router never over-fills)")
    if args.pool == "mixed" and args.peak_replicas < 2:
        parser.error("--pool mixed needs --peak-replicas >= 2 (a pod of each engine)")
    if not (0 <= args.cold_start < 600 and 0 <= args.trtllm_cold_start < 600):
        parser.error("want cold starts in [0, 600) seconds")
    work = Path(tempfile.mkdtemp(prefix="bench-autoscale-"))
    results = []
    with_hpa = "hpa-prometheus" in contenders
    if with_hpa:
        ensure_adapter()  # a cold build takes minutes: before the control plane starts
    # CRDs preloaded before the controller manager: the HPA can target them at once
    config = ClusterConfig(
        preload=(REPO / "crds",),
        aggregation=with_hpa,
        hpa_sync_period_s=args.hpa_sync_period if with_hpa else None,
    )
    with running_cluster(ensure_binaries(), config) as cluster:
        for c in contenders:
            (work / c).mkdir()
            print(f"running {c} (logs in {work / c})", flush=True)
            results.append(asyncio.run(run_contender(cluster, c, args, work / c)))
    print("\n| contender | replica-s | max pods | critical | standard | failed | cold TTFT |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        att = {c: r["attainment"][c] for c in OBJECTIVE_S}
        cells = [
            f"{a['attainment']:.1%} of {a['requests']}" if a["attainment"] is not None else "-"
            for a in att.values()
        ]
        cold = r["cold_request"]
        cold_cell = f"{cold['ttft_s']:.2f}s" if cold["ttft_s"] is not None else cold["error"]
        print(f"| {r['contender']} | {r['replica_seconds']} | {r['max_replicas']} | "
              f"{cells[0]} | {cells[1]} | {r['failed']} | {cold_cell} |")  # fmt: skip
    print("\nTTFT per class (s; nearest rank, a failed request counts as infinite: '-')")
    print("| contender | class | p50 | p90 | p99 |")
    print("|---|---|---|---|---|")
    for r in results:
        for cls in OBJECTIVE_S:
            q = r["attainment"][cls]["ttft_s"]
            cells = " | ".join("-" if q[k] is None else f"{q[k]:.3f}" for k in q)
            print(f"| {r['contender']} | {cls} | {cells} |")
    static = next((r for r in results if r["contender"] == "static-peak"), None)
    if static is not None and static["replica_seconds"]:
        for r in results:
            if r is not static:
                print(f"\nreplica-seconds ratio {r['contender']} / static-peak: "
                      f"{r['replica_seconds'] / static['replica_seconds']:.2f}")  # fmt: skip
    for r in results:
        cold = r["cold_request"]
        if "to_pod_listed_s" in cold:
            print(f"{r['contender']} cold request: {cold['ttft_s']:.2f}s = pod listed after "
                  f"{cold['to_pod_listed_s']:.2f}s + modelled cold start "
                  f"{cold['modelled_cold_start_s']:.1f}s ({cold['engine']}) + engine bound to "
                  f"first token {cold['bound_to_first_token_s']:.2f}s "
                  f"(x{cold['ttft_over_cold_start']:.2f} the cold start)")  # fmt: skip
        if args.pool == "mixed":
            for cls in OBJECTIVE_S:
                print(f"{r['contender']} {cls} served by: {r['attainment'][cls]['served_by']}")
        if r["errors"]:
            print(f"{r['contender']} errors: {r['errors']}")
        limited = [e for e in r.get("operator_events") or () if e[2] == "ScaleUpLimited"]
        if args.pool_gpu_budget is not None or limited:
            print(f"{r['contender']} ScaleUpLimited events: {len(limited)}"
                  + "".join(f"\n  {t:.0f}s {s}: {m}" for t, s, _, m in limited))  # fmt: skip
        for name in sorted({h[4] for h in r.get("hpa_status") or ()}):
            changes = ", ".join(
                f"{t:.1f}s: {v} -> {n}" for t, v, n, _, s in r["hpa_status"] if s == name
            )
            print(f"{r['contender']} HPA {name} status changes (metric per pod -> desired): "
                  f"{changes}")  # fmt: skip
    clairvoyant = clairvoyant_reference(results, args)
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json),
                             "plot": str(args.plot)}, "results": results,
                             "clairvoyant": clairvoyant}, indent=1))  # fmt: skip
    if args.plot:
        plot(results, args.plot, trace(args.scale, args.base_rate), args.pool)
        print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
