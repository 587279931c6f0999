"""Online re-fit of the bucket boundaries: a rolling sample of recent lengths, a drift test,
hysteresis, and the boundaries that minimise padded tokens. Pure: numpy only, no clock.

`Refitter.observe` takes every admitted length; `Refitter.consider(now, bounds)` says whether to
swap to new boundaries now. It proposes a re-fit only when all of these hold:

* at least `min_requests` lengths arrived since the last fit, and `min_interval` seconds passed;
* the recent lengths differ from those the current boundaries were fitted on: a two-sample
  Kolmogorov-Smirnov test at the 1 % level (`D > 1.628 * sqrt((n + m) / (n m))`); with no
  reference yet (`boundaries = "auto"`, or boundaries given by hand) the first check fits;
* the new boundaries cut the predicted cost per request on the recent sample by at least
  `min_saving` (hysteresis: small gains never cause a swap).

The predicted cost of a set of boundaries is the expected padded tokens per request when each
request is padded to its bucket's upper bound (the overlong lane to the longest length seen),
plus the fixed cost per call shared by the requests of a lane's batch, in token-equivalents.
The default fitter is the exact DP over the sorted distinct lengths minimising that padded-token
term (`optimal_bounds`); the shell may inject another (e.g. `plan.fitting`'s `optimal`).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from lenbatch.config import AdaptiveConfig

__all__ = [
    "BoundarySwap",
    "Fitter",
    "RefitEvent",
    "Refitter",
    "build_refitter",
    "ks_distance",
    "optimal_bounds",
]

IntArray = npt.NDArray[np.int64]
# (recent lengths, most buckets, model max length) -> boundaries
Fitter = Callable[[IntArray, int, int], tuple[int, ...]]
_KS_C = 1.628  # c(alpha) for alpha = 0.01


def ks_distance(a: Sequence[int] | IntArray, b: Sequence[int] | IntArray) -> float:
    """Two-sample Kolmogorov-Smirnov statistic: the largest gap between the two empirical CDFs."""
    x = np.sort(np.asarray(a, dtype=np.int64))
    y = np.sort(np.asarray(b, dtype=np.int64))
    if not len(x) or not len(y):
        return 0.0
    grid = np.union1d(x, y)
    fx = np.searchsorted(x, grid, side="right") / len(x)
    fy = np.searchsorted(y, grid, side="right") / len(y)
    return float(np.max(np.abs(fx - fy)))


def optimal_bounds(lengths: IntArray, buckets: int, max_length: int) -> tuple[int, ...]:
    """Boundaries (at most `buckets`, the last at the longest length seen) minimising the total
    padded tokens of `lengths` padded to their bucket's upper bound; exact DP."""
    arr = np.asarray(lengths, dtype=np.int64)
    arr = arr[(arr >= 1) & (arr <= max_length)]
    if not len(arr):
        return (max_length,)
    values, counts = np.unique(arr, return_counts=True)
    u = len(values)
    k = max(1, min(buckets, u))
    cum = np.concatenate(([0], np.cumsum(counts))).astype(np.float64)
    v = values.astype(np.float64)
    # f[j, b]: least padded tokens covering values 0..b with j groups; the last group a..b
    # pads count(a..b) rows to v[b].
    f = np.full((k + 1, u), np.inf)
    back = np.zeros((k + 1, u), dtype=np.int64)
    f[1] = cum[1:] * v
    for j in range(2, k + 1):
        for b in range(j - 1, u):
            a = np.arange(j - 1, b + 1)  # the last group starts at a (a >= j - 1)
            cand = f[j - 1, a - 1] + (cum[b + 1] - cum[a]) * v[b]
            i = int(np.argmin(cand))
            f[j, b], back[j, b] = cand[i], a[i]
    best_j = int(np.argmin(f[1:, u - 1])) + 1
    out: list[int] = []
    b, j = u - 1, best_j
    while j >= 1:
        out.append(int(values[b]))
        b = int(back[j, b]) - 1 if j > 1 else -1
        j -= 1
    return tuple(sorted(out))


def padded_per_request(bounds: Sequence[int], lengths: IntArray, overhead_tokens: float) -> float:
    """Predicted cost per request (token-equivalents) of `bounds` on `lengths`: padded to the
    bucket bound (overlong: to the longest length), plus a call's fixed cost shared by the
    requests of each lane that sample saw (one call per lane per sample-mean batch)."""
    arr = np.asarray(lengths, dtype=np.int64)
    if not len(arr):
        return 0.0
    edges = np.asarray(bounds, dtype=np.int64)
    lane = np.searchsorted(edges, arr, side="left")
    uppers = np.append(edges, max(int(arr.max()), int(edges[-1]) if len(edges) else 0))
    padded = float(uppers[lane].mean())
    lanes_used = len(np.unique(lane))
    return padded + overhead_tokens * lanes_used / len(arr)


