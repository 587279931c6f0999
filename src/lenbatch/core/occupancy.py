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

`RequestCpu` is the per-request part: the CPU seconds the server spends per request outside
the model call (the event loop's HTTP parsing, JSON and answers, the tokenizer threads),
measured live from cumulative CPU readings between batches. That work takes a share of the
cores the model runs on: at `rate` requests/s it leaves the model `1 - rate * r / cores` of
them, so a batch runs `cpu_slowdown` times slower than alone (the simulator's
`CostModel.slowdown`, the same formula). The engine divides each measured batch time by the
slowdown of the moment before the cost model learns it (so the model holds the batch's own
cost, as the simulator's does) and shedding multiplies its predictions by the slowdown of
the current arrival rate.
"""

from __future__ import annotations

import heapq
import math

__all__ = ["MAX_CPU_SHARE", "RequestCpu", "SlotGaps", "cpu_slowdown"]

# The share of the cores request-side work may take in the slowdown formula: past it the model
# is predicted 10x slower, which is "overloaded" already (a cap keeps the division finite).
MAX_CPU_SHARE = 0.9


def cpu_slowdown(rate: float, cpu_per_request_s: float, cores: int) -> float:
    """How much slower a batch runs while requests arrive at `rate` per second, each taking
    `cpu_per_request_s` CPU seconds outside the model on the `cores` the model shares
    (1.0 without such work; at most 1 / (1 - MAX_CPU_SHARE))."""
    if cpu_per_request_s <= 0 or rate <= 0:
        return 1.0
    share = min(MAX_CPU_SHARE, rate * cpu_per_request_s / max(1, cores))
    return 1.0 / (1.0 - share)


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


class RequestCpu:
    """The CPU seconds per request spent outside the model call, from cumulative readings
    (see the module docstring). `observe(now, cpu_s, requests)` takes the request-side
    threads' total CPU seconds and the requests admitted so far; over each interval of at
    least `min_interval_s` with a request in it, `cpu_s / requests` moves the moving average
    (weight `alpha` for the newest). An interval without requests moves the baseline only
    (idle housekeeping is not a request's cost)."""

    __slots__ = ("_alpha", "_last", "cores", "min_interval_s", "per_request_s", "samples")

    def __init__(self, cores: int, *, alpha: float = 0.2, min_interval_s: float = 0.5) -> None:
        if cores < 1:
            raise ValueError(f"cores must be at least 1, got {cores}")
        self.cores = cores
        self.min_interval_s = min_interval_s
        self._alpha = alpha
        self._last: tuple[float, float, int] | None = None  # (time, cpu s, requests)
        self.per_request_s = 0.0
        self.samples = 0

    def due(self, now: float) -> bool:
        """Whether a reading at `now` would be used (the caller skips reading the CPU
        otherwise: reading it costs a few system calls)."""
        return self._last is None or now - self._last[0] >= self.min_interval_s

    def observe(self, now: float, cpu_s: float, requests: int) -> None:
        """A reading at `now`: the request-side threads' cumulative CPU seconds and the
        cumulative count of requests admitted."""
        last = self._last
        if last is not None and now - last[0] < self.min_interval_s:
            return
        self._last = (now, cpu_s, requests)
        if last is None:
            return
        n = requests - last[2]
        used = cpu_s - last[1]
        if n < 1 or used < 0:  # no request, or a thread ended and took its CPU with it
            return
        sample = used / n
        self.samples += 1
        a = self._alpha if self.samples > 1 else 1.0
        self.per_request_s += a * (sample - self.per_request_s)

    def slowdown(self, rate: float) -> float:
        """`cpu_slowdown` at `rate` requests/s with what was measured."""
        return cpu_slowdown(rate, self.per_request_s, self.cores)

    def describe(self) -> dict[str, float | int]:
        """What `/stats` shows: the mean CPU per request (ms), cores, intervals measured."""
        return {
            "cpu_per_request_ms": round(self.per_request_s * 1000, 4),
            "cores": self.cores,
            "intervals": self.samples,
        }
