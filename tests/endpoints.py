"""Router ``Endpoint`` records for tests that need no engine behind them.

Importable from every test directory (``tests/`` is on ``sys.path``, see
``tests/realvllm.py``).
"""

from __future__ import annotations

from typing import Any

from fleetgate.router.scheduling.types import EndpointId
from fleetgate.router.served import adapter_for
from fleetgate.router.state import Endpoint


def loopback_endpoint(kind: str, name: str, port: int, **kw: Any) -> Endpoint:
    """An endpoint of engine ``kind`` at ``http://127.0.0.1:PORT`` (pool ``default``,
    the adapter's first metrics source)."""
    adapter = adapter_for(kind, None)
    return Endpoint(
        id=EndpointId(name),
        pool="default",
        engine=adapter.name,
        url=f"http://127.0.0.1:{port}",
        adapter=adapter,
        metrics_source=adapter.metrics_sources[0],
        **kw,
    )
