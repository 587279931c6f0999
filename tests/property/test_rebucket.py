"""A lane swap (online re-fit) re-buckets queued requests: none lost, none duplicated, each in
its new lane, arrival order kept; and `adaptive` keeps every invariant across swaps."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lenbatch.config import BatchingConfig, Strategy
from lenbatch.core.lanes import resolve_scheduler
from lenbatch.core.queues import Queues
from lenbatch.core.request import Request

pytestmark = pytest.mark.slow

bounds = st.sets(st.integers(1, 128), min_size=1, max_size=5).map(lambda s: tuple(sorted(s)))


def _cfg(b: tuple[int, ...]):  # type: ignore[no-untyped-def]
    return resolve_scheduler(BatchingConfig(strategy=Strategy.ADAPTIVE, boundaries=b), 128)


@settings(max_examples=300, deadline=None)
@given(
    old=bounds,
    new=bounds,
    work=st.lists(
        st.tuples(st.integers(1, 128), st.sampled_from([0.0, 0.0, 0.001, 0.01])), max_size=80
    ),
)
def test_rebucket_loses_duplicates_and_reorders_nothing(
    old: tuple[int, ...], new: tuple[int, ...], work: list[tuple[int, float]]
) -> None:
    q = Queues(_cfg(old))
    t = 0.0
    reqs = []
    for length, gap in work:
        t += gap
        r = Request(length, t)
        q.push(r)
        reqs.append(r)
    before = {id(r): i for i, r in enumerate(reqs)}
    cfg = _cfg(new)
    q.rebucket(cfg)
    seen = [r for lane in q.lanes for r in lane]
    assert sorted(id(r) for r in seen) == sorted(before)  # none lost, none twice
    assert q.size == len(reqs) and q.inflight == [0] * len(cfg.lanes)
    for i, lane in enumerate(q.lanes):
        for r in lane:
            assert r.lane == i == q.lane_of(r.length)
        order = [before[id(r)] for r in lane]
        assert order == sorted(order)  # arrival (= push) order within each new lane
