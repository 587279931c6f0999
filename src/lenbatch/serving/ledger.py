"""The ledger of admitted requests: the one place where a request ends, exactly once.

    admit ─► QUEUED ─start()─► RUNNING ─► answered | failed | shed | cancelled | expired
               └──── cancel, deadline, shed, fail, drain timeout ───┘ (ENDED)

Every front-end hands the requests it admits to a `Ledger`: the embedding engine, the
generation engine and the Ray ingress alike. A `Ticket` is the ledger's record of one request:
the `Reply` that delivers its answer (a future, a token stream), its phase, its deadline timer
and its timings. The first ending wins and later attempts are ignored, so a bisected batch, an
expired deadline, a crash, a caller that goes away and a drain that times out can race without
a double answer or a lost one.

A deadline ends only a request that is still queued: once it runs it is left to finish (its
compute is already spent). A caller that stopped waiting (its future cancelled) is ended as
cancelled at the next attempt to answer it. Each ending is recorded once in the metrics and
the length log, with lengths and times only, and `wait_idle()` tells when nothing admitted is
left unanswered (the drain waits on it).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Generic, Protocol, TypeVar

from lenbatch.core.clock import Clock
from lenbatch.core.errors import DeadlineExceeded, LenbatchError
from lenbatch.core.request import Request, RequestStatus
from lenbatch.serving.lengthlog import LengthLog

__all__ = [
    "FutureReply",
    "Ledger",
    "OutcomeRecorder",
    "Phase",
    "Reply",
    "Ticket",
    "wait_set",
]

T = TypeVar("T")
T_contra = TypeVar("T_contra", contravariant=True)


async def wait_set(event: asyncio.Event, timeout: float | None) -> bool:
    """Wait until `event` is set; False if `timeout` seconds passed first."""
    if event.is_set():
        return True
    try:
        await asyncio.wait_for(event.wait(), timeout)
    except TimeoutError:
        return False
    return True


class Phase(StrEnum):
    """Where an admitted request is."""

    QUEUED = "queued"  # waiting for a batch (a deadline may still end it)
    RUNNING = "running"  # its batch started: it is left to finish
    ENDED = "ended"  # answered, failed, shed, cancelled or expired


class Reply(Protocol[T_contra]):
    """How an answer reaches the caller of one request."""

    def give(self, value: T_contra) -> None:
        """Deliver the result."""
        ...

    def refuse(self, err: LenbatchError) -> None:
        """Deliver an error."""
        ...

    def withdraw(self) -> None:
        """The request ended without an answer (cancelled): release the caller's wait."""
        ...

    @property
    def abandoned(self) -> bool:
        """True if the caller stopped waiting on its own (nobody will read an answer)."""
        ...


class FutureReply(Generic[T]):
    """A `Reply` through one asyncio future (one result per request)."""

    __slots__ = ("future",)

    def __init__(self, future: asyncio.Future[T]) -> None:
        self.future = future

    def give(self, value: T) -> None:
        """Set the future's result."""
        self.future.set_result(value)

    def refuse(self, err: LenbatchError) -> None:
        """Set the future's exception; not retrieving it (the caller left) is not a warning."""
        self.future.set_exception(err)
        self.future.add_done_callback(_consume_exception)

    def withdraw(self) -> None:
        """Cancel the future, if nobody has yet."""
        if not self.future.done():
            self.future.cancel()

    @property
    def abandoned(self) -> bool:
        """True if the caller cancelled the future (e.g. `gather` was cancelled)."""
        return self.future.cancelled()


class OutcomeRecorder(Protocol):
    """Where the ledger records each ending (`serving.metrics.Metrics` is one)."""

    def record_request(self, lane: int, latency: float, status: str) -> None:
        """One request ended in `lane` after `latency` seconds with `status`."""
        ...


@dataclass(slots=True, eq=False)
class Ticket(Generic[T]):
    """The ledger's record of one admitted request."""

    request: Request
    reply: Reply[T]
    arrival: float = math.nan  # clock time latency counts from (default: the request's)
    phase: Phase = Phase.QUEUED
    status: RequestStatus | None = None  # how it ended, once it has
    started: float | None = None  # clock time its (latest) model call began
    exec_s: float | None = None  # model time of its batch, where known
    timer: asyncio.TimerHandle | None = None  # fires at the deadline while queued

    def __post_init__(self) -> None:
        if math.isnan(self.arrival):
            self.arrival = self.request.arrival

    @property
    def finished(self) -> bool:
        """Ended and accounted for (not `future.done()`: a caller that goes away cancels its
        own future before the ledger hears of it)."""
        return self.phase is Phase.ENDED


