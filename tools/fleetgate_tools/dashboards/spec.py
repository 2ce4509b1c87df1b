"""What each dashboard shows, as plain data (pure: no Grafana types here).

Every panel is a title, a unit and PromQL queries over the stable metric names
in docs/router.md and docs/operator.md. ``build.py`` turns these into Grafana
JSON; the dashboard test runs every query here against a real Prometheus.

Queries use four template variables: ``$model`` and ``$class`` (multi-value
regexes), ``$pool`` and ``$namespace``; ``$__rate_interval`` is Grafana's.
"""

from __future__ import annotations

import dataclasses

MODEL = 'model=~"$model"'
CLS = 'class=~"$class"'


@dataclasses.dataclass(frozen=True, slots=True)
class Query:
    expr: str
    legend: str


@dataclasses.dataclass(frozen=True, slots=True)
class PanelSpec:
    title: str
    unit: str
    queries: tuple[Query, ...]
    description: str = ""
    kind: str = "timeseries"
    width: int = 12


@dataclasses.dataclass(frozen=True, slots=True)
class DashboardSpec:
    uid: str
    title: str
    description: str
    variables: tuple[str, ...]
    """Which of model / class / namespace this dashboard filters by."""
    panels: tuple[PanelSpec, ...]


def _q(quantile: float, metric: str, by: str, sel: str) -> Query:
    expr = (
        f"histogram_quantile({quantile}, sum by (le, {by}) "
        f"(rate({metric}_bucket{{{sel}}}[$__rate_interval])))"
    )
    return Query(expr, f"p{int(quantile * 100)} {{{{{by.replace(', ', '}} {{')}}}}}")


def _pcts(metric: str, by: str, sel: str) -> tuple[Query, ...]:
    return tuple(_q(q, metric, by, sel) for q in (0.5, 0.9, 0.99))


FLEET = DashboardSpec(
    uid="fleetgate-fleet",
    title="fleetgate / Fleet overview",
    description="Traffic, latency and errors as the router sees them, per model and class.",
    variables=("model", "class"),
    panels=(
        PanelSpec(
            "Requests per second by model and status",
            "reqps",
            (
                Query(
                    f"sum by (model, status) (rate(fleetgate_requests_total{{{MODEL}}}"
                    "[$__rate_interval]))",
                    "{{model}} {{status}}",
                ),
            ),
        ),
        PanelSpec(
            "Error ratio (4xx and 5xx answered by the router)",
            "percentunit",
            (
                Query(
                    # `or ... * 0`: a model with traffic and no errors shows 0, not "no data"
                    f'(sum by (model) (rate(fleetgate_requests_total{{{MODEL},status=~"[45].."}}'
                    "[$__rate_interval])) or 0 * sum by (model) "
                    f"(rate(fleetgate_requests_total{{{MODEL}}}[$__rate_interval]))) / clamp_min("
                    f"sum by (model) (rate(fleetgate_requests_total{{{MODEL}}}[$__rate_interval])),"
                    " 1e-9)",
                    "{{model}}",
                ),
            ),
        ),
        PanelSpec(
            "Time to first token by class",
            "s",
            _pcts("fleetgate_time_to_first_token_seconds", "class", f"{MODEL},{CLS}"),
            width=12,
        ),
        PanelSpec(
            "Time to first token by model",
            "s",
            _pcts("fleetgate_time_to_first_token_seconds", "model", f"{MODEL},{CLS}"),
        ),
        PanelSpec(
            "Inter-token latency by model",
            "s",
            _pcts("fleetgate_inter_token_latency_seconds", "model", f"{MODEL},{CLS}"),
        ),
        PanelSpec(
            "End-to-end latency by model",
            "s",
            _pcts("fleetgate_e2e_request_latency_seconds", "model", f"{MODEL},{CLS}"),
        ),
    ),
)

