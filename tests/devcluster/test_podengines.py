"""The pod-engine launcher's pure parts (tools/fleetgate_tools/devcluster/podengines.py),
and one real child: the modelled cold start keeps the address closed until it ends."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from fleetgate_tools.devcluster.podengines import (
    EnginePod,
    PodError,
    engine_argv,
    engine_pod,
    parse_cold_starts,
    plan,
)


def pod(
    name: str = "llama-abc",
    ip: str | None = "127.0.1.7",
    engine: str = "vllm",
    args: list[str] | None = None,
    **meta: Any,
) -> dict[str, Any]:
    return {
        "metadata": {
            "name": name, "namespace": "ns", "uid": f"uid-{name}",
            "labels": {"fleetgate.dev/engine": engine, "fleetgate.dev/pool": "default"},
            "annotations": {"fleetgate.dev/served-model": "llama-3.1-8b"},
            **meta,
        },
        "spec": {"containers": [{
            "name": "engine", "command": ["python3", "-m", "vllm.entrypoints.openai.api_server"],
            "args": args or ["--port", "8000", "--max-num-seqs", "8"],
            "ports": [{"name": "metrics", "containerPort": 9000},
                      {"name": "http", "containerPort": 8000}],
        }]},
        "status": {"podIP": ip} if ip else {},
    }  # fmt: skip


def test_engine_pod_reads_what_the_operator_writes() -> None:
    got = engine_pod(pod())
    assert got == EnginePod(
        uid="uid-llama-abc", namespace="ns", name="llama-abc", ip="127.0.1.7", port=8000,
        engine="vllm", model="llama-3.1-8b", max_batch=8,
    )  # fmt: skip
    trt = engine_pod(pod(engine="trtllm", args=["serve", "m", "--max_batch_size=16"]))
    assert trt is not None and trt.engine == "trtllm" and trt.max_batch == 16
    assert engine_pod(pod(args=["--port", "8000"])).max_batch is None  # type: ignore[union-attr]


def test_no_engine_without_an_ip_or_once_deleting() -> None:
    assert engine_pod(pod(ip=None)) is None
    assert engine_pod(pod(deletionTimestamp="2026-01-01T00:00:00Z")) is None


@pytest.mark.parametrize(
    "bad, message",
    [
        (pod(ip="10.0.0.5"), "not a loopback"),
        (pod(ip="nonsense"), "not a loopback"),
        (pod(engine="sglang"), "fleetgate.dev/engine='sglang'"),
        (pod(args=["--max-num-seqs", "many"]), "--max-num-seqs 'many'"),
    ],
)
def test_pods_it_cannot_serve_are_clear_errors(bad: dict[str, Any], message: str) -> None:
    with pytest.raises(PodError, match=message):
        engine_pod(bad)


def test_a_pod_without_model_or_http_port_is_an_error() -> None:
    p = pod()
    p["metadata"]["annotations"] = {}
    with pytest.raises(PodError, match="served-model"):
        engine_pod(p)
    p = pod()
    p["spec"]["containers"][0]["ports"] = [{"name": "metrics", "containerPort": 9000}]
    with pytest.raises(PodError, match="no container port named http"):
        engine_pod(p)


def ep(name: str, ip: str) -> EnginePod:
    return EnginePod(f"uid-{name}", "ns", name, ip, 8000, "vllm", "m")


def test_plan_starts_new_pods_and_stops_gone_ones() -> None:
    a, b, c = ep("a", "127.0.1.1"), ep("b", "127.0.1.2"), ep("c", "127.0.1.3")
    got = plan({a.uid: a, c.uid: c}, {a.uid: a, b.uid: b})
    assert got.start == (c,) and got.stop == (b.uid,) and got.waiting == ()
    assert plan({}, {}) == plan({a.uid: a}, {a.uid: a})  # nothing to do


def test_a_reused_address_waits_for_the_old_engine_to_exit() -> None:
    old, new = ep("old", "127.0.1.1"), ep("new", "127.0.1.1")
    got = plan({new.uid: new}, {old.uid: old})  # the same round: stop first, wait
    assert got.stop == (old.uid,) and got.start == () and got.waiting == (new,)
    still = plan({new.uid: new}, {}, exiting=[old.address])  # old not exited yet
    assert still.start == () and still.waiting == (new,)
    assert plan({new.uid: new}, {}).start == (new,)  # it has exited


def test_cold_starts_per_engine_kind() -> None:
    assert parse_cold_starts([]) == {"vllm": 0.0, "trtllm": 0.0}
    assert parse_cold_starts(["vllm=3", "trtllm=5.5"]) == {"vllm": 3.0, "trtllm": 5.5}
    for bad in ("vllm", "sglang=1", "vllm=x", "vllm=-1"):
        with pytest.raises(ValueError, match="--cold-start"):
            parse_cold_starts([bad])


def test_engine_argv_binds_the_pod_address_at_the_cold_start() -> None:
    p = EnginePod("u", "ns", "n", "127.0.1.9", 8001, "trtllm", "qwen", max_batch=4)
    argv = engine_argv(p, "/py", 1000.5, seed=3)
    assert argv[:6] == ["/py", "-m", "fleetgate_tools.devcluster.podengines", "--serve",
                        "--bind-at", "1000.500"]  # fmt: skip
    sim = argv[argv.index("--") + 1 :]
    assert sim == ["sim", "--trtllm", "1", "--host", "127.0.1.9", "--port", "8001",
                   "--model", "qwen", "--seed", "3", "--max-num-seqs", "4"]  # fmt: skip


def _closed(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def test_the_child_binds_only_after_its_cold_start() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p = EnginePod("u", "ns", "n", "127.0.0.1", port, "vllm", "m")
    t0 = time.time()
    child = subprocess.Popen(engine_argv(p, sys.executable, t0 + 2.0), start_new_session=True,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        while time.time() < t0 + 1.8:
            assert _closed(port), "bound before its cold start"
            time.sleep(0.1)
        deadline = time.time() + 20
        while _closed(port):
            assert time.time() < deadline, "never bound"
            time.sleep(0.05)
        assert time.time() - t0 >= 2.0
    finally:
        child.terminate()
        child.wait(10)


@pytest.mark.parametrize(
    "example, engine, batch",
    [("vllm-llama-3.1-8b.yaml", "vllm", 128), ("trtllm-qwen2.5-7b.yaml", "trtllm", 64)],
)
def test_reads_the_pods_the_operator_makes_from_the_examples(
    example: str, engine: str, batch: int | None
) -> None:
    """The pod template of the operator's Deployment for each example, as kwok runs it."""
    import yaml

    from fleetgate.api.v1alpha1 import InferenceServiceSpec
    from fleetgate.operator import manifests
    from fleetgate.operator.options import OperatorOptions

    doc = yaml.safe_load((Path(__file__).parents[2] / "examples" / example).read_text())
    spec = InferenceServiceSpec.model_validate(doc["spec"])
    children = manifests.build_children(
        manifests.Owner(name="svc", namespace="ns", uid="u"), spec, OperatorOptions(),
        service_monitor_supported=False,
    )  # fmt: skip
    (dep,) = [o for o in children.objects if o["kind"] == "Deployment"]
    template = dep["spec"]["template"]
    kwok_pod = {
        "metadata": {**template["metadata"], "name": "svc-1", "namespace": "ns", "uid": "p"},
        "spec": template["spec"],
        "status": {"podIP": "127.0.1.4"},
    }
    got = engine_pod(kwok_pod)
    assert got is not None
    assert (got.engine, got.model, got.ip, got.port) == (
        engine, spec.model.name or "svc", "127.0.1.4", 8000,
    )  # fmt: skip
    assert got.max_batch == batch  # maxNumSeqs / maxBatchSize in the example


