"""Plain views and snapshots for the scheduling tests (no servers)."""

from __future__ import annotations

from fleetgate.engines.base import LoadSnapshot
from fleetgate.router.scheduling.load import LoadParams
from fleetgate.router.scheduling.types import (
    EndpointId,
    EndpointView,
    LoadEstimate,
    RequestView,
)

P = LoadParams()


def snap(now: float = 100.0, **kw: object) -> LoadSnapshot:
    base: dict[str, object] = dict(
        scraped_at=now,
        kv_usage=0.1,
        running=1,
        waiting=0,
        block_size=16,
        blocks_total=1000,
        blocks_free=900,
        max_running=8,
    )
    base.update(kw)
    return LoadSnapshot(**base)  # type: ignore[arg-type]


def load(
    work: float = 0.0,
    kv: float = 0.0,
    capacity: int = 8,
    free: int | None = None,
    total: int | None = None,
    block: int = 16,
) -> LoadEstimate:
    return LoadEstimate(
        requests=work * capacity,
        capacity=capacity,
        work=work,
        kv_fraction=kv,
        free_kv_tokens=free,
        total_kv_tokens=total,
        block_size=block,
        confidence=1.0,
        age=0.0,
    )


def view(
    name: str,
    *,
    work: float = 0.0,
    kv: float = 0.0,
    match: int = 0,
    rank: int = 0,
    healthy: bool = True,
    ejected: bool = False,
    models: frozenset[str] = frozenset({"m"}),
    max_len: int | None = None,
    free: int | None = None,
    total: int | None = None,
    engine: str = "vllm",
    backlog: int = 0,
) -> EndpointView:
    return EndpointView(
        id=EndpointId(name),
        engine=engine,
        models=models,
        healthy=healthy,
        ejected=ejected,
        load=load(work, kv, free=free, total=total),
        max_model_len=max_len,
        prefix_match=match,
        rendezvous_rank=rank,
        pending_prefill_tokens=backlog,
    )


def req(chunks: int = 4, prompt_tokens: int = 256, max_tokens: int = 16) -> RequestView:
    return RequestView(model="m", chunks=chunks, prompt_tokens=prompt_tokens, max_tokens=max_tokens)


#: A 3000-token document prompt in 100 chunks.
DOC = dict(chunks=100, prompt_tokens=3000)
