"""Placement: the scheduling pipeline over the endpoints a request may use.

Both admissions place through one :class:`Placer`, so the router has one
definition of "can serve" (the pipeline's own hard filters,
``Pipeline.eligible``: healthy, not ejected, serves the model) and one way to
reserve the pick (``Request.reserve``).
"""

from __future__ import annotations

import random
from collections.abc import Collection, Sequence
from typing import Any

from fleetgate.router.metrics import RouterMetrics
from fleetgate.router.request import Request
from fleetgate.router.scheduling.pipeline import NoEndpointError, Pipeline
from fleetgate.router.scheduling.plugins.prefix_affinity import approximate_cached
from fleetgate.router.scheduling.types import Decision, EndpointView
from fleetgate.router.state import Endpoint, Fleet


class Placer:
    """The scheduling pipeline over the endpoints a request may use; reserves its pick."""

    def __init__(
        self, fleet: Fleet, pipeline: Pipeline, metrics: RouterMetrics, rng: random.Random
    ) -> None:
        self.fleet = fleet
        self.pipeline = pipeline
        self.metrics = metrics
        self.rng = rng

    def eligible(
        self, req: Request, now: float, fleet_views: Sequence[EndpointView] | None = None
    ) -> list[Endpoint]:
        """Endpoints that can serve ``req`` (pipeline hard filters), preferring the ones
        it has not failed on, and for a text-only chat resume the ones that continue a
        partial assistant message (with no such engine, any: documented risk).

        ``fleet_views``: ``Fleet.views((), [], now)`` when the caller already has it
        (a queue drain asks this for every queued request at one ``now``)."""
        if fleet_views is None:
            fleet_views = self.fleet.views((), [], now)
        views = self.pipeline.eligible(req.view, fleet_views)
        out = [self.fleet.endpoints[v.id] for v in views]
        if req.failed:
            out = [e for e in out if e.id not in req.failed] or out
        if req.needs_final_message and req.parked_at is not None:
            out = [e for e in out if e.adapter.continues_final_message] or out
        return out

    def pick(self, req: Request, allowed: Collection[str], now: float) -> Endpoint | None:
        """The pipeline's best endpoint among ``allowed`` (None: the filters left none)."""
        views = [
            v for v in self.fleet.views(req.chain, req.order, now, req.prompt) if v.id in allowed
        ]
        try:
            decision = self.pipeline.schedule(req.view, views, self.rng)
        except NoEndpointError:
            return None
        self.metrics.child(
            self.metrics.decisions,
            req.model,
            decision.reason,
            decision.decided_by,
            decision.cache_source,
        ).inc()
        if self.metrics.trace is not None:
            self.metrics.trace(_trace_record(req, views, decision, now))
        for eid in decision.ranking:
            if eid in allowed:
                return self.fleet.endpoints[eid]
        return None

    def affinity_targets(self, req: Request, able: Sequence[Endpoint]) -> frozenset[str]:
        """The endpoints of :meth:`affinity` alone."""
        return self.affinity(req, able)[0]

    def affinity(self, req: Request, able: Sequence[Endpoint]) -> tuple[frozenset[str], int]:
        """Where ``req`` should wait for a slot, busy or not: the endpoints of ``able``
        (those that may serve it, :meth:`eligible`, which the caller has) that
        hold the most of its prompt (exact view where live, else the approximate one,
        pending placements included); when none holds more than the others, its
        prefix's rendezvous target, so every queued request on a prefix nobody holds
        waits for the same endpoint; empty for a prompt with no prefix to reuse.
        Load plays no part and nothing is recorded: the class queue asks this to match
        queued requests to the endpoint that just freed (``priority.affinity_wait_s``).
        Also returns the prompt tokens believed cached on those endpoints (0 for a
        rendezvous target): what the request loses by running elsewhere."""
        cached = {
            e.id: self.fleet.believed_cached(e, req.chain, req.prompt, req.view)[0] for e in able
        }
        best = max(cached.values(), default=0)
        top = frozenset(eid for eid, n in cached.items() if n == best)
        if best > 0 and len(top) < len(cached):
            return top, best
        if not req.chain and best <= 0:
            return frozenset(), 0  # nothing of this prompt is worth keeping together
        rank = {eid: i for i, eid in enumerate(req.order)}
        first = min(cached, key=lambda eid: rank.get(eid, len(rank)), default=None)
        return (frozenset() if first is None else frozenset({first})), 0

    def reserve(self, req: Request, e: Endpoint) -> Endpoint:
        cached, source = self.fleet.believed_cached(e, req.chain, req.prompt, req.view)
        req.reserve(e, cached)
        req.believed = (e.id, cached, source)
        index = self.fleet.kv_index
        if req.prompt is not None and index is not None and index.pending is not None:
            keys = index.place(e.id, req.prompt.keys(e.block_size))
            if keys:
                eid = e.id
                req.pending_settle = lambda: index.settle(eid, keys)
        return e


def _trace_record(
    req: Request, views: Sequence[EndpointView], decision: Decision, now: float
) -> dict[str, Any]:
    """One placement for the diagnostic trace: per endpoint [exact-view tokens (None:
    the view does not speak), approximate-view tokens, work, queued prefill, the
    prefix-affinity score]."""
    affinity = {s.id: dict(s.scores).get("prefix-affinity") for s in decision.scored}
    return {
        "t": round(now, 4),
        "id": req.id,
        "doc": req.chain[0] if req.chain else None,
        "n": req.view.prompt_tokens,
        "pick": decision.ranking[0],
        "reason": decision.reason,
        "by": decision.decided_by,
        "eps": {
            v.id: [
                v.exact_cached_tokens,
                approximate_cached(req.view, v.prefix_match),
                round(v.load.work, 3),
                v.pending_prefill_tokens,
                affinity.get(v.id),
            ]
            for v in views
        },
    }
