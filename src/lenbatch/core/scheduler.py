"""The scheduler: a pure function from (queues, now, config) to the batches to run now.

`schedule()` never sleeps, logs, reads a clock or touches futures; the engine calls it with the
real clock and the simulator with a virtual one, so both run exactly this code.

Rules, per lane (a length bucket, the overlong lane, or the single queue of the baselines):

* A lane is *ready* when it holds `max_batch` requests, when its oldest request has waited
  `max_wait`, or when its head already fills the token budget (`max_batch_tokens`, counted as
  batch size x padded length).
* Batches are only emitted while runner slots are free (`cfg.slots` minus batches in flight) and,
  for a lane with a quota (overlong), while the lane is under its quota.
* Among ready lanes the one with the oldest head goes first (higher `priority` first on ties of
  readiness), one batch at a time, so a lane with a deep backlog cannot starve the others.
* A batch takes its lane's requests in FIFO order until `max_batch` or the token budget.
  Requests whose deadline has passed are taken out instead and returned as `expired`.
* `wake_at` is the earliest moment a waiting lane becomes ready by time; None when nothing
  waits on a timer (the caller re-runs `schedule` on arrivals and batch completions anyway).

`sorted` (Infinity's method) differs only in batch formation: when its single queue is ready it
sorts a window of the oldest `sorted_window` requests by length and cuts it into batches; the
chunk holding the oldest request runs first and unused requests go back in arrival order.
"""

from __future__ import annotations

from collections import deque

from lenbatch.config import Strategy
from lenbatch.core.adaptive import AdaptiveState
from lenbatch.core.batch import Batch, Decision
from lenbatch.core.lanes import LanePolicy, SchedulerConfig
from lenbatch.core.queues import Queues
from lenbatch.core.request import Request

__all__ = ["schedule"]

_INF = float("inf")


def schedule(
    queues: Queues, now: float, cfg: SchedulerConfig, adaptive: AdaptiveState | None = None
) -> Decision:
    """Take the batches that should run at time `now` out of `queues`.

    Emitted batches are counted as in flight in `queues`; the caller reports each one back
    with `queues.batch_done(batch.lane)` when it has finished. Strategy `adaptive` decides
    with its state (cost model, arrival rates), which the caller owns and passes in.
    """
    if cfg.strategy is Strategy.ADAPTIVE:
        if adaptive is None:
            raise ValueError("strategy adaptive needs its AdaptiveState")
        return adaptive.schedule(queues, now, cfg)
    # This runs on every arrival, completion and timer, in the engine and (millions of times)
    # in the simulator: keep the lane scan free of allocations and calls where it can be.
    decision = Decision()
    if queues.size == 0:
        return decision
    free = cfg.slots - queues.inflight_total
    lanes = queues.lanes
    inflight = queues.inflight
    policies = cfg.lanes
    budget = cfg.max_batch_tokens
    while free > 0:
        best = -1
        best_prio = 0  # ready lanes are ranked by (-head.priority, head.arrival)
        best_arrival = _INF
        wake = _INF
        i = -1
        for q in lanes:
            i += 1
            if not q:
                continue
            pol = policies[i]
            if pol.quota is not None and inflight[i] >= pol.quota:
                continue  # re-checked when one of its batches completes
            head = q[0]
            due = head.arrival + pol.max_wait
            if (
                due <= now
                or len(q) >= pol.max_batch
                # the budget can only bind when a full batch of the longest could exceed it
                or (
                    pol.max_batch * (pol.pad_to or pol.upper) > budget
                    and _fills_budget(q, pol, cfg)
                )
            ):
                prio = -head.priority
                if (
                    best < 0
                    or prio < best_prio
                    or (prio == best_prio and head.arrival < best_arrival)
                ):
                    best, best_prio, best_arrival = i, prio, head.arrival
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
    pol = cfg.lanes[lane]
    budget = cfg.max_batch_tokens
    max_batch = pol.max_batch
    pad_to = pol.pad_to
    taken: list[Request] = []
    pad = 0
    read = 0  # requests read from the head: taken or expired
    for r in queues.lanes[lane]:
        if len(taken) >= max_batch:
            break
        if r.deadline is not None and r.deadline <= now:
            decision.expired.append(r)
            read += 1
            continue
        new_pad = pad_to or (r.length if r.length > pad else pad)
        if taken and new_pad * (len(taken) + 1) > budget:
            break
        taken.append(r)
        read += 1
        pad = new_pad
    queues.remove_front(lane, read)
    if not taken:
        return 0
    queues.batch_started(lane)
    decision.batches.append(Batch(lane, taken, pad))
    return 1


def _cut_sorted(
    queues: Queues, lane: int, now: float, cfg: SchedulerConfig, free: int, decision: Decision
) -> int:
    """Sort a window of the lane by length, cut it into batches, emit up to `free` of them."""
    pol = cfg.lanes[lane]
    size = cfg.sorted_window
    window: list[Request] = []
    read = 0  # requests read from the head: in the window or expired
    for r in queues.lanes[lane]:
        if len(window) >= size:
            break
        read += 1
        if r.deadline is not None and r.deadline <= now:
            decision.expired.append(r)
        else:
            window.append(r)
    queues.remove_front(lane, read)
    if not window:
        return 0
    if len(window) == 1:  # common at light load: nothing to sort or cut
        queues.batch_started(lane)
        r = window[0]
        decision.batches.append(Batch(lane, window, pol.pad_to or r.length))
        return 1
    oldest = window[0]
    ordered = sorted(window, key=_length)  # stable: equal lengths keep arrival order
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
    if len(chunks) > 1:
        # The chunk holding the oldest request first, then by each chunk's oldest member.
        chunks.sort(key=lambda c: (oldest not in c, min(r.arrival for r in c)))
    run, back = chunks[:free], chunks[free:]
    for c in run:
        queues.batch_started(lane)
        # each chunk is sorted ascending, so its last member is its longest
        decision.batches.append(Batch(lane, c, pol.pad_to or c[-1].length))
    if back:
        leftover = sorted((r for c in back for r in c), key=_arrival)
        queues.push_front(leftover)
    return len(run)


def _length(r: Request) -> int:
    return r.length


def _arrival(r: Request) -> float:
    return r.arrival
