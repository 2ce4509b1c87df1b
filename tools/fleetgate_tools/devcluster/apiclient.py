"""A minimal JSON client for the dev cluster's own API server and components.

The dev cluster needs a handful of calls while starting (``/readyz``, create nodes,
read nodes and the default ServiceAccount, the components' ``/healthz``), some of them
before its CA is known. It speaks plain HTTP with httpx, as the router's watch does
(see "Kubernetes clients" in docs/operator.md), rather than through the official
``kubernetes`` client: that client warns on every unverified request (and this
project's pytest turns warnings into errors), and starting a cluster stays free of
its slow import.

TLS is not verified (the API server self-signs via ``--cert-dir``); the client refuses
any server that is not on 127.0.0.0/8, so the skipped verification can only ever apply
to our own loopback API server. Proxy environment variables are ignored (an
``https_proxy`` must never see the admin token or carry loopback traffic off the host).
"""

from __future__ import annotations

import ipaddress
import ssl
import urllib.parse
from collections.abc import Iterator
from typing import Any

import httpx


class ApiClient:
    def __init__(self, server: str, token: str, timeout_s: float = 5.0) -> None:
        host = urllib.parse.urlsplit(server).hostname or ""
        try:
            loopback = ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = False
        if not loopback:
            raise ValueError(f"dev-cluster API client only talks to loopback, got {server!r}")
        self.server = server.rstrip("/")
        self._token = token
        self._timeout_s = timeout_s
        self._ssl = ssl.create_default_context()
        self._ssl.check_hostname = False
        self._ssl.verify_mode = ssl.CERT_NONE

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        content_type: str = "application/json",
    ) -> tuple[int, Any]:
        """Return (HTTP status, decoded JSON or text). Connection errors raise OSError."""
        headers = {"Authorization": f"Bearer {self._token}", "Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = content_type
        try:
            # one connection per call, as the callers poll rarely and from several threads
            with httpx.Client(verify=self._ssl, trust_env=False, timeout=self._timeout_s) as c:
                resp = c.request(method, self.server + path, headers=headers, json=body)
        except httpx.TransportError as e:
            raise OSError(f"{method} {self.server}{path}: {e}") from e
        try:
            return resp.status_code, resp.json()
        except ValueError:
            return resp.status_code, resp.text

    def get(self, path: str) -> tuple[int, Any]:
        return self.request("GET", path)

    def watch_lines(self, path: str) -> Iterator[str]:
        """The lines of a watch (``path`` with ``watch=1``) until the server ends it.
        Connection errors and a non-200 answer raise OSError."""
        headers = {"Authorization": f"Bearer {self._token}"}
        timeout = httpx.Timeout(self._timeout_s, read=None)  # a watch is quiet for long
        try:
            with (
                httpx.Client(verify=self._ssl, trust_env=False, timeout=timeout) as c,
                c.stream("GET", self.server + path, headers=headers) as resp,
            ):
                if resp.status_code != 200:
                    raise OSError(f"watch {path}: HTTP {resp.status_code}")
                for line in resp.iter_lines():
                    if line:
                        yield line
        except httpx.HTTPError as e:
            raise OSError(f"watch {self.server}{path}: {e}") from e

    def post(self, path: str, body: Any) -> tuple[int, Any]:
        return self.request("POST", path, body)

    def merge_patch(self, path: str, body: Any) -> tuple[int, Any]:
        return self.request("PATCH", path, body, "application/merge-patch+json")
