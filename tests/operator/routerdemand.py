"""Router ``/metrics`` text for autoscaling tests, rendered by the router's own classes.

The operator may not import the router (import contract), so it names the series in
:mod:`fleetgate.operator.autoscale`; these helpers render them with
:class:`fleetgate.router.metrics.RouterMetrics` / ``ClassMetrics`` so a rename on the
router side breaks the tests (``fleetgate_arrivals_total`` and
``fleetgate_held_requests`` live in ``ClassMetrics``).
"""

from __future__ import annotations

from collections.abc import Mapping

from endpoints import loopback_endpoint
from prometheus_client import Counter, Gauge, generate_latest

from fleetgate.operator import autoscale
from fleetgate.router.metrics import ClassMetrics, RouterMetrics
from fleetgate.router.priority.config import PriorityConfig
from fleetgate.router.scheduling.load import LoadParams
from fleetgate.router.scheduling.prefix import PrefixIndex
from fleetgate.router.state import Endpoint, Fleet


class RouterDemand:
    """One router's demand series; ``text()`` is its /metrics body."""

    def __init__(self) -> None:
        self.metrics = RouterMetrics()
        self.classes = ClassMetrics(self.metrics, PriorityConfig())
        # the router's own series: a rename on either side fails here
        self.arrivals: Counter = self.classes.arrivals
        self.held: Gauge = self.classes.held
        assert self.arrivals._name == autoscale.ARRIVALS
        assert self.held._name == autoscale.HELD
        assert self.metrics.requests._name == autoscale.REQUESTS
        self._health_eps: list[Endpoint] | None = None

    def arrive(self, model: str, n: int, cls: str = "standard") -> None:
        self.arrivals.labels(model=model, **{"class": cls}).inc(n)

    def set_held(self, model: str, n: float, cls: str = "standard") -> None:
        self.held.labels(model=model, **{"class": cls}).set(n)

    def set_queue(self, model: str, n: float, cls: str = "standard") -> None:
        self.classes.depth.labels(model, cls).set(n)

    def set_in_flight(self, endpoints: Mapping[str, float], engine: str = "vllm") -> None:
        for ep, n in endpoints.items():
            self.metrics.in_flight.labels(ep, engine).set(n)

    def complete(self, model: str, endpoint: str, n: int, status: str = "200") -> None:
        """``n`` requests answered from ``endpoint`` ('none': no engine reached)."""
        self.metrics.requests.labels(model, "vllm", endpoint, status).inc(n)

    def ttft(self, model: str, cls: str, met: int, missed: int) -> None:
        self.classes.ttft_objective.labels(model, cls, "true").inc(met)
        self.classes.ttft_objective.labels(model, cls, "false").inc(missed)

    def set_health(self, endpoints: Mapping[str, bool]) -> None:
        """The router's per-endpoint state (``fleetgate_endpoint_healthy`` among it),
        exported by its own fleet collector over endpoints with these ids; a later
        call with the same ids changes their state."""
        if self._health_eps is not None:
            for e in self._health_eps:
                e.healthy = endpoints[e.id]
            return
        eps = []
        for k, (ep, ok) in enumerate(endpoints.items()):
            e = loopback_endpoint("vllm", ep, 18500 + k)
            e.healthy = ok
            eps.append(e)
        self._health_eps = eps
        fleet = Fleet(eps, index=PrefixIndex(1024), load_params=LoadParams())
        self.metrics.watch_fleet(fleet, lambda: 0.0)

    def text(self) -> str:
        return generate_latest(self.metrics.registry).decode()
