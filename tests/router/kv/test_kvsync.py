"""The per-endpoint sequencer (pure): apply, gap, duplicate, restart, accepted gaps."""

from __future__ import annotations

import pytest

from fleetgate.router.scheduling.kvsync import FeedSequencer, KvFeedStatus, Step


def feed(seq: FeedSequencer, *batches: tuple[int, float]) -> list[Step]:
    out = []
    for s, ts in batches:
        step = seq.classify(s, ts)
        out.append(step)
        if step is Step.APPLY:
            seq.applied(s, ts)
    return out


def test_in_order_stream_applies_and_needed_follows() -> None:
    seq = FeedSequencer()
    assert seq.needed == 0
    assert feed(seq, (0, 1.0), (1, 1.1), (2, 1.2)) == [Step.APPLY] * 3
    assert seq.last == 2 and seq.needed == 3 and seq.complete


def test_first_batch_after_zero_is_a_gap_and_a_jump_is_a_gap() -> None:
    seq = FeedSequencer()
    assert seq.classify(5, 1.0) is Step.GAP
    feed(seq, (0, 1.0), (1, 1.1))
    assert seq.classify(3, 1.3) is Step.GAP
    assert seq.last == 1, "a gap applies nothing"


def test_replayed_batch_seen_again_is_a_duplicate() -> None:
    seq = FeedSequencer()
    feed(seq, (0, 1.0), (1, 1.1), (2, 1.2))
    assert seq.classify(1, 1.1) is Step.DUPLICATE
    assert seq.classify(2, 1.2) is Step.DUPLICATE


def test_going_back_with_another_timestamp_is_a_restart() -> None:
    seq = FeedSequencer()
    feed(seq, (0, 1.0), (1, 1.1), (2, 1.2))
    assert seq.classify(0, 9.0) is Step.RESTART, "seq 0 again, a new engine"
    assert seq.classify(1, 9.1) is Step.RESTART
    assert seq.classify(1, None) is Step.RESTART, "no timestamp: nothing proves a duplicate"
    seq.restart()
    assert seq.last is None and seq.classify(0, 9.0) is Step.APPLY


def test_restart_past_last_is_caught_by_same_stream() -> None:
    seq = FeedSequencer()
    feed(seq, (0, 1.0), (1, 1.1))
    assert seq.same_stream(1, 1.1)
    assert not seq.same_stream(1, 7.5), "the new engine's batch 1"
    assert not seq.same_stream(5, 1.1)
    assert not seq.same_stream(1, None)


def test_accepted_gap_makes_the_stream_incomplete_until_a_clear() -> None:
    seq = FeedSequencer()
    assert seq.classify(40, 1.0) is Step.GAP
    seq.accept_gap(40)
    assert not seq.complete and seq.classify(40, 1.0) is Step.APPLY
    seq.applied(40, 1.0)
    seq.cleared()
    assert seq.complete
    seq.accept_gap(0)
    assert seq.last is None and not seq.complete


def test_history_is_bounded() -> None:
    seq = FeedSequencer(history=2)
    feed(seq, (0, 1.0), (1, 1.1), (2, 1.2))
    assert seq.classify(0, 1.0) is Step.RESTART, "too old to prove a duplicate"
    assert seq.classify(1, 1.1) is Step.DUPLICATE
    with pytest.raises(ValueError):
        FeedSequencer(history=0)
    with pytest.raises(ValueError):
        seq.classify(-1, None)


def test_no_seq_always_applies() -> None:
    seq = FeedSequencer()
    assert seq.classify(None, None) is Step.APPLY
    seq.applied(None, None)
    assert seq.last is None


def test_status_exact_only_when_live() -> None:
    st = KvFeedStatus()
    assert st.state == "off" and not st.exact
    assert st.set("syncing", 1.0, "connecting")
    assert not st.set("syncing", 2.0)
    assert st.since == 1.0
    st.set("partial", 3.0)
    assert not st.exact
    st.set("live", 4.0)
    assert st.exact and st.reason is None
