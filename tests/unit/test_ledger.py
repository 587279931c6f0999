"""The ledger ends each admitted request exactly once, whatever races to end it."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from lenbatch.core.clock import FakeClock
from lenbatch.core.errors import DeadlineExceeded, ModelFailed
from lenbatch.core.request import Request
from lenbatch.embed.ledger import Ledger, Ticket
from lenbatch.serving.metrics import Metrics


def _ledger() -> Ledger:
    return Ledger(FakeClock(), Metrics(["all"], "fifo"), ["all"])


def _request(loop: asyncio.AbstractEventLoop) -> Request:
    r = Request(3, 0.0, [1, 2, 3], handle=Ticket(loop.create_future()))
    r.lane = 0
    return r


async def test_first_ending_wins_and_is_counted_once() -> None:
    """Answer, then fail, then cancel: the caller gets the vector, the metrics one `ok`."""
    ledger = _ledger()
    r = _request(asyncio.get_running_loop())
    ledger.admit([r])
    ledger.answer(r, np.ones(2, dtype=np.float32))
    ledger.fail(r, ModelFailed("late"))
    assert ledger.cancel(r) is False
    np.testing.assert_array_equal(await r.handle.future, np.ones(2))
    assert ledger.metrics.stats()["requests"] == {"ok": 1}
    assert ledger.unanswered == 0


async def test_caller_cancelled_future_ends_as_cancelled() -> None:
    """A future the caller cancelled is ended as `cancelled`, not answered into the void."""
    ledger = _ledger()
    r = _request(asyncio.get_running_loop())
    ledger.admit([r])
    r.handle.future.cancel()
    ledger.fail(r, DeadlineExceeded("too late"))
    assert r.handle.finished and ledger.metrics.stats()["requests"] == {"cancelled": 1}


async def test_wait_idle_waits_for_the_last_answer() -> None:
    """`wait_idle` returns False on timeout while requests are open, True once all ended."""
    ledger = _ledger()
    loop = asyncio.get_running_loop()
    rs = [_request(loop) for _ in range(2)]
    ledger.admit(rs)
    assert await ledger.wait_idle(0.01) is False
    ledger.fail(rs[0], DeadlineExceeded("x"))
    loop.call_soon(ledger.cancel, rs[1])
    assert await ledger.wait_idle(1.0) is True
    assert ledger.metrics.stats()["requests"] == {"expired": 1, "cancelled": 1}
    with pytest.raises(DeadlineExceeded):
        await rs[0].handle.future
