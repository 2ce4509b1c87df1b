"""The ``prefix-affinity`` scorer: send a prompt where its prefix is cached, within
bounds on load and queued prefill, and place a new prefix by rendezvous hashing.

Also the prefill arithmetic the router shares with it (:func:`uncached_tokens`,
:func:`prefill_cost`): the request record counts the same uncached tokens as the
engine's queued prefill.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from fleetgate.router.scheduling.types import CacheSource, EndpointId, EndpointView, RequestView


def over_bound(e: EndpointView, mean_work: float, bound: float, slack_requests: float) -> bool:
    """Consistent hashing with bounded loads: is ``e`` past ``(1 + bound) x mean``?

    ``slack_requests`` (in requests, converted to that engine's work units)
    keeps a nearly idle pool from spilling on every single request.
    """
    return e.load.work > (1.0 + bound) * mean_work + slack_requests / max(1, e.load.capacity)


def approximate_cached(request: RequestView, matched_chunks: int) -> int:
    """Prompt tokens ``matched_chunks`` leading approximate chunks stand for: the
    matched fraction of the request's token count (exact when it was tokenized)."""
    if request.chunks <= 0:
        return 0
    return round(request.prompt_tokens * min(1.0, max(0, matched_chunks) / request.chunks))


def cached_tokens(request: RequestView, e: EndpointView) -> int:
    """Prompt tokens ``e`` holds for ``request``: the exact view where it has one (its
    feed is live), else the approximate chunks converted to tokens. One currency, so
    one rule covers a fleet where only some engines publish KV events."""
    if e.exact_cached_tokens is not None:
        return min(request.prompt_tokens, max(0, e.exact_cached_tokens))
    return approximate_cached(request, e.prefix_match)


def cache_source(e: EndpointView) -> CacheSource:
    """The view :func:`cached_tokens` used for ``e``."""
    return "approximate" if e.exact_cached_tokens is None else "events"


def uncached_tokens(request: RequestView, cached: int) -> int:
    """Prompt tokens to prefill where ``cached`` leading prompt tokens are cached."""
    return max(0, request.prompt_tokens - max(0, cached))


def may_reuse(request: RequestView, endpoints: Sequence[EndpointView]) -> bool:
    """Whether any endpoint could hold part of the prompt: a whole approximate chunk,
    or a resident block by the exact view."""
    return request.chunks > 0 or any(e.exact_cached_tokens for e in endpoints)


def prefill_cost(request: RequestView, e: EndpointView) -> int:
    """Prompt tokens to prefill on ``e`` before this request's first token: the router's
    own backlog there (requests without a first token yet) plus this prompt's uncached part.

    On an engine that spends its steps on prompt tokens (a long-document prefill costs
    tens of milliseconds per thousand tokens, a decode step a few), the first token
    arrives after roughly this many prompt tokens: a cost in the engine's own currency,
    comparable between a warm engine with a queue and a cold idle one.
    """
    return max(0, e.pending_prefill_tokens) + uncached_tokens(request, cached_tokens(request, e))


@dataclasses.dataclass(frozen=True, slots=True)
class PrefixAffinityScorer:
    """Longest believed prefix match scores high; a new prefix goes where the least
    prefill is queued (by rendezvous among near-equals).

    * Some eligible endpoint holds part of the prompt: score = cached / prompt tokens
      (:func:`cached_tokens`: the exact view where the endpoint's feed is live, the
      approximate chunks converted to tokens elsewhere).
    * None does (a cold prefix, or every holder is ineligible below): among the
      eligible endpoints whose prefill cost is within ``prefill_slack_tokens`` of the
      least (a new prefix is prefilled in full, so it goes where the fewest prompt
      tokens are queued), the first ``cold_choices`` in rendezvous order (of the
      prompt's first chunk) score 1, 0.99, ... and the load and KV scorers choose
      between them: the power of d choices; ``None`` = all of them, so the least
      loaded wins. With d = 1 router replicas that share no state agree on the engine
      whenever their backlogs agree (plain rendezvous when no prefill is queued);
      with more, one router balances new prefixes better, but replicas would place
      the same new prefix on different engines (a second copy), hence
      ``scheduling.router_replicas``. A spilled hot prefix goes the same way
      (consistent hashing with bounded loads), and the engine it lands on then holds
      the prefix too (the router records it), so it spreads instead of hot-spotting
      one engine.
    * Eligible means all of:

      - bounded load: work at most ``(1 + bound) x`` the pool mean (plus
        ``slack_requests``), where ``bound`` is ``load_bound`` scaled by what this
        endpoint's cache saves (:meth:`bounds`, when ``bound_tokens`` is set): a
        spill costs a second prefill of the prompt part only this endpoint holds,
        so a 3000-token document may keep its engine up to the full bound while a
        conversation whose few hundred history tokens are the only difference
        spills near the mean;
      - no queueing: not a full batch (work >= ``queue_work``) while another
        endpoint has a free slot and markedly less work (``queue_ratio``, :meth:`queues`);
      - prefill cost (:func:`prefill_cost`, when ``prefill_slack`` is not None): at
        most ``(1 + prefill_slack) x`` the cheapest endpoint's plus
        ``prefill_slack_tokens``, the cheapest among the endpoints the two rules above
        let take the request (one past its own bound would not get it, and the spill
        would land on a third endpoint), where an alternative's cost also counts the prompt
        tokens it would prefill beyond this endpoint, ``spill_prefill_weight x (1 +
        prompts of this size queued for prefill there)`` times. A cache hit saves
        this prompt's prefill; it is worth nothing if the warm engine has more
        prompt tokens queued than recomputing the prompt elsewhere would cost. But
        a spill does not only move this request: the second prefill is extra work
        that delays every request arriving at the target before its queue drains
        (about as many as are queued there now, under steady load), and under an
        even overload it is pure loss. Counting it so makes a spill pay only when
        the target is markedly less loaded: an idle one at once, a busy one only
        when the holder's queue is several times longer. The slack keeps the hit
        (and the copy it avoids) when the two are close.

    * A prompt with nothing to reuse (shorter than one chunk, and no exact block held
      anywhere): all score 0.
    """

    load_bound: float = 0.25
    slack_requests: float = 2.0
    queue_work: float = 1.0
    """Affinity never sends a request to queue (work >= this) while another engine
    is below it: waiting behind a full batch costs more than a cache miss."""
    cold_choices: int | None = 1
    """Rendezvous candidates a cold prefix may go to (the load scorers pick among them);
    None = every eligible endpoint."""
    prefill_slack: float | None = 0.25
    """Relative slack of the prefill-cost rule; None turns the rule off."""
    prefill_slack_tokens: int = 512
    bound_tokens: int | None = None
    """Saved prompt tokens at which an endpoint gets the full ``load_bound``; fewer
    scale it down linearly (:meth:`bounds`). None: ``load_bound`` everywhere."""
    queue_ratio: float | None = 1.5
    """The no-queueing rule needs an endpoint with a free slot AND at most ``1 /
    queue_ratio`` of the full one's work (:meth:`queues`); None: any free slot."""
    spill_prefill_weight: float = 1.0
    """Prefill-cost rule: an alternative endpoint's cost includes this many times the
    prompt tokens it would prefill beyond the holder (the duplicated work a spill adds
    to the fleet); 0: its own cost only."""
    name: str = "prefix-affinity"

    def score(
        self, request: RequestView, endpoints: Sequence[EndpointView]
    ) -> dict[EndpointId, float]:
        if not endpoints or not may_reuse(request, endpoints):
            return {e.id: 0.0 for e in endpoints}
        ok = self.eligible(request, endpoints)
        cached = {e.id: cached_tokens(request, e) for e in endpoints}
        if any(cached[e.id] and ok[e.id] for e in endpoints):
            total = max(1, request.prompt_tokens)
            return {e.id: (min(1.0, cached[e.id] / total) if ok[e.id] else 0.0) for e in endpoints}
        if self.prefill_slack is not None and any(ok.values()):
            costs = {e.id: prefill_cost(request, e) for e in endpoints if ok[e.id]}
            near = min(costs.values()) + self.prefill_slack_tokens
            ok = {eid: eid in costs and costs[eid] <= near for eid in ok}
        scores = {e.id: 0.0 for e in endpoints}
        chosen = 0
        limit = len(endpoints) if self.cold_choices is None else self.cold_choices
        for e in sorted(endpoints, key=lambda v: v.rendezvous_rank):
            if chosen >= limit:
                break
            if ok[e.id]:
                # 1, 0.99, ...: rendezvous order breaks ties (replicas agree when
                # loads are level); about one request of load difference overrides it
                scores[e.id] = 1.0 - 0.01 * chosen
                chosen += 1
        return scores

    def eligible(
        self, request: RequestView, endpoints: Sequence[EndpointView]
    ) -> dict[EndpointId, bool]:
        """Which endpoints may get affinity credit (the three rules in the class doc)."""
        mean = sum(e.load.work for e in endpoints) / len(endpoints)
        bounds, slack = self.bounds(request, endpoints), self.slack_requests
        ok = {
            e.id: not over_bound(e, mean, bounds[e.id], slack) and not self.queues(e, endpoints)
            for e in endpoints
        }
        if self.prefill_slack is not None:
            load_ok = dict(ok)
            uncached = {
                e.id: uncached_tokens(request, cached_tokens(request, e)) for e in endpoints
            }
            costs = {e.id: max(0, e.pending_prefill_tokens) + uncached[e.id] for e in endpoints}
            weight = self.spill_prefill_weight
            prompt = max(1, request.prompt_tokens)
            # prompts of this size already queued for prefill on each endpoint
            queued = {e.id: max(0, e.pending_prefill_tokens) / prompt for e in endpoints}
            for e in endpoints:
                if not ok[e.id]:
                    continue
                # the cheapest place for this request, where each alternative also pays
                # for the prompt part it would prefill again beyond what ``e`` would:
                # work added to a queue delays every request that arrives before the
                # queue drains, about as many as are queued there now when the load
                # is steady, so that part counts (1 + queued) x ``spill_prefill_weight``.
                # Alternatives are the endpoints the load rules let take the request
                # (``e`` is one): an idle engine past its own bound would not get it.
                own = uncached[e.id]
                alternative = min(
                    costs[t.id] + weight * max(0, uncached[t.id] - own) * (1.0 + queued[t.id])
                    for t in endpoints
                    if load_ok[t.id]
                )
                limit = (1.0 + self.prefill_slack) * alternative + self.prefill_slack_tokens
                ok[e.id] = costs[e.id] <= limit
        return ok

    def queues(self, e: EndpointView, endpoints: Sequence[EndpointView]) -> bool:
        """The no-queueing rule: ``e`` holds a full batch (work >= ``queue_work``) while
        another endpoint has a free slot and, with ``queue_ratio``, at most
        ``1 / queue_ratio`` of ``e``'s work. Under an even overload every engine
        hovers around a full batch and a free slot elsewhere is soon taken: moving a
        cached prompt there only prefills it twice."""
        if e.load.work < self.queue_work:
            return False
        ratio = self.queue_ratio
        return any(
            t.load.work < self.queue_work and (ratio is None or t.load.work * ratio <= e.load.work)
            for t in endpoints
        )

    def bounds(
        self, request: RequestView, endpoints: Sequence[EndpointView]
    ) -> dict[EndpointId, float]:
        """Each endpoint's load bound: ``load_bound x min(1, saved / bound_tokens)``.

        ``saved`` = prompt tokens this endpoint holds beyond the endpoint that holds
        the least of this prompt, i.e. the prefill a spill would repeat. A system
        prompt every engine holds saves nothing against the others, so it earns no
        extra load; a long document only one engine holds earns the full bound.
        With rendezvous placement (``cold_choices`` set), a prompt some endpoint holds
        none of gives its first ``cold_choices`` rendezvous candidates the bound of a
        holder of the whole prompt, as a replica that placed it there believes it is.
        """
        if not self.bound_tokens:
            return {e.id: self.load_bound for e in endpoints}
        uncached = {e.id: uncached_tokens(request, cached_tokens(request, e)) for e in endpoints}
        most = max(uncached.values())
        bounds = {
            eid: self.load_bound * min(1.0, (most - u) / self.bound_tokens)
            for eid, u in uncached.items()
        }
        if self.cold_choices is not None and most >= request.prompt_tokens > 0:
            # Some endpoint holds none of the prompt: its rendezvous candidates get the
            # bound of a holder of the whole prompt. They are where a replica sends a
            # prompt no holder may take (a new document, or a spill), so another router
            # replica may have sent it there a moment ago (a queued request stores no
            # block until its prefill), and that replica's view names the engine its
            # holder: under the cold bound (the mean) the two disagree whenever the
            # engine is between the two bounds, and each sends the document to a
            # different engine. Not when every endpoint holds part of the prompt (a
            # shared system prompt): rendezvous follows the first chunk, which such
            # prompts share, and the wider bound would draw them all to one engine.
            full = self.load_bound * min(1.0, request.prompt_tokens / self.bound_tokens)
            for e in sorted(endpoints, key=lambda v: v.rendezvous_rank)[: self.cold_choices]:
                bounds[e.id] = full
        return bounds
