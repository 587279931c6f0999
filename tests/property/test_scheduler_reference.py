"""The optimised scheduler decides exactly what the original one (a frozen copy) decides."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lenbatch.config import BatchingConfig
from lenbatch.core.lanes import SchedulerConfig, resolve_scheduler
from lenbatch.core.queues import Queues
from lenbatch.core.request import Request
from lenbatch.core.scheduler import schedule
from tests.property import reference_scheduler
from tests.property.strategies import FIXED

pytestmark = pytest.mark.slow


@dataclass
class Op:
    """One step: requests arrive (lengths, priorities, deadlines), then a decision at `now`,
    then `done` of the oldest in-flight batches finish."""

    dt: float
    arrivals: list[tuple[int, int, float | None]]
    done: int


configs = st.builds(
    lambda strategy, bounds, mb, wait, tokens, conc, pre, window, omb, quota: resolve_scheduler(
        BatchingConfig(
            strategy=strategy,
            boundaries=tuple(sorted(set(bounds))) if bounds else None,
            max_batch=mb,
            max_wait_ms=wait,
            max_batch_tokens=tokens,
            max_concurrent_batches=conc,
            prefetch_batches=pre,
            sorted_window=window,
            overlong_max_batch=omb,
            overlong_max_inflight=quota,
        ),
        128,
        (16, 32, 64),
    ),
    st.sampled_from(FIXED),
    st.lists(st.integers(1, 128), max_size=4),
    st.integers(1, 12),
    st.sampled_from([0.0, 1.0, 5.0, 20.0]),
    st.sampled_from([128, 256, 512, 4096]),
    st.integers(1, 3),
    st.integers(0, 2),
    st.integers(1, 20),
    st.integers(1, 6),
    st.integers(1, 2),
)

ops = st.lists(
    st.builds(
        Op,
        st.sampled_from([0.0, 0.0005, 0.002, 0.004, 0.01, 0.03]),
        st.lists(
            st.tuples(
                st.integers(1, 128),
                st.sampled_from([0, 0, 0, 1]),
                st.one_of(st.none(), st.sampled_from([0.001, 0.005, 0.02])),
            ),
            max_size=8,
        ),
        st.integers(0, 3),
    ),
    min_size=1,
    max_size=40,
)


def _shape(decision: object) -> tuple[object, ...]:
    batches = [(b.lane, [r.id for r in b.requests], b.padded_len) for b in decision.batches]  # type: ignore[attr-defined]
    expired = [r.id for r in decision.expired]  # type: ignore[attr-defined]
    return batches, expired, decision.wake_at  # type: ignore[attr-defined]


@settings(max_examples=120, deadline=None)
@given(configs, ops)
def test_same_decisions_as_the_reference(cfg: SchedulerConfig, steps: list[Op]) -> None:
    """Same queues, same times: identical batches, expiries and wake-up times."""
    worlds = [(schedule, Queues(cfg), []), (reference_scheduler.schedule, Queues(cfg), [])]
    now = 0.0
    n = 0
    for op in steps:
        now += op.dt
        for length, prio, ttl in op.arrivals:
            n += 1
            for _, q, _ in worlds:
                deadline = None if ttl is None else now + ttl
                q.push(Request(length, now, id=f"r{n}", deadline=deadline, priority=prio))
        shapes = []
        for fn, q, inflight in worlds:
            d = fn(q, now, cfg)
            inflight.extend(b.lane for b in d.batches)
            shapes.append(_shape(d))
            for _ in range(min(op.done, len(inflight))):
                q.batch_done(inflight.pop(0))
        assert shapes[0] == shapes[1]
        assert worlds[0][1].depths() == worlds[1][1].depths()
        assert worlds[0][1].size == worlds[1][1].size
