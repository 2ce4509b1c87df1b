"""The router's ASGI app: routes, lifespan, and the objects it wires together.

``build_router(config)`` builds everything per app (no globals): the fleet,
prefix index, pipeline, upstream client, metrics registry, poller, admission
and in-flight table, all reachable as ``app.state.router`` (a ``Services``).
The lifespan starts the client and the per-endpoint background loops and
stops them again; ``start_background=False`` lets tests drive the poller by
hand.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (proxied),
``GET /v1/models`` (union over healthy endpoints), ``GET /health`` (the router
process is up), ``GET /ready`` (at least one healthy endpoint with models, or a model that scales
from zero),
``GET /metrics`` (Prometheus text), ``GET /held?after=N&wait=S`` (a long poll that
answers when a model's first request is held: autoscalers wake on it instead of
waiting for their next period).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from fleetgate.router.admission import Admission, Holds, ImmediateAdmission
from fleetgate.router.admission_queue import ClassQueueAdmission
from fleetgate.router.asgi import RequestHandler
from fleetgate.router.client import make_client
from fleetgate.router.config import ConfigError, RouterConfig, Scheduling
from fleetgate.router.errors import error_body
from fleetgate.router.exchange import Exchange
from fleetgate.router.identity import Gatekeeper, KeyFile, TenantLimiter
from fleetgate.router.kvfeed import KvFeeds
from fleetgate.router.metrics import ClassMetrics, RouterMetrics
from fleetgate.router.placement import Placer
from fleetgate.router.poller import Poller
from fleetgate.router.rawhttp import RawUpstream
from fleetgate.router.scheduling.kvindex import KvIndex
from fleetgate.router.scheduling.kvpending import PendingBlocks
from fleetgate.router.scheduling.load import LoadParams
from fleetgate.router.scheduling.pipeline import Pipeline, PipelineWeights, default_pipeline
from fleetgate.router.scheduling.prefix import PrefixIndex
from fleetgate.router.scheduling.types import EndpointId
from fleetgate.router.serve import ServeLoop
from fleetgate.router.served import adapter_for
from fleetgate.router.services import Services, random_request_id
from fleetgate.router.state import Endpoint, Fleet, Standby
from fleetgate.router.tokenizer_files import load_tokenizers
from fleetgate.router.upstream import HttpxUpstream, Upstream


def build_fleet(config: RouterConfig, clock: Callable[[], float] = time.monotonic) -> Fleet:
    """The fleet the config describes; ``clock`` times the exact view's pending blocks."""
    endpoints = []
    for pool, b in config.backends():
        adapter = adapter_for(b.engine, b.version)
        sources = {s.name: s for s in adapter.metrics_sources}
        if b.metrics_source is not None and b.metrics_source not in sources:
            raise ConfigError(
                f"backend {b.endpoint_id}: metrics_source {b.metrics_source!r} unknown; "
                f"{adapter.name} offers {', '.join(sources)}"
            )
        source = sources[b.metrics_source] if b.metrics_source else adapter.metrics_sources[0]
        endpoints.append(
            Endpoint(
                id=EndpointId(b.endpoint_id),
                pool=pool,
                engine=adapter.name,
                url=b.url,
                adapter=adapter,
                metrics_source=source,
                capacity_hint=b.capacity,
                schedulers=b.scheduler_count,
                served_model=b.served_model,
                kv_events=b.kv_events.endpoint(adapter.name) if b.kv_events else None,
            )
        )
    sched = config.scheduling
    standby = [
        Standby(model=name, pool=m.pool, cold_start_s=m.cold_start_s)
        for name, m in config.models.items()
        if m.scale_from_zero
    ]
    return Fleet(
        endpoints,
        standby=standby,
        index=PrefixIndex(sched.index_capacity),
        kv_index=KvIndex(config.kv_events.max_blocks, pending=_pending(config, clock)),
        load_params=LoadParams(
            fresh_for=sched.fresh_for_s,
            stale_after=sched.stale_after_s,
            default_capacity=sched.default_capacity,
        ),
        scrape_pace=config.scrape.pace(),
    )


def _pending(config: RouterConfig, clock: Callable[[], float]) -> PendingBlocks | None:
    kv = config.kv_events
    if kv.pending_ttl_s is None:
        return None
    return PendingBlocks(
        clock,
        ttl_s=kv.pending_ttl_s,
        max_age_s=kv.pending_max_age_s,
        max_blocks=kv.pending_max_blocks,
    )


