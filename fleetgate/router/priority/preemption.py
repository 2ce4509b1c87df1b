"""Choosing which in-flight request to preempt for an overdue higher-class request.

The trigger (all must hold, else the decision says why not):

* preemption is enabled in :class:`~fleetgate.router.priority.config.PriorityConfig`;
* the waiting request is *fresh* (a parked request already has its first token,
  so TTFT no longer argues for it; it resumes when capacity returns);
* its class has ``preempt_after_fraction`` and it has waited at least
  ``preempt_after_fraction x ttft_objective_s``;
* its pool is saturated (nothing is free; otherwise dispatch, do not preempt).

Candidates are in-flight requests that are of a **strictly lower** level, that
are resumable (the router can continue them: one choice, engine reachable), that
run on an endpoint eligible for the waiting request, and that have been
preempted fewer than their class's ``max_preemptions_per_request`` times.

Score (higher is a better victim)::

    score = freed_kv_tokens / (1 + generated_tokens)

``freed_kv_tokens = prompt_tokens + generated_tokens`` is the victim's KV
footprint, what its cancellation returns to the engine. ``generated_tokens`` is
the work at risk: resume re-prefills prompt + generated tokens (cheap when the
prefix is still cached, and decode work is never redone because the tokens are
kept), but a request that has produced a lot is also the one closest to
finishing by itself. When ``needed_tokens`` is given, victims that free at least
that much KV rank before those that do not. Ties: lower level first (the least
important work), then the most recently started (as vLLM's own scheduler picks
the newest of the lowest priority, ``v1/core/sched/scheduler.py``), then request id.

Pure: the caller passes ``now`` and plain snapshots.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence

from fleetgate.router.priority.config import PriorityConfig


@dataclasses.dataclass(frozen=True, slots=True)
class InFlight:
    """One running request as the router tracks it."""

    request_id: str
    endpoint: str
    class_name: str
    level: int
    prompt_tokens: int
    generated_tokens: int
    preemptions: int
    started_at: float
    resumable: bool = True

    @property
    def freed_kv_tokens(self) -> int:
        return self.prompt_tokens + self.generated_tokens

    @property
    def score(self) -> float:
        return self.freed_kv_tokens / (1 + self.generated_tokens)


@dataclasses.dataclass(frozen=True, slots=True)
class Waiting:
    """The queued request that might preempt (usually the head of its class)."""

    request_id: str
    class_name: str
    enqueued_at: float
    parked: bool = False
    needed_tokens: int | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class PreemptionDecision:
    victim: InFlight | None
    reason: str

    @property
    def preempt(self) -> bool:
        return self.victim is not None


def choose_victim(
    config: PriorityConfig,
    waiting: Waiting,
    in_flight: Sequence[InFlight],
    now: float,
    *,
    pool_saturated: bool,
    eligible_endpoints: Collection[str] | None = None,
) -> PreemptionDecision:
    """Decide whether to preempt for ``waiting``, and whom (see module docstring)."""
    if not config.preemption_enabled:
        return PreemptionDecision(None, "preemption disabled")
    cls = config.get(waiting.class_name)
    if waiting.parked:
        return PreemptionDecision(None, "parked requests never preempt (TTFT already served)")
    threshold = cls.preempt_after_s
    if threshold is None:
        return PreemptionDecision(None, f"class {cls.name!r} never preempts")
    waited = now - waiting.enqueued_at
    if waited < threshold:
        return PreemptionDecision(
            None, f"waited {waited:.3f}s < {threshold:.3f}s preemption threshold"
        )
    if not pool_saturated:
        return PreemptionDecision(None, "capacity is free: dispatch instead")
    candidates = []
    for r in in_flight:
        if r.level >= cls.level or not r.resumable:
            continue
        if eligible_endpoints is not None and r.endpoint not in eligible_endpoints:
            continue
        try:
            limit = config.get(r.class_name).max_preemptions_per_request
        except KeyError:
            continue  # class removed by a config reload: leave it alone
        if r.preemptions >= limit:
            continue
        candidates.append(r)
    if not candidates:
        return PreemptionDecision(None, f"no in-flight request below level {cls.level} to preempt")

    def rank(r: InFlight) -> tuple[bool, float, int, float, str]:
        enough = waiting.needed_tokens is None or r.freed_kv_tokens >= waiting.needed_tokens
        return (not enough, -r.score, r.level, -r.started_at, r.request_id)

    victim = min(candidates, key=rank)
    return PreemptionDecision(
        victim,
        f"waited {waited:.3f}s >= {threshold:.3f}s; preempt {victim.request_id} "
        f"({victim.class_name}, frees {victim.freed_kv_tokens} KV tokens, "
        f"{victim.generated_tokens} generated, score {victim.score:.2f})",
    )
