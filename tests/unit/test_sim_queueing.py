"""The simulator runs the engine's own scheduling code, and agrees with queueing theory."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest

import lenbatch.core.scheduler
import lenbatch.embed.engine
import lenbatch.plan.sim
import lenbatch.serving.engine
from lenbatch.config import AdaptiveConfig, BatchingConfig, Strategy
from lenbatch.core.adaptive import build_state
from lenbatch.core.admission import Admission
from lenbatch.core.batch import Decision
from lenbatch.core.errors import LenbatchError
from lenbatch.core.lanes import SchedulerConfig, resolve_lanes
from lenbatch.core.queues import Queues
from lenbatch.core.request import Request
from lenbatch.plan.costmodel import CostModel
from lenbatch.plan.trace import Trace


def poisson(rate: float, n: int, lengths: Sequence[int] | np.ndarray, seed: int = 0) -> Trace:
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1 / rate, n))
    return Trace(np.asarray(lengths, dtype=np.int64), arrivals - arrivals[0])


def test_engine_and_simulator_use_the_same_scheduling_objects() -> None:
    """One scheduler function, one Queues class, one Admission class, shared by both."""
    assert lenbatch.plan.sim.schedule is lenbatch.core.scheduler.schedule
    assert lenbatch.embed.engine.schedule is lenbatch.core.scheduler.schedule
    assert lenbatch.plan.sim.Queues is lenbatch.serving.engine.Queues  # the engines' base
    assert lenbatch.plan.sim.Admission is lenbatch.serving.engine.Admission
    assert lenbatch.plan.sim.build_state is lenbatch.embed.engine.build_state  # adaptive's


def test_simulator_decisions_come_from_the_scheduler(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every batch the simulator runs was emitted by a call to `schedule()`."""
    emitted = []
    real = lenbatch.core.scheduler.schedule

    def spy(queues: Queues, now: float, cfg: SchedulerConfig, ad: object = None) -> Decision:
        d = real(queues, now, cfg, ad)  # type: ignore[arg-type]
        emitted.extend(len(b.requests) for b in d.batches)
        return d

    monkeypatch.setattr(lenbatch.plan.sim, "schedule", spy)
    t = poisson(50.0, 500, np.full(500, 20))
    run = lenbatch.plan.sim.simulate(t, CostModel(const=0.01, per_token=1e-4), BatchingConfig())
    assert sum(emitted) == 500
    assert len(emitted) == sum(s.batches for s in run.lane_stats)


@pytest.mark.parametrize("strategy", list(Strategy))
def test_schedule_is_empty_without_work_or_free_slot(strategy: Strategy) -> None:
    """The simulator skips `schedule()` in exactly these two states; it must decide nothing
    there (no batch, no expiry, no timer), or the shortcut would change the simulation."""
    cfg = resolve_lanes(BatchingConfig(strategy=strategy, max_wait_ms=0), 256).cfg
    ad = None
    if strategy is Strategy.ADAPTIVE:
        ad = build_state(AdaptiveConfig(), None, cfg, longest=256)
    q = Queues(cfg)
    assert lenbatch.core.scheduler.schedule(q, 5.0, cfg, ad) == Decision()
    for _ in range(cfg.slots):
        q.batch_started(q.lane_of(10))
    for n in (10, 100, 200):
        q.push(Request(n, 0.0, deadline=1.0))
    assert lenbatch.core.scheduler.schedule(q, 5.0, cfg, ad) == Decision()


def test_md1_mean_wait_matches_pollaczek_khinchine() -> None:
    """Batches of one, Poisson arrivals, fixed 100 ms service at load 0.5 is an M/D/1 queue:
    mean wait = rho * s / (2 (1 - rho)) = 50 ms. Tolerance ~4 sigma of 20k samples."""
    t = poisson(5.0, 20_000, np.full(20_000, 10), seed=1)
    cfg = BatchingConfig(strategy=Strategy.FIFO, max_batch=1, max_wait_ms=0, prefetch_batches=0)
    run = lenbatch.plan.sim.simulate(t, CostModel(const=0.1), cfg)
    assert float(np.mean(run.waits)) == pytest.approx(0.05, rel=0.08)
    assert float(np.mean(run.latencies)) == pytest.approx(0.15, rel=0.03)


def test_littles_law_holds_between_queue_state_and_reported_waits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Little: mean requests waiting = arrival rate x mean wait. The left side is read from
    the simulator's own queues at each Poisson arrival (which sees time averages, PASTA); the
    right side from the per-request waits it reports."""
    seen: list[int] = []

    class Spy(Admission):
        def check(self, lengths: Sequence[int], queues: Queues, now: float) -> LenbatchError | None:
            seen.append(queues.size)
            return super().check(lengths, queues, now)

    monkeypatch.setattr(lenbatch.plan.sim, "Admission", Spy)
    rng = np.random.default_rng(3)
    n = 20_000
    t = poisson(40.0, n, rng.integers(4, 250, n), seed=3)
    cfg = BatchingConfig(max_wait_ms=20, prefetch_batches=0)  # leaving the queue = starting
    run = lenbatch.plan.sim.simulate(t, CostModel(const=0.005, per_token=2e-5), cfg)
    assert len(seen) == n
    rate = n / t.duration
    mean_wait = float(np.mean(run.waits))
    assert mean_wait > 0.005  # a real queue, not an empty system
    assert float(np.mean(seen)) == pytest.approx(rate * mean_wait, rel=0.03)
