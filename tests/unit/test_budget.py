"""The CPU budget several models share: turns go by priority, then due time, then arrival; a
cancelled waiter gives its place up; nothing waits when a slot is free."""

from __future__ import annotations

import asyncio

import pytest

from lenbatch.serving.budget import ComputeBudget


async def _order(waiters: list[tuple[str, int, float]], cancel: str | None = None) -> list[str]:
    budget = ComputeBudget(slots=1)
    ran: list[str] = []
    await budget.acquire()  # the cores are busy: everyone below has to wait

    async def call(name: str, priority: int, due: float) -> None:
        await budget.acquire(priority, due)
        ran.append(name)
        await asyncio.sleep(0)
        budget.release()

    tasks = {n: asyncio.create_task(call(n, p, d)) for n, p, d in waiters}
    await asyncio.sleep(0)  # every waiter queues
    assert budget.queued == len(waiters)
    if cancel is not None:
        tasks[cancel].cancel()
    budget.release()
    await asyncio.gather(*tasks.values(), return_exceptions=True)
    assert budget.running == 0 and budget.queued == 0
    return ran


def test_priority_then_due_then_arrival() -> None:
    """A rerank burst queued first does not run ahead of an embedding batch due sooner, and
    a higher priority runs first whatever its due time."""
    waiters = [
        ("rerank-1", 0, 5.0),
        ("rerank-2", 0, 5.0),
        ("embed", 0, 1.0),
        ("urgent", 1, 9.0),
        ("rerank-3", 0, 5.0),
    ]
    assert asyncio.run(_order(waiters)) == ["urgent", "embed", "rerank-1", "rerank-2", "rerank-3"]


def test_cancelled_waiter_gives_up_its_turn() -> None:
    waiters = [("a", 0, 1.0), ("b", 0, 2.0), ("c", 0, 3.0)]
    assert asyncio.run(_order(waiters, cancel="a")) == ["b", "c"]


def test_free_slots_do_not_wait() -> None:
    async def go() -> ComputeBudget:
        budget = ComputeBudget(slots=2)
        await budget.acquire()
        await budget.acquire()
        assert budget.running == 2
        budget.release()
        budget.release()
        return budget

    figures = asyncio.run(go()).describe()
    assert figures["turns"] == 2 and figures["turns_waited"] == 0


def test_slots_must_be_positive() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        ComputeBudget(slots=0)
