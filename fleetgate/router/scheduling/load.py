"""Fresh and honest load: last scrape + the router's own traffic, decayed by age.

Scraped gauges are always a little old, and a burst that lands between two
scrapes is invisible to them (a scrape-only router reacts one cycle late).
Router-side counting alone misses other routers' traffic. fleetgate combines both:

    requests = scraped(running + waiting + paused)
               + dispatched_since_scrape - finished_since_scrape

floored at the router's own in-flight count (they are certainly there).
``finished_since_scrape`` may include requests that were already in the
scrape; that is exactly what they should subtract.

Confidence falls linearly from 1 at ``age <= fresh_for`` to 0 at
``age >= stale_after``. As it falls, ``work`` and ``kv_fraction`` are blended
towards ``stale_work`` / ``stale_kv`` (pessimistic priors, default: a full
engine), so **a stale, failing or missing scrape never reads as idle**.

Mixed engines: ``work = requests / capacity`` where capacity is the engine's
own concurrent-sequence limit (``LoadSnapshot.max_running``, else the
adapter default passed in), so a 256-seq vLLM and a 64-seq TensorRT-LLM
engine with the same ``work`` are equally busy. KV is a fraction of that
engine's blocks; tokens needed by a request are rounded up to its block size.

Pure: time comes in as ``now``.
"""

from __future__ import annotations

import dataclasses
import math

from fleetgate.engines.base import LoadSnapshot
from fleetgate.router.scheduling.types import LoadEstimate


@dataclasses.dataclass(frozen=True, slots=True)
class RouterCounts:
    """What this router itself did on one endpoint since that endpoint's last scrape."""

    in_flight: int = 0
    dispatched_since_scrape: int = 0
    finished_since_scrape: int = 0
    dispatched_tokens_since_scrape: int = 0
    """KV tokens (prompt + max output, estimated) of requests dispatched since the scrape."""
    finished_tokens_since_scrape: int = 0
    freed_tokens_since_scrape: int = 0
    """KV tokens the finished requests actually held (prompt + generated so far), where
    the router knows it; else their dispatch estimate. Priority saturation subtracts
    it from the scraped KV use, so a preemption's freed blocks count at once."""


@dataclasses.dataclass(frozen=True, slots=True)
class LoadParams:
    fresh_for: float = 0.5
    """Seconds a scrape counts as fully trustworthy."""
    stale_after: float = 3.0
    """Seconds after which a scrape carries no weight at all."""
    stale_work: float = 1.0
    """Work assumed for an engine we know nothing fresh about (1.0 = one full batch)."""
    stale_kv: float = 0.9
    default_capacity: int = 64
    default_block_size: int = 16


def confidence(age: float, params: LoadParams) -> float:
    """1 while fresh, linearly down to 0 at ``stale_after``."""
    if age <= params.fresh_for:
        return 1.0
    if age >= params.stale_after or not math.isfinite(age):
        return 0.0
    return 1.0 - (age - params.fresh_for) / (params.stale_after - params.fresh_for)


def replica_snapshot(snapshot: LoadSnapshot | None, schedulers: int) -> LoadSnapshot | None:
    """The replica's figures from a scrape whose concurrency limit and KV block counts
    are one of its ``schedulers``' (``LoadSnapshot.max_running``; TensorRT-LLM attention
    DP, whose ranks have pools of one size): those times the schedulers, the rest as
    scraped. The snapshot itself for one scheduler. Applied where the figures are read,
    never stored: the poller hands the scraped snapshot back to the parser."""
    if snapshot is None or schedulers == 1:
        return snapshot

    def times(value: int | None) -> int | None:
        return None if value is None else value * schedulers

    return dataclasses.replace(
        snapshot,
        max_running=times(snapshot.max_running),
        blocks_total=times(snapshot.blocks_total),
        blocks_free=times(snapshot.blocks_free),
    )


def slot_limit(snapshot: LoadSnapshot | None, capacity_hint: int | None) -> int | None:
    """The most requests a replica runs at once: the limit in its (replica) snapshot,
    else ``capacity_hint`` (its configuration's); None when neither says."""
    if snapshot is not None and snapshot.max_running:
        return snapshot.max_running
    return capacity_hint


def estimate_load(
    snapshot: LoadSnapshot | None,
    counts: RouterCounts,
    now: float,
    params: LoadParams,
    *,
    capacity_hint: int | None = None,
    block_size_hint: int | None = None,
    scrape_failing: bool = False,
) -> LoadEstimate:
    """Combine one endpoint's last scrape (its replica's figures: :func:`replica_snapshot`)
    with the router's own counts.

    ``scrape_failing`` (the latest scrape attempt failed) zeroes confidence
    at once: a failing engine is never trusted on an older good scrape.
    """
    capacity = slot_limit(snapshot, capacity_hint) or params.default_capacity
    block_size = (
        (snapshot.block_size if snapshot is not None and snapshot.block_size else None)
        or block_size_hint
        or params.default_block_size
    )
    delta = counts.dispatched_since_scrape - counts.finished_since_scrape
    if snapshot is None:
        age = math.inf
        conf = 0.0
        scraped_requests = 0.0
        scraped_kv = 0.0
        free_tokens: int | None = None
        total_tokens: int | None = None
    else:
        age = max(0.0, now - snapshot.scraped_at)
        conf = 0.0 if scrape_failing else confidence(age, params)
        scraped_requests = float(
            (snapshot.running or 0) + (snapshot.waiting or 0) + (snapshot.paused or 0)
        )
        if snapshot.kv_usage is not None:
            scraped_kv = snapshot.kv_usage
        elif snapshot.running == 0 and snapshot.waiting == 0:
            # idle with no KV figure (a TensorRT-LLM engine before its first iteration):
            # nothing runs, so nothing holds blocks that new work could not take
            scraped_kv = 0.0
        else:
            scraped_kv = params.stale_kv
        free_tokens = snapshot.free_kv_tokens
        total_tokens = (
            snapshot.blocks_total * block_size if snapshot.blocks_total is not None else None
        )
    requests = max(float(counts.in_flight), scraped_requests + delta, 0.0)
    fresh_work = requests / capacity
    work = conf * fresh_work + (1.0 - conf) * max(fresh_work, params.stale_work)

    token_delta = counts.dispatched_tokens_since_scrape - counts.finished_tokens_since_scrape
    if free_tokens is not None and total_tokens:
        est_free = free_tokens - max(token_delta, 0)
        fresh_kv = min(1.0, max(0.0, 1.0 - est_free / total_tokens))
    else:
        fresh_kv = scraped_kv
    kv = conf * fresh_kv + (1.0 - conf) * max(fresh_kv, params.stale_kv)
    if free_tokens is not None:
        # Pessimism reaches the token figure too: scale by the blended fraction.
        est_free_tokens: int | None = max(0, free_tokens - max(token_delta, 0))
        if total_tokens:
            est_free_tokens = min(est_free_tokens or 0, int((1.0 - kv) * total_tokens))
    else:
        est_free_tokens = None
    return LoadEstimate(
        requests=requests,
        capacity=capacity,
        work=work,
        kv_fraction=kv,
        free_kv_tokens=est_free_tokens,
        total_kv_tokens=total_tokens,
        block_size=block_size,
        confidence=conf,
        age=age,
    )


def kv_tokens_needed(prompt_tokens: int, max_tokens: int, block_size: int) -> int:
    """KV tokens one request will occupy, rounded up to whole blocks of ``block_size``."""
    tokens = max(0, prompt_tokens) + max(0, max_tokens)
    blocks = -(-tokens // max(1, block_size))
    return blocks * max(1, block_size)
