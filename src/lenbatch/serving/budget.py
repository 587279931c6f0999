"""One CPU budget for several models in one process: their model calls take turns.

Each served model keeps its own engine, lanes, buckets and cost model; what they share is the
cores. Two forward passes at once on a 2-core CPU each run at about half speed (or worse, as
their thread pools fight), so the engines ask a `ComputeBudget` for a turn before each model
call. A waiting call is granted by, in order:

1. priority (higher first);
2. its model's share: the model that has used the fewest CPU seconds goes first (start-time
   fair queueing: a model that was idle rejoins at the current virtual time, so it cannot save
   credit up). A burst of rerank pairs therefore takes turns with the embedding calls instead
   of running ahead of all of them; a model alone gets every turn;
3. when its oldest member is due (its SLO time, else its deadline, else its arrival);
4. the order the calls asked.

A call is never preempted: an embedding call that arrives while a rerank batch runs waits for
that batch (keep batches short, `max_batch_tokens`, where that matters). A single-model server
has no budget and pays nothing for it.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["ComputeBudget", "Turn"]


@dataclass(eq=False)
class Turn:
    """One model call's turn on the budget: who asked, and when it was granted."""

    owner: str
    priority: int
    due: float
    seq: int
    future: asyncio.Future[None] | None = None
    asked: float = 0.0
    started: float = 0.0
    waited: bool = field(default=False)


class ComputeBudget:
    """At most `slots` model calls run at once across every engine that shares it (all on one
    event loop); the others wait in the order the module's docstring gives."""

    def __init__(self, slots: int = 1, clock: Callable[[], float] = time.monotonic) -> None:
        if slots < 1:
            raise ValueError(f"slots must be at least 1, got {slots}")
        self.slots = slots
        self.clock = clock
        self.running = 0
        self._waiting: list[Turn] = []
        self._seq = itertools.count()
        self._used: dict[str, float] = {}  # CPU seconds each owner's turns took (virtual time)
        self._busy: dict[str, int] = {}  # an owner's turns waiting or running
        self._now_v = 0.0  # virtual time: the last granted turn's start (its owner's share)
        self.seconds: dict[str, float] = {}  # CPU seconds each owner's turns really took
        self.granted = 0
        self.waits: dict[str, list[float]] = {}  # seconds each owner's recent turns waited
        self.waited = 0  # turns that had to wait

    @property
    def queued(self) -> int:
        """Calls waiting for a turn now."""
        return sum(1 for t in self._waiting if t.future is not None and not t.future.done())

    async def acquire(self, priority: int = 0, due: float = 0.0, owner: str = "") -> Turn:
        """Wait for a turn (a cancelled waiter gives its place up); `release` it after."""
        turn = Turn(owner, priority, due, next(self._seq), asked=self.clock())
        if not self._busy.get(owner):
            # An idle owner rejoins at the current virtual time: no credit saved while idle.
            self._used[owner] = max(self._used.get(owner, 0.0), self._now_v)
        self._busy[owner] = self._busy.get(owner, 0) + 1
        if self.running < self.slots and not self.queued:
            self._grant(turn)
            return turn
        self.waited += 1
        turn.waited = True
        turn.future = asyncio.get_running_loop().create_future()
        self._waiting.append(turn)
        try:
            await turn.future
        except asyncio.CancelledError:
            if turn.future.done() and not turn.future.cancelled():
                self.release(turn)  # granted just as it was cancelled: pass the turn on
            else:
                self._busy[owner] -= 1
            raise
        return turn

    def release(self, turn: Turn) -> None:
        """End `turn` (its seconds count to its owner's share); the next waiter gets one."""
        self.running -= 1
        self._busy[turn.owner] -= 1
        took = self.clock() - turn.started
        self._used[turn.owner] = self._used.get(turn.owner, 0.0) + took
        self.seconds[turn.owner] = self.seconds.get(turn.owner, 0.0) + took
        if not self.queued:  # idle: virtual time moves on to where the last turn ended
            self._now_v = max(self._now_v, self._used[turn.owner])
        while self._waiting:
            best = min(self._waiting, key=self._order)
            self._waiting.remove(best)
            assert best.future is not None
            if best.future.done():
                continue  # cancelled while waiting
            self._grant(best)
            best.future.set_result(None)
            return

    def _order(self, t: Turn) -> tuple[int, float, float, int]:
        return (-t.priority, self._used.get(t.owner, 0.0), t.due, t.seq)

    def _grant(self, turn: Turn) -> None:
        self.running += 1
        self.granted += 1
        self._now_v = max(self._now_v, self._used.get(turn.owner, 0.0))
        turn.started = self.clock()
        waits = self.waits.setdefault(turn.owner, [])
        waits.append(turn.started - turn.asked)
        del waits[:-1000]  # the last 1,000 turns' waits per owner

    def describe(self) -> dict[str, object]:
        """Figures for `/stats`: slots, running, queued, turns granted and how many waited,
        each model's CPU seconds, and the P95 of its last 1,000 turns' waits for a turn."""
        return {
            "slots": self.slots,
            "running": self.running,
            "queued": self.queued,
            "turns": self.granted,
            "turns_waited": self.waited,
            "seconds_by_model": {k: round(v, 3) for k, v in self.seconds.items()},
            "wait_p95_ms_by_model": {k: _p95_ms(v) for k, v in self.waits.items() if v},
        }


def _p95_ms(seconds: list[float]) -> float:
    ordered = sorted(seconds)
    return round(1000 * ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))], 1)
