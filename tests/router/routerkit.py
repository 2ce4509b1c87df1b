"""Router test helpers (``import routerkit``): serve an app on 127.0.0.1, build configs."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Sequence
from typing import Any

import uvicorn
from starlette.types import ASGIApp

from fleetgate.router.config import RouterConfig, parse_config


@contextlib.asynccontextmanager
async def serve(
    app: ASGIApp, *, lifespan: str = "on", http: Any = "httptools", **uvicorn_kw: Any
) -> AsyncIterator[str]:
    """Run ``app`` with uvicorn on an ephemeral loopback port; yield its base URL.

    ``http``: uvicorn's protocol (the router CLI passes ``guarded_protocol(config)``)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # TCP_NODELAY
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(
        app, lifespan=lifespan, log_level="warning", access_log=False, http=http,
        timeout_graceful_shutdown=2, **uvicorn_kw,
    )  # fmt: skip
    server = uvicorn.Server(config)
    task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
    try:
        for _ in range(500):
            if server.started or task.done():
                break
            await asyncio.sleep(0.01)
        if task.done():
            task.result()
        assert server.started, "uvicorn did not start"
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(task, 10)
        sock.close()


def router_config(
    backends: Sequence[tuple[str, str]], capacity: int | None = 8, **sections: Any
) -> RouterConfig:
    """A test config: fast scrapes and probes, the given (engine, url) backends.

    ``capacity`` 8 is the emulator "test" profile's max_num_seqs.
    """
    entries = [{"engine": e, "url": u, "capacity": capacity} for e, u in backends]
    data: dict[str, Any] = {
        "test_mode": True,
        "pools": [{"name": "default", "backends": entries}],
        "scrape": {"interval_s": 0.05, "timeout_s": 1.0},
        "health": {"interval_s": 0.1, "timeout_s": 1.0, "eject_base_s": 0.5},
    }
    for key, value in sections.items():
        data[key] = {**data.get(key, {}), **value} if isinstance(value, dict) else value
    return parse_config(data)
