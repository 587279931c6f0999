"""`run_in_worker`: a call on a worker thread, awaited as an asyncio future."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from lenbatch.serving.workers import run_in_worker


async def test_the_result_comes_back_from_the_worker_thread() -> None:
    with ThreadPoolExecutor(1) as pool:
        where = await run_in_worker(pool, lambda x: (x * 2, threading.get_ident()), 21)
    assert where[0] == 42
    assert where[1] != threading.get_ident()


async def test_what_the_call_raises_is_raised_to_the_awaiting_side() -> None:
    def boom() -> None:
        raise MemoryError("no room")

    with ThreadPoolExecutor(1) as pool, pytest.raises(MemoryError, match="no room"):
        await run_in_worker(pool, boom)


async def test_a_call_cancelled_before_a_worker_took_it_never_runs() -> None:
    gate, ran = threading.Event(), []
    with ThreadPoolExecutor(1) as pool:
        blocker = run_in_worker(pool, gate.wait)  # the only worker is busy
        queued = run_in_worker(pool, ran.append, "queued")
        queued.cancel()
        gate.set()
        await blocker
        await run_in_worker(pool, ran.append, "after")  # the queued one has had its turn
    assert ran == ["after"]


async def test_a_running_call_cancelled_runs_to_its_end_and_its_result_is_dropped() -> None:
    started, gate, done = threading.Event(), threading.Event(), []
    errors: list[dict[str, object]] = []
    asyncio.get_running_loop().set_exception_handler(lambda _loop, ctx: errors.append(ctx))

    def slow() -> str:
        started.set()
        gate.wait()
        done.append(True)
        return "late"

    with ThreadPoolExecutor(1) as pool:
        fut = run_in_worker(pool, slow)
        await asyncio.to_thread(started.wait)
        fut.cancel()
        gate.set()
        await run_in_worker(pool, lambda: None)  # after `slow` ended on the same worker
        await asyncio.sleep(0)  # its hand-off callback runs on the loop, finding it cancelled
    assert done == [True] and fut.cancelled()
    assert errors == []  # no "invalid state" from setting a cancelled future
