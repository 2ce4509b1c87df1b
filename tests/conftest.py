"""Project-wide test guards.

* Every coroutine test fails if it leaves asyncio tasks running (kopf's habit).
* ``FLEETGATE_TEST_MODE=1`` is set for the whole run: fleetgate's HTTP clients
  then refuse any backend outside 127.0.0.0/8.
* As a second line of defence, ``socket.connect`` in this process refuses any
  IPv4/IPv6 address that is not loopback, so no test can send traffic elsewhere.
"""

from __future__ import annotations

import asyncio
import inspect
import ipaddress
import os
import socket
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import pytest_asyncio

os.environ["FLEETGATE_TEST_MODE"] = "1"

# One real Kubernetes control plane per test session, shared by every test dir.
pytest_plugins = ["k8s_fixtures"]


def _is_loopback(address: Any) -> bool:
    host = address[0] if isinstance(address, tuple) else address
    if not isinstance(host, str):
        return True  # AF_UNIX and friends
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        return False  # a name: refuse, tests must use loopback literals


@pytest.fixture(autouse=True, scope="session")
def _loopback_only() -> Iterator[None]:
    original_connect = socket.socket.connect
    original_connect_ex = socket.socket.connect_ex

    def guarded(self: socket.socket, address: Any) -> Any:
        if self.family in (socket.AF_INET, socket.AF_INET6) and not _is_loopback(address):
            raise PermissionError(f"test traffic must stay on loopback, refused {address!r}")
        return original_connect(self, address)

    def guarded_ex(self: socket.socket, address: Any) -> Any:
        if self.family in (socket.AF_INET, socket.AF_INET6) and not _is_loopback(address):
            raise PermissionError(f"test traffic must stay on loopback, refused {address!r}")
        return original_connect_ex(self, address)

    socket.socket.connect = guarded  # type: ignore[method-assign]
    socket.socket.connect_ex = guarded_ex  # type: ignore[method-assign]
    yield
    socket.socket.connect = original_connect  # type: ignore[method-assign]
    socket.socket.connect_ex = original_connect_ex  # type: ignore[method-assign]


@pytest_asyncio.fixture
async def _task_leak_guard() -> AsyncIterator[None]:
    before = set(asyncio.all_tasks())
    yield
    for _ in range(5):  # let cancelled tasks run their finally blocks
        await asyncio.sleep(0)
    current = asyncio.current_task()
    leaked = [
        t for t in asyncio.all_tasks() if t not in before and t is not current and not t.done()
    ]
    if leaked:
        for task in leaked:
            task.cancel()
        pytest.fail(f"Unattended asyncio tasks detected: {leaked!r}")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        fn = getattr(item, "function", None)
        if fn is not None and inspect.iscoroutinefunction(fn):
            fixturenames = getattr(item, "fixturenames", None)
            if fixturenames is not None and "_task_leak_guard" not in fixturenames:
                fixturenames.insert(0, "_task_leak_guard")
