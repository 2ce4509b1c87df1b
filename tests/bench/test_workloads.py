"""Benchmark workloads are reproducible from a seed and shaped as documented."""

from __future__ import annotations

import statistics

import pytest

from fleetgate_tools.bench import workloads
from fleetgate_tools.bench.workloads import Session, Turn, WorkloadParams


@pytest.mark.parametrize("name", sorted(workloads.WORKLOADS))
def test_same_seed_same_workload_other_seed_differs(name: str) -> None:
    p = WorkloadParams(duration_s=20, rate=2, scale=0.2, seed=7)
    a = workloads.build(name, p)
    b = workloads.build(name, p)
    c = workloads.build(name, WorkloadParams(duration_s=20, rate=2, scale=0.2, seed=8))
    assert a == b
    assert a != c
    assert a, "a 20 s workload at 2/s must have sessions"
    assert all(0 <= s.start_s < 20 for s in a)
    assert [s.start_s for s in a] == sorted(s.start_s for s in a)


def test_arrival_rate_matches_parameter() -> None:
    sessions = workloads.build("shared-prefix", WorkloadParams(duration_s=400, rate=3, seed=1))
    assert 3 * 400 * 0.9 < len(sessions) < 3 * 400 * 1.1


def test_chat_lengths_follow_sharegpt_means() -> None:
    sessions = workloads.build("chat-multiturn", WorkloadParams(duration_s=300, rate=4, seed=2))
    prompt_words = [len(t.content.split()) for s in sessions for t in s.turns]
    outputs = [t.max_tokens for s in sessions for t in s.turns]
    # log-normal fits with means 161 / 338, truncated to [4, 1024]
    assert 130 < statistics.fmean(prompt_words) < 175
    assert 280 < statistics.fmean(outputs) < 345
    systems = {s.system for s in sessions}
    assert len(systems) == 4, "a handful of shared system prompts"


def test_shared_prefix_groups_share_long_documents() -> None:
    sessions = workloads.build("shared-prefix", WorkloadParams(duration_s=60, rate=4, seed=3))
    groups: dict[str, list[str]] = {}
    for s in sessions:
        groups.setdefault(s.session_id.split("-")[0], []).append(s.turns[0].content)
    shared = [g for g in groups.values() if len(g) > 1]
    assert shared, "several questions per document"
    for contents in shared:
        doc = contents[0].split("\n\nQuestion:")[0]
        assert len(doc.split()) == 3000
        assert all(c.startswith(doc) for c in contents)


def test_a_long_shared_prefix_run_reuses_one_document_pool() -> None:
    # a run up to SHARED_PREFIX_POOL_S has about four questions per document; a longer
    # one draws from the same number of documents, so its working set stays put
    def documents(duration: float) -> int:
        p = WorkloadParams(duration_s=duration, rate=4, scale=0.05, seed=3)
        return len({s.session_id.split("-")[0] for s in workloads.build("shared-prefix", p)})

    assert workloads.SHARED_PREFIX_POOL_S == 16.0
    assert documents(8) <= 8 and 12 < documents(16) <= 16
    assert 12 < documents(64) <= 16


def test_priority_storm_mixes_classes_with_critical_bursts() -> None:
    sessions = workloads.build("priority-storm", WorkloadParams(duration_s=100, rate=8, seed=4))
    classes = {s.priority_class for s in sessions}
    assert classes == {"critical", "batch"}
    crit = [s.start_s for s in sessions if s.priority_class == "critical"]
    in_burst = sum(1 for t in crit if 30 <= t < 40 or 70 <= t < 80)
    # bursts cover 20% of the time at 4x the rate: about half of critical traffic
    assert in_burst / len(crit) > 0.35


def test_messages_for_carries_real_answers_in_history() -> None:
    s = Session(
        "s",
        0.0,
        "sys",
        (Turn("q1", 4), Turn("q2", 4, think_s=1.0), Turn("q3", 4)),
    )
    msgs = s.messages_for(2, ["a1", "a2"])
    assert [(m["role"], m["content"]) for m in msgs] == [
        ("system", "sys"),
        ("user", "q1"),
        ("assistant", "a1"),
        ("user", "q2"),
        ("assistant", "a2"),
        ("user", "q3"),
    ]


def test_unknown_workload_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match="shared-prefix"):
        workloads.build("nope", WorkloadParams())


def test_evictions_sizes_documents_from_the_cache_and_skews_popularity() -> None:
    p = WorkloadParams(duration_s=200, rate=8, seed=5, cache_tokens=30000)
    groups, doc = workloads.eviction_documents(p)
    assert doc == workloads.EVICTION_DOC_TOKENS
    assert groups * doc == pytest.approx(workloads.EVICTION_WORKING_SET * 30000, rel=0.05)
    sessions = workloads.build("evictions", p)
    counts: dict[str, int] = {}
    for s in sessions:
        g = s.session_id.split("-")[0]
        counts[g] = counts.get(g, 0) + 1
    ranked = sorted(counts.values(), reverse=True)
    # Zipf-like: the most asked document far above the median one, but the tail is asked too
    assert ranked[0] > 4 * statistics.median(ranked)
    assert len(counts) > 0.8 * groups


def test_flash_burst_follows_fleet_slots() -> None:
    assert workloads.flash_burst(WorkloadParams(duration_s=10, slots=64))[0] == 200
    n, start, end = workloads.flash_burst(WorkloadParams(duration_s=10, slots=1024))
    assert n == 1024 and start == 3.0 and end == 3.5
