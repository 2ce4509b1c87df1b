"""The dev cluster's JSON client: bearer token, JSON both ways, OSError on no connection."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from fleetgate_tools import procs
from fleetgate_tools.devcluster.apiclient import ApiClient

SEEN: list[dict[str, Any]] = []


class _Handler(BaseHTTPRequestHandler):
    def _answer(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length).decode() if length else ""
        SEEN.append(
            {
                "method": self.command,
                "path": self.path,
                "auth": self.headers.get("Authorization"),
                "type": self.headers.get("Content-Type"),
                "body": json.loads(body) if body else None,
            }
        )
        status, payload = (404, b"not json") if self.path == "/missing" else (201, b'{"ok":1}')
        if self.path.startswith("/watch"):
            status, payload = 200, b'{"type":"ADDED"}\n\n{"type":"MODIFIED"}\n'
        self.send_response(status)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    do_GET = do_POST = do_PATCH = _answer

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def server() -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    SEEN.clear()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=5)


def test_json_calls_carry_the_token_and_decode_the_answer(server: str) -> None:
    api = ApiClient(server, "s3cret")
    assert api.post("/api/v1/nodes", {"kind": "Node"}) == (201, {"ok": 1})
    assert api.merge_patch("/api/v1/nodes/n/status", {"status": {}}) == (201, {"ok": 1})
    assert api.get("/missing") == (404, "not json")
    assert [(s["method"], s["auth"], s["type"], s["body"]) for s in SEEN] == [
        ("POST", "Bearer s3cret", "application/json", {"kind": "Node"}),
        ("PATCH", "Bearer s3cret", "application/merge-patch+json", {"status": {}}),
        ("GET", "Bearer s3cret", None, None),
    ]


def test_no_server_is_an_os_error() -> None:
    port = procs.free_loopback_port()
    with pytest.raises(OSError, match=f"GET http://127.0.0.1:{port}/readyz"):
        ApiClient(f"http://127.0.0.1:{port}", "t", timeout_s=2).get("/readyz")


def test_watch_lines_yields_the_non_empty_lines_and_refuses_errors(server: str) -> None:
    api = ApiClient(server, "s3cret")
    lines = list(api.watch_lines("/watch?watch=1"))
    assert lines == ['{"type":"ADDED"}', '{"type":"MODIFIED"}']
    assert SEEN[-1]["auth"] == "Bearer s3cret"
    with pytest.raises(OSError, match="HTTP 404"):
        list(api.watch_lines("/missing"))
    closed = ApiClient(f"http://127.0.0.1:{procs.free_loopback_port()}", "t", timeout_s=1.0)
    with pytest.raises(OSError):
        list(closed.watch_lines("/watch"))
