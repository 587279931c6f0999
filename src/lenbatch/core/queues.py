"""The waiting room: one FIFO per lane, plus the count of batches each lane has in flight.

Lanes are the scheduler's queues: a single one for `static`, `fifo` and `sorted`; one per
length bucket plus the overlong lane for `bucketed`. The queues also count the batches each
lane has running or prepared, because the scheduler needs both to decide (free runner slots,
the overlong lane's quota). Pure bookkeeping: no clock, no asyncio.

`Queues` is the only writer of its lanes and counters: the scheduler reads `lanes`, `size` and
`inflight` to decide, then takes what it decided on out with `remove_front` (a lane's head) or
`remove_many` (any requests), and puts back what it did not use with `push_front`.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import deque

from lenbatch.core.lanes import SchedulerConfig
from lenbatch.core.request import Request

__all__ = ["Queues"]


class Queues:
    """Per-lane FIFO queues and in-flight batch counters for one `SchedulerConfig`."""

    __slots__ = ("_bounds", "_bucketed", "_pushed", "inflight", "inflight_total", "lanes", "size")

    def __init__(self, cfg: SchedulerConfig) -> None:
        self.lanes: list[deque[Request]] = [deque() for _ in cfg.lanes]
        self.inflight: list[int] = [0] * len(cfg.lanes)
        self.inflight_total = 0
        self.size = 0
        self._pushed = 0
        self._bucketed = cfg.strategy.bucketed
        self._bounds = cfg.boundaries

    def lane_of(self, length: int) -> int:
        """The lane a request of `length` tokens waits in."""
        return bisect_left(self._bounds, length) if self._bucketed else 0

    def push(self, request: Request) -> int:
        """Queue `request` at the back of its lane; returns the lane."""
        lane = self.lane_of(request.length)
        request.lane = lane
        self._pushed += 1
        request.seq = self._pushed
        self.lanes[lane].append(request)
        self.size += 1
        return lane

    def push_front(self, requests: list[Request]) -> None:
        """Put requests back at the front of their lanes, keeping their given order."""
        for r in reversed(requests):
            self.lanes[r.lane].appendleft(r)
        self.size += len(requests)

    def remove_front(self, lane: int, n: int) -> None:
        """Take the first `n` requests out of `lane`: those the caller has just read at the
        head of `lanes[lane]` and batched or found expired."""
        q = self.lanes[lane]
        if n > len(q):
            raise RuntimeError(f"bug: {n} requests taken from lane {lane} holding {len(q)}")
        self.size -= n
        if n == len(q):
            q.clear()
            return
        popleft = q.popleft
        while n:
            popleft()
            n -= 1

    def remove_many(self, requests: list[Request]) -> int:
        """Take `requests` out of their lanes (fast when they are a lane's head, in order);
        returns how many were queued. Requests no longer queued are passed over."""
        by_lane: dict[int, list[Request]] = {}
        for r in requests:
            by_lane.setdefault(r.lane, []).append(r)
        removed = 0
        for lane, rs in by_lane.items():
            q = self.lanes[lane]
            k = 0
            for r in rs:
                if k < len(q) and q[k] is r:
                    k += 1
                else:
                    break
            if k == len(rs):
                for _ in range(k):
                    q.popleft()
                removed += k
            else:
                ids = {id(r) for r in rs}
                kept = [r for r in q if id(r) not in ids]
                removed += len(q) - len(kept)
                q.clear()
                q.extend(kept)
        self.size -= removed
        return removed

    def remove(self, request: Request) -> bool:
        """Take a waiting request out (cancelled or expired); False if it is no longer queued."""
        lane = request.lane
        if lane < 0 or lane >= len(self.lanes):
            return False
        try:
            self.lanes[lane].remove(request)
        except ValueError:
            return False
        self.size -= 1
        return True

    def depth(self, lane: int) -> int:
        """Requests waiting in `lane`."""
        return len(self.lanes[lane])

    def depths(self) -> list[int]:
        """Requests waiting in each lane."""
        return [len(q) for q in self.lanes]

    def batch_started(self, lane: int) -> None:
        """Count a batch of `lane` as in flight (the scheduler calls this when it emits one)."""
        self.inflight[lane] += 1
        self.inflight_total += 1

    def batch_done(self, lane: int) -> None:
        """A batch of `lane` finished (or failed): free its slot."""
        if self.inflight[lane] <= 0:
            raise RuntimeError(f"bug: batch_done for lane {lane} with nothing in flight")
        self.inflight[lane] -= 1
        self.inflight_total -= 1

    def rebucket(self, cfg: SchedulerConfig) -> None:
        """Swap to `cfg`'s lanes atomically, re-routing every waiting request: none lost or
        duplicated, each new lane in arrival order (requests of one old lane keep their order).
        Only with nothing in flight: a running batch's lane must keep its meaning."""
        if self.inflight_total:
            raise RuntimeError("bug: lanes swapped with batches in flight")
        waiting = sorted((r for q in self.lanes for r in q), key=_queued_order)
        self.lanes = [deque() for _ in cfg.lanes]
        self.inflight = [0] * len(cfg.lanes)
        self._bucketed = cfg.strategy.bucketed
        self._bounds = cfg.boundaries
        for r in waiting:
            lane = self.lane_of(r.length)
            r.lane = lane
            self.lanes[lane].append(r)

    def drain(self) -> list[Request]:
        """Remove and return every waiting request (shutdown, runner crash)."""
        out = [r for q in self.lanes for r in q]
        for q in self.lanes:
            q.clear()
        self.size = 0
        return out


def _queued_order(r: Request) -> tuple[float, int]:
    return (r.arrival, r.seq)
