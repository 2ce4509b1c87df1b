"""trtllm-serve emulation quirks, the fleet runner and the ``fleetgate sim`` CLI.

We test these aspects: drained JSON /metrics with TRT's field names, the
first-chat-chunk space, include_usage defaulting on, stream_options without
stream -> 400, /prometheus/metrics families, a 16-engine fleet serving from one
process, and the CLI refusing non-loopback hosts and bad fleet files (one line).
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from fleetgate.engines import get_adapter
from fleetgate.engines.trtllm.sources import ITERATION_STATS, PROMETHEUS
from fleetgate.router.config import parse_backend_flag
from fleetgate.sim.fleet import EngineSpec, Fleet, FleetError, run_fleet


@pytest.fixture
async def trt() -> AsyncIterator[Fleet]:
    async with run_fleet([EngineSpec(kind="trtllm")], "127.0.0.1", 0, model="m") as f:
        yield f


async def test_trt_json_metrics_are_drained(trt: Fleet) -> None:
    async with httpx.AsyncClient(base_url=trt.engines[0].url, timeout=10) as c:
        r = await c.post("/v1/completions", json={"prompt": "hello there", "max_tokens": 5})
        assert r.status_code == 200
        assert r.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
        first = (await c.get("/metrics")).json()
        assert isinstance(first, list) and first
        it = first[-1]
        for key in (
            "timestamp",
            "iter",
            "iterLatencyMS",
            "numActiveRequests",
            "numQueuedRequests",
            "maxNumActiveRequests",
            "kvCacheStats",
            "inflightBatchingStats",
        ):
            assert key in it
        assert set(it["kvCacheStats"]) == {
            "maxNumBlocks",
            "freeNumBlocks",
            "usedNumBlocks",
            "tokensPerBlock",
            "allocTotalBlocks",
            "allocNewBlocks",
            "reusedBlocks",
            "missedBlocks",
            "cacheHitRate",
        }
        assert it["kvCacheStats"]["tokensPerBlock"] == 32
        assert "numPausedRequests" in it["inflightBatchingStats"]
        assert (await c.get("/metrics")).json() == [], "read once, then gone"
        prom = (await c.get("/prometheus/metrics")).text
        assert "trtllm_num_requests_running{" in prom
        assert "trtllm_kv_cache_utilization{" in prom
        assert "trtllm_request_success_total{" in prom
        # the limit the router reads, in both sources alike
        snap = get_adapter("trtllm").parse_metrics(PROMETHEUS, prom.encode(), 0.0, None)
        assert snap.max_running == it["maxNumActiveRequests"] > 0
        models = (await c.get("/v1/models")).json()
        assert models["data"][0]["owned_by"] == "tensorrt_llm"


#: Families of main's collector (the contract exposition) the emulator does not write,
#: and why.
NOT_EMULATED = {
    "trtllm_kv_cache_iter_reused_blocks": "from kvCacheIterationStats, not emulated",
}


def _families(text: str) -> set[str]:
    """``trtllm_*`` family names of an exposition (``_total`` dropped, as TYPE gives them
    for counters by the client library's version)."""
    return {
        line.split()[2].removesuffix("_total")
        for line in text.splitlines()
        if line.startswith("# TYPE trtllm_")
    }


async def test_trt_prometheus_has_every_family_of_mains_collector(trt: Fleet) -> None:
    contract = Path(__file__).parents[1] / "engines" / "data" / "trtllm_prometheus_main.prom.txt"
    want = _families(contract.read_text()) - set(NOT_EMULATED)
    async with httpx.AsyncClient(base_url=trt.engines[0].url, timeout=10) as c:
        before = _families((await c.get("/prometheus/metrics")).text)
        r = await c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3})
        assert r.status_code == 200
        prom = (await c.get("/prometheus/metrics")).text
    assert want - _families(prom) == set(), "families main's collector writes"
    # the row-fed families appear once a request completed, as in the collector
    assert "trtllm_iteration_latency_seconds" not in before
    snap = get_adapter("trtllm").parse_metrics(PROMETHEUS, prom.encode(), 0.0, None)
    assert snap.max_running is not None and snap.running == 0


