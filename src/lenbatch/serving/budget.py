"""One CPU budget for several models in one process: their model calls take turns.

Each served model keeps its own engine, lanes, buckets and cost model; what they share is the
cores. Two forward passes at once on a 2-core CPU each run at about half speed (or worse, as
their thread pools fight), so the engines ask a `ComputeBudget` for a turn before each model
call. Waiting calls are granted by priority (higher first), then by when their oldest member is
due (its deadline or SLO, else its arrival), then in the order they asked; a burst of rerank
pairs therefore queues its batches behind an embedding batch that is due sooner, and no model
waits for more than the calls already ahead of it. A single-model server has no budget and pays
nothing for it.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from dataclasses import dataclass, field

__all__ = ["ComputeBudget"]


@dataclass(order=True)
class _Waiter:
    key: tuple[int, float, int]
    future: asyncio.Future[None] = field(compare=False)


class ComputeBudget:
    """At most `slots` model calls run at once across every engine that shares it (all on one
    event loop); the others wait in order of (priority desc, due asc, arrival)."""

    def __init__(self, slots: int = 1) -> None:
        if slots < 1:
            raise ValueError(f"slots must be at least 1, got {slots}")
        self.slots = slots
        self.running = 0
        self._waiting: list[_Waiter] = []
        self._seq = itertools.count()
        self.granted = 0
        self.waited = 0  # turns that had to wait

    @property
    def queued(self) -> int:
        """Calls waiting for a turn now."""
        return sum(1 for w in self._waiting if not w.future.done())

    async def acquire(self, priority: int = 0, due: float = 0.0) -> None:
        """Wait for a turn (a cancelled waiter gives its place up)."""
        self.granted += 1
        if self.running < self.slots and not self.queued:
            self.running += 1
            return
        self.waited += 1
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiting, _Waiter((-priority, due, next(self._seq)), future))
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self.release()  # granted just as it was cancelled: pass the turn on
            raise

    def release(self) -> None:
        """End a turn; the next waiter in order gets it."""
        self.running -= 1
        while self._waiting:
            w = heapq.heappop(self._waiting)
            if w.future.done():
                continue  # cancelled while waiting
            self.running += 1
            w.future.set_result(None)
            return

    def describe(self) -> dict[str, int]:
        """Figures for `/stats`: slots, running, queued, turns granted and how many waited."""
        return {
            "slots": self.slots,
            "running": self.running,
            "queued": self.queued,
            "turns": self.granted,
            "turns_waited": self.waited,
        }
