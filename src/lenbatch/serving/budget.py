"""One CPU budget for several models in one process: their model calls take turns.

Each served model keeps its own engine, lanes, buckets and cost model; what they share is the
cores. Two forward passes at once on a 2-core CPU each run at about half speed (or worse, as
their thread pools fight), so the engines ask a `ComputeBudget` for a turn before each model
call. A waiting call is granted by, in order:

1. priority (higher first);
2. its model's share: the model that has used the fewest CPU seconds goes first (start-time
   fair queueing: a model that was idle rejoins at most `idle_credit_s` behind the current
   virtual time, so it cannot save credit up beyond that, as Linux's CFS treats a waking
   task). A burst of rerank pairs therefore takes turns with the embedding calls instead of
   running ahead of all of them, and a light model's short burst (one embedding call's few
   batches) runs at once, not interleaved with the heavy one; a model alone gets every turn;
3. when its oldest member is due (its SLO time, else its deadline, else its arrival);
4. the order the calls asked.

A call whose runner can pause (`preemptible`: the packed and padded encoder runners, between
two layers) is preempted when a waiter outranks it by that order, counting the seconds the
running call has taken so far: its worker thread reaches the next layer, gives the turn back
(`pause_point`) and blocks until the budget grants it again, first among its own model's turns.
An embedding call that arrives while a long rerank batch runs so waits for one layer of it, not
for all of it. A call that cannot pause (a generation step) runs to its end. A single-model
server has no budget and pays nothing for it.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["IDLE_CREDIT_S", "ComputeBudget", "Turn"]

# CPU seconds a model that was idle may run ahead of a busy one before their shares count: one
# embedding call's batches (~0.15 s of CPU for 8 paragraphs in float32 on 2 cores) fit in it.
IDLE_CREDIT_S = 0.25


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
    preemptible: bool = False  # its call can give the turn back at a `pause_point`
    # Set on the event loop when a waiter outranks this running turn; read by its worker.
    preempt: bool = False
    suspended: bool = False  # paused at a `pause_point`, waiting to be granted again
    paused_s: float = 0.0  # seconds its call spent paused so far (not working)
    timer_epoch: int = 0  # which preemption timer of this turn is the live one
    resume: threading.Event | None = None  # set to let its paused worker thread run on

    def paused_until(self, now: float) -> float:
        """Seconds the call has been paused by `now`, the pause under way included."""
        return self.paused_s + (now - self.asked if self.suspended else 0.0)


class ComputeBudget:
    """At most `slots` model calls run at once across every engine that shares it (all on one
    event loop); the others wait in the order the module's docstring gives."""

    def __init__(
        self,
        slots: int = 1,
        clock: Callable[[], float] = time.monotonic,
        idle_credit_s: float = IDLE_CREDIT_S,
    ) -> None:
        if slots < 1:
            raise ValueError(f"slots must be at least 1, got {slots}")
        if idle_credit_s < 0:
            raise ValueError(f"idle_credit_s must be at least 0, got {idle_credit_s}")
        self.slots = slots
        self.idle_credit_s = idle_credit_s
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
        self.preemptions = 0  # running calls paused for a waiter that outranked them
        self._running: list[Turn] = []
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def queued(self) -> int:
        """Calls waiting for a turn now."""
        return sum(1 for t in self._waiting if t.future is not None and not t.future.done())

    async def acquire(
        self, priority: int = 0, due: float = 0.0, owner: str = "", preemptible: bool = False
    ) -> Turn:
        """Wait for a turn (a cancelled waiter gives its place up); `release` it after.
        `preemptible`: the call will reach `pause_point(turn)` now and then, where it gives the
        turn back if a waiter outranks it."""
        self._loop = asyncio.get_running_loop()
        turn = Turn(owner, priority, due, next(self._seq), asked=self.clock())
        turn.preemptible = preemptible
        if not self._busy.get(owner):
            # An idle owner rejoins at most the idle credit behind the current virtual time.
            rejoin = self._now_v - self.idle_credit_s
            self._used[owner] = max(self._used.get(owner, 0.0), rejoin)
        self._busy[owner] = self._busy.get(owner, 0) + 1
        if self.running < self.slots and not self.queued:
            self._grant(turn)
            return turn
        self.waited += 1
        turn.waited = True
        turn.future = self._loop.create_future()
        self._waiting.append(turn)
        self._arm_preemption()
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
        """End `turn` (its seconds count to its owner's share); the next waiter gets one.
        A turn released while paused (its call was cancelled) lets its worker run on."""
        if turn.suspended:
            self._waiting.remove(turn)
            turn.suspended = False
            self._busy[turn.owner] -= 1
            assert turn.future is not None and turn.resume is not None
            turn.future.cancel()
            turn.resume.set()  # directly: the loop may stop before a callback would run
            return
        self.running -= 1
        self._running.remove(turn)
        self._busy[turn.owner] -= 1
        self._count(turn)
        if not self.queued:  # idle: virtual time moves on to where the last turn ended
            self._now_v = max(self._now_v, self._used[turn.owner])
        self._dispatch()

    def pause_point(self, turn: Turn) -> None:
        """Called by `turn`'s call in its worker thread where it can pause (between layers):
        if a waiter outranks it, give the turn back and block until it is granted again."""
        loop = self._loop
        if not turn.preempt or loop is None:
            return
        resumed = threading.Event()
        start = time.monotonic()
        try:
            loop.call_soon_threadsafe(self._suspend, turn, resumed)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            return
        resumed.wait()
        turn.paused_s += time.monotonic() - start

    def _suspend(self, turn: Turn, resumed: threading.Event) -> None:
        """(On the loop) `turn`'s call paused: its seconds so far count, it waits again."""
        turn.preempt = False
        if turn not in self._running:  # released meanwhile
            resumed.set()
            return
        self.running -= 1
        self._running.remove(turn)
        self._count(turn)
        self.preemptions += 1
        turn.suspended = True
        turn.asked = self.clock()
        assert self._loop is not None
        turn.future = self._loop.create_future()
        turn.resume = resumed
        self._waiting.append(turn)
        self._dispatch()

    def _count(self, turn: Turn) -> None:
        took = self.clock() - turn.started
        self._used[turn.owner] = self._used.get(turn.owner, 0.0) + took
        self.seconds[turn.owner] = self.seconds.get(turn.owner, 0.0) + took

    def _dispatch(self) -> None:
        """Grant free slots to waiters, in order; a model's paused call before its others
        (they would queue behind it in the model's worker thread)."""
        while self.running < self.slots:
            live = [t for t in self._waiting if t.future is not None and not t.future.done()]
            self._waiting = live  # cancelled waiters are gone
            if not live:
                return
            best = min(live, key=self._order)
            paused = [t for t in live if t.suspended and t.owner == best.owner]
            if paused:
                best = min(paused, key=self._order)
            self._waiting.remove(best)
            self._grant(best)
            assert best.future is not None
            best.future.set_result(None)
        self._arm_preemption()

    def _arm_preemption(self) -> None:
        """For each running call that can pause: ask it to now if a waiter of another model
        outranks it, else set a timer for when one will (its seconds so far count to its
        model's share as it runs, so a waiter with more CPU used overtakes it later)."""
        now = self.clock()
        for run in self._running:
            if not run.preemptible or run.preempt:
                continue
            running_used = self._used.get(run.owner, 0.0) + (now - run.started)
            delay = float("inf")
            for w in self._waiting:
                if w.owner == run.owner or w.future is None or w.future.done():
                    continue
                if w.priority != run.priority:
                    delay = min(delay, 0.0 if w.priority > run.priority else float("inf"))
                else:
                    delay = min(delay, max(0.0, self._used.get(w.owner, 0.0) - running_used))
            if delay == 0.0:
                run.preempt = True
            elif delay < float("inf") and self._loop is not None:
                run.timer_epoch += 1
                epoch = run.timer_epoch
                # A hair past the crossing, so the waiter outranks it when the timer fires.
                self._loop.call_later(delay + 1e-4, self._timer, run, epoch)

    def _timer(self, run: Turn, epoch: int) -> None:
        if run in self._running and run.timer_epoch == epoch:
            self._arm_preemption()

    def _order(self, t: Turn) -> tuple[int, float, float, int]:
        return (-t.priority, self._used.get(t.owner, 0.0), t.due, t.seq)

    def _grant(self, turn: Turn) -> None:
        self.running += 1
        self._running.append(turn)
        self._now_v = max(self._now_v, self._used.get(turn.owner, 0.0))
        turn.started = self.clock()
        if turn.suspended:  # a paused call resumes: not a new turn
            turn.suspended = False
            assert turn.resume is not None
            turn.resume.set()
            return
        self.granted += 1
        waits = self.waits.setdefault(turn.owner, [])
        waits.append(turn.started - turn.asked)
        del waits[:-1000]  # the last 1,000 turns' waits per owner

    def describe(self) -> dict[str, object]:
        """Figures for `/stats`: slots, running, queued, turns granted and how many waited,
        running calls paused for a waiter, each model's CPU seconds, and the P95 of its last
        1,000 turns' waits for a turn."""
        return {
            "slots": self.slots,
            "running": self.running,
            "queued": self.queued,
            "turns": self.granted,
            "turns_waited": self.waited,
            "preemptions": self.preemptions,
            "seconds_by_model": {k: round(v, 3) for k, v in self.seconds.items()},
            "wait_p95_ms_by_model": {k: _p95_ms(v) for k, v in self.waits.items() if v},
        }


def _p95_ms(seconds: list[float]) -> float:
    ordered = sorted(seconds)
    return round(1000 * ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))], 1)
