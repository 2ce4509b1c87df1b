"""The project-wide guards in conftest.py really guard."""

from __future__ import annotations

import socket

import pytest


def test_non_loopback_connect_is_refused() -> None:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        with pytest.raises(PermissionError, match="loopback"):
            s.connect(("192.0.2.1", 80))  # TEST-NET-1: refused before any packet
    finally:
        s.close()


def test_loopback_connect_is_allowed() -> None:
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    client = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        client.connect(server.getsockname())
        conn, _ = server.accept()
        conn.close()
    finally:
        client.close()
        server.close()