ROUTING = DashboardSpec(
    uid="fleetgate-routing",
    title="fleetgate / Routing",
    description="Where requests went and why; prefix-cache hits predicted vs reported; "
    "per-endpoint load for vLLM and TensorRT-LLM side by side.",
    variables=("model",),
    panels=(
        PanelSpec(
            "Decisions by reason",
            "ops",
            (
                Query(
                    f"sum by (reason) (rate(fleetgate_decisions_total{{{MODEL}}}"
                    "[$__rate_interval]))",
                    "{{reason}}",
                ),
            ),
            description="affinity-hit: longest cached prefix won; spill: affinity target "
            "over the load bound; cold: new prefix placed by rendezvous hashing.",
        ),
        PanelSpec(
            "Cached prompt tokens: predicted by the router vs reported by engines",
            "short",
            (
                Query(
                    "sum by (engine) (rate(fleetgate_predicted_cached_tokens_total"
                    "[$__rate_interval]))",
                    "predicted {{engine}}",
                ),
                Query(
                    "sum by (engine) (rate(fleetgate_actual_cached_tokens_total"
                    "[$__rate_interval]))",
                    "reported {{engine}}",
                ),
            ),
            description="A silent 0% hit rate shows as 'reported' flat at zero.",
        ),
        PanelSpec(
            "Decisions by cache view (exact KV events vs approximate)",
            "ops",
            (
                Query(
                    f"sum by (source) (rate(fleetgate_decisions_total{{{MODEL}}}"
                    "[$__rate_interval]))",
                    "{{source}}",
                ),
            ),
            description="events: the endpoint's KV-event feed was live and the exact index "
            "spoke for it; approximate: the router's own routing history did (no feed, or "
            "a feed not live).",
        ),
        PanelSpec(
            "Closed loop: |predicted - reported cached tokens| / prompt tokens, per view",
            "percentunit",
            tuple(
                _q(q, "fleetgate_cache_prediction_error_ratio", "source", "") for q in (0.5, 0.9)
            ),
            description="Per response, from the engine's usage.prompt_tokens_details."
            "cached_tokens. The issue's goal: median <= 5% with events.",
        ),
        PanelSpec(
            "Cached prompt tokens per view: predicted vs reported",
            "short",
            (
                Query(
                    "sum by (source) (rate(fleetgate_predicted_cached_tokens_total"
                    "[$__rate_interval]))",
                    "predicted {{source}}",
                ),
                Query(
                    "sum by (source) (rate(fleetgate_actual_cached_tokens_total"
                    "[$__rate_interval]))",
                    "reported {{source}}",
                ),
            ),
        ),
        PanelSpec(
            "KV-event feed state per endpoint",
            "short",
            (
                Query(
                    "max by (endpoint, state) (fleetgate_kv_feed_state) == 1",
                    "{{endpoint}} {{state}}",
                ),
            ),  # fmt: skip
            description="One line per endpoint, labelled with its present state: live (exact "
            "view in use), syncing, partial (older blocks unknown), broken, off (no feed).",
        ),
        PanelSpec(
            "KV-event feed state per attention-DP rank",
            "short",
            (
                Query(
                    "max by (endpoint, rank, state) (fleetgate_kv_feed_rank_state) == 1",
                    "{{endpoint}} rank {{rank}} {{state}}",
                ),
            ),  # fmt: skip
            description="Engines of several attention-DP ranks (TensorRT-LLM "
            "enable_attention_dp): one line per rank's own feed; the endpoint is live only "
            "when every rank is.",
        ),
        PanelSpec(
            "Exact index blocks per endpoint (from KV events)",
            "short",
            (Query("fleetgate_kv_index_blocks", "{{engine}} {{endpoint}}"),),
        ),
        PanelSpec(
            "Engine prefix-cache hit rate (engines' own counters)",
            "percentunit",
            (
                Query(
                    "sum by (endpoint, engine) (rate(fleetgate_engine_prefix_cache_hit_tokens"
                    "[$__rate_interval]) or deriv(fleetgate_engine_prefix_cache_hit_tokens"
                    "[$__rate_interval])) / clamp_min(sum by (endpoint, engine) "
                    "(deriv(fleetgate_engine_prefix_cache_query_tokens[$__rate_interval])), "
                    "1e-9)",
                    "{{engine}} {{endpoint}}",
                ),
            ),
        ),
        PanelSpec(
            "KV-cache use per endpoint",
            "percentunit",
            (Query("fleetgate_endpoint_kv_usage", "{{engine}} {{endpoint}}"),),
        ),
        PanelSpec(
            "Requests in flight per endpoint (router's own count)",
            "short",
            (Query("fleetgate_endpoint_in_flight", "{{engine}} {{endpoint}}"),),
        ),
        PanelSpec(
            "Requests in the engine per endpoint (scraped)",
            "short",
            (Query("fleetgate_endpoint_requests", "{{engine}} {{endpoint}}"),),
        ),
        PanelSpec(
            "Decode seconds per token per endpoint (learned; engine-speed scorer)",
            "s",
            (Query("fleetgate_endpoint_decode_seconds_per_token", "{{engine}} {{endpoint}}"),),
        ),
        PanelSpec(
            "Prefill backlog per endpoint (uncached prompt tokens awaiting a first token)",
            "short",
            (Query("fleetgate_endpoint_prefill_backlog_tokens", "{{engine}} {{endpoint}}"),),
        ),
        PanelSpec(
            "Scrape age per endpoint",
            "s",
            (Query("clamp_max(fleetgate_scrape_age_seconds, 3600)", "{{endpoint}}"),),
        ),
        PanelSpec(
            "Scrapes per second per endpoint (this router's /metrics reads)",
            "ops",
            (
                Query(
                    "sum by (endpoint) (rate(fleetgate_scrape_duration_seconds_count"
                    "[$__rate_interval]))",
                    "{{endpoint}}",
                ),
            ),
            description="5/s without a live KV-event feed or near saturation, fewer with one "
            "(docs/router.md, Scrape intervals); every replica adds its own.",
        ),
        PanelSpec(
            "Endpoint health and ejections",
            "short",
            (
                Query("fleetgate_endpoint_healthy", "healthy {{endpoint}}"),
                Query("fleetgate_endpoint_ejected", "ejected {{endpoint}}"),
            ),
        ),
    ),
)

