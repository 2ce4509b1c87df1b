"""The in-tree scheduling plugins, one module each (what a plugin is: ``base``).

=====================  ======================  ==========================================
module                 plugin (config name)    job
=====================  ======================  ==========================================
``filters``            ``healthy``,            hard: drop unhealthy, ejected, draining
                       ``not-ejected``,        and wrong-model endpoints; soft: steer
                       ``not-draining``,       long prompts away from short contexts
                       ``serves-model``,
                       ``context-fits``
``prefix_affinity``    ``prefix-affinity``     cached prefix, bounded load and prefill
``load_scorer``        ``load``                least work
``kv_headroom``        ``kv-headroom``         most KV cache left after the request
``engine_speed``       ``engine-speed``        urgent to fast engines, batch to slow ones
``max_score``          ``max-score`` picker    highest total; seeded tie-break
``round_robin``        ``round-robin`` picker  take turns, ignore scores
=====================  ======================  ==========================================

``scheduling.pipeline.default_pipeline`` wires them in order. The names below are
re-exported so callers may import a plugin from the package.
"""

from fleetgate.router.scheduling.plugins.base import (
    Filter,
    Picker,
    PickerName,
    Scorer,
    WeightedScorer,
)
from fleetgate.router.scheduling.plugins.engine_speed import (
    NEUTRAL_SPEED_SCORE,
    EngineSpeedScorer,
)
from fleetgate.router.scheduling.plugins.filters import (
    ContextFitsFilter,
    HealthyFilter,
    NotDrainingFilter,
    NotEjectedFilter,
    ServesModelFilter,
)
from fleetgate.router.scheduling.plugins.kv_headroom import KvHeadroomScorer
from fleetgate.router.scheduling.plugins.load_scorer import LoadScorer
from fleetgate.router.scheduling.plugins.max_score import MaxScorePicker
from fleetgate.router.scheduling.plugins.prefix_affinity import (
    PrefixAffinityScorer,
    approximate_cached,
    cache_source,
    cached_tokens,
    over_bound,
    prefill_cost,
    uncached_tokens,
)
from fleetgate.router.scheduling.plugins.round_robin import RoundRobinPicker

__all__ = [
    "NEUTRAL_SPEED_SCORE",
    "ContextFitsFilter",
    "EngineSpeedScorer",
    "Filter",
    "HealthyFilter",
    "KvHeadroomScorer",
    "LoadScorer",
    "MaxScorePicker",
    "NotDrainingFilter",
    "NotEjectedFilter",
    "Picker",
    "PickerName",
    "PrefixAffinityScorer",
    "RoundRobinPicker",
    "Scorer",
    "ServesModelFilter",
    "WeightedScorer",
    "approximate_cached",
    "cache_source",
    "cached_tokens",
    "over_bound",
    "prefill_cost",
    "uncached_tokens",
]
