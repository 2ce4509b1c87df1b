"""The whole fleet on the dev cluster, everything on 127.0.0.0/8.

helm install (chart values only) -> one vLLM and one TensorRT-LLM InferenceService ->
the operator, run as a ``fleetgate operator`` process with the args and environment of
the chart's operator Deployment, creates the engine Deployments; kwok schedules their
pods on fake GPU nodes with loopback pod IPs -> the test starts an emulated engine of
the right kind on each pod IP and port -> the router, run as a process with the
chart's ConfigMap, discovers them through the API and serves real streaming requests
to both. Scaling the vLLM service to 3 adds endpoints to routing, deleting a pod
removes it (and its engine gets no new request afterwards), and a bounded request
loop running all along sees no failure.

The chart's own operator/router pods never run (kwok), which is why the test runs
both as local processes configured from what the chart installed, each with a token
of the chart's ServiceAccount for it: they get exactly the chart's RBAC, as their
in-cluster credentials would.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from fleetgate_tools.devcluster import DevCluster, ensure_binaries

pytestmark = [pytest.mark.k8s, pytest.mark.slow, pytest.mark.timeout(480)]

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "fleetgate"
FLEETGATE = str(Path(sys.executable).parent / "fleetgate")
KWOK = {"key": "kwok.x-k8s.io/node", "operator": "Exists", "effect": "NoSchedule"}
MODELS = {"vllm": "llama-3.1-8b", "trtllm": "qwen2.5-7b"}
TRAFFIC_MAX_REQUESTS = 3000
TRAFFIC_MAX_SECONDS = 240.0


def inference_service(name: str, engine: str) -> dict[str, Any]:
    """Like examples/, minus the HF secret (nothing downloads here)."""
    if engine == "vllm":
        engine_spec = {
            "type": "vllm",
            "image": "vllm/vllm-openai:v0.32.0",
            "vllm": {"maxNumSeqs": 8, "enablePrefixCaching": True},
        }
        gpus, tensor = 1, 1
    else:
        engine_spec = {
            "type": "tensorrt-llm",
            "image": "nvcr.io/nvidia/tensorrt-llm/release:1.0.0",
            "tensorrtLlm": {"backend": "pytorch", "maxBatchSize": 8},
        }
        gpus, tensor = 2, 2
    return {
        "apiVersion": "fleetgate.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": name},
        "spec": {
            "model": {"uri": f"hf://test/{name}", "name": MODELS[engine]},
            "engine": engine_spec,
            "parallelism": {"tensor": tensor, "pipeline": 1},
            "gpu": {"count": gpus},
            "replicas": 1,
            "routing": {"pool": "default", "role": "latency"},
        },
    }  # fmt: skip


def as_service_account(
    cluster: DevCluster, namespace: str, account: str, where: Path
) -> tuple[str, str]:
    """A kubeconfig with a token of the chart's ServiceAccount, so the process has
    exactly the chart's RBAC (what its in-cluster credentials would give it)."""
    token = cluster.kubectl(
        "-n", namespace, "create", "token", account, "--duration=1h"
    ).stdout.strip()
    config = yaml.safe_load(cluster.kubeconfig.read_text())
    for user in config["users"]:
        user["user"] = {"token": token}
    path = where / f"{account}.kubeconfig"
    path.write_text(yaml.safe_dump(config))
    return str(path), token


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Processes:
    logs: Path
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        log = open(self.logs / f"{name}.log", "wb")
        self.procs[name] = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
            start_new_session=True,
        )  # fmt: skip
        log.close()

    def check_alive(self) -> None:
        dead = {n: p.returncode for n, p in self.procs.items() if p.poll() is not None}
        assert not dead, f"processes died: {dead}\n{self.tail()}"

    def tail(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
            for p in sorted(self.logs.glob("*.log"))
        )

    def stop_all(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=5)


async def until(what: Callable[[], Any], within: float, message: str) -> Any:
    deadline = time.monotonic() + within
    while True:
        value = what()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out: {message}")
        await asyncio.sleep(0.2)