async def test_trt_stream_quirks(trt: Fleet) -> None:
    async with httpx.AsyncClient(base_url=trt.engines[0].url, timeout=10) as c:
        body = {
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 3,
            "stream": True,
            "stream_options": {},
            "ignore_eos": True,
        }
        r = await c.post("/v1/chat/completions", json=body)
        text = r.text
        assert text.startswith("data: {") and text.split("\n\n")[0].endswith("} ")
        chunks = [c for c in text.split("\n\n") if c.strip()]
        assert chunks[-1] == "data: [DONE]"
        last = json.loads(chunks[-2].removeprefix("data: "))
        assert last["choices"] == [] and last["usage"]["completion_tokens"] == 3
        bad = await c.post(
            "/v1/completions", json={"prompt": "x", "stream_options": {"include_usage": True}}
        )
        assert bad.status_code == 400 and "error" in bad.json()
        pr = await c.post("/v1/completions", json={"prompt": "x", "priority": 2.0})
        assert pr.status_code == 400
        long = await c.post("/v1/completions", json={"prompt": "hello world " * 400})
        assert long.status_code == 400 and long.json()["object"] == "error"


async def test_sixteen_engine_fleet_serves() -> None:
    specs = [EngineSpec(kind="vllm")] * 8 + [EngineSpec(kind="trtllm")] * 8
    async with run_fleet(specs, "127.0.0.1", 0, model="m", time_scale=0.0) as f:
        assert len({e.port for e in f.engines}) == 16
        async with httpx.AsyncClient(timeout=20) as c:
            rs = await asyncio.gather(
                *(
                    c.post(e.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4})
                    for e in f.engines
                )
            )
    assert [r.status_code for r in rs] == [200] * 16


async def test_non_loopback_refused() -> None:
    with pytest.raises(FleetError, match="loopback"):
        async with run_fleet([EngineSpec(kind="vllm")], "0.0.0.0", 0):
            pass


def run_cli(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fleetgate", "sim", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        pytest.param(["--vllm", "1", "--host", "0.0.0.0"], "loopback", id="any-host"),
        pytest.param(["--vllm", "1", "--host", "10.1.2.3"], "loopback", id="lan-host"),
        pytest.param([], "nothing to run", id="empty"),
        pytest.param(["--vllm", "-1"], ">= 0", id="negative"),
        pytest.param(
            ["--vllm", "1", "--profile", "nope", "--port", "0"], "unknown profile", id="profile"
        ),
    ],
)
def test_cli_one_line_errors(args: list[str], needle: str) -> None:
    p = run_cli(*args)
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], p.stderr


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        pytest.param("engines: []\n", "field engines", id="no-engines"),
        pytest.param("engines:\n  - kind: sglang\n", "field engines.0.kind", id="bad-kind"),
        pytest.param("engines:\n  - kind: vllm\n    colour: red\n", "engines.0.colour", id="extra"),
        pytest.param("engines: [\n", "not valid YAML", id="yaml"),
    ],
)
def test_cli_bad_fleet_file(tmp_path: Path, content: str, needle: str) -> None:
    path = tmp_path / "fleet.yaml"
    path.write_text(content)
    p = run_cli("--fleet", str(path))
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], p.stderr


def test_cli_prints_engines_and_exits_on_sigterm(tmp_path: Path) -> None:
    fleet = tmp_path / "f.yaml"
    fleet.write_text("model: tiny\nengines:\n  - kind: trtllm\n    port: 0\n")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "fleetgate",
            "sim",
            "--vllm",
            "1",
            "--port",
            "0",
            "--fleet",
            str(fleet),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        lines = [proc.stdout.readline().strip() for _ in range(2)]
        assert lines[0].startswith("engine=trtllm url=http://127.0.0.1:")
        assert lines[1].startswith("engine=vllm url=http://127.0.0.1:")
        assert lines[1].endswith(" model=tiny")
        url = lines[1].split()[1].removeprefix("url=")
        assert httpx.get(url + "/health", timeout=5).status_code == 200
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=15)
    assert proc.returncode == 0, err


