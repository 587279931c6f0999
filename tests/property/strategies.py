"""Hypothesis strategies for scheduler configs and workloads (one place, reused by tests)."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import strategies as st

from lenbatch.config import BatchingConfig, Strategy
from lenbatch.core.lanes import SchedulerConfig, resolve_scheduler

# The strategies whose readiness follows fixed max_wait / max_batch rules (adaptive decides
# from a cost model and deadlines: tests/property/test_adaptive_properties.py).
FIXED = [s for s in Strategy if s is not Strategy.ADAPTIVE]


@dataclass(frozen=True)
class Arrival:
    """One request of a generated workload."""

    t: float
    length: int
    timeout: float | None


@st.composite
def scheduler_configs(draw: st.DrawFn) -> SchedulerConfig:
    """Any strategy, random boundaries and caps; budgets always admit one max-length row."""
    max_length = draw(st.sampled_from([32, 64, 128]))
    strategy = draw(st.sampled_from(FIXED))
    bounds = None
    if strategy is Strategy.BUCKETED:
        picks = draw(st.sets(st.integers(1, max_length), min_size=1, max_size=5))
        bounds = tuple(sorted(picks))
    cfg = BatchingConfig(
        strategy=strategy,
        boundaries=bounds,
        max_batch=draw(st.integers(1, 8)),
        max_wait_ms=draw(st.sampled_from([0.0, 1.0, 5.0, 20.0])),
        max_batch_tokens=draw(st.integers(max_length, 6 * max_length)),
        overlong_max_batch=draw(st.integers(1, 4)),
        overlong_max_wait_ms=draw(st.sampled_from([0.0, 10.0, 50.0])),
        overlong_max_inflight=draw(st.integers(1, 2)),
        sorted_window=draw(st.integers(1, 16)),
        max_concurrent_batches=draw(st.integers(1, 3)),
        prefetch_batches=0,
    )
    return resolve_scheduler(cfg, max_length, bounds or ())


@st.composite
def workloads(draw: st.DrawFn, max_length: int) -> list[Arrival]:
    """Arrivals with random gaps (bursts included), lengths and optional deadlines."""
    n = draw(st.integers(1, 60))
    t = 0.0
    out = []
    for _ in range(n):
        t += draw(st.sampled_from([0.0, 0.0, 0.0005, 0.002, 0.01, 0.05]))
        length = draw(st.integers(1, max_length))
        timeout = draw(st.one_of(st.none(), st.sampled_from([0.005, 0.05, 1.0])))
        out.append(Arrival(t, length, timeout))
    return out
