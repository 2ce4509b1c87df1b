"""The emulator image runs the operator's engine containers exactly as generated.

For every case of tests/engine_cmdlines.py (each ``examples/*.yaml``, every CRD
engine setting, ``extraArgs``), the container runs with the generated ``command``
as its entrypoint and the generated ``args``, the TensorRT-LLM options ConfigMap
mounted read-only where the manifest mounts it, read-only root, no capabilities,
uid 65532. It must start, answer the manifest's startup, readiness and liveness
probe paths on the manifest's port, serve a streamed completion, log unknown
flags exactly once, and exit 0 on ``podman stop``.

The container binds the generated ``--host 0.0.0.0`` as a 127/8 address of its
own (``FLEETGATE_TEST_MODE=1`` and ``FLEETGATE_SIM_BIND_HOST``; host network).
"""

from __future__ import annotations

import contextlib
import random
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from engine_cmdlines import cases, engine_container
from imagekit import container

pytestmark = [pytest.mark.image, pytest.mark.slow]


def wait_healthy(url: str, path: str, c: Any, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + path, timeout=2).status_code == 200:
                return
        assert c.running() or not c.state(), c.logs()
        time.sleep(0.2)
    raise AssertionError(f"startup probe {path} never passed:\n{c.logs()}")


@pytest.mark.parametrize("spec", cases())
def test_generated_engine_container_runs_in_the_emulator_image(
    images: dict[str, str], spec: dict[str, Any], tmp_path: Path
) -> None:
    e = engine_container(spec)
    host = f"127.{random.randint(64, 250)}.{random.randint(0, 255)}.{random.randint(2, 250)}"
    volumes = []
    if e.config_files:
        config = tmp_path / "config"
        config.mkdir()
        config.chmod(0o755)
        for name, text in e.config_files.items():
            (config / name).write_text(text)
        volumes.append(f"{config}:{e.config_mount_path}:ro")
    env = {"FLEETGATE_SIM_BIND_HOST": host, "FLEETGATE_SIM_TIME_SCALE": "0.01"}
    with container(
        images["emulator"], e.args, entrypoint=e.command, env=env, volumes=volumes, name="fg-engine"
    ) as c:
        url = f"http://{host}:{e.port}"
        wait_healthy(url, e.probes["startupProbe"], c)
        for kind in ("readinessProbe", "livenessProbe"):
            assert httpx.get(url + e.probes[kind], timeout=5).status_code == 200, kind
        model = httpx.get(url + "/v1/models", timeout=5).json()["data"][0]["id"]
        if e.engine == "vllm":
            assert model == e.served_model
        body = {"model": model, "stream": True, "max_tokens": 8,
                "messages": [{"role": "user", "content": "hi"}]}  # fmt: skip
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=30) as r:
            assert r.status_code == 200, r.read()
            lines = [x for x in r.iter_lines() if x.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        code, took = c.stop(grace_s=20)
        logs = c.logs()
    assert code == 0, logs
    assert took < 20
    assert logs.count("unknown to the emulator") == (1 if e.spec.engine.extra_args else 0), logs
    assert f"emulating {e.engine}" in logs
