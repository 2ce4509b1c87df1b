"""The operator/router image runs the router read-only, non-root, without capabilities.

* It routes streams to emulated engines (a vLLM and a TensorRT-LLM on 127.0.0.1,
  started on the host) and serves its Prometheus metrics.
* PID 1 is fleetgate itself (exec-form entrypoint), running as uid 65532.
* ``podman stop`` during a stream: the router stops accepting, the stream runs to
  ``[DONE]``, and the container exits 0 well inside the grace period.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from imagekit import container

pytestmark = [pytest.mark.image, pytest.mark.slow]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(url: str, timeout: float = 60) -> httpx.Response:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            r = httpx.get(url, timeout=2)
            if r.status_code == 200:
                return r
        time.sleep(0.2)
    raise AssertionError(f"{url} did not answer 200 in {timeout} s")


@pytest.fixture
def engines(tmp_path: Path) -> Iterator[list[tuple[str, str]]]:
    log_path = tmp_path / "sim.log"
    with log_path.open("wb") as log:
        # --port 0: ephemeral ports, read back from the sim's engine lines (two
        # consecutive ports from a free one may not both be free)
        proc = subprocess.Popen(
            [sys.executable, "-m", "fleetgate", "sim", "--vllm", "1", "--trtllm", "1",
             "--profile", "test", "--port", "0", "--model", "m", "--time-scale", "10",
             "--max-num-seqs", "32", "--num-gpu-blocks", "1024"],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while log_path.read_text().count("engine=") < 2:
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.1)
        lines = [ln for ln in log_path.read_text().splitlines() if ln.startswith("engine=")]
        fields = [dict(f.split("=", 1) for f in ln.split()) for ln in lines]
        urls = [kv["url"] for kv in sorted(fields, key=lambda kv: kv["engine"] != "vllm")]
        for url in urls:
            wait_for(url + "/health", 30)
        yield [("vllm", urls[0]), ("trtllm", urls[1])]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(20)


def stream(url: str, max_tokens: int) -> int:
    body = {"model": "m", "stream": True, "max_tokens": max_tokens, "ignore_eos": True,
            "messages": [{"role": "user", "content": "hello from the image test"}]}  # fmt: skip
    chunks, done = 0, False
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                assert '"error"' not in line, line
                chunks += 1
    assert done, "no [DONE]"
    return chunks


def test_router_image_routes_streams_serves_metrics_and_drains_on_stop(
    images: dict[str, str], engines: list[tuple[str, str]]
) -> None:
    port = free_port()
    args = ["router", "--host", "127.0.0.1", "--port", str(port), "--drain-timeout", "20"]
    for engine, url in engines:
        args += ["--backend", f"{engine}={url}"]
    with container(images["runtime"], args, name="fg-router") as c:
        url = f"http://127.0.0.1:{port}"
        wait_for(url + "/metrics")
        # PID 1 is fleetgate, as uid 65532, on a read-only root
        cmdline = c.exec("cat", "/proc/1/cmdline").split("\0")
        assert "fleetgate" in cmdline[1] and cmdline[2] == "router", cmdline
        status = c.exec("cat", "/proc/1/status")
        assert any(line.split()[:2] == ["Uid:", "65532"] for line in status.splitlines()), status
        assert any(line.startswith("CapEff:\t0000000000000000") for line in status.splitlines())
        denied = c.exec("sh", "-c", "touch /opt/x 2>&1 || true")
        assert "Read-only file system" in denied, denied
        # routes streams to both engines
        for _ in range(6):
            assert stream(url, 8) >= 8
        metrics = httpx.get(url + "/metrics", timeout=5).text
        assert "fleetgate_" in metrics, metrics[:500]
        # podman stop in the middle of a stream: it finishes, the container exits 0
        result: list[int | BaseException] = []

        def run() -> None:
            try:
                result.append(stream(url, 150))  # ~150 x 10 ms of modelled decode
            except BaseException as e:
                result.append(e)

        t = threading.Thread(target=run)
        t.start()
        time.sleep(0.5)
        assert not result, result
        code, took = c.stop(grace_s=25)
        t.join(30)
        assert result and isinstance(result[0], int) and result[0] >= 150, result
        assert code == 0, c.logs()
        assert took < 25, f"stop took {took:.1f} s: the grace period ran out"
        with pytest.raises(httpx.ConnectError):
            httpx.get(url + "/metrics", timeout=2)
    assert os.environ.get("FLEETGATE_TEST_MODE") == "1"
