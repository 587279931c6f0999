"""The ledger of admitted requests: each one is answered exactly once.

Every admitted `Request` carries a `Ticket` (its future, its deadline timer, its timing). The
ledger ends a request with a vector, an error or a cancellation, once: later attempts are
ignored, so a bisected batch, an expired deadline, a crash and a shutdown can race without a
double answer or a lost one. Each ending is recorded in the metrics and the length log (lengths
and times only), and `wait_idle()` tells when no admitted request is left unanswered.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from lenbatch.core.clock import Clock
from lenbatch.core.errors import DeadlineExceeded, LenbatchError
from lenbatch.core.request import Request, RequestStatus
from lenbatch.serving.lengthlog import LengthLog
from lenbatch.serving.lifecycle import wait_set
from lenbatch.serving.metrics import Metrics

__all__ = ["Ledger", "Ticket"]

Vector = npt.NDArray[np.float32]


@dataclass(slots=True)
class Ticket:
    """The engine's handle on one request (kept in `Request.handle`)."""

    future: asyncio.Future[Vector]
    timer: asyncio.TimerHandle | None = None  # fires at the deadline
    started: float | None = None  # clock time its batch started executing
    exec_s: float | None = None
    # Ended and accounted for. Not `future.done()`: a caller that goes away cancels the future
    # itself (through gather) before the engine hears of it.
    finished: bool = False


class Ledger:
    """Admitted, unanswered requests, and the one place where a request ends."""

    def __init__(
        self,
        clock: Clock,
        metrics: Metrics,
        lane_labels: Sequence[str],
        length_log: LengthLog | None = None,
    ) -> None:
        self.clock = clock
        self.metrics = metrics
        self.lane_labels = list(lane_labels)
        self.length_log = length_log
        self._live: set[Request[Ticket]] = set()
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def unanswered(self) -> int:
        """Admitted requests not answered yet."""
        return len(self._live)

    def live(self) -> list[Request[Ticket]]:
        """The unanswered requests (a copy)."""
        return list(self._live)

    def admit(self, requests: Iterable[Request[Ticket]]) -> None:
        """Start accounting for `requests` (each with a `Ticket` as its handle)."""
        self._live.update(requests)
        if self._live:
            self._idle.clear()

    async def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until no admitted request is unanswered; False if `timeout` passed first."""
        return await wait_set(self._idle, timeout)

    def answer(self, r: Request[Ticket], vec: Vector) -> None:
        """End `r` with its vector (or as cancelled if its caller has gone)."""
        if self._still_wanted(r):
            r.handle.future.set_result(vec)
            self._finish(r, RequestStatus.OK)

    def fail(self, r: Request[Ticket], err: LenbatchError) -> None:
        """End `r` with `err` (or as cancelled if its caller has gone)."""
        if self._still_wanted(r):
            fut: asyncio.Future[Vector] = r.handle.future
            fut.set_exception(err)
            # Retrieved by gather; if the caller has gone, do not warn about it.
            fut.add_done_callback(_consume_exception)
            expired = isinstance(err, DeadlineExceeded)
            self._finish(r, RequestStatus.EXPIRED if expired else RequestStatus.ERROR)

    def cancel(self, r: Request[Ticket]) -> bool:
        """End `r` as cancelled; False if it had already ended."""
        t: Ticket = r.handle
        if t.finished:
            return False
        if not t.future.done():
            t.future.cancel()
        self._finish(r, RequestStatus.CANCELLED)
        return True

    def close(self) -> None:
        """Close the length log."""
        if self.length_log is not None:
            self.length_log.close()

    def _still_wanted(self, r: Request[Ticket]) -> bool:
        """True if `r` awaits its answer; an ended request stays ended, and one whose caller
        cancelled its future is ended here as cancelled."""
        t: Ticket = r.handle
        if t.finished:
            return False
        if t.future.cancelled():
            self._finish(r, RequestStatus.CANCELLED)
            return False
        return True

    def _finish(self, r: Request[Ticket], status: RequestStatus) -> None:
        t: Ticket = r.handle
        t.finished = True
        if t.timer is not None:
            t.timer.cancel()
            t.timer = None
        self._live.discard(r)
        if not self._live:
            self._idle.set()
        latency = self.clock.now() - r.arrival
        self.metrics.record_request(r.lane, latency, status.value)
        if self.length_log is not None:
            wait = None if t.started is None else (t.started - r.arrival) * 1000
            self.length_log.write(
                id=r.id,
                arrival=time.time() - latency,
                length=r.length,
                bucket=self.lane_labels[r.lane] if r.lane >= 0 else "none",
                queue_wait_ms=wait,
                exec_ms=None if t.exec_s is None else t.exec_s * 1000,
                status=status.value,
            )


def _consume_exception(fut: asyncio.Future[Vector]) -> None:
    if not fut.cancelled():
        fut.exception()
