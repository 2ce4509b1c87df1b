"""The filters (``plugins.filters``) in the default pipeline: hard filters name the one
that emptied the pool; the soft context filter never empties it.
"""

from __future__ import annotations

import random

import pytest

from fleetgate.router.scheduling.pipeline import NoEndpointError, default_pipeline
from fleetgate.router.scheduling.types import EndpointId

from .views import req, view


def test_filters_and_no_endpoint() -> None:
    pipe = default_pipeline()
    eps = [
        view("sick", healthy=False),
        view("out", ejected=True),
        view("other", models=frozenset({"x"})),
        view("ok"),
    ]
    d = pipe.schedule(req(), eps, random.Random(0))
    assert d.ranking == (EndpointId("ok"),)
    assert d.decided_by == "filter:serves-model" and d.reason == "single"
    assert {n for n, _ in d.filtered_out} == {"healthy", "not-ejected", "serves-model"}
    with pytest.raises(NoEndpointError) as err:
        pipe.schedule(req(), [view("sick", healthy=False)], random.Random(0))
    assert err.value.filter_name == "healthy"


def test_soft_context_filter_never_empties_the_pool() -> None:
    pipe = default_pipeline()
    short, long_ = view("short", max_len=512), view("long", max_len=8192)
    d = pipe.schedule(req(prompt_tokens=4000), [short, long_], random.Random(0))
    assert d.ranking == (EndpointId("long"),)
    d = pipe.schedule(req(prompt_tokens=40000), [short, long_], random.Random(0))
    assert len(d.ranking) == 2  # clearly too long for all: the engine answers