@dataclass
class Engines:
    """Emulated engines started on pod IPs as the pods appear (keyed by IP)."""

    cluster: DevCluster
    namespace: str
    procs: Processes
    by_ip: dict[str, tuple[str, str]] = field(default_factory=dict)  # ip -> (engine, model)
    pods: dict[str, str] = field(default_factory=dict)  # pod name -> ip

    async def sync(self, client: httpx.AsyncClient) -> None:
        pods = await asyncio.to_thread(
            self.cluster.kubectl_json, "-n", self.namespace, "get", "pods",
            "-l", "fleetgate.dev/pool",
        )  # fmt: skip
        for pod in pods["items"]:
            ip = pod.get("status", {}).get("podIP")
            name = pod["metadata"]["name"]
            if not ip or name in self.pods or pod["metadata"].get("deletionTimestamp"):
                continue
            engine = pod["metadata"]["labels"]["fleetgate.dev/engine"]
            model = pod["metadata"]["annotations"]["fleetgate.dev/served-model"]
            assert ip.startswith("127."), ip
            if ip in self.by_ip:  # kwok reused an IP: the engine there must fit
                assert self.by_ip[ip] == (engine, model), (ip, self.by_ip[ip], engine, model)
            else:
                self.procs.start(
                    f"engine-{ip}",
                    [FLEETGATE, "sim", f"--{engine}", "1", "--host", ip, "--port", "8000",
                     "--model", model, "--seed", str(len(self.by_ip))],
                )  # fmt: skip
                self.by_ip[ip] = (engine, model)

                async def up(ip: str = ip) -> bool:
                    with contextlib.suppress(httpx.HTTPError):
                        return (await client.get(f"http://{ip}:8000/health")).status_code == 200
                    return False

                await until(up, 30, f"emulated {engine} on {ip}")
            self.pods[name] = ip

    async def served(self, client: httpx.AsyncClient, ip: str) -> float:
        """Requests an engine finished, from its Prometheus metrics (for TensorRT-LLM the
        /prometheus/metrics text: its JSON /metrics drains on read and is the router's)."""
        engine = self.by_ip[ip][0]
        path = "/metrics" if engine == "vllm" else "/prometheus/metrics"
        text = (await client.get(f"http://{ip}:8000{path}")).text
        name = "vllm:request_success_total" if engine == "vllm" else "trtllm_request_success_total"
        return sum(
            float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name)
        )


def healthy_endpoints(metrics: str) -> dict[str, str]:
    """endpoint -> engine for every ``fleetgate_endpoint_healthy ... 1.0`` line."""
    out = {}
    for m in re.finditer(
        r"^fleetgate_endpoint_healthy\{([^}]*)\} 1\.0$", metrics, flags=re.MULTILINE
    ):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        out[labels["endpoint"]] = labels["engine"]
    return out


