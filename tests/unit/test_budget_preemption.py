"""Preemption on the shared CPU budget: a running call that can pause gives its turn back at
its next pause point when another model's waiter outranks it, and resumes first among its own
model's turns. The calls here are worker threads doing "layers" of a few milliseconds."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

from lenbatch.serving.budget import ComputeBudget, Turn

LAYER_S = 0.01


def _layers(budget: ComputeBudget, turn: Turn, name: str, n: int, log: list[str]) -> None:
    """A model call in a worker thread: `n` layers, a pause point before each."""
    for i in range(n):
        budget.pause_point(turn)
        time.sleep(LAYER_S)
        log.append(f"{name}{i}")


async def _until(cond: object, seconds: float = 5.0) -> None:
    stop = time.monotonic() + seconds
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < stop, "timed out"
        await asyncio.sleep(0.001)


async def test_another_models_waiter_runs_between_layers() -> None:
    """The embedder's call, asked for while a 20-layer rerank call runs, runs after one more
    layer of it, not after all of it; the rerank call then finishes its layers."""
    budget = ComputeBudget()
    loop = asyncio.get_running_loop()
    log: list[str] = []
    with ThreadPoolExecutor(1) as reranker, ThreadPoolExecutor(1) as embedder:
        turn = await budget.acquire(owner="reranker", preemptible=True)
        call = loop.run_in_executor(reranker, _layers, budget, turn, "r", 20, log)
        await _until(lambda: len(log) >= 2)
        other = await asyncio.wait_for(budget.acquire(owner="embedder"), 5)
        await loop.run_in_executor(embedder, log.append, "E")
        budget.release(other)
        await asyncio.wait_for(call, 5)
        budget.release(turn)
    assert log.index("E") < 6, log  # the rerank call paused at its next pause point
    assert [x for x in log if x != "E"] == [f"r{i}" for i in range(20)]
    assert budget.describe()["preemptions"] == 1
    assert budget.running == 0 and budget.queued == 0


async def test_a_call_that_cannot_pause_runs_to_its_end() -> None:
    budget = ComputeBudget()
    loop = asyncio.get_running_loop()
    log: list[str] = []
    with ThreadPoolExecutor(1) as pool:
        turn = await budget.acquire(owner="llm")  # not preemptible
        call = loop.run_in_executor(pool, _layers, budget, turn, "g", 6, log)
        await _until(lambda: len(log) >= 1)
        waiter = asyncio.create_task(budget.acquire(owner="embedder"))
        await asyncio.wait_for(call, 5)
        log.append("released")
        budget.release(turn)
        budget.release(await waiter)
    assert log[-1] == "released" and budget.describe()["preemptions"] == 0


async def test_the_same_models_turns_do_not_preempt_each_other() -> None:
    budget = ComputeBudget()
    loop = asyncio.get_running_loop()
    log: list[str] = []
    with ThreadPoolExecutor(1) as pool:
        turn = await budget.acquire(owner="reranker", preemptible=True)
        call = loop.run_in_executor(pool, _layers, budget, turn, "r", 6, log)
        await _until(lambda: len(log) >= 1)
        second = asyncio.create_task(budget.acquire(priority=0, due=-1.0, owner="reranker"))
        await asyncio.wait_for(call, 5)
        budget.release(turn)
        budget.release(await asyncio.wait_for(second, 5))
    assert log == [f"r{i}" for i in range(6)]
    assert budget.describe()["preemptions"] == 0


async def test_a_waiter_with_more_cpu_used_preempts_once_the_call_has_caught_up() -> None:
    """The embedder used 50 ms more than the reranker (idle credit 50 ms): its waiter outranks
    the running rerank call only once that call has run about 50 ms, then at its next layer."""
    clock = time.monotonic
    budget = ComputeBudget(idle_credit_s=0.05)
    loop = asyncio.get_running_loop()
    log: list[str] = []
    first = await budget.acquire(owner="embedder")
    await asyncio.sleep(0.05)
    budget.release(first)
    with ThreadPoolExecutor(1) as pool:
        turn = await budget.acquire(owner="reranker", preemptible=True)
        started = clock()
        call = loop.run_in_executor(pool, _layers, budget, turn, "r", 30, log)
        other = await asyncio.wait_for(budget.acquire(owner="embedder"), 5)
        granted = clock() - started
        log.append("E")
        budget.release(other)
        await asyncio.wait_for(call, 5)
        budget.release(turn)
    assert granted >= 0.045, granted  # not before the rerank call had its share
    assert log.index("E") < 25, log  # but long before its end
    assert budget.describe()["preemptions"] == 1


async def test_a_paused_call_resumes_before_its_models_other_turns() -> None:
    """A paused rerank call is granted again before the reranker's other waiting turn, even
    one due earlier: that turn's call would queue behind it in the model's worker thread."""
    budget = ComputeBudget()
    loop = asyncio.get_running_loop()
    log: list[str] = []
    with ThreadPoolExecutor(1) as pool:
        turn = await budget.acquire(due=5.0, owner="reranker", preemptible=True)
        call = loop.run_in_executor(pool, _layers, budget, turn, "r", 8, log)
        await _until(lambda: len(log) >= 1)
        second = asyncio.create_task(budget.acquire(due=0.0, owner="reranker"))
        await asyncio.sleep(0)
        other = await asyncio.wait_for(budget.acquire(owner="embedder"), 5)
        log.append("E")
        budget.release(other)
        await asyncio.sleep(0.05)
        jumped = second.done()
        if jumped:  # the paused call would wait for ever: let it resume, then fail
            budget.release(second.result())
        await asyncio.wait_for(call, 5)
        budget.release(turn)
        log.append("second")
        if not jumped:
            budget.release(await asyncio.wait_for(second, 5))
    assert not jumped, "the reranker's other turn went before its paused call"
    assert log.index("E") < log.index("r7") < log.index("second")
    assert budget.describe()["preemptions"] == 1


async def test_a_call_released_while_paused_runs_on() -> None:
    """A turn given up while its call is paused (the call was cancelled) wakes the worker
    thread, which finishes without a turn; the budget is left clean."""
    budget = ComputeBudget()
    loop = asyncio.get_running_loop()
    log: list[str] = []
    with ThreadPoolExecutor(1) as pool:
        turn = await budget.acquire(owner="reranker", preemptible=True)
        call = loop.run_in_executor(pool, _layers, budget, turn, "r", 6, log)
        await _until(lambda: len(log) >= 1)
        other = await asyncio.wait_for(budget.acquire(owner="embedder"), 5)
        await _until(lambda: turn.suspended)
        budget.release(turn)  # cancelled while paused
        await asyncio.wait_for(call, 5)
        budget.release(other)
    assert log == [f"r{i}" for i in range(6)]
    assert budget.running == 0 and budget.queued == 0
