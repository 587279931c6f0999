"""Frozen copy of `lenbatch/core/scheduler.py` as the lead wrote it (commit ace16fa), before it was
optimised for the simulator. The property tests run both on the same inputs and require
identical decisions, so speed work cannot change what the scheduler decides.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from lenbatch.config import Strategy
from lenbatch.core.lanes import LanePolicy, SchedulerConfig
from lenbatch.core.queues import Queues
from lenbatch.core.request import Request

__all__ = ["Batch", "Decision", "schedule"]

_INF = float("inf")


@dataclass(slots=True)
class Batch:
    """Requests that run together, all padded to `padded_len` tokens."""

    lane: int
    requests: list[Request]
    padded_len: int

    @property
    def size(self) -> int:
        """Number of requests."""
        return len(self.requests)

    @property
    def real_tokens(self) -> int:
        """Tokens that carry input."""
        return sum(r.length for r in self.requests)

    @property
    def padded_tokens(self) -> int:
        """Tokens the model computes: size x padded length."""
        return len(self.requests) * self.padded_len


@dataclass(slots=True)
class Decision:
    """What to do now: batches to run, requests that expired, and when to ask again."""

    batches: list[Batch] = field(default_factory=list)
    wake_at: float | None = None
    expired: list[Request] = field(default_factory=list)


def schedule(queues: Queues, now: float, cfg: SchedulerConfig) -> Decision:
    """Take the batches that should run at time `now` out of `queues`.

    Emitted batches are counted as in flight in `queues`; the caller reports each one back
    with `queues.batch_done(batch.lane)` when it has finished.
    """
    decision = Decision()
    if queues.size == 0:
        return decision
    free = cfg.slots - queues.inflight_total
    lanes = queues.lanes
    policies = cfg.lanes
    while free > 0:
        best = -1
        best_key: tuple[int, float] = (0, _INF)
        wake = _INF
        for i, q in enumerate(lanes):
            if not q:
                continue
            pol = policies[i]
            if pol.quota is not None and queues.inflight[i] >= pol.quota:
                continue  # re-checked when one of its batches completes
            head = q[0]
            due = head.arrival + pol.max_wait
            if due <= now or len(q) >= pol.max_batch or _fills_budget(q, pol, cfg):
                key = (-head.priority, head.arrival)
                if best < 0 or key < best_key:
                    best, best_key = i, key
            elif due < wake:
                wake = due
        if best < 0:
            decision.wake_at = wake if wake < _INF else None
            return decision
        if cfg.strategy is Strategy.SORTED:
            emitted = _cut_sorted(queues, best, now, cfg, free, decision)
        else:
            emitted = _take_fifo(queues, best, now, cfg, decision)
        free -= emitted
        if queues.size == 0:
            break
    return decision  # no free slot left: the next batch completion triggers a new decision


def _fills_budget(q: deque[Request], pol: LanePolicy, cfg: SchedulerConfig) -> bool:
    """True when the lane's head requests already fill the token budget before `max_batch`."""
    budget = cfg.max_batch_tokens
    if pol.max_batch * (pol.pad_to or pol.upper) <= budget:
        return False  # the budget can never bind in this lane
    pad = 0
    for n, r in enumerate(q):
        if n >= pol.max_batch:
            return False
        pad = pol.pad_to or max(pad, r.length)
        if pad * (n + 1) > budget:
            return n > 0
    return False


def _take_fifo(
    queues: Queues, lane: int, now: float, cfg: SchedulerConfig, decision: Decision
) -> int:
    """Emit one batch from the head of `lane` (FIFO); returns the number of batches emitted."""
    q = queues.lanes[lane]
    pol = cfg.lanes[lane]
    budget = cfg.max_batch_tokens
    taken: list[Request] = []
    pad = 0
    expired = 0
    while q and len(taken) < pol.max_batch:
        r = q[0]
        if r.deadline is not None and r.deadline <= now:
            decision.expired.append(q.popleft())
            expired += 1
            continue
        new_pad = pol.pad_to or max(pad, r.length)
        if taken and new_pad * (len(taken) + 1) > budget:
            break
        taken.append(q.popleft())
        pad = new_pad
    queues.size -= len(taken) + expired
    if not taken:
        return 0
    queues.batch_started(lane)
    decision.batches.append(Batch(lane, taken, pad))
    return 1


def _cut_sorted(
    queues: Queues, lane: int, now: float, cfg: SchedulerConfig, free: int, decision: Decision
) -> int:
    """Sort a window of the lane by length, cut it into batches, emit up to `free` of them."""
    q = queues.lanes[lane]
    pol = cfg.lanes[lane]
    window: list[Request] = []
    expired = 0
    while q and len(window) < cfg.sorted_window:
        r = q.popleft()
        if r.deadline is not None and r.deadline <= now:
            decision.expired.append(r)
            expired += 1
        else:
            window.append(r)
    queues.size -= len(window) + expired
    if not window:
        return 0
    oldest = window[0]
    ordered = sorted(window, key=lambda r: r.length)
    chunks: list[list[Request]] = []
    current: list[Request] = []
    for r in ordered:
        pad = pol.pad_to or r.length  # sorted ascending: the newcomer is the longest
        full = len(current) >= pol.max_batch or pad * (len(current) + 1) > cfg.max_batch_tokens
        if current and full:
            chunks.append(current)
            current = []
        current.append(r)
    chunks.append(current)
    # The chunk holding the oldest request first, then by each chunk's oldest member.
    chunks.sort(key=lambda c: (oldest not in c, min(r.arrival for r in c)))
    run, back = chunks[:free], chunks[free:]
    for c in run:
        queues.batch_started(lane)
        decision.batches.append(Batch(lane, c, pol.pad_to or max(r.length for r in c)))
    if back:
        leftover = sorted((r for c in back for r in c), key=lambda r: r.arrival)
        queues.push_front(leftover)
    return len(run)