def test_cli_line_of_an_attention_dp_replica_pastes_into_a_backend_flag() -> None:
    """Without KV events the ranks are printed as the replica's schedulers."""
    cmd = [sys.executable, "-m", "fleetgate", "sim", "--trtllm", "1",
           "--trtllm-attention-dp", "2", "--host", "127.0.0.1", "--port", "0"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=15)
    assert proc.returncode == 0, err
    fields = dict(part.split("=", 1) for part in line.split())
    assert fields["schedulers"] == "2" and "kv_events" not in fields, line
    backend = parse_backend_flag(f"trtllm={fields['url']},schedulers={fields['schedulers']}")
    assert backend.scheduler_count == 2


async def test_port_in_use_is_a_clear_error_and_frees_what_started() -> None:
    import socket

    blocker = socket.socket()
    blocker.bind(("127.0.0.1", 0))
    blocker.listen(1)
    taken = blocker.getsockname()[1]
    try:
        first = EngineSpec(kind="vllm")
        second = EngineSpec(kind="vllm", port=taken)
        with pytest.raises(FleetError, match=f"cannot listen on 127.0.0.1:{taken}"):
            async with run_fleet([first, second], "127.0.0.1", 0):
                pass
    finally:
        blocker.close()


def test_listening_socket_is_tcp_so_asyncio_sets_nodelay() -> None:
    """asyncio enables TCP_NODELAY on accepted sockets only when proto == IPPROTO_TCP."""
    from fleetgate.sim.fleet import _bind

    sock = _bind("127.0.0.1", 0)
    try:
        assert sock.proto == socket.IPPROTO_TCP
    finally:
        sock.close()


@pytest.mark.parametrize("ctype", ["text/plain", "application/x-www-form-urlencoded"])
async def test_trt_refuses_a_body_that_is_not_json(trt: Fleet, ctype: str) -> None:
    """trtllm-serve (FastAPI) answers 422 and runs nothing for a non-JSON POST."""
    body = b'{"model": "m", "prompt": "hi", "max_tokens": 2}'
    async with httpx.AsyncClient(base_url=trt.engines[0].url, timeout=10) as c:
        resp = await c.post("/v1/completions", content=body, headers={"content-type": ctype})
        assert resp.status_code == 422, resp.text
        assert resp.json()["detail"][0]["loc"] == ["body"]
        for ok_type in (None, "application/json; charset=utf-8"):
            headers = {} if ok_type is None else {"content-type": ok_type}
            resp = await c.post("/v1/completions", content=body, headers=headers)
            assert resp.status_code == 200, resp.text


async def test_trt_main_writes_one_iteration_row_per_attention_dp_rank() -> None:
    spec = EngineSpec(kind="trtllm", overrides={"attention_dp_ranks": 2})
    async with (
        run_fleet([spec], "127.0.0.1", 0, model="m") as f,
        httpx.AsyncClient(base_url=f.engines[0].url, timeout=10) as c,
    ):
        body = {"prompt": "hello there", "max_tokens": 4, "ignore_eos": True}
        answers = await asyncio.gather(*(c.post("/v1/completions", json=body) for _ in range(4)))
        assert all(r.status_code == 200 for r in answers)
        rows = (await c.get("/metrics")).json()
    by_iter: dict[int, list[dict[str, object]]] = {}
    for row in rows:
        by_iter.setdefault(row["iter"], []).append(row)
    assert by_iter and all(
        [r["attentionDpRank"] for r in group] == [0, 1] for group in by_iter.values()
    )
    for zero, one in by_iter.values():
        assert one["numQueuedRequests"] == 0 and one["kvCacheStats"] == zero["kvCacheStats"]
    scheduled = sum(r["inflightBatchingStats"]["numScheduledRequests"] for r in rows)
    assert scheduled > 0 and any(
        r["attentionDpRank"] == 1 and r["inflightBatchingStats"]["numScheduledRequests"]
        for r in rows
    ), "both ranks ran requests"
    snap = get_adapter("trtllm").parse_metrics(ITERATION_STATS, json.dumps(rows).encode(), 0, None)
    newest = by_iter[max(by_iter)][0]
    assert snap.running == newest["numActiveRequests"]
    assert snap.waiting == newest["numQueuedRequests"], "rank 0's row: it carries the queue"


async def test_trt_main_rows_without_attention_dp_are_rank_0(trt: Fleet) -> None:
    async with httpx.AsyncClient(base_url=trt.engines[0].url, timeout=10) as c:
        await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        rows = (await c.get("/metrics")).json()
    assert rows and {r["attentionDpRank"] for r in rows} == {0}