class Ledger(Generic[T]):
    """Admitted, unanswered requests, and the one place where a request ends.

    `withdraw(request)` takes a queued request out of the owner's queues (on cancel and on
    deadline); `wake()` tells the owner's loop that something changed outside it. Both are
    optional: a front-end without queues of its own passes neither.
    """

    def __init__(
        self,
        clock: Clock,
        recorder: OutcomeRecorder,
        lane_labels: Sequence[str] = ("all",),
        length_log: LengthLog | None = None,
        *,
        withdraw: Callable[[Request], object] | None = None,
        wake: Callable[[], None] | None = None,
    ) -> None:
        self.clock = clock
        self.recorder = recorder
        self.lane_labels = list(lane_labels)
        self.length_log = length_log
        self._withdraw = withdraw
        self._wake = wake
        self._live: dict[Ticket[T], None] = {}  # insertion-ordered set
        self._idle = asyncio.Event()
        self._idle.set()

    # ------------------------------------------------------------------ what is open

    @property
    def unanswered(self) -> int:
        """Admitted requests not ended yet."""
        return len(self._live)

    def live(self) -> list[Ticket[T]]:
        """The unanswered requests, in admission order (a copy)."""
        return list(self._live)

    async def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until no admitted request is unanswered; False if `timeout` passed first."""
        return await wait_set(self._idle, timeout)

    # ------------------------------------------------------------------ admitting, running

    def admit(self, tickets: Iterable[Ticket[T]]) -> None:
        """Start accounting for `tickets`. A request with a deadline gets a timer that ends it
        as expired if it is still queued then (this needs a running event loop)."""
        loop: asyncio.AbstractEventLoop | None = None
        now = self.clock.now()
        for t in tickets:
            if t.phase is not Phase.QUEUED:
                raise RuntimeError(f"bug: ticket of request {t.request.id} admitted twice")
            self._live[t] = None
            deadline = t.request.deadline
            if deadline is not None:
                loop = loop or asyncio.get_running_loop()
                t.timer = loop.call_later(max(0.0, deadline - now), self.deadline_passed, t)
        if self._live:
            self._idle.clear()

    def start(self, t: Ticket[T], at: float) -> bool:
        """`t` begins running at clock time `at`: its deadline no longer ends it. Called again
        when it runs again (a split or bisected batch), `started` moves to the new run. False if
        it has already ended."""
        if t.phase is Phase.ENDED:
            return False
        if t.phase is Phase.QUEUED:
            t.phase = Phase.RUNNING
            self._stop_timer(t)
        t.started = at
        return True

    # ------------------------------------------------------------------ endings

    def answer(self, t: Ticket[T], value: T) -> bool:
        """End `t` with its result; False if it had already ended (or its caller had gone:
        then it ends as cancelled)."""
        if not self._still_wanted(t):
            return False
        t.reply.give(value)
        self._end(t, RequestStatus.OK)
        return True

    def fail(self, t: Ticket[T], err: LenbatchError) -> bool:
        """End `t` with `err` (status `expired` for a `DeadlineExceeded`, else `error`)."""
        expired = isinstance(err, DeadlineExceeded)
        return self._refuse(t, err, RequestStatus.EXPIRED if expired else RequestStatus.ERROR)

    def shed(self, t: Ticket[T], err: LenbatchError) -> bool:
        """End `t` with `err` because it was predicted to miss its deadline (status `shed`)."""
        return self._refuse(t, err, RequestStatus.SHED)

    def expire(self, t: Ticket[T]) -> bool:
        """End `t` as expired: its deadline passed before it ran (504)."""
        return self._refuse(t, self.expired_error(t.request), RequestStatus.EXPIRED)

    def cancel(self, t: Ticket[T]) -> bool:
        """End `t` as cancelled (the caller went away), taking it out of the queues if it still
        waits there; False if it had already ended."""
        if t.finished:
            return False
        queued = t.phase is Phase.QUEUED
        t.reply.withdraw()
        self._end(t, RequestStatus.CANCELLED)
        if queued and self._withdraw is not None:
            self._withdraw(t.request)
        if self._wake is not None:
            self._wake()
        return True

    def abandon(self, err: LenbatchError) -> int:
        """End every unanswered request with `err` (a drain that timed out, a crash);
        returns how many."""
        left = self.live()
        for t in left:
            self.fail(t, err)
        return len(left)

    def deadline_passed(self, t: Ticket[T]) -> None:
        """The deadline timer of `t`: a request still queued leaves the queue and ends as
        expired; one that is running, or has ended, is left alone."""
        t.timer = None
        if t.phase is not Phase.QUEUED:
            return
        if self._withdraw is not None:
            self._withdraw(t.request)
        self.expire(t)
        if self._wake is not None:
            self._wake()

    def expired_error(self, r: Request) -> DeadlineExceeded:
        """The 504 for a request whose deadline passed before it ran."""
        waited = self.clock.now() - r.arrival
        allowed = 0.0 if r.deadline is None else r.deadline - r.arrival
        return DeadlineExceeded(
            f"request timeout of {allowed:.3f} s passed after {waited:.3f} s waiting; it was "
            "dropped before running"
        )

    def close(self) -> None:
        """Close the length log."""
        if self.length_log is not None:
            self.length_log.close()

    # ------------------------------------------------------------------ internals

    def _refuse(self, t: Ticket[T], err: LenbatchError, status: RequestStatus) -> bool:
        if not self._still_wanted(t):
            return False
        t.reply.refuse(err)
        self._end(t, status)
        return True

    def _still_wanted(self, t: Ticket[T]) -> bool:
        """True if `t` awaits its answer; an ended request stays ended, and one whose caller
        stopped waiting is ended here as cancelled."""
        if t.finished:
            return False
        if t.reply.abandoned:
            self._end(t, RequestStatus.CANCELLED)
            return False
        return True

    def _stop_timer(self, t: Ticket[T]) -> None:
        if t.timer is not None:
            t.timer.cancel()
            t.timer = None

    def _end(self, t: Ticket[T], status: RequestStatus) -> None:
        t.phase = Phase.ENDED
        t.status = status
        self._stop_timer(t)
        self._live.pop(t, None)
        if not self._live:
            self._idle.set()
        r = t.request
        latency = self.clock.now() - t.arrival
        self.recorder.record_request(r.lane, latency, status.value)
        if self.length_log is not None:
            self.length_log.write(
                id=r.id,
                arrival=time.time() - latency,
                length=r.length,
                bucket=self.lane_labels[r.lane] if 0 <= r.lane < len(self.lane_labels) else "none",
                queue_wait_ms=None if t.started is None else (t.started - r.arrival) * 1000,
                exec_ms=None if t.exec_s is None else t.exec_s * 1000,
                status=status.value,
            )


def _consume_exception(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()
