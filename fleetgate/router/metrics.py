"""The router's Prometheus metrics: names and labels are a stable interface.

Dashboards depend on these; docs/router.md lists every one. A fresh
``CollectorRegistry`` is built per app (no process-global registry), so tests
and several routers in one process never collide.

Labels are bounded: ``model`` (served models), ``engine`` (adapter name),
``endpoint`` (configured endpoints), ``status`` (HTTP status code as text),
``reason`` / ``decided_by`` (fixed sets from the pipeline), ``source`` (``events`` |
``approximate``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from fleetgate.router.priority.config import PriorityConfig
from fleetgate.router.scheduling.kvsync import FEED_STATES
from fleetgate.router.state import Fleet

_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_ITL = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.5, 5)
_WAIT = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 600)
_RATIO = (0.0, 0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0)
_SCRAPE = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class RouterMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        self.trace: Callable[[dict[str, Any]], None] | None = None
        """Diagnostic decision trace (``FLEETGATE_DECISION_TRACE``, app.py): one record
        per placement and per upstream usage; None (the default) records nothing."""
        ep = ["endpoint", "engine"]
        self.requests = Counter(
            "fleetgate_requests",
            "Requests answered, by model, engine, endpoint and HTTP status "
            "(engine and endpoint are 'none' when no endpoint was reached).",
            ["model", "engine", "endpoint", "status"],
            registry=r,
        )
        self.ttft = Histogram(
            "fleetgate_time_to_first_token_seconds",
            "Router-observed time from request arrival to the first body byte sent "
            "(class: priority class, 'none' without a priority section).",
            ["model", "engine", "class"],
            buckets=_LATENCY,
            registry=r,
        )
        self.itl = Histogram(
            "fleetgate_inter_token_latency_seconds",
            "Router-observed gap between consecutive streamed chunks.",
            ["model", "engine", "class"],
            buckets=_ITL,
            registry=r,
        )
        self.e2e = Histogram(
            "fleetgate_e2e_request_latency_seconds",
            "Router-observed time from request arrival to the last byte.",
            ["model", "engine", "stream", "class"],
            buckets=_LATENCY,
            registry=r,
        )
        self.in_flight = Gauge(
            "fleetgate_endpoint_in_flight",
            "Requests this router has in flight on the endpoint.",
            ep,
            registry=r,
        )
        self.decisions = Counter(
            "fleetgate_decisions",
            "Scheduling decisions by reason (affinity-hit, spill, cold, fallback, single), "
            "deciding plugin, and the cache view that spoke for the pick (source: events = "
            "the exact KV index, its feed live; approximate = the router's prefix index).",
            ["model", "reason", "decided_by", "source"],
            registry=r,
        )
        self.retries = Counter(
            "fleetgate_retries",
            "Requests re-sent to another endpoint before any byte reached the client.",
            ["model", "cause"],
            registry=r,
        )
        self.upstream_errors = Counter(
            "fleetgate_upstream_errors",
            "Failed upstream attempts by cause (connect, timeout, status_5xx, overload, "
            "stream_broken).",
            ["endpoint", "engine", "cause"],
            registry=r,
        )
        src = [*ep, "source"]
        self.predicted_cached = Counter(
            "fleetgate_predicted_cached_tokens",
            "Prompt tokens the router predicted the endpoint had cached, by the view that "
            "predicted it (source: events | approximate).",
            src,
            registry=r,
        )
        self.actual_cached = Counter(
            "fleetgate_actual_cached_tokens",
            "Prompt tokens the engine reported as cached "
            "(usage.prompt_tokens_details.cached_tokens), by the view that predicted them.",
            src,
            registry=r,
        )
        self.cache_error = Histogram(
            "fleetgate_cache_prediction_error_ratio",
            "Per response: |predicted - actual cached tokens| / prompt tokens, by the view "
            "that predicted (source: events | approximate); needs cached_tokens in usage.",
            ["source"],
            buckets=_RATIO,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "fleetgate_prompt_tokens",
            "Prompt tokens the engine reported (usage.prompt_tokens).",
            ep,
            registry=r,
        )
        self.usage_without_cache = Counter(
            "fleetgate_usage_without_cached_details",
            "Responses whose usage had no prompt_tokens_details.cached_tokens "
            "(engine not run with --enable-prompt-tokens-details).",
            ep,
            registry=r,
        )
        self.scrape_duration = Histogram(
            "fleetgate_scrape_duration_seconds",
            "Time to fetch and parse one load scrape.",
            ep,
            buckets=_SCRAPE,
            registry=r,
        )
        self.scrape_errors = Counter(
            "fleetgate_scrape_errors",
            "Failed load scrapes (connect, status, parse).",
            ep,
            registry=r,
        )
        self.ejections = Counter(
            "fleetgate_endpoint_ejections",
            "Passive outlier ejections.",
            ep,
            registry=r,
        )
        self.client_disconnects = Counter(
            "fleetgate_client_disconnects",
            "Requests whose client went away before the end; the upstream request was closed.",
            ep,
            registry=r,
        )

        self.kv_events = Counter(
            "fleetgate_kv_events",
            "KV-cache events applied to the exact index, by kind (stored, removed, cleared).",
            [*ep, "kind"],
            registry=r,
        )
        self.kv_replays = Counter(
            "fleetgate_kv_replays",
            "Replays asked of an engine's KV-event replay socket, by cause (start, gap, "
            "reconnect, restart, idle).",
            [*ep, "cause"],
            registry=r,
        )
        self.kv_restarts = Counter(
            "fleetgate_kv_feed_restarts",
            "Engine restarts seen in a KV-event stream (the endpoint's entries were cleared).",
            ep,
            registry=r,
        )
        self.kv_decode_errors = Counter(
            "fleetgate_kv_decode_errors",
            "KV-event messages that did not decode (each handled as a gap).",
            ep,
            registry=r,
        )

    def child(self, metric: Any, *labels: str) -> Any:
        """``metric.labels(*labels)``, memoised: the request path asks for the same few
        children on every request, and label sets are bounded (see module docstring)."""
        key = (id(metric), labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return found

    def record_usage(
        self,
        endpoint: str,
        engine: str,
        usage: Mapping[str, Any],
        predicted: int,
        source: str,
        *,
        rid: str | None = None,
    ) -> None:
        """Count one upstream ``usage`` for the cache closed loop: prompt tokens, the
        router's predicted cached tokens (by ``source``, the view that predicted them:
        ``events`` or ``approximate``), the engine's reported
        ``prompt_tokens_details.cached_tokens`` and the relative error of the two."""
        lv = (endpoint, engine)
        prompt = usage.get("prompt_tokens")
        if isinstance(prompt, int):
            self.child(self.prompt_tokens, *lv).inc(prompt)
            predicted = min(predicted, prompt)
        predicted = max(0, predicted)
        self.child(self.predicted_cached, *lv, source).inc(predicted)
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        if self.trace is not None:
            self.trace(
                {"usage": rid, "ep": endpoint, "pred": predicted, "src": source,
                 "cached": cached, "prompt": prompt}
            )  # fmt: skip
        if isinstance(cached, int):
            self.child(self.actual_cached, *lv, source).inc(cached)
            if isinstance(prompt, int) and prompt > 0:
                error = abs(predicted - cached) / prompt
                self.child(self.cache_error, source).observe(error)
        else:
            self.child(self.usage_without_cache, *lv).inc()

    def watch_fleet(self, fleet: Fleet, clock: Callable[[], float]) -> None:
        """Export per-endpoint state computed at scrape time (health, ages, engine counters)."""
        self.registry.register(_FleetCollector(fleet, clock))

    def watch_tokenizers(self, tokenizers: Mapping[str, object]) -> None:
        """Export each model's prefix token cache counters (scheduling/tokencache.py)."""
        self.registry.register(_TokenCacheCollector(tokenizers))


