"""The ``kv-headroom`` scorer: prefer the engine with the most KV cache left after this request."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from fleetgate.router.scheduling.load import kv_tokens_needed
from fleetgate.router.scheduling.types import EndpointId, EndpointView, RequestView


@dataclasses.dataclass(frozen=True, slots=True)
class KvHeadroomScorer:
    """KV fraction left AFTER this request, counted in the engine's own blocks.

    0 when the request's blocks (prompt + max output, rounded up to the
    engine's block size) do not fit in the estimated free KV.
    """

    name: str = "kv-headroom"

    def score(
        self, request: RequestView, endpoints: Sequence[EndpointView]
    ) -> dict[EndpointId, float]:
        out: dict[EndpointId, float] = {}
        for e in endpoints:
            load = e.load
            if load.free_kv_tokens is not None and load.total_kv_tokens:
                need = kv_tokens_needed(request.prompt_tokens, request.max_tokens, load.block_size)
                left = load.free_kv_tokens - need
                out[e.id] = 0.0 if left < 0 else left / load.total_kv_tokens
            else:
                out[e.id] = 1.0 - load.kv_fraction
        return out