def pipeline_for(sched: Scheduling) -> Pipeline:
    """The scheduling pipeline the router YAML's ``scheduling:`` section describes."""
    return default_pipeline(
        PipelineWeights(
            sched.weights.prefix, sched.weights.load, sched.weights.kv, sched.weights.speed
        ),
        load_bound=sched.effective_load_bound(),
        slack_requests=sched.slack_requests,
        queue_work=sched.queue_work,
        picker=sched.picker,
        cold_choices=sched.effective_cold_choices(),
        prefill_slack=sched.effective_prefill_slack(),
        prefill_slack_tokens=sched.prefill_slack_tokens,
        bound_tokens=sched.load_bound_tokens,
        queue_ratio=sched.queue_ratio,
        spill_prefill_weight=sched.spill_prefill_weight,
    )


def build_router(
    config: RouterConfig,
    *,
    clock: Callable[[], float] = time.monotonic,
    rng: random.Random | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
    new_id: Callable[[], str] = random_request_id,
    start_background: bool = True,
) -> Starlette:
    """The router app.

    ``transport`` replaces the network with an httpx transport (tests use
    ``httpx.MockTransport``); the request path then runs over httpx instead of
    the raw upstream client. Probes and scrapes always use the httpx client.
    """
    config.check_loopback()
    fleet = build_fleet(config, clock)
    sched = config.scheduling
    pipeline = pipeline_for(sched)
    n = max(1, len(fleet.endpoints))
    client = make_client(
        test_mode=config.effective_test_mode,
        max_connections=config.limits.connections_per_endpoint * n,
        connect_timeout=config.timeouts.connect_s,
        read_timeout=max(config.timeouts.first_byte_s, config.timeouts.idle_s),
        transport=transport,
    )
    metrics = RouterMetrics()
    metrics.watch_fleet(fleet, clock)
    metrics.trace = decision_trace(os.environ.get("FLEETGATE_DECISION_TRACE"))
    t = config.timeouts
    upstream: Upstream
    if transport is not None:
        upstream = HttpxUpstream(
            client,
            httpx.Timeout(connect=t.connect_s, read=max(t.first_byte_s, t.idle_s), write=30.0,
                          pool=t.connect_s),
        )  # fmt: skip
    else:
        upstream = RawUpstream(
            test_mode=config.effective_test_mode,
            connect_timeout=t.connect_s,
            first_byte_timeout=t.first_byte_s,
            idle_timeout=t.idle_s,
            max_idle=config.limits.connections_per_endpoint,
        )
    services = Services(
        config=config,
        fleet=fleet,
        pipeline=pipeline,
        upstream=upstream,
        metrics=metrics,
        classes=ClassMetrics(metrics, config.classes),
        clock=clock,
        rng=rng or random.Random(sched.seed),
        new_id=new_id,
        tokenizers=load_tokenizers(sched.tokenizers),
    )
    metrics.watch_tokenizers(services.tokenizers)
    services.classes.precreate(sorted(fleet.standby))  # series before any endpoint joins
    placer = Placer(fleet, pipeline, metrics, services.rng)
    admission: Admission
    queue: ClassQueueAdmission | None = None
    if config.priority is not None:
        holds = Holds(config, fleet, services.classes)
        admission = queue = ClassQueueAdmission(
            config.priority, placer, services.classes, clock, holds
        )
    else:
        immediate = ImmediateAdmission(config, placer, services.classes, clock)
        admission, holds = immediate, immediate.holds
    serve_loop = ServeLoop(
        services,
        admission,
        Exchange(
            services,
            config.engine_priority,
            held_prefix_sooner=config.scheduling.held_prefix_sooner,
            held_prefix_guard_s=config.scheduling.held_prefix_guard_s,
        ),
    )
    ident = config.identity
    gate = Gatekeeper(ident, config.classes)
    limits = ident.tenant_limits if ident is not None else None
    limiter = TenantLimiter(limits.default if limits else None, limits.tenants if limits else {})
    poller = Poller(fleet, client, config, metrics, clock, raw_gets=transport is None)
    poller.on_change = admission.on_fleet_change
    kv_feeds = KvFeeds(fleet, client, config.kv_events, metrics, clock)

    async def models(request: Request) -> Response:
        now = clock()
        listed = set(fleet.models(healthy_only=True, now=now)) | set(fleet.standby)
        data = [{"id": m, "object": "model", "owned_by": "fleetgate"} for m in sorted(listed)]
        return JSONResponse({"object": "list", "data": data})

    async def health(request: Request) -> Response:
        return Response(b"", status_code=200)

    async def ready(request: Request) -> Response:
        now = clock()
        # A model that scales from zero counts: the router can take (and hold) its
        # requests, and a router pod kept out of its Service could never see the demand
        # that scales it up.
        ok = bool(fleet.standby) or bool(fleet.models(healthy_only=True, now=now))
        if ok:
            return JSONResponse({"status": "ready"})
        return Response(
            error_body(503, "no healthy endpoint with models yet"),
            status_code=503,
            media_type="application/json",
            headers={"retry-after": "1"},
        )

    async def held(request: Request) -> Response:
        """Long poll for autoscalers: answers when a model's first request is held
        (``generation`` moved past ``after``) or after ``wait`` seconds (at most 60)."""
        try:
            after = int(request.query_params.get("after", "-1"))
            wait = float(request.query_params.get("wait", "0"))
        except ValueError:
            return Response(
                error_body(400, "want integer `after` and numeric `wait` query parameters"),
                status_code=400,
                media_type="application/json",
            )
        if not 0 <= wait <= 60:  # also refuses nan
            return Response(
                error_body(400, "`wait` must be between 0 and 60 seconds"),
                status_code=400,
                media_type="application/json",
            )
        generation = await holds.changed(after, wait)
        return JSONResponse({"generation": generation, "held": dict(holds.count)})

    async def prometheus(request: Request) -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    running_loop: list[asyncio.AbstractEventLoop] = []

    def end_long_polls() -> None:
        """End every pending ``GET /held`` now; safe from a signal handler or another
        thread (the server's SIGTERM drain waits for open responses)."""
        if running_loop:
            running_loop[0].call_soon_threadsafe(holds.close)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        running_loop[:] = [asyncio.get_running_loop()]
        reload: asyncio.Task[None] | None = None
        if start_background:
            await poller.start()
            kv_feeds.start()
            if gate.keys is not None and ident is not None and ident.api_keys is not None:
                reload = asyncio.get_running_loop().create_task(
                    _reload_keys(gate.keys, ident.api_keys.reload_s)
                )
        try:
            yield
        finally:
            if reload is not None:
                reload.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await reload
            await kv_feeds.stop()
            await poller.stop()
            if queue is not None:
                queue.close()
            await upstream.aclose()
            await client.aclose()

    routes = [
        Route(path, RequestHandler(services, serve_loop, path, gate, limiter), methods=["POST"])
        for path in ("/v1/completions", "/v1/chat/completions")
    ] + [
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/ready", ready, methods=["GET"]),
        Route("/metrics", prometheus, methods=["GET"]),
        Route("/held", held, methods=["GET"]),
    ]

    async def http_error(request: Request, exc: Exception) -> Response:
        """Starlette's own answers (unknown route 404, wrong method 405) as JSON errors."""
        assert isinstance(exc, HTTPException)
        return Response(
            error_body(exc.status_code, str(exc.detail)[:200]),
            status_code=exc.status_code,
            media_type="application/json",
            headers=exc.headers,
        )

    app = Starlette(
        routes=routes, lifespan=lifespan, exception_handlers={HTTPException: http_error}
    )
    app.state.router = services
    app.state.admission = admission
    app.state.poller = poller
    app.state.kv_feeds = kv_feeds
    app.state.gate = gate
    app.state.limiter = limiter
    app.state.end_long_polls = end_long_polls
    return app


async def _reload_keys(keys: KeyFile, every_s: float) -> None:
    """Re-read the API keys file when it changes (a rotated Secret), for ever."""
    while True:
        await asyncio.sleep(every_s)
        await asyncio.to_thread(keys.poll)


def decision_trace(path: str | None) -> Callable[[dict[str, Any]], None] | None:
    """A diagnostic: append every placement and upstream usage the router records as
    one JSON line to ``path`` (env ``FLEETGATE_DECISION_TRACE``; the pid is appended
    so router replicas do not share a file). None or empty: no trace. The file is
    opened per record (a diagnostic's cost, and nothing left open at shutdown)."""
    if not path:
        return None
    target = f"{path}.{os.getpid()}"

    def write(record: dict[str, Any]) -> None:
        with open(target, "a") as out:
            out.write(json.dumps(record, separators=(",", ":")) + "\n")

    return write
