"""Issue 14: the admission queue's state is bounded by what is queued.

Per-tenant WFQ tags, per-pool class queues, lazily deleted heap entries and the
expiry heap are freed as the queue empties, so a stream of distinct tenant names
(one per request, as a hostile client may send) holds no memory afterwards.
"""

from __future__ import annotations

from fleetgate.router.priority.config import PriorityConfig
from fleetgate.router.priority.queue import AdmissionQueue


def test_tenant_state_is_freed_when_the_queue_empties() -> None:
    cfg = PriorityConfig()
    std = cfg.get("standard")
    q: AdmissionQueue[None] = AdmissionQueue(cfg)
    now = 0.0
    for i in range(5000):
        q.offer(f"r{i}", std, f"tenant-{i}", now, None, pool=f"model-{i % 3}")
        if i % 2:
            q.remove(f"r{i}")  # the client went away
        else:
            assert q.pop_next(now, lambda item: True) is not None
        assert q.tenants_tracked() <= 1
    assert len(q) == 0 and q.tenants_tracked() == 0
    assert not q._pools and not q._expiries


def test_stale_entries_are_compacted_while_work_stays_queued() -> None:
    cfg = PriorityConfig()
    std = cfg.get("standard")
    q: AdmissionQueue[None] = AdmissionQueue(cfg)
    q.offer("keep", std, "a", 0.0, None)
    for i in range(5000):
        q.offer(f"r{i}", std, f"t{i}", 0.0, None)
        q.remove(f"r{i}")
    assert len(q) == 1 and q.tenants_tracked() == 1
    cq = q._pools[""]["standard"]
    assert len(cq.heap) <= 2 * len(cq.live) + 64 + 1
    assert len(q._expiries) <= 2 * len(q) + 64 + 1
    item = q.pop_next(0.0, lambda item: True)
    assert item is not None and item.request_id == "keep"
    assert q.tenants_tracked() == 0
