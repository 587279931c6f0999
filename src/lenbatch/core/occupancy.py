"""What a batch costs the whole server, not only the model call: the time a runner slot sits
idle while a batch for it has already been emitted. Pure, clock injected.

Between one model call's end and the next one's start on a slot, the server answers the
finished batch, decides, collates the next one and hands it to a worker thread, all on the
same cores as the HTTP parsing and tokenization of the requests arriving meanwhile. The model
call's own timing misses that; a cost model fitted to it alone predicts more capacity than the
server has. `SlotGaps` measures it per batch: when a call starts, its gap is the time since
the earliest free slot became free or since the batch was emitted, whichever is later (a
batch collated ahead and waiting for its slot costs only the hand-off). The engine adds the
gap to the call's measured seconds before the online cost model learns them, so the model's
per-batch constant holds the server's per-batch overhead too, and `/stats` shows its average.
"""

from __future__ import annotations

import heapq
import math

__all__ = ["SlotGaps"]


class SlotGaps:
    """The idle time of `slots` runner slots before each model call (see the module docstring)."""

    __slots__ = ("_alpha", "_free", "calls", "mean_s", "slots")

    def __init__(self, slots: int, alpha: float = 0.05) -> None:
        if slots < 1:
            raise ValueError(f"a runner has at least one slot, got {slots}")
        self.slots = slots
        self._free: list[float] = []  # times slots became free (a min-heap); absent: never used
        self.calls = 0
        self.mean_s = 0.0  # moving average of the gaps (weight `alpha` for the newest)
        self._alpha = alpha

    def started(self, at: float, emitted: float) -> float:
        """A model call starts at `at` on a batch emitted at `emitted`: its gap in seconds."""
        free_at = heapq.heappop(self._free) if self._free else -math.inf
        gap = max(0.0, at - max(free_at, emitted))
        self.calls += 1
        a = self._alpha if self.calls > 1 else 1.0
        self.mean_s += a * (gap - self.mean_s)
        return gap

    def ended(self, at: float) -> None:
        """A model call ended at `at`: its slot is free (the earliest frees are forgotten
        first when more calls end than started, e.g. after a crash)."""
        heapq.heappush(self._free, at)
        while len(self._free) > self.slots:
            heapq.heappop(self._free)

    def describe(self) -> dict[str, float | int]:
        """What `/stats` shows: calls measured and the mean gap (ms)."""
        return {"calls": self.calls, "mean_gap_ms": round(self.mean_s * 1000, 3)}
