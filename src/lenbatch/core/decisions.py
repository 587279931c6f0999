"""The decision log of `adaptive`'s shedding: why each refused or shed request was refused.

Every refusal at admission and every shed from a lane's head records what the strategy
predicted at that moment: when the request would start and finish, its due time, the work and
the requests counted ahead of it, what was running, and the cost model's coefficients and how
many batches they were fitted on. No request text and no id: lengths, times and counts only.

The log is a bounded ring (the latest `capacity` decisions) plus running totals; `summary`
is what `/stats` shows (`adaptive.decisions`) and `worst_burst` finds the window of the ring
with the most sheds and summarises it, as a bench reads it after a replay. Pure, clock
injected (times are the caller's clock).
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["DecisionLog", "ShedDecision"]


@dataclass(frozen=True, slots=True)
class ShedDecision:
    """One refusal (`where` = `admission`) or shed from a lane's head (`queue`), with what the
    strategy predicted then. Times in seconds on the caller's clock; `*_in` are relative to
    `at`."""

    at: float
    where: str  # "admission" or "queue"
    length: int  # tokens of the (longest) input
    inputs: int  # inputs of the call (1 for a shed from the queue)
    lane: int
    priority: int
    due_in: float  # its due time, from `at`
    start_in: float  # predicted start, from `at`
    finish_in: float  # predicted finish (start + its share of the work), from `at`
    running_s: float  # predicted seconds still on the runner(s) when decided
    queued_s: float  # predicted seconds of queued work counted ahead of it
    queue_ahead: int  # queued requests counted ahead of it
    queued: int  # requests queued in all lanes
    inflight: int  # batches in flight
    cost_a_s: float  # the cost model a + b*B*L + c*B*L^2 at that moment
    cost_b_s: float
    cost_c_s: float
    observed_batches: int  # batches the cost model had seen
    drift: float = 1.0  # recent measured / predicted batch time the prediction was scaled by
    queue_drift: float = 1.0  # the same over more batches, which the queued work was scaled by

    @property
    def late_by(self) -> float:
        """Seconds the prediction said it would miss its due time by."""
        return self.finish_in - self.due_in

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (milliseconds for the durations, as `/stats` shows times)."""
        out = asdict(self)
        for name, shown in _MS_FIELDS.items():
            out[shown] = round(out.pop(name) * 1000, 3)
        out["late_by_ms"] = round(self.late_by * 1000, 3)
        return out


_MS_FIELDS = {
    "due_in": "due_in_ms",
    "start_in": "start_in_ms",
    "finish_in": "finish_in_ms",
    "running_s": "running_ms",
    "queued_s": "queued_ms",
}


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


class DecisionLog:
    """The latest `capacity` shed decisions and the totals since start."""

    __slots__ = ("_ring", "totals")

    def __init__(self, capacity: int = 1024) -> None:
        if capacity < 1:
            raise ValueError(f"the decision log needs room for at least 1 decision, got {capacity}")
        self._ring: deque[ShedDecision] = deque(maxlen=capacity)
        self.totals = {"admission": 0, "queue": 0}

    def record(self, d: ShedDecision) -> None:
        """Keep one decision (the oldest leaves a full ring)."""
        self._ring.append(d)
        self.totals[d.where] = self.totals.get(d.where, 0) + 1

    def __len__(self) -> int:
        return len(self._ring)

    def decisions(self) -> list[ShedDecision]:
        """The decisions the ring holds, oldest first."""
        return list(self._ring)

    def worst_burst(self, window_s: float = 1.0) -> dict[str, Any] | None:
        """The `window_s`-second window of the ring holding the most decisions, summarised
        (None when the ring is empty): when it began, how many were refused where, and the
        medians of what was predicted (margin, start, work and requests ahead), with the cost
        model of its first decision."""
        ring = self._ring
        if not ring:
            return None
        best_lo, best_n, lo = 0, 0, 0
        items = list(ring)
        for hi, d in enumerate(items):  # two pointers: decisions are recorded in time order
            while d.at - items[lo].at > window_s:
                lo += 1
            if hi - lo + 1 > best_n:
                best_lo, best_n = lo, hi - lo + 1
        burst = items[best_lo : best_lo + best_n]
        first = burst[0]
        return {
            "window_s": window_s,
            "start": first.at,
            "shed": best_n,
            "by_where": {w: sum(1 for d in burst if d.where == w) for w in ("admission", "queue")},
            "median_late_by_ms": round(1000 * (_median([d.late_by for d in burst]) or 0), 3),
            "min_late_by_ms": round(1000 * min(d.late_by for d in burst), 3),
            "median_start_in_ms": round(1000 * (_median([d.start_in for d in burst]) or 0), 3),
            "median_due_in_ms": round(1000 * (_median([d.due_in for d in burst]) or 0), 3),
            "median_running_ms": round(1000 * (_median([d.running_s for d in burst]) or 0), 3),
            "median_queued_ms": round(1000 * (_median([d.queued_s for d in burst]) or 0), 3),
            "median_queue_ahead": _median([float(d.queue_ahead) for d in burst]),
            "max_queued": max(d.queued for d in burst),
            "lengths": {
                "median": _median([float(d.length) for d in burst]),
                "max": max(d.length for d in burst),
            },
            "cost_model": {
                "a_s": first.cost_a_s,
                "b_s_per_token": first.cost_b_s,
                "c_s_per_token_sq": first.cost_c_s,
                "observed_batches": first.observed_batches,
                "drift": first.drift,
                "queue_drift": first.queue_drift,
            },
        }

    def summary(self, now: float, recent: int = 10) -> dict[str, Any]:
        """What `/stats` shows: totals since start, the ring's size, the `recent` latest
        decisions (with their age), and the worst one-second burst of the ring."""
        latest = list(self._ring)[-recent:] if recent > 0 else []
        return {
            "totals": dict(self.totals),
            "held": len(self._ring),
            "capacity": self._ring.maxlen,
            "recent": [{"age_s": round(now - d.at, 3), **d.to_json()} for d in latest],
            "worst_burst": self.worst_burst(1.0),
        }
