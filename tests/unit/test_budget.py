"""The CPU budget several models share: turns go by priority, then each model's share of the
CPU used so far, then due time, then arrival; a cancelled waiter gives its place up; nothing
waits when a slot is free."""

from __future__ import annotations

import asyncio

import pytest

from lenbatch.serving.budget import ComputeBudget


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


async def _order(
    waiters: list[tuple[str, str, int, float, float]],
    cancel: str | None = None,
    used: dict[str, float] | None = None,
    idle_credit_s: float = 0.0,
) -> list[str]:
    """Run `waiters` (name, owner, priority, due, seconds its call takes) while one call
    holds the budget; the order their turns came in. `used`: seconds each owner used before."""
    clock = _Clock()
    budget = ComputeBudget(slots=1, clock=clock, idle_credit_s=idle_credit_s)
    for owner, seconds in (used or {}).items():
        turn = await budget.acquire(owner=owner)
        clock.t += seconds
        budget.release(turn)
    ran: list[str] = []
    first = await budget.acquire(owner="busy")  # the cores are busy: everyone has to wait

    async def call(name: str, owner: str, priority: int, due: float, seconds: float) -> None:
        turn = await budget.acquire(priority, due, owner)
        ran.append(name)
        clock.t += seconds
        await asyncio.sleep(0)
        budget.release(turn)

    tasks = {w[0]: asyncio.create_task(call(*w)) for w in waiters}
    await asyncio.sleep(0)  # every waiter queues
    assert budget.queued == len(waiters)
    if cancel is not None:
        tasks[cancel].cancel()
    budget.release(first)
    await asyncio.gather(*tasks.values(), return_exceptions=True)
    assert budget.running == 0 and budget.queued == 0
    return ran


def test_a_burst_takes_turns_with_another_model() -> None:
    """A rerank burst queued first alternates with the embedding calls (the model with less
    CPU used goes first), instead of running all of its batches ahead of them."""
    waiters = [
        ("rerank-1", "reranker", 0, 1.0, 1.0),
        ("rerank-2", "reranker", 0, 1.0, 1.0),
        ("rerank-3", "reranker", 0, 1.0, 1.0),
        ("embed-1", "embedder", 0, 2.0, 0.1),
        ("embed-2", "embedder", 0, 3.0, 0.1),
    ]
    order = asyncio.run(_order(waiters))
    assert order == ["rerank-1", "embed-1", "embed-2", "rerank-2", "rerank-3"]


def test_priority_first_then_due_within_a_share() -> None:
    waiters = [
        ("late", "a", 0, 5.0, 0.1),
        ("soon", "a", 0, 1.0, 0.1),
        ("urgent", "b", 1, 9.0, 0.1),
    ]
    assert asyncio.run(_order(waiters)) == ["urgent", "soon", "late"]


def test_an_idle_model_saves_no_credit() -> None:
    """A model idle while another ran rejoins at the current virtual time: it does not get
    every turn until it has caught up on what the other used."""
    waiters = [
        ("a-1", "a", 0, 1.0, 1.0),
        ("b-1", "b", 0, 2.0, 1.0),
        ("a-2", "a", 0, 3.0, 1.0),
        ("b-2", "b", 0, 4.0, 1.0),
    ]
    order = asyncio.run(_order(waiters, used={"a": 30.0}))
    assert order == ["a-1", "b-1", "a-2", "b-2"]


def test_an_idle_model_rejoins_at_most_its_credit_behind() -> None:
    """With an idle credit of 1.5 s, the model that was idle runs its first two 1-s calls
    before the busy one's shares count again, and no more: its credit is bounded."""
    waiters = [
        ("a-1", "a", 0, 1.0, 1.0),
        ("a-2", "a", 0, 2.0, 1.0),
        ("b-1", "b", 0, 3.0, 1.0),
        ("b-2", "b", 0, 4.0, 1.0),
        ("b-3", "b", 0, 5.0, 1.0),
    ]
    order = asyncio.run(_order(waiters, used={"a": 30.0}, idle_credit_s=1.5))
    assert order == ["b-1", "b-2", "a-1", "b-3", "a-2"]


def test_cancelled_waiter_gives_up_its_turn() -> None:
    waiters = [("a", "m", 0, 1.0, 0.1), ("b", "m", 0, 2.0, 0.1), ("c", "m", 0, 3.0, 0.1)]
    assert asyncio.run(_order(waiters, cancel="a")) == ["b", "c"]


def test_free_slots_do_not_wait() -> None:
    async def go() -> ComputeBudget:
        budget = ComputeBudget(slots=2)
        one = await budget.acquire()
        two = await budget.acquire()
        assert budget.running == 2
        budget.release(one)
        budget.release(two)
        return budget

    figures = asyncio.run(go()).describe()
    assert figures["turns"] == 2 and figures["turns_waited"] == 0


def test_slots_must_be_positive() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        ComputeBudget(slots=0)
    with pytest.raises(ValueError, match="at least 0"):
        ComputeBudget(idle_credit_s=-1)


def test_describe_reports_each_models_turn_waits() -> None:
    """/stats carries the P95 wait for a turn per model: the reranker's turn ran 0.3 s while
    the embedder's turn waited, the reranker's own turn did not wait."""

    async def go() -> dict[str, object]:
        clock = _Clock()
        budget = ComputeBudget(slots=1, clock=clock)
        first = await budget.acquire(owner="reranker")
        waiting = asyncio.create_task(budget.acquire(owner="embedder"))
        await asyncio.sleep(0)
        clock.t += 0.3
        budget.release(first)
        budget.release(await waiting)
        return budget.describe()

    waits = asyncio.run(go())["wait_p95_ms_by_model"]
    assert waits == {"reranker": 0.0, "embedder": 300.0}
