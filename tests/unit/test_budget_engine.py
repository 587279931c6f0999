"""An embedding engine on a shared CPU budget: the batches it forms ahead wait for their turn
at the budget, not behind the engine's own runner slot (where another model's batch would take
every turn its predecessor gave back)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from lenbatch.config import BatchingConfig
from lenbatch.core.collate import Collated
from lenbatch.embed.engine import Engine
from lenbatch.runners.fake import FakeRunner
from lenbatch.serving.budget import ComputeBudget


def _ids(n: int) -> list[int]:
    return [101, *([2000] * (n - 2)), 102]


async def test_batches_formed_ahead_queue_at_the_budget() -> None:
    budget = ComputeBudget()
    batching = BatchingConfig(strategy="fifo", max_batch=1, max_wait_ms=0.0)
    engine = Engine(FakeRunner(), batching)
    engine.use_budget(budget, "embedder")
    await engine.start()
    try:
        other = await budget.acquire(owner="reranker")  # another model's batch is running
        calls = [asyncio.create_task(engine.embed([_ids(5)])) for _ in range(2)]
        for _ in range(50):
            await asyncio.sleep(0.001)
            if budget.queued == 2:
                break
        # both batches (one running slot + one formed ahead) ask for their turns now
        assert budget.queued == 2
        budget.release(other)
        results = await asyncio.wait_for(asyncio.gather(*calls), 10)
        assert all(len(r) == 1 for r in results)
        assert budget.describe()["turns"] == 3
    finally:
        await engine.stop(timeout=1.0)


@dataclass
class _LayeredRunner(FakeRunner):
    """A fake model whose call is 10 layers of `cost / 10` seconds each, with a pause point
    before each layer (`between_layers`, as the packed and padded encoder runners have)."""

    between_layers: Callable[[], None] | None = None

    def embed(self, batch: Collated) -> npt.NDArray[np.float32]:
        for _ in range(10):
            if self.between_layers is not None:
                self.between_layers()
            time.sleep(0.02)
        return super().embed(batch)


async def test_an_embedding_call_runs_between_a_long_rerank_batchs_layers() -> None:
    """A 200-ms batch of another model pauses at its next layer for an embedding batch that
    arrives while it runs: the embedding call is answered before the long batch ends."""
    budget = ComputeBudget()
    batching = BatchingConfig(strategy="fifo", max_batch=1, max_wait_ms=0.0)
    slow = Engine(_LayeredRunner(), batching)
    fast = Engine(FakeRunner(cost=lambda rows, width: 0.1), batching)  # a 100-ms batch
    slow.use_budget(budget, "reranker")
    fast.use_budget(budget, "embedder")
    await slow.start()
    await fast.start()
    try:
        long_call = asyncio.create_task(slow.embed([_ids(5)]))
        await asyncio.sleep(0.05)  # the long batch is running
        assert budget.running == 1 and not long_call.done()
        await asyncio.wait_for(fast.embed([_ids(5)]), 5)
        assert not long_call.done()
        assert len(await asyncio.wait_for(long_call, 5)) == 1
        assert budget.describe()["preemptions"] == 1
        # The paused time is not the long batch's work (its cost model learns from it):
        # measured as its 10 layers, not its layers plus the embedding batch it waited for.
        (bucket,) = [b for b in slow.stats()["per_bucket"] if b["batches"]]
        assert 200 <= bucket["mean_exec_ms"] < 260
    finally:
        await fast.stop(timeout=1.0)
        await slow.stop(timeout=1.0)
