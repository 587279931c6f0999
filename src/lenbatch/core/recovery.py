"""Recovery bookkeeping for the engine: batch caps lowered after out-of-memory errors. Pure.

When a batch runs out of memory the engine splits it and retries the halves, and lowers that
lane's `max_batch` to half the failing batch for a cool-down, so the next batches of the lane are
formed small enough from the start. The scheduler stays pure: it is simply handed a
`SchedulerConfig` whose `LanePolicy.max_batch` is the lowered cap, built here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from lenbatch.core.lanes import SchedulerConfig

__all__ = ["BatchCaps"]


class BatchCaps:
    """Per-lane batch caps, each lowered until a deadline, over a base `SchedulerConfig`."""

    def __init__(self, base: SchedulerConfig, cooldown_s: float) -> None:
        self.base = base
        self.cooldown_s = cooldown_s
        self._lowered: dict[int, tuple[int, float]] = {}  # lane -> (cap, restore at)

    def lower(self, lane: int, failed_size: int, now: float) -> int:
        """A batch of `failed_size` requests of `lane` ran out of memory: cap the lane at half
        of it (at least 1, never above the current cap) until `now + cooldown_s`. Returns the
        new cap."""
        cap = max(1, min(self.cap(lane), failed_size // 2))
        self._lowered[lane] = (cap, now + self.cooldown_s)
        return cap

    def expire(self, now: float) -> list[int]:
        """Restore every lane whose cool-down has passed; returns those lanes."""
        done = [lane for lane, (_, until) in self._lowered.items() if until <= now]
        for lane in done:
            del self._lowered[lane]
        return done

    def cap(self, lane: int) -> int:
        """The lane's max batch in force now."""
        lowered = self._lowered.get(lane)
        return lowered[0] if lowered is not None else self.base.lanes[lane].max_batch

    def caps(self) -> list[int]:
        """Every lane's max batch in force now."""
        return [self.cap(i) for i in range(len(self.base.lanes))]

    def config(self, draining: bool = False) -> SchedulerConfig:
        """The scheduler configuration in force: lowered caps applied; when `draining`, no lane
        waits for its batch to fill (nobody new will join)."""
        lanes = []
        for i, policy in enumerate(self.base.lanes):
            changes: dict[str, Any] = {}
            if i in self._lowered:
                changes["max_batch"] = self._lowered[i][0]
            if draining:
                changes["max_wait"] = 0.0
            lanes.append(dataclasses.replace(policy, **changes) if changes else policy)
        return dataclasses.replace(self.base, lanes=tuple(lanes))

    def describe(self, now: float, labels: Sequence[str]) -> list[dict[str, Any]]:
        """JSON-ready view for /stats: configured and current cap per lane, and when a lowered
        cap is restored."""
        out = []
        for i, label in enumerate(labels):
            lowered = self._lowered.get(i)
            out.append(
                {
                    "bucket": label,
                    "max_batch": self.base.lanes[i].max_batch,
                    "current": self.cap(i),
                    "restored_in_s": None if lowered is None else max(0.0, lowered[1] - now),
                }
            )
        return out
