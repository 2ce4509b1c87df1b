"""``fleetgate router --port P [--host H] [--config FILE.yaml] [--backend ENGINE=URL ...]``.

Serves with uvicorn on httptools (and uvloop when installed; ``--loop asyncio``
to compare, see bench/bench_router_overhead.py). ``--backend`` flags join the
pool ``default`` of the config file (or form it). The host defaults to
127.0.0.1: exposing the router is an explicit choice.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import logging
import signal
import socket
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any
from urllib.parse import urlsplit

from fleetgate.cli import CliError
from fleetgate.router.config import (
    ConfigError,
    RouterConfig,
    is_loopback_host,
    load_config,
    with_backends,
    with_tokenizers,
)

#: Seconds a SIGTERM drain waits for in-flight requests (charts/fleetgate sets the
#: pod's terminationGracePeriodSeconds above the preStop sleep plus this).
DRAIN_TIMEOUT_S = 30.0


def build_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--port", type=int, required=True, help="port to listen on")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--config", metavar="FILE.yaml", help="router configuration file")
    parser.add_argument(
        "--backend",
        action="append",
        default=[],
        metavar="ENGINE=URL[,OPT=V...]",
        help="add an engine endpoint, e.g. vllm=http://127.0.0.1:18100 (repeatable); "
        "options after commas: name=ID, kv_events=tcp://HOST:PORT, kv_replay=tcp://HOST:PORT, "
        "kv_topic=T, or kv_events=http-drain:/PATH (what `fleetgate sim --kv-events` prints)",
    )
    parser.add_argument(
        "--tokenizer",
        action="append",
        default=[],
        metavar="MODEL=hf:DIR|MODEL=emulator",
        help="a served model's tokenizer for the exact KV view: hf:DIR (tokenizer.json + "
        "chat template) or emulator (repeatable; scheduling.tokenizers in the config)",
    )
    parser.add_argument(
        "--loop", choices=("auto", "uvloop", "asyncio"), default="auto", help="event loop"
    )
    parser.add_argument("--log-level", default="warning", help="python log level (default warning)")
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=DRAIN_TIMEOUT_S,
        metavar="SECONDS",
        help="on SIGTERM/SIGINT: stop accepting, let in-flight streams finish for at most "
        f"this long, then exit 0 (default {DRAIN_TIMEOUT_S:g}; the chart's grace period is longer)",
    )


def resolve_config(args: argparse.Namespace) -> RouterConfig:
    try:
        config = load_config(args.config) if args.config else RouterConfig()
        config = with_backends(config, list(args.backend))
        config = with_tokenizers(config, list(getattr(args, "tokenizer", [])))
        config.backends()
        config.check_loopback()
    except ConfigError as e:
        raise CliError(str(e)) from None
    if not config.backends() and config.discovery.kind == "static":
        raise CliError("no backends: pass --backend ENGINE=URL or a --config with pools")
    return config


def attach_discovery(app: Any, config: RouterConfig) -> None:
    """Wire ``discovery.kind: kubernetes`` (fleetgate/router/discovery_k8s.py) into the app."""
    if config.discovery.kind != "kubernetes":
        return
    from fleetgate.router.discovery_k8s import attach

    k8s = config.discovery.kubernetes
    allow = None
    if config.effective_test_mode:

        def allow(url: str) -> bool:
            return is_loopback_host(urlsplit(url).hostname or "")

    attach(app, k8s, allow_url=allow)


def run(args: argparse.Namespace) -> int:
    if not 0 < args.port < 65536:
        raise CliError(f"--port {args.port}: must be 1-65535")
    if not args.drain_timeout >= 0:
        raise CliError(f"--drain-timeout {args.drain_timeout}: must be >= 0")
    config = resolve_config(args)
    import uvicorn

    from fleetgate.router.app import build_router
    from fleetgate.router.http_server import guarded_protocol

    level = str(args.log_level).upper()
    if level not in logging.getLevelNamesMapping():
        raise CliError(f"--log-level {args.log_level!r}: unknown level")
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        app = build_router(config)
    except ConfigError as e:
        raise CliError(str(e)) from None
    try:
        attach_discovery(app, config)
    except ConfigError as e:  # e.g. an unusable kubeconfig: one line, not a traceback
        raise CliError(str(e)) from None
    loop = args.loop
    if loop == "auto":
        loop = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"
    sock = listen_socket(args.host, args.port)
    server_config = uvicorn.Config(
        app,
        loop=loop,
        http=guarded_protocol(config),
        lifespan="on",
        access_log=False,
        log_level=level.lower(),
        timeout_keep_alive=config.timeouts.client_keep_alive_s,  # type: ignore[arg-type]
        timeout_graceful_shutdown=args.drain_timeout,
    )
    try:
        draining_server(server_config, on_exit=app.state.end_long_polls).run(sockets=[sock])
    finally:
        sock.close()
    return 0


def draining_server(config: Any, on_exit: Callable[[], None] | None = None) -> Any:
    """A ``uvicorn.Server`` whose SIGTERM/SIGINT is a drain that ends in exit code 0.

    uvicorn already drains on these signals: it closes the listener (new
    connections are refused), closes idle keep-alive connections, lets every
    in-flight response (a stream included) finish for up to
    ``timeout_graceful_shutdown`` seconds, then cancels what is left. Afterwards it
    re-raises the signal with the default handler, so a drained router would end
    "killed by SIGTERM" (143) instead of 0, except as PID 1 in a container where the
    kernel drops that signal. Here the drain is the whole answer to the signal.
    ``on_exit`` runs on the signal too (the app ends its ``GET /held`` long polls, which
    would otherwise hold the drain up for their whole wait).
    """

    import uvicorn

    class DrainingServer(uvicorn.Server):
        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            super().handle_exit(sig, frame)
            if on_exit is not None:
                on_exit()

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            handled = (signal.SIGINT, signal.SIGTERM)
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    return DrainingServer(config)


def listen_socket(host: str, port: int) -> socket.socket:
    """The listening socket, created with ``IPPROTO_TCP``.

    asyncio only sets TCP_NODELAY on accepted sockets whose ``proto`` is
    IPPROTO_TCP (``base_events._set_nodelay``); a socket made with the default
    proto 0 (as ``uvicorn`` binds it) leaves Nagle on under the plain asyncio
    loop, which holds a response body behind its headers until the client's
    delayed ACK (~40 ms). uvloop sets TCP_NODELAY itself; this covers both.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise CliError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock
