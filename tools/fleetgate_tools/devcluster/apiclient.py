"""A minimal JSON client for the dev cluster's API server (stdlib only).

The dev cluster only needs a handful of calls while starting (``/readyz``, create nodes,
read nodes and the default ServiceAccount), so it uses ``urllib`` rather than the
``kubernetes`` package: starting a cluster never imports a Kubernetes client and the
module stays usable from ``fleetgate dev-cluster`` without heavy imports.

TLS is not verified (the API server self-signs via ``--cert-dir``); the client refuses
any server that is not on 127.0.0.0/8, so the skipped verification can only ever apply
to our own loopback API server. Proxy environment variables are ignored (an
``https_proxy`` must never see the admin token or carry loopback traffic off the host).
"""

from __future__ import annotations

import ipaddress
import json
import ssl
import urllib.error
import urllib.parse
import urllib.request
from typing import Any


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
        self._opener = urllib.request.build_opener(
            urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=self._ssl)
        )

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        content_type: str = "application/json",
    ) -> tuple[int, Any]:
        """Return (HTTP status, decoded JSON or text). Connection errors raise OSError."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.server + path, data=data, method=method)
        req.add_header("Authorization", f"Bearer {self._token}")
        req.add_header("Accept", "application/json")
        if data is not None:
            req.add_header("Content-Type", content_type)
        try:
            with self._opener.open(req, timeout=self._timeout_s) as resp:
                status, raw = int(resp.status), resp.read()
        except urllib.error.HTTPError as e:
            status, raw = int(e.code), e.read()
        text = raw.decode(errors="replace")
        try:
            return status, json.loads(text)
        except ValueError:
            return status, text

    def get(self, path: str) -> tuple[int, Any]:
        return self.request("GET", path)

    def post(self, path: str, body: Any) -> tuple[int, Any]:
        return self.request("POST", path, body)

    def merge_patch(self, path: str, body: Any) -> tuple[int, Any]:
        return self.request("PATCH", path, body, "application/merge-patch+json")