class _TokenCacheCollector(Collector):
    def __init__(self, tokenizers: Mapping[str, object]) -> None:
        self.tokenizers = tokenizers

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        lookups = CounterMetricFamily(
            "fleetgate_token_cache_lookups",
            "Prompts tokenized through the prefix token cache: hit (the shared prefix's ids "
            "reused), miss (nothing to reuse: tokenized whole), mismatch (the self-check "
            "found a difference and turned the cache off). Prompts under 512 characters "
            "skip the cache and are not counted.",
            labels=["model", "result"],
        )
        reused = CounterMetricFamily(
            "fleetgate_token_cache_reused_tokens",
            "Token ids taken from the prefix token cache instead of tokenizing again.",
            labels=["model"],
        )
        enabled = GaugeMetricFamily(
            "fleetgate_token_cache_enabled",
            "1 while the model's prefix token cache is on (0 after a self-check mismatch).",
            labels=["model"],
        )
        for model, tok in sorted(self.tokenizers.items()):
            cache = getattr(tok, "prefix_cache", None)
            if cache is None:
                continue
            lookups.add_metric([model, "hit"], cache.hits)
            lookups.add_metric([model, "miss"], cache.misses)
            lookups.add_metric([model, "mismatch"], cache.mismatches)
            reused.add_metric([model], cache.reused_ids)
            enabled.add_metric([model], 0.0 if cache.disabled else 1.0)
        yield lookups
        yield reused
        yield enabled