async def stream_chat(client: httpx.AsyncClient, router: str, model: str, i: int) -> str | None:
    """One streaming chat request; None when it completed, else what went wrong."""
    prompt = f"request {i}: tell me about fleets"
    body = {"model": model, "stream": True, "max_tokens": 8,
            "messages": [{"role": "user", "content": prompt}]}  # fmt: skip
    try:
        async with client.stream("POST", f"{router}/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                return f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
            text, done, raw, finish = "", False, [], None
            async for line in r.aiter_lines():
                raw.append(line)
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        return f"in-band error {chunk['error']}"
                    assert chunk["model"] == model
                    for choice in chunk.get("choices", []):
                        text += choice.get("delta", {}).get("content") or ""
                        finish = choice.get("finish_reason") or finish
            # An immediate end-of-sequence (finish "stop", no text) is a valid answer.
            if done and finish in ("stop", "length"):
                return None
            return f"incomplete stream (done={done}, finish={finish}): {raw[-6:]}"
    except httpx.HTTPError as e:
        return f"{type(e).__name__}: {e}"


@dataclass
class Traffic:
    sent: int = 0
    failures: list[str] = field(default_factory=list)


@contextlib.asynccontextmanager
async def traffic(
    client: httpx.AsyncClient, router: str, workers: int = 4
) -> AsyncIterator[Traffic]:
    """A bounded request loop (count and time) alternating both models."""
    t = Traffic()
    stop = asyncio.Event()
    deadline = time.monotonic() + TRAFFIC_MAX_SECONDS

    async def worker(w: int) -> None:
        while not stop.is_set() and t.sent < TRAFFIC_MAX_REQUESTS and time.monotonic() < deadline:
            i = t.sent
            t.sent += 1
            model = MODELS["vllm"] if i % 3 else MODELS["trtllm"]
            error = await stream_chat(client, router, model, i)
            if error:
                t.failures.append(f"#{i} {model}: {error}")

    tasks = [asyncio.get_running_loop().create_task(worker(w)) for w in range(workers)]
    try:
        yield t
    finally:
        stop.set()
        await asyncio.gather(*tasks)


async def test_helm_operator_router_and_emulated_engines_end_to_end(
    k8s_cluster: DevCluster, k8s_namespace: str, tmp_path: Path
) -> None:
    ns, cluster = k8s_namespace, k8s_cluster
    release = f"e2e-{uuid.uuid4().hex[:6]}"
    kc = str(cluster.kubeconfig)
    helm = str(ensure_binaries().path("helm"))
    procs = Processes(tmp_path)

    # 1. The CRD (kubectl, the chart's crds.enabled=false path) and the chart.
    cluster.kubectl("apply", "-f", str(REPO / "crds"))
    cluster.kubectl("wait", "--for=condition=Established", "crd/inferenceservices.fleetgate.dev")
    tol = json.dumps([KWOK])
    subprocess.run(  # noqa: ASYNC221 - nothing else runs on the loop yet
        [helm, "--kubeconfig", kc, "install", release, str(CHART), "-n", ns,
         "--set", "crds.enabled=false",
         "--set-json", f"operator.tolerations={tol}", "--set-json", f"router.tolerations={tol}",
         "--set-json", f"operator.engineTolerations={tol}",
         "--set-json", f'operator.watchNamespaces=["{ns}"]',
         "--set", "router.config.discovery.kubernetes.source=pods",
         "--set-json", f'router.config.discovery.kubernetes.namespaces=["{ns}"]',
         "--wait", "--timeout", "180s"],
        check=True, capture_output=True, timeout=240,
    )  # fmt: skip
    try:
        # 2. The operator: the chart Deployment's args and env, plus local overrides.
        dep = cluster.kubectl_json("-n", ns, "get", "deployment", f"{release}-fleetgate-operator")
        (container,) = dep["spec"]["template"]["spec"]["containers"]
        env = {e["name"]: e["value"] for e in container.get("env", [])}
        assert json.loads(env["FLEETGATE_EXTRA_TOLERATIONS"]) == [KWOK]
        procs.start(
            "operator",
            [FLEETGATE, *container["args"], "--kubeconfig", as_service_account(
                cluster, ns, dep["spec"]["template"]["spec"]["serviceAccountName"], tmp_path)[0],
             "--metrics-host", "127.0.0.1", "--metrics-port", "0"],
            env=env,
        )  # fmt: skip

        # 3. The router: the chart's ConfigMap, with the kubeconfig the pod would not need.
        cm = cluster.kubectl_json("-n", ns, "get", "configmap", f"{release}-fleetgate-router")
        config = yaml.safe_load(cm["data"]["router.yaml"])
        assert config["discovery"]["kind"] == "kubernetes"
        router_sa = cluster.kubectl_json(
            "-n", ns, "get", "deployment", f"{release}-fleetgate-router"
        )["spec"]["template"]["spec"]["serviceAccountName"]
        router_kc, _ = as_service_account(cluster, ns, router_sa, tmp_path)
        config["discovery"]["kubernetes"]["kubeconfig"] = router_kc
        (tmp_path / "router.yaml").write_text(yaml.safe_dump(config))
        port = free_port()
        router = f"http://127.0.0.1:{port}"
        procs.start(
            "router",
            [FLEETGATE, "router", "--config", str(tmp_path / "router.yaml"), "--port", str(port),
             "--host", "127.0.0.1", "--log-level", "info"],
        )  # fmt: skip

        # 4. One InferenceService per engine.
        cluster.apply(
            *({**inference_service(n, e), "metadata": {"name": n, "namespace": ns}}
              for n, e in (("llama", "vllm"), ("qwen", "trtllm")))
        )  # fmt: skip
        engines = Engines(cluster, ns, procs)
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(timeout=30, limits=limits, trust_env=False) as client:

            async def synced_pods(count: int) -> bool:
                procs.check_alive()
                await engines.sync(client)
                return len(engines.pods) >= count

            await until(lambda: synced_pods(2), 90, "two engine pods with emulators")

            async def router_metrics() -> str:
                procs.check_alive()
                with contextlib.suppress(httpx.HTTPError):
                    return (await client.get(f"{router}/metrics")).text
                return ""

            async def healthy() -> dict[str, str]:
                return healthy_endpoints(await router_metrics())

            got = await until(lambda: healthy_len(healthy, 2), 60, "router sees both engines")
            assert sorted(got.values()) == ["trtllm", "vllm"]

            async def both_models() -> bool:
                models = (await client.get(f"{router}/v1/models")).json()
                return sorted(m["id"] for m in models["data"]) == sorted(MODELS.values())

            await until(both_models, 30, "/v1/models lists both served models")

            # 5. Streaming through the router to both engines.
            for i, model in enumerate(sorted(MODELS.values()) * 2):
                assert await stream_chat(client, router, model, i) is None
            for ip in engines.by_ip:
                assert await engines.served(client, ip) >= 1, f"engine {ip} got no request"

            # 6. Scale to 3 and delete a pod while a bounded request loop runs.
            async with traffic(client, router) as load:
                t0 = time.monotonic()
                await asyncio.to_thread(
                    cluster.kubectl, "-n", ns, "scale", "inferenceservice", "llama", "--replicas=3"
                )
                await until(lambda: synced_pods(4), 90, "four engine pods")
                t_engines = time.monotonic()
                got = await until(lambda: healthy_len(healthy, 4), 60, "router routes to 4")
                print(
                    f"figures: scale -> pods with engines up {t_engines - t0:.2f}s, "
                    f"-> router routes to all 4 {time.monotonic() - t0:.2f}s"
                )
                assert sorted(got.values()) == ["trtllm", "vllm", "vllm", "vllm"]

                async def routed() -> dict[str, float]:
                    return routed_requests(await router_metrics())

                async def every_endpoint_routed() -> bool:
                    counts = await routed()
                    return all(counts.get(e, 0) > 0 for e in await healthy())

                await until(every_endpoint_routed, 60, "requests reach all 4 endpoints")
                for ip, (engine, _) in engines.by_ip.items():  # and the engines answered them
                    assert await engines.served(client, ip) >= 1, f"{engine} on {ip} served none"

                victim = sorted(p for p in engines.pods if p.startswith("llama-"))[0]
                t0 = time.monotonic()
                await asyncio.to_thread(
                    cluster.kubectl, "-n", ns, "delete", "pod", victim, "--wait=false"
                )
                await until(lambda: gone(healthy, f"{ns}/{victim}"), 60, f"{victim} left the fleet")
                print(f"figures: pod delete -> out of routing {time.monotonic() - t0:.2f}s")
                # The counter counts answered requests: let the ones in flight on the
                # victim when it left finish (8-token streams take ~50 ms), then freeze it.
                await asyncio.sleep(1.0)
                before = (await routed()).get(f"{ns}/{victim}", 0.0)
                await until(lambda: synced_pods(5), 90, "the replacement pod")
                got = await until(lambda: healthy_len(healthy, 4), 60, "the replacement joined")
                assert f"{ns}/{victim}" not in got
                await asyncio.sleep(2.0)  # the loop keeps going; nothing may reach the victim
                assert (await routed()).get(f"{ns}/{victim}", 0.0) == before
                await until(every_endpoint_routed, 60, "requests reach the replacement")
                sent_during_scale = load.sent
            for failure in load.failures:
                print("FAILED REQUEST", failure)
            assert load.failures == [], load.failures[:10]
            print(f"requests during scale-up and pod deletion: {sent_during_scale}, all completed")
            assert sent_during_scale >= 20, f"only {sent_during_scale} requests during the scale"
            procs.check_alive()
    except BaseException:
        print(procs.tail())
        raise
    finally:
        procs.stop_all()
        subprocess.run(  # noqa: ASYNC221 - teardown, every task has ended
            [helm, "--kubeconfig", kc, "uninstall", release, "-n", ns, "--wait"],
            capture_output=True, timeout=120, check=False,
        )  # fmt: skip


async def healthy_len(healthy: Callable[[], Any], n: int) -> dict[str, str] | None:
    got: dict[str, str] = await healthy()
    return got if len(got) == n else None


async def gone(healthy: Callable[[], Any], endpoint: str) -> bool:
    return endpoint not in await healthy()


def routed_requests(metrics: str) -> dict[str, float]:
    """endpoint -> requests the router answered through it (fleetgate_requests_total)."""
    out: dict[str, float] = {}
    for m in re.finditer(r"^fleetgate_requests_total\{([^}]*)\} (\S+)$", metrics, re.MULTILINE):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        out[labels["endpoint"]] = out.get(labels["endpoint"], 0.0) + float(m.group(2))
    return out