@dataclass(frozen=True, slots=True)
class RefitEvent:
    """One re-fit, as logged and shown in /stats (lengths only)."""

    at: float
    old: tuple[int, ...]
    new: tuple[int, ...]
    ks: float | None  # drift statistic (None: no reference sample yet)
    saving: float  # predicted cut of the cost per request, as a share

    def describe(self) -> dict[str, Any]:
        """JSON-ready."""
        return {
            "at": self.at,
            "old": list(self.old),
            "new": list(self.new),
            "ks": self.ks,
            "saving": self.saving,
        }


@dataclass
class Refitter:
    """The rolling sample, the drift test and the hysteresis; proposes new boundaries."""

    max_length: int
    sample: int = 2000
    min_requests: int = 300
    min_interval: float = 10.0
    min_saving: float = 0.05
    buckets: int = 6
    overhead_tokens: float = 80.0  # a call's fixed cost in padded tokens (cost model a / b)
    fit: Fitter = optimal_bounds
    recent: deque[int] = field(init=False)
    reference: IntArray | None = None
    since_fit: int = 0
    last_fit: float = -math.inf
    events: list[RefitEvent] = field(default_factory=list)
    checks: int = 0

    def __post_init__(self) -> None:
        self.recent = deque(maxlen=self.sample)

    def observe(self, length: int) -> None:
        """One admitted request's length."""
        self.recent.append(length)
        self.since_fit += 1

    def consider(self, now: float, bounds: tuple[int, ...]) -> tuple[int, ...] | None:
        """New boundaries to swap to now, or None (see the module docstring)."""
        if self.since_fit < self.min_requests or now - self.last_fit < self.min_interval:
            return None
        self.checks += 1
        window = np.fromiter(self.recent, dtype=np.int64)
        latest = window[-self.min_requests :]
        ks = None
        if self.reference is not None:
            ks = ks_distance(self.reference, latest)
            n, m = len(self.reference), len(latest)
            if ks <= _KS_C * math.sqrt((n + m) / (n * m)):
                self.since_fit = 0  # no drift: test again after as many requests
                return None
        new = tuple(self.fit(latest, self.buckets, self.max_length))
        old_cost = padded_per_request(bounds, latest, self.overhead_tokens)
        new_cost = padded_per_request(new, latest, self.overhead_tokens)
        saving = 1 - new_cost / old_cost if old_cost > 0 else 0.0
        self.since_fit = 0
        if new == bounds or saving < self.min_saving:
            self.reference = latest.copy()  # the current boundaries suit this sample
            return None
        self.reference = latest.copy()
        self.last_fit = now
        self.events.append(RefitEvent(now, bounds, new, ks, saving))
        return new

    def describe(self) -> dict[str, Any]:
        """What /stats shows: settings, sample size, checks and every re-fit."""
        return {
            "sample": len(self.recent),
            "min_requests": self.min_requests,
            "min_interval_s": self.min_interval,
            "min_saving": self.min_saving,
            "checks": self.checks,
            "refits": len(self.events),
            "events": [e.describe() for e in self.events[-10:]],
        }


@dataclass
class BoundarySwap:
    """The swap rule the engine and the simulator share: ask the re-fitter (only while
    accepting work); once new boundaries are pending, the caller holds new batches
    (`holding`) until nothing is in flight, and `step` then returns them to swap to."""

    refitter: Refitter
    pending: tuple[int, ...] | None = None

    @property
    def holding(self) -> bool:
        """A swap is pending: emit no new batch until it has happened."""
        return self.pending is not None

    def step(
        self, now: float, bounds: tuple[int, ...], inflight: int, accepting: bool = True
    ) -> tuple[int, ...] | None:
        """The boundaries to swap the lanes to now (the caller re-buckets the queued requests),
        or None: no re-fit proposed, or batches still in flight."""
        if self.pending is None and accepting:
            self.pending = self.refitter.consider(now, bounds)
        if self.pending is None or inflight:
            return None
        new, self.pending = self.pending, None
        return new


def build_refitter(
    ac: AdaptiveConfig,
    max_length: int,
    call_s: float,
    token_s: float,
    fit: Fitter = optimal_bounds,
) -> Refitter:
    """The re-fitter `ac` configures, as the engine and the simulator both build it: a call's
    fixed cost `call_s` over the cost per padded token `token_s` prices the overhead."""
    return Refitter(
        max_length=max_length,
        sample=ac.refit_sample,
        min_requests=ac.refit_min_requests,
        min_interval=ac.refit_min_interval_s,
        min_saving=ac.refit_min_saving,
        buckets=ac.refit_buckets,
        overhead_tokens=call_s / token_s if token_s > 0 else 80.0,
        fit=fit,
    )
