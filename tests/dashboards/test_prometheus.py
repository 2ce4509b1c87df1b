"""Every dashboard panel's query, run against a REAL Prometheus.

We test these aspects: Debian's ``prometheus`` binary, on loopback, scrapes the
router, the operator and emulated vLLM and TensorRT-LLM engines while a short
mixed-priority load runs; then every query of every panel (template variables
set to "all") must parse and return at least one series. The routing dashboard
is also rendered to PNG from the same results.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from fleetgate_tools.bench.loadgen import run_sessions
from fleetgate_tools.bench.workloads import WorkloadParams, priority_storm, shared_prefix
from fleetgate_tools.dashboards.render import render_png, series_from_matrix
from fleetgate_tools.dashboards.spec import DASHBOARDS, ROUTING

pytestmark = [pytest.mark.k8s, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
ROUTING_SOURCES = "Decisions by cache view (exact KV events vs approximate)"
ROUTING_FEEDS = "KV-event feed state per endpoint"
VARIABLES = {"$model": ".*", "$class": ".*", "$namespace": ".*", "$__rate_interval": "20s"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _prometheus() -> str:
    path = shutil.which("prometheus")
    if path is None:  # installed by `make test` (hack/install-prometheus.sh)
        subprocess.run(["bash", str(ROOT / "hack" / "install-prometheus.sh")], check=True)
        path = shutil.which("prometheus")
    assert path, "Debian's prometheus package is required (hack/install-prometheus.sh)"
    return path


class Procs:
    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, argv: list[str], **kw: Any) -> subprocess.Popen[bytes]:
        with open(self.logs / f"{name}.log", "wb") as log:
            p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, **kw)
        self.procs[name] = p
        return p

    def tail(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-2000:]}"
            for p in sorted(self.logs.glob("*.log"))
        )

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


@pytest.fixture
def stack(tmp_path: Path, k8s_cluster: Any, k8s_namespace: str) -> Iterator[dict[str, Any]]:
    procs = Procs(tmp_path)
    fg = [sys.executable, "-m", "fleetgate"]
    try:
        # operator, watching one namespace, with one small vLLM service to reconcile
        k8s_cluster.kubectl("apply", "--server-side", "-f", str(ROOT / "crds"))
        op_port, router_port = _free_port(), _free_port()
        procs.start(
            "operator",
            [*fg, "operator", "--kubeconfig", str(k8s_cluster.kubeconfig),
             "--namespace", k8s_namespace, "--metrics-host", "127.0.0.1",
             "--metrics-port", str(op_port), "--interval", "2",
             "--extra-toleration", "kwok.x-k8s.io/node=fake:NoSchedule",
             # the autoscaling panels: the operator reads the router's demand
             "--autoscale-interval", "1",
             "--router-metrics-url", f"http://127.0.0.1:{router_port}/metrics",
             # the pool GPU budget panel
             "--pool-gpu-budget", "default=4"],
        )  # fmt: skip
        isvc = {
            "apiVersion": "fleetgate.dev/v1alpha1",
            "kind": "InferenceService",
            "metadata": {"name": "dash", "namespace": k8s_namespace},
            "spec": {
                "model": {"uri": "hf://org/tiny", "name": "tiny"},
                "engine": {"type": "vllm", "image": "vllm/vllm-openai:v0.32.0"},
                "gpu": {"count": 1},
                "replicas": 1,
                # min = max: the decision and its demand are exported, replicas stay 1
                "autoscaling": {"minReplicas": 1, "maxReplicas": 1, "targetInFlightPerReplica": 4},
            },
        }
        k8s_cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(isvc))
        # emulated engines: 2 vLLM + 1 TensorRT-LLM of 2 attention-DP ranks, small so the
        # load queues, with KV events (the exact-view panels, per rank too); the router
        # subscribes with the emulator's tokenizer
        # --port 0: each engine binds an ephemeral port and prints it (consecutive ports
        # from a free one may be taken meanwhile: CI saw "Address already in use")
        sim = procs.start(
            "sim",
            [*fg, "sim", "--vllm", "2", "--trtllm", "1", "--port", "0",
             "--profile", "test", "--max-num-seqs", "4", "--model", "tiny", "--seed", "3",
             "--kv-events", "--trtllm-attention-dp", "2"],
        )  # fmt: skip
        engines: list[tuple[str, str]] = []
        feeds: list[str] = []
        deadline = time.monotonic() + 60
        while len(engines) < 3 and time.monotonic() < deadline:
            text = (tmp_path / "sim.log").read_text()
            started = [
                dict(f.split("=", 1) for f in line.split())
                for line in text.splitlines()
                if line.startswith("engine=")
            ]
            engines = [(kv["engine"], kv["url"]) for kv in started]
            feeds = [
                "".join(
                    f",{k}={kv[k]}"
                    for k in ("kv_events", "kv_replay", "kv_ranks", "kv_rank_choice")
                    if k in kv
                )
                for kv in started
            ]
            if sim.poll() is not None:
                break
            time.sleep(0.2)
        assert len(engines) == 3, procs.tail()
        (tmp_path / "router.yaml").write_text("priority: {}\n")  # the chart's default classes
        procs.start(
            "router",
            [
                *fg,
                "router",
                "--port",
                str(router_port),
                "--config",
                str(tmp_path / "router.yaml"),
                "--tokenizer",
                "tiny=emulator",
            ]
            + [
                a
                for (kind, url), feed in zip(engines, feeds, strict=True)
                for a in ("--backend", f"{kind}={url}{feed}")
            ],
        )
        prom_port = _free_port()
        jobs = [
            {"job_name": "router", "static_configs": [{"targets": [f"127.0.0.1:{router_port}"]}]},
            {"job_name": "operator", "static_configs": [{"targets": [f"127.0.0.1:{op_port}"]}]},
        ]
        for i, (kind, url) in enumerate(engines):
            jobs.append(
                {
                    "job_name": f"engine-{i}",
                    "metrics_path": "/metrics" if kind == "vllm" else "/prometheus/metrics",
                    "static_configs": [{"targets": [url.removeprefix("http://")]}],
                }
            )
        (tmp_path / "prometheus.yml").write_text(
            yaml.safe_dump({"global": {"scrape_interval": "1s"}, "scrape_configs": jobs})
        )
        procs.start(
            "prometheus",
            [_prometheus(), f"--config.file={tmp_path / 'prometheus.yml'}",
             f"--storage.tsdb.path={tmp_path / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{prom_port}"],
        )  # fmt: skip
        yield {
            "router": f"http://127.0.0.1:{router_port}",
            "prometheus": f"http://127.0.0.1:{prom_port}",
            "procs": procs,
            "tmp": tmp_path,
        }
    finally:
        procs.stop()
        k8s_cluster.kubectl("-n", k8s_namespace, "delete", "inferenceservice", "dash",
                            "--wait=false", check=False)  # fmt: skip


async def _wait_ready(client: httpx.AsyncClient, url: str, within: float, procs: Procs) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            if (await client.get(url)).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        await asyncio.sleep(0.3)
    pytest.fail(f"{url} never became ready\n{procs.tail()}")


async def test_every_panel_query_returns_series(stack: dict[str, Any]) -> None:
    procs: Procs = stack["procs"]
    async with httpx.AsyncClient(timeout=10) as client:
        await _wait_ready(client, stack["router"] + "/ready", 60, procs)
        await _wait_ready(client, stack["prometheus"] + "/-/ready", 60, procs)
        # priority classes (queue, preemption panels) plus shared documents (cache panels)
        sessions = priority_storm(WorkloadParams(duration_s=12, rate=3, scale=0.2, seed=11))
        sessions += shared_prefix(WorkloadParams(duration_s=12, rate=1, scale=0.1, seed=12))
        sessions.sort(key=lambda s: s.start_s)
        results = await run_sessions(stack["router"], "tiny", sessions, deadline_s=40)
        ok = sum(r.ok for r in results)
        assert ok >= len(results) * 0.8, [r.error for r in results if not r.ok][:5]
        await asyncio.sleep(4)  # a few more scrapes after the load

        end = time.time()
        missing: list[str] = []
        data: dict[str, list[Any]] = {}
        for dash in DASHBOARDS:
            for panel in dash.panels:
                for q in panel.queries:
                    expr = q.expr
                    for var, value in VARIABLES.items():
                        expr = expr.replace(var, value)
                    r = await client.get(
                        stack["prometheus"] + "/api/v1/query_range",
                        params={"query": expr, "start": end - 90, "end": end, "step": "2"},
                    )
                    body = r.json()
                    assert body["status"] == "success", (dash.uid, panel.title, expr, body)
                    result = body["data"]["result"]
                    if not result:
                        missing.append(f"{dash.uid} / {panel.title}: {expr}")
                    if dash is ROUTING:
                        data.setdefault(panel.title, []).extend(
                            series_from_matrix(q.legend, result)
                        )
        assert not missing, "queries with no series:\n" + "\n".join(missing)
        # The engines' KV events reached the router: some decisions came from the exact
        # view and some endpoint's feed was live (not just the approximate fallback).
        by_source = {legend for legend, points in data[ROUTING_SOURCES] if points}
        assert "events" in by_source, by_source
        states = {legend for legend, points in data[ROUTING_FEEDS] if points}
        assert any(legend.endswith(" live") for legend in states), states

    png = render_png(ROUTING, data, stack["tmp"] / "routing.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert png.stat().st_size > 20_000  # a real picture with data, not an empty canvas
    target = os.environ.get("FLEETGATE_DASHBOARD_PNG")
    if target:  # `make docs-dashboard` keeps the picture for the docs
        shutil.copy(png, target)
