"""Prometheus metrics of the operator itself.

One :class:`OperatorMetrics` per operator, on its own ``CollectorRegistry`` (no
process-global default registry: tests build fresh ones).

* ``fleetgate_operator_reconciles_total{result}``: result is ``ok`` (nothing to
  write or writes succeeded), ``invalid`` (spec refused) or ``error`` (API error).
* ``fleetgate_operator_reconcile_errors_total{reason}``: by status reason.
* ``fleetgate_operator_reconcile_duration_seconds``: histogram of one reconcile.
* ``fleetgate_operator_writes_total{kind}``: server-side applies actually sent
  (the level-based loop must not write when nothing changed).
* ``fleetgate_operator_replicas_ready{namespace,name}``: ready engine replicas.
* ``fleetgate_operator_autoscale_desired_replicas{namespace,name}``: the last decision.
* ``fleetgate_operator_autoscale_demand{namespace,name,signal}``: the demand it saw
  (signal: inFlight, queued, held, arrivalRate, kvCacheUtilization, ttftAttainment).
* ``fleetgate_operator_autoscale_decisions_total{namespace,name,direction}``: scales.
* ``fleetgate_operator_autoscale_scrape_errors_total``: router /metrics not read.
* ``fleetgate_operator_pool_gpus{pool,state}``: a pool's GPU budget (``budget``), the
  GPUs its autoscaled services' demand asks for (``wanted``) and what the budget
  grants them (``granted``); only for pools with ``--pool-gpu-budget``.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

__all__ = ["OperatorMetrics"]


class OperatorMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.reconciles = Counter(
            "fleetgate_operator_reconciles",
            "InferenceService reconciles, by result.",
            ["result"],
            registry=self.registry,
        )
        self.errors = Counter(
            "fleetgate_operator_reconcile_errors",
            "Reconciles that ended in a fault, by status reason.",
            ["reason"],
            registry=self.registry,
        )
        self.duration = Histogram(
            "fleetgate_operator_reconcile_duration_seconds",
            "Wall time of one reconcile.",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
            registry=self.registry,
        )
        self.writes = Counter(
            "fleetgate_operator_writes",
            "Child objects written by server-side apply, by kind.",
            ["kind"],
            registry=self.registry,
        )
        self.replicas_ready = Gauge(
            "fleetgate_operator_replicas_ready",
            "Ready engine replicas per InferenceService.",
            ["namespace", "name"],
            registry=self.registry,
        )

        self.autoscale_desired = Gauge(
            "fleetgate_operator_autoscale_desired_replicas",
            "Replicas the last autoscaling decision asked for.",
            ["namespace", "name"],
            registry=self.registry,
        )
        self.autoscale_demand = Gauge(
            "fleetgate_operator_autoscale_demand",
            "Demand the last autoscaling decision saw, summed over the routers.",
            ["namespace", "name", "signal"],
            registry=self.registry,
        )
        self.autoscale_decisions = Counter(
            "fleetgate_operator_autoscale_decisions",
            "Replica changes made by the autoscaler, by direction (up, down).",
            ["namespace", "name", "direction"],
            registry=self.registry,
        )
        self.autoscale_scrape_errors = Counter(
            "fleetgate_operator_autoscale_scrape_errors",
            "Router /metrics scrapes that failed (unreachable or unparsable).",
            registry=self.registry,
        )

        self.pool_gpus = Gauge(
            "fleetgate_operator_pool_gpus",
            "GPUs of a routing pool with a budget: budget, wanted by the demand, granted.",
            ["pool", "state"],
            registry=self.registry,
        )

    def forget(self, namespace: str, name: str) -> None:
        """Drop the per-service series of a deleted InferenceService."""
        for gauge in (self.replicas_ready, self.autoscale_desired):
            try:
                gauge.remove(namespace, name)
            except KeyError:
                pass
        for family in (self.autoscale_demand, self.autoscale_decisions):
            for labels in list(family._metrics):
                if labels[:2] == (namespace, name):
                    family.remove(*labels)
