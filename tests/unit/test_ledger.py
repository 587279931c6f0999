"""The ledger ends each admitted request exactly once, whatever races to end it."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from lenbatch.core.clock import FakeClock
from lenbatch.core.errors import DeadlineExceeded, ModelFailed, Overloaded, Unavailable
from lenbatch.core.request import Request
from lenbatch.serving.ledger import FutureReply, Ledger, Phase, Ticket
from lenbatch.serving.metrics import Metrics


def _ledger(**kwargs: object) -> Ledger[np.ndarray]:
    return Ledger(FakeClock(), Metrics(["all"], "fifo"), ["all"], **kwargs)  # type: ignore[arg-type]


def _ticket(loop: asyncio.AbstractEventLoop, deadline: float | None = None) -> Ticket[np.ndarray]:
    r = Request(3, 0.0, [1, 2, 3], deadline=deadline)
    r.lane = 0
    return Ticket(r, FutureReply(loop.create_future()))


def _future(t: Ticket[np.ndarray]) -> asyncio.Future[np.ndarray]:
    assert isinstance(t.reply, FutureReply)
    return t.reply.future


def _counts(ledger: Ledger[np.ndarray]) -> dict[str, int]:
    recorder = ledger.recorder
    assert isinstance(recorder, Metrics)
    counts: dict[str, int] = recorder.stats()["requests"]
    return counts


async def test_first_ending_wins_and_is_counted_once() -> None:
    """Answer, then fail, then cancel: the caller gets the vector, the metrics one `ok`."""
    ledger = _ledger()
    t = _ticket(asyncio.get_running_loop())
    ledger.admit([t])
    assert ledger.answer(t, np.ones(2, dtype=np.float32)) is True
    assert ledger.fail(t, ModelFailed("late")) is False
    assert ledger.cancel(t) is False
    np.testing.assert_array_equal(await _future(t), np.ones(2))
    assert _counts(ledger) == {"ok": 1}
    assert ledger.unanswered == 0


async def test_caller_cancelled_future_ends_as_cancelled() -> None:
    """A future the caller cancelled is ended as `cancelled`, not answered into the void."""
    ledger = _ledger()
    t = _ticket(asyncio.get_running_loop())
    ledger.admit([t])
    _future(t).cancel()
    ledger.fail(t, DeadlineExceeded("too late"))
    assert t.finished and _counts(ledger) == {"cancelled": 1}


async def test_wait_idle_waits_for_the_last_answer() -> None:
    """`wait_idle` returns False on timeout while requests are open, True once all ended."""
    ledger = _ledger()
    loop = asyncio.get_running_loop()
    ts = [_ticket(loop) for _ in range(2)]
    ledger.admit(ts)
    assert await ledger.wait_idle(0.01) is False
    ledger.fail(ts[0], DeadlineExceeded("x"))
    loop.call_soon(ledger.cancel, ts[1])
    assert await ledger.wait_idle(1.0) is True
    assert _counts(ledger) == {"expired": 1, "cancelled": 1}
    with pytest.raises(DeadlineExceeded):
        await _future(ts[0])


async def test_shed_is_its_own_outcome() -> None:
    """A request shed after admission is counted `shed`, and its caller gets the error."""
    ledger = _ledger()
    t = _ticket(asyncio.get_running_loop())
    ledger.admit([t])
    assert ledger.shed(t, Overloaded("predicted to miss its deadline"))
    assert _counts(ledger) == {"shed": 1}
    with pytest.raises(Overloaded):
        await _future(t)


async def test_deadline_ends_a_queued_request_and_withdraws_it() -> None:
    """The deadline timer takes a queued request out of the queues and answers 504."""
    withdrawn: list[Request] = []
    woken: list[bool] = []
    ledger = _ledger(withdraw=withdrawn.append, wake=lambda: woken.append(True))
    t = _ticket(asyncio.get_running_loop(), deadline=0.001)
    ledger.admit([t])
    with pytest.raises(DeadlineExceeded, match=r"request timeout of 0\.001 s"):
        await _future(t)
    assert withdrawn == [t.request] and woken == [True]
    assert t.phase is Phase.ENDED and _counts(ledger) == {"expired": 1}


async def test_deadline_spares_a_running_request() -> None:
    """Once started, a request is left to finish: its deadline timer is cancelled."""
    ledger = _ledger()
    t = _ticket(asyncio.get_running_loop(), deadline=0.001)
    ledger.admit([t])
    assert ledger.start(t, 0.0)
    await asyncio.sleep(0.01)
    assert not t.finished
    ledger.deadline_passed(t)  # a timer that fired anyway changes nothing
    assert ledger.answer(t, np.zeros(1, dtype=np.float32))
    assert _counts(ledger) == {"ok": 1}


async def test_abandon_answers_everything_left() -> None:
    """A drain that timed out answers every open request with its error, once."""
    ledger = _ledger()
    loop = asyncio.get_running_loop()
    ts = [_ticket(loop) for _ in range(3)]
    ledger.admit(ts)
    ledger.answer(ts[0], np.zeros(1, dtype=np.float32))
    assert ledger.abandon(Unavailable("shutting down")) == 2
    assert ledger.abandon(Unavailable("again")) == 0
    assert _counts(ledger) == {"ok": 1, "error": 2}


async def test_admitting_a_ticket_twice_is_a_bug() -> None:
    """A ticket is admitted once: a second admission raises rather than double-counting."""
    ledger = _ledger()
    t = _ticket(asyncio.get_running_loop())
    ledger.admit([t])
    ledger.start(t, 0.0)
    with pytest.raises(RuntimeError, match="admitted twice"):
        ledger.admit([t])


def test_queue_depth_gauges_follow_every_change() -> None:
    """`set_depths` writes only the lanes that changed, yet the gauges always read the
    latest depths, also for lanes re-labelled by a re-fit."""
    m = Metrics(["1-16", "17-32", "33-64"], "adaptive")

    def gauges() -> tuple[list[float | None], float | None]:
        reg = m.registry
        lanes = [
            reg.get_sample_value("lenbatch_queue_depth", {"bucket": label}) for label in m.labels
        ]
        return lanes, reg.get_sample_value("lenbatch_batches_in_flight")

    m.set_depths([0, 0, 0], 0)
    assert gauges() == ([0.0, 0.0, 0.0], 0.0)
    m.set_depths([3, 0, 0], 1)
    assert gauges() == ([3.0, 0.0, 0.0], 1.0)
    m.set_depths([0, 0, 2], 1)
    assert gauges() == ([0.0, 0.0, 2.0], 1.0)
    m.set_depths([0, 0, 2], 0)
    assert gauges() == ([0.0, 0.0, 2.0], 0.0)
    m.record_refit(["1-24", "25-64"])
    m.set_depths([0, 2], 0)  # new lanes: every one written, though the numbers look alike
    assert gauges() == ([0.0, 2.0], 0.0)