def test_sync_starts_restarts_a_crashed_engine_and_stops_it_with_its_pod(tmp_path: Path) -> None:
    """Real children: the first cannot bind (the test holds the address) and exits; it is
    started again after its back-off, binds, and is stopped once the pod is gone."""
    from fleetgate_tools.devcluster.podengines import PodEngines

    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    live = pod(ip="127.0.0.1")
    live["spec"]["containers"][0]["ports"] = [{"name": "http", "containerPort": port}]
    listed = [live]
    events: list[dict[str, Any]] = []
    engines = PodEngines(lambda: listed, {"vllm": 0.0}, tmp_path, events.append)
    try:
        engines.sync()
        assert [e["event"] for e in events] == ["start"]
        deadline = time.time() + 30
        while not any(e["event"] == "crashed" for e in events):
            assert time.time() < deadline, events
            time.sleep(0.2)
            engines.sync()
        crash = next(e for e in events if e["event"] == "crashed")
        assert crash["code"] != 0 and crash["restarts_in_s"] == 2.0
        holder.close()  # the address is free: the restart binds it
        engines.sync()
        assert [e["event"] for e in events].count("start") == 1  # not before its back-off
        while _closed(port):
            assert time.time() < deadline, events
            time.sleep(0.2)
            engines.sync()
        assert [e["event"] for e in events].count("start") == 2
        listed.clear()  # the pod is gone
        engines.sync()
        assert events[-1]["event"] == "stop"
        while engines.exiting:
            assert time.time() < deadline, events
            time.sleep(0.2)
            engines.sync()
        assert events[-1]["event"] == "exit" and _closed(port)
    finally:
        holder.close()
        engines.stop_all()


def test_the_cold_start_runs_from_the_pods_first_listing(tmp_path: Path) -> None:
    """A pod listed before it has an IP (scheduling, kwok) starts its cold start then,
    as a real node's would: the engine binds at first listing + cold start, not at the
    moment the IP shows up; a pod first listed with its IP binds cold start from then."""
    from fleetgate_tools.devcluster.podengines import PodEngines

    clock = [100.0]
    listed = [pod("early", ip=None)]
    events: list[dict[str, Any]] = []
    engines = PodEngines(
        lambda: listed, {"vllm": 3.0}, tmp_path, events.append, python="/bin/true",
        now=lambda: clock[0],
    )  # fmt: skip
    try:
        engines.sync()
        assert events == []  # no IP yet: nothing to start
        clock[0] = 100.4
        listed[:] = [pod("early", ip="127.0.1.7"), pod("late", ip="127.0.1.8")]
        engines.sync()
        starts = {e["pod"]: e for e in events if e["event"] == "start"}
        assert starts["early"]["first_seen"] == 100.0 and starts["early"]["bind_at"] == 103.0
        assert starts["early"]["t"] == 100.4
        assert starts["late"]["first_seen"] == 100.4 and starts["late"]["bind_at"] == 103.4
        listed.clear()
        engines.sync()
        assert engines.first_seen == {}  # forgotten with the pods
    finally:
        engines.stop_all()
