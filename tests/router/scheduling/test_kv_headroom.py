"""The ``kv-headroom`` scorer counts the request's own blocks at the engine's block size."""

from __future__ import annotations

import pytest

from fleetgate.router.scheduling.plugins.kv_headroom import KvHeadroomScorer
from fleetgate.router.scheduling.types import EndpointId

from .views import req, view


def test_kv_headroom_counts_request_blocks() -> None:
    r = req(prompt_tokens=100, max_tokens=30)  # 144 tokens at block 16
    eps = [view("fits", free=200, total=1000), view("tight", free=140, total=1000)]
    got = KvHeadroomScorer().score(r, eps)
    assert got[EndpointId("fits")] == pytest.approx(56 / 1000)
    assert got[EndpointId("tight")] == 0.0