PRIORITY = DashboardSpec(
    uid="fleetgate-priority",
    title="fleetgate / Priority and preemption",
    description="The admission queue per class, preemptions that resume, sheds and TTFT "
    "objective attainment.",
    variables=("model", "class"),
    panels=(
        PanelSpec(
            "Queue depth by class",
            "short",
            (Query(f"sum by (class) (fleetgate_queue_depth{{{MODEL},{CLS}}})", "{{class}}"),),
        ),
        PanelSpec(
            "Queue wait p99 by class",
            "s",
            (_q(0.99, "fleetgate_queue_wait_seconds", "class", f"{MODEL},{CLS}"),),
        ),
        PanelSpec(
            "Preemptions and resumes",
            "ops",
            (
                Query(
                    f"sum by (class) (rate(fleetgate_preemptions_total{{{MODEL},{CLS}}}"
                    "[$__rate_interval]))",
                    "preempted {{class}}",
                ),
                Query(
                    f"sum by (class, cause) (rate(fleetgate_resumes_total{{{MODEL},{CLS}}}"
                    "[$__rate_interval]))",
                    "resumed {{class}} ({{cause}})",
                ),
            ),
        ),
        PanelSpec(
            "Sheds by class and status",
            "ops",
            (
                Query(
                    f"sum by (class, status) (rate(fleetgate_sheds_total{{{MODEL},{CLS}}}"
                    "[$__rate_interval]))",
                    "{{class}} {{status}}",
                ),
            ),
        ),
        PanelSpec(
            "TTFT objective attainment by class",
            "percentunit",
            (
                Query(
                    "sum by (class) (rate(fleetgate_ttft_objective_total"
                    f'{{{MODEL},{CLS},met="true"}}[$__rate_interval])) / clamp_min('
                    f"sum by (class) (rate(fleetgate_ttft_objective_total{{{MODEL},{CLS}}}"
                    "[$__rate_interval])), 1e-9)",
                    "{{class}}",
                ),
            ),
        ),
        PanelSpec(
            "Dispatches by class",
            "ops",
            (
                Query(
                    f"sum by (class) (rate(fleetgate_dispatches_total{{{MODEL},{CLS}}}"
                    "[$__rate_interval]))",
                    "{{class}}",
                ),
            ),
        ),
    ),
)

