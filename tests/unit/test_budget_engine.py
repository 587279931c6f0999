"""An embedding engine on a shared CPU budget: the batches it forms ahead wait for their turn
at the budget, not behind the engine's own runner slot (where another model's batch would take
every turn its predecessor gave back)."""

from __future__ import annotations

import asyncio

from lenbatch.config import BatchingConfig
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
