"""Memory and speed of the router's exact KV index (``KvIndex``), measured with tracemalloc.

``python -m fleetgate_tools.bench.kvindex_memory [--blocks N] [--holders H]``

Feeds ``N`` distinct blocks (chains of 32 blocks of 16 tokens, as a vLLM engine would
report them: 64-bit int engine hashes) to each of ``H`` endpoints, holding the same
blocks (the shared-prefix case), and prints the bytes tracemalloc sees allocated per
(endpoint, block) entry and per million blocks, and the time of one ``match`` of a
512-token prompt (32 keys) that hits in full, with the index over half its bound
(the matched run moves to the young end) and as if below (lookups only). The
decoded events are dropped after each ``apply``, so only what the index keeps is
counted.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import random
import time
import tracemalloc

from fleetgate.engines.base import BlockStored, KvEventBatch
from fleetgate.router.scheduling.kvindex import KvIndex, block_keys
from fleetgate.router.scheduling.types import EndpointId

BLOCK = 16
CHAIN = 32


@dataclasses.dataclass(frozen=True)
class Measured:
    blocks: int
    holders: int
    entries: int
    bytes_total: int
    match_us: float
    """One full-hit ``match`` of 32 keys with the index over half its bound (moves)."""
    lookup_us: float
    """The same below half the bound (lookups only)."""

    @property
    def bytes_per_entry(self) -> float:
        return self.bytes_total / max(1, self.entries)

    @property
    def mb_per_million_entries(self) -> float:
        return self.bytes_per_entry * 1e6 / 2**20


def _chains(blocks: int, seed: int) -> list[tuple[int, ...]]:
    rng = random.Random(seed)
    out = []
    for _ in range(0, blocks, CHAIN):
        out.append(tuple(rng.randrange(1, 128_000) for _ in range(CHAIN * BLOCK)))
    return out


def measure(blocks: int = 1_000_000, holders: int = 1, seed: int = 0) -> Measured:
    chains = _chains(blocks, seed)
    rng = random.Random(seed + 1)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        idx = KvIndex(max_blocks=blocks * holders + 1)
        for h in range(holders):
            eid = EndpointId(f"engine-{h}")
            for toks in chains:
                hashes = tuple(rng.getrandbits(64) for _ in range(CHAIN))
                idx.apply(eid, KvEventBatch(None, (BlockStored(hashes, None, toks, BLOCK),)))
        gc.collect()
        after = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    keys = block_keys(chains[0], BLOCK)
    n = 5000
    eid = EndpointId("engine-0")
    start = time.perf_counter()
    for _ in range(n):
        idx.match(eid, keys)
    match_us = (time.perf_counter() - start) / n * 1e6
    # the same index as if it were below half its bound (no recency move on match)
    idx._touch_from = idx.max_blocks
    start = time.perf_counter()
    for _ in range(n):
        idx.match(eid, keys)
    lookup_us = (time.perf_counter() - start) / n * 1e6
    return Measured(blocks, holders, len(idx), after - before, match_us, lookup_us)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=1_000_000)
    parser.add_argument("--holders", type=int, nargs="+", default=[1, 4])
    args = parser.parse_args()
    for h in args.holders:
        m = measure(args.blocks, h)
        print(
            f"holders={h} blocks={m.blocks} entries={m.entries} "
            f"bytes/entry={m.bytes_per_entry:.0f} MiB/1M entries={m.mb_per_million_entries:.0f} "
            f"match({CHAIN} keys)={m.match_us:.1f}us (below half the bound {m.lookup_us:.1f}us)"
        )


if __name__ == "__main__":
    main()