OPERATOR = DashboardSpec(
    uid="fleetgate-operator",
    title="fleetgate / Operator",
    description="Reconciles, errors, latency and ready replicas per InferenceService.",
    variables=("namespace",),
    panels=(
        PanelSpec(
            "Reconciles per second",
            "ops",
            (
                Query(
                    "sum by (result) (rate(fleetgate_operator_reconciles_total[$__rate_interval]))",
                    "{{result}}",
                ),
            ),
        ),
        PanelSpec(
            "Reconcile errors per second",
            "ops",
            (
                Query(
                    "sum by (reason) (rate(fleetgate_operator_reconcile_errors_total"
                    "[$__rate_interval])) or vector(0)",
                    "{{reason}}",
                ),
            ),
        ),
        PanelSpec(
            "Reconcile latency p99",
            "s",
            (
                Query(
                    "histogram_quantile(0.99, sum by (le) (rate("
                    "fleetgate_operator_reconcile_duration_seconds_bucket[$__rate_interval])))",
                    "p99",
                ),
            ),
        ),
        PanelSpec(
            "Ready replicas per InferenceService",
            "short",
            (
                Query(
                    'fleetgate_operator_replicas_ready{namespace=~"$namespace"}',
                    "{{namespace}}/{{name}}",
                ),
            ),
        ),
        PanelSpec(
            "Autoscaling: desired vs ready replicas",
            "short",
            (
                Query(
                    'fleetgate_operator_autoscale_desired_replicas{namespace=~"$namespace"}',
                    "desired {{namespace}}/{{name}}",
                ),
                Query(
                    'fleetgate_operator_replicas_ready{namespace=~"$namespace"}'
                    " and on (namespace, name) fleetgate_operator_autoscale_desired_replicas",
                    "ready {{namespace}}/{{name}}",
                ),
            ),
            description="What the last autoscaling decision asked for (spec.autoscaling) "
            "and what is ready; the reason is in the Autoscaling condition and the Events.",
        ),
        PanelSpec(
            "Autoscaling: demand seen (summed over routers)",
            "short",
            (
                Query(
                    "fleetgate_operator_autoscale_demand{"
                    'namespace=~"$namespace", signal=~"inFlight|queued|held"}',
                    "{{signal}} {{namespace}}/{{name}}",
                ),
            ),
            description="Requests in flight on the engines, queued and held in the "
            "routers, as the autoscaler read them from the routers' /metrics.",
        ),
        PanelSpec(
            "Autoscaling: pool GPU budget",
            "short",
            (Query("fleetgate_operator_pool_gpus", "{{state}} {{pool}}"),),
            description="Pools with --pool-gpu-budget: the budget, the GPUs the demand of "
            "their autoscaled services wants (replicas x gpu.count) and what the budget "
            "grants (latency role first). wanted above granted: a ScaleUpLimited reason.",
        ),
    ),
)

DASHBOARDS: tuple[DashboardSpec, ...] = (FLEET, ROUTING, PRIORITY, OPERATOR)
