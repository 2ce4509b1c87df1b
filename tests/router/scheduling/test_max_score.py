"""The ``max-score`` picker breaks equal totals with the injected, seeded random."""

from __future__ import annotations

import random

from fleetgate.router.scheduling.plugins.max_score import MaxScorePicker
from fleetgate.router.scheduling.types import (
    EndpointId,
    ScoredEndpoint,
)


def test_picker_seeded_tie_break() -> None:
    tied = [ScoredEndpoint(EndpointId(n), 1.0, ()) for n in "abcd"]
    picks = {MaxScorePicker().order(tied, random.Random(s))[0][0].id for s in range(40)}
    assert len(picks) > 1
    a = MaxScorePicker().order(tied, random.Random(7))
    b = MaxScorePicker().order(tied, random.Random(7))
    assert a == b and a[1] is True
