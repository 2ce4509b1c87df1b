"""Backends for the conformance suite: the emulator and a REAL vLLM 0.32 (CPU).

Every check in ``tests/conformance`` takes the ``backend`` fixture, which is
parametrised over ``emulator`` (see :mod:`.backends`) and ``vllm``, the real
server of :mod:`realvllm` (marked ``realvllm``; never skipped: a failed install
or start FAILS these tests). The same assertions run against both, so a check
that passes on ``vllm`` and fails on ``emulator`` is an emulator fidelity bug
(docs/emulator-fidelity.md). Both servers bind to 127.0.0.1 and are stopped by
PID at the end of the session.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator

import pytest
import zmq
from realvllm import real_vllm

from . import kv_scenario as sc
from .backends import Backend, run_emulator

__all__ = ["backend", "emulator", "real_vllm", "sub_socket"]


@pytest.fixture(scope="session")
def emulator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Backend]:
    with run_emulator(tmp_path_factory.mktemp("emulator") / "sim.log") as backend:
        yield backend


@pytest.fixture(
    scope="session",
    params=[
        pytest.param("emulator", id="emulator"),
        # The first run may install vLLM (~5 min) and cold-start it (~1 min).
        pytest.param("vllm", id="vllm", marks=[pytest.mark.realvllm, pytest.mark.timeout(1500)]),
    ],
)
def backend(request: pytest.FixtureRequest) -> Backend:
    if request.param == "emulator":
        emu: Backend = request.getfixturevalue("emulator")
        return emu
    server = request.getfixturevalue("real_vllm")
    return Backend("vllm", server.base_url, server.model, server.log_path)


@pytest.fixture(autouse=True)
def _show_log_on_failure(request: pytest.FixtureRequest) -> Iterator[None]:
    """Attach the backend's log tail to a failing check's report."""
    yield
    rep = getattr(request.node, "rep_call", None)
    if rep is not None and rep.failed and "backend" in request.fixturenames:
        b: Backend = request.getfixturevalue("backend")
        with contextlib.suppress(OSError):
            tail = "\n".join(b.log_path.read_text(errors="replace").splitlines()[-40:])
            rep.sections.append((f"{b.name} log tail ({b.log_path})", tail))


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> object:
    rep = yield
    if call.when == "call":
        item.rep_call = rep  # type: ignore[attr-defined]
    return rep


@pytest.fixture
def sub_socket() -> Iterator[tuple[zmq.Socket[bytes], str]]:
    """A SUB socket connected (retrying until it exists) to an ipc:// endpoint that
    the engine binds; a short path, as unix socket paths are limited to ~107 bytes."""
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, sc.TOPIC.encode())
    with tempfile.TemporaryDirectory(prefix="fg-kv-") as tmp:
        endpoint = f"ipc://{tmp}/pub.ipc"
        sc.watch_connection(sub)
        sub.connect(endpoint)
        try:
            yield sub, endpoint
        finally:
            sub.close()