class _FleetCollector(Collector):
    def __init__(self, fleet: Fleet, clock: Callable[[], float]) -> None:
        self.fleet = fleet
        self.clock = clock

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        now = self.clock()
        ep = ["endpoint", "engine"]
        healthy = GaugeMetricFamily(
            "fleetgate_endpoint_healthy", "1 when the last /health probe answered 200.", labels=ep
        )
        ejected = GaugeMetricFamily(
            "fleetgate_endpoint_ejected", "1 while passive outlier ejection is on.", labels=ep
        )
        age = GaugeMetricFamily(
            "fleetgate_scrape_age_seconds",
            "Seconds since the last successful load scrape (+Inf before the first).",
            labels=ep,
        )
        kv = GaugeMetricFamily(
            "fleetgate_endpoint_kv_usage",
            "KV-cache fraction in use from the last scrape.",
            labels=ep,
        )
        queued = GaugeMetricFamily(
            "fleetgate_endpoint_requests",
            "Requests in the engine (running + waiting + paused) from the last scrape.",
            labels=ep,
        )
        hits = GaugeMetricFamily(
            "fleetgate_engine_prefix_cache_hit_tokens",
            "The engine's own cumulative prefix-cache hit tokens (its counter, as scraped).",
            labels=ep,
        )
        queries = GaugeMetricFamily(
            "fleetgate_engine_prefix_cache_query_tokens",
            "The engine's own cumulative prefix-cache query tokens (its counter, as scraped).",
            labels=ep,
        )
        index = GaugeMetricFamily(
            "fleetgate_prefix_index_entries",
            "Chain hashes the router's prefix index holds for the endpoint.",
            labels=ep,
        )
        speed = GaugeMetricFamily(
            "fleetgate_endpoint_decode_seconds_per_token",
            "Decode seconds per output token the router learned from the engine's own "
            "latency counters (the engine-speed scorer's input); absent while unknown.",
            labels=ep,
        )
        backlog = GaugeMetricFamily(
            "fleetgate_endpoint_prefill_backlog_tokens",
            "Uncached prompt tokens of this router's requests on the endpoint that have no "
            "first token yet (the prefill-cost rule's input).",
            labels=ep,
        )
        feed = GaugeMetricFamily(
            "fleetgate_kv_feed_state",
            "1 for the KV-event feed's current state (off, syncing, live, partial, broken); "
            "the exact view is used only while live.",
            labels=[*ep, "state"],
        )
        rank_feed = GaugeMetricFamily(
            "fleetgate_kv_feed_rank_state",
            "1 for the current state of each attention-DP rank's KV-event feed (endpoints "
            "with several ranks only; fleetgate_kv_feed_state is the least usable rank's).",
            labels=[*ep, "rank", "state"],
        )
        feed_age = GaugeMetricFamily(
            "fleetgate_kv_feed_verified_age_seconds",
            "Seconds since the KV-event feed last confirmed it had every batch (a batch "
            "applied, a replay or idle check answered, a drain answered); absent before any.",
            labels=ep,
        )
        kv_blocks = GaugeMetricFamily(
            "fleetgate_kv_index_blocks",
            "Blocks the exact index holds for the endpoint (from its KV events).",
            labels=ep,
        )
        kv_index = self.fleet.kv_index
        evictions = CounterMetricFamily(
            "fleetgate_kv_index_evictions",
            "Exact-index entries evicted by its bound (kv_events.max_blocks).",
        )
        evictions.add_metric([], float(kv_index.evicted))
        for e in self.fleet:
            lv = [e.id, e.engine]
            for state in FEED_STATES:
                feed.add_metric([*lv, state], 1.0 if e.kv_feed.state == state else 0.0)
            for rank, status in enumerate(e.kv_rank_feeds):
                for state in FEED_STATES:
                    rank_feed.add_metric(
                        [*lv, str(rank), state], 1.0 if status.state == state else 0.0
                    )
            if e.kv_feed.verified_at is not None:
                feed_age.add_metric(lv, max(0.0, now - e.kv_feed.verified_at))
            kv_blocks.add_metric(lv, float(kv_index.blocks(e.id)))
            healthy.add_metric(lv, 1.0 if e.healthy else 0.0)
            backlog.add_metric(lv, float(e.prefilling))
            if e.speed.seconds_per_token is not None:
                speed.add_metric(lv, e.speed.seconds_per_token)
            ejected.add_metric(lv, 1.0 if e.is_ejected(now) else 0.0)
            s = e.snapshot
            age.add_metric(lv, math.inf if s is None else max(0.0, now - s.scraped_at))
            index.add_metric(lv, float(self.fleet.index.size(e.id)))
            if s is None:
                continue
            if s.kv_usage is not None:
                kv.add_metric(lv, s.kv_usage)
            if s.running is not None or s.waiting is not None:
                queued.add_metric(lv, float((s.running or 0) + (s.waiting or 0) + (s.paused or 0)))
            if s.prefix_hit_tokens is not None:
                hits.add_metric(lv, s.prefix_hit_tokens)
            if s.prefix_query_tokens is not None:
                queries.add_metric(lv, s.prefix_query_tokens)
        yield from (healthy, ejected, age, kv, queued, hits, queries, index, speed, backlog)
        yield from (feed, rank_feed, feed_age, kv_blocks, evictions)


