"""serving/disconnects.py: a waiting request whose client left is cancelled; others are not."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from lenbatch.serving.disconnects import DisconnectSweeper, receive_now


class Connection:
    """An ASGI receive as uvicorn's behaves once the body is read: it waits until the client
    disconnects, then says so (and keeps saying so)."""

    def __init__(self) -> None:
        self.gone = asyncio.Event()
        self.calls = 0

    async def receive(self) -> dict[str, Any]:
        self.calls += 1
        if not self.gone.is_set():
            await self.gone.wait()
        return {"type": "http.disconnect"}


async def test_receive_now_neither_blocks_nor_leaves_a_waiter() -> None:
    conn = Connection()
    assert receive_now(conn.receive) is None
    assert not conn.gone._waiters  # the closed coroutine took its waiter away
    conn.gone.set()
    assert receive_now(conn.receive) == {"type": "http.disconnect"}


async def test_a_departed_client_has_its_work_cancelled_and_gets_none() -> None:
    sweeper = DisconnectSweeper(interval_s=0.01)
    conn = Connection()
    cancelled = asyncio.Event()

    async def work() -> str:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()  # the work sees its cancellation (the engine withdraws it)
            raise
        return "never"

    call = asyncio.create_task(sweeper.run(conn.receive, work()))
    await asyncio.sleep(0.05)
    assert not call.done() and sweeper.waiting == 1
    conn.gone.set()
    assert await asyncio.wait_for(call, 2) is None
    assert cancelled.is_set() and sweeper.waiting == 0


async def test_work_that_finishes_returns_its_value_and_errors_propagate() -> None:
    sweeper = DisconnectSweeper(interval_s=0.01)

    async def ok() -> int:
        await asyncio.sleep(0.03)
        return 7

    async def bad() -> int:
        await asyncio.sleep(0.03)
        raise ValueError("boom")

    assert await sweeper.run(Connection().receive, ok()) == 7
    with pytest.raises(ValueError, match="boom"):
        await sweeper.run(Connection().receive, bad())
    assert sweeper.waiting == 0


async def test_a_cancellation_from_elsewhere_is_not_swallowed() -> None:
    sweeper = DisconnectSweeper(interval_s=0.01)
    call = asyncio.create_task(sweeper.run(Connection().receive, asyncio.sleep(30)))
    await asyncio.sleep(0.03)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call


async def test_many_waiting_share_one_sweeper_task() -> None:
    sweeper = DisconnectSweeper(interval_s=0.01)
    conns = [Connection() for _ in range(50)]

    async def work(i: int) -> int:
        await asyncio.sleep(0.2)
        return i

    before = len(asyncio.all_tasks())
    calls = [asyncio.create_task(sweeper.run(c.receive, work(i))) for i, c in enumerate(conns)]
    await asyncio.sleep(0.05)
    assert len(asyncio.all_tasks()) == before + len(calls) + 1  # the calls and one sweeper
    conns[3].gone.set()
    results = await asyncio.gather(*calls)
    assert results == [None if i == 3 else i for i in range(50)]
