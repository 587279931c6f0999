"""The simulator predicts what the real engine does: same batches, same latencies.

The engine runs on the real clock with a fake model that sleeps for exactly the cost model's
time, so the only difference left is timer jitter; arrivals are spaced 100 ms or more away
from every decision point so that jitter cannot change which batch a request joins.
"""

from __future__ import annotations

import asyncio
import gc
import time

import numpy as np
import pytest

from lenbatch.config import BatchingConfig, Strategy
from lenbatch.embed.engine import Engine
from lenbatch.plan.costmodel import CostModel
from lenbatch.plan.sim import simulate
from lenbatch.plan.trace import Trace
from lenbatch.runners.fake import FakeRunner

pytestmark = pytest.mark.slow

COST = CostModel(const=0.4, per_token=0.001)
# (arrival s, length): A and B together, then C, D, E while the runner is busy
ARRIVALS = [(0.0, 5), (0.0, 10), (0.6, 20), (0.9, 8), (1.2, 30)]


async def run_engine(cfg: BatchingConfig) -> tuple[list[tuple[int, ...]], list[float]]:
    runner = FakeRunner(max_length=64, cost=COST.latency)
    engine = Engine(runner, cfg)
    await engine.start()
    t0 = time.monotonic()
    latencies = [0.0] * len(ARRIVALS)

    async def call(i: int, at: float, length: int) -> None:
        await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
        start = time.monotonic()
        await engine.embed([[101, *([2000] * (length - 2)), 102]])
        latencies[i] = time.monotonic() - start

    # No garbage collection while timing: late in the whole suite the process holds several
    # models, and one full collection on the event loop took ~90 ms, more than the jitter
    # this test allows (it compares the schedule, not the interpreter's pauses).
    gc.collect()
    gc.disable()
    try:
        await asyncio.gather(*(call(i, at, n) for i, (at, n) in enumerate(ARRIVALS)))
    finally:
        gc.enable()
    await engine.stop()
    return [b.lengths for b in runner.batches], latencies


def sim_batches(cfg: BatchingConfig) -> tuple[list[tuple[int, ...]], list[float]]:
    t = Trace(np.array([n for _, n in ARRIVALS]), np.array([a for a, _ in ARRIVALS]))
    run = simulate(t, COST, cfg, max_length=64)
    starts = run.arrivals + run.waits
    batches: dict[float, list[int]] = {}
    for k in np.argsort(starts, kind="stable"):
        batches.setdefault(round(float(starts[k]), 9), []).append(int(run.lengths[k]))
    return [tuple(b) for b in batches.values()], run.latencies.tolist()


@pytest.mark.parametrize("prefetch", [1, 0])
async def test_engine_forms_the_batches_the_simulator_predicts(prefetch: int) -> None:
    """With prefetch D is batched alone while C runs and E follows alone; without it D and E
    wait together. The engine does the same, and each latency agrees within timer jitter."""
    cfg = BatchingConfig(
        strategy=Strategy.FIFO, max_batch=3, max_wait_ms=200, prefetch_batches=prefetch
    )
    predicted, predicted_lat = sim_batches(cfg)
    expected = [(5, 10), (20,), (8,), (30,)] if prefetch else [(5, 10), (20,), (8, 30)]
    assert predicted == expected
    seen, measured_lat = await run_engine(cfg)
    assert seen == predicted
    assert measured_lat == pytest.approx(predicted_lat, abs=0.08)