class ClassMetrics:
    """Per-class metrics (queue, preemption, resume, TTFT objective); every config has
    classes, so these exist whether or not admission queues."""

    def __init__(self, metrics: RouterMetrics, config: PriorityConfig) -> None:
        r = metrics.registry
        self.m = metrics
        self.config = config
        mc = ["model", "class"]
        self.depth = Gauge(
            "fleetgate_queue_depth", "Requests waiting in the admission queue (incl. parked).",
            mc, registry=r,
        )  # fmt: skip
        self.wait = Histogram(
            "fleetgate_queue_wait_seconds",
            "Arrival to first dispatch (0 when placed at once).",
            mc, buckets=_WAIT, registry=r,
        )  # fmt: skip
        self.dispatches = Counter(
            "fleetgate_dispatches", "Requests (and resumes) sent to an engine.", mc, registry=r
        )
        self.queue_dispatches = Counter(
            "fleetgate_queue_dispatches",
            "Requests dispatched from the admission queue, by how the drain chose them "
            "(in-order | ahead | waited-out | head-elsewhere | cheapest-elsewhere: "
            "priority.affinity_wait_s).",
            ["model", "class", "how"], registry=r,
        )  # fmt: skip
        self.preemptions = Counter(
            "fleetgate_preemptions", "In-flight requests preempted (class of the victim).",
            mc, registry=r,
        )  # fmt: skip
        self.resumes = Counter(
            "fleetgate_resumes",
            "Parked requests dispatched again as a continuation (cause preempted|engine_failure).",
            ["model", "class", "cause"], registry=r,
        )  # fmt: skip
        self.resume_latency = Histogram(
            "fleetgate_resume_latency_seconds",
            "Park to the first continuation token.",
            mc, buckets=_WAIT, registry=r,
        )  # fmt: skip
        self.sheds = Counter(
            "fleetgate_sheds",
            "Requests refused by the admission queue (queue full or queue timeout).",
            ["model", "class", "status"], registry=r,
        )  # fmt: skip
        self.ttft_objective = Counter(
            "fleetgate_ttft_objective",
            "Requests that got a first token (met = within the class TTFT objective) or failed.",
            ["model", "class", "met"], registry=r,
        )  # fmt: skip
        self.refed = Counter(
            "fleetgate_resume_refed_tokens",
            "Generated tokens sent back to an engine as prompt by continuations "
            "(re-prefilled unless the engine still caches them).",
            mc, registry=r,
        )  # fmt: skip
        self.arrivals = Counter(
            "fleetgate_arrivals",
            "Requests that arrived for a known model, counted once by the router that "
            "received them, before admission (the autoscaler's demand signal).",
            mc, registry=r,
        )  # fmt: skip
        self.held = Gauge(
            "fleetgate_held_requests",
            "Requests held now because their model (one that scales from zero) has no "
            "ready endpoint, by priority class.",
            mc, registry=r,
        )  # fmt: skip
        self._models: set[str] = set()

    def precreate(self, models: Sequence[str]) -> None:
        """Series at 0 for every configured class of every (new) model."""
        for model in models:
            if model in self._models:
                continue
            self._models.add(model)
            for c in self.config.classes:
                lv = (model, c.name)
                self.m.child(self.held, *lv).set(0)
                self.m.child(self.depth, *lv).set(0)
                self.m.child(self.wait, *lv)
                self.m.child(self.dispatches, *lv)
                self.m.child(self.arrivals, *lv)
                self.m.child(self.preemptions, *lv)
                self.m.child(self.refed, *lv)
                self.m.child(self.resume_latency, *lv)
                for cause in ("preempted", "engine_failure"):
                    self.m.child(self.resumes, *lv, cause)
                self.m.child(self.sheds, *lv, str(c.reject_status()))
                for met in ("true", "false"):
                    self.m.child(self.ttft_objective, *lv, met)
