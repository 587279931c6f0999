"""What a simulated run produced: the event loop's record (`ReplayLog`) and the result it turns
into (`SimRun`: per-request columns, per-lane batch totals, the shared summary).

The event loop (`lenbatch.plan.sim`) keeps per request only what cannot be derived from the
batch log afterwards (its outcome when it did not run, its lane) and per executed batch five
numbers and its members; `ReplayLog.to_run` derives the rest at the end, with numpy.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import chain
from operator import attrgetter
from typing import Any

import numpy as np
import numpy.typing as npt

from lenbatch.config import Strategy
from lenbatch.core.lanes import Lanes, SchedulerConfig
from lenbatch.core.request import Request
from lenbatch.core.totals import LaneTotals
from lenbatch.plan.costmodel import CostModel
from lenbatch.plan.summary import OUTCOME_ERROR, OUTCOME_OK, OUTCOME_REJECTED, summarize

__all__ = ["OUTCOME_PENDING", "ReplayLog", "SimRun"]

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

OUTCOME_PENDING = -1  # not answered yet (the event loop's mark; none is left in a SimRun)
_handle = attrgetter("handle")
_MB = 1024 * 1024


@dataclass
class SimRun:
    """Everything one simulated run produced: per-request columns and per-lane batch totals."""

    strategy: Strategy
    cfg: SchedulerConfig
    labels: list[str]
    uses_default_boundaries: bool
    arrivals: FloatArray
    lengths: IntArray  # after truncation
    outcomes: IntArray  # OUTCOME_OK / OUTCOME_ERROR / OUTCOME_REJECTED
    lanes: IntArray  # lane each request was routed to; -1 if rejected before routing
    latencies: FloatArray  # seconds from arrival to answer (NaN unless answered OK)
    waits: FloatArray  # seconds from arrival to its batch's start (NaN unless it ran)
    execs: FloatArray  # its batch's execution seconds (NaN unless it ran)
    lane_stats: list[LaneTotals]  # per lane, what its batches ran
    peak_memory_bytes: float
    rejections: dict[str, int] = field(default_factory=dict)  # error code -> count
    events: int = 0  # distinct event instants processed (each ran `schedule()` once)
    adaptive: dict[str, Any] | None = None  # `adaptive`'s state at the end (as in /stats)
    # The online re-fit's record at the end (as in /stats), None when it was off. After a
    # re-fit `cfg`, `labels`, `lanes` and `lane_stats` are those of the final boundaries: each
    # request and batch counted in the final lane of its length (a batch: its padded length).
    refit: dict[str, Any] | None = None
    slo_s: float | None = None  # `adaptive`'s SLO (its lowest level), for goodput

    @property
    def padding_waste(self) -> float | None:
        """Token-weighted padding waste over all executed batches."""
        padded = sum(s.padded_tokens for s in self.lane_stats)
        real = sum(s.real_tokens for s in self.lane_stats)
        return 1.0 - real / padded if padded else None

    @property
    def mean_batch_size(self) -> float | None:
        """Mean rows per executed batch."""
        batches = sum(s.batches for s in self.lane_stats)
        return sum(s.requests for s in self.lane_stats) / batches if batches else None

    @property
    def busy_s(self) -> float:
        """Total execution seconds over all batches (summed over runner slots)."""
        return sum(s.exec_s for s in self.lane_stats)

    def summary(self) -> dict[str, Any]:
        """The shared run summary (`lenbatch.plan.summary.summarize` keys), per-bucket rows extended
        with rejected/errors, batch totals and the queue-wait vs execution split."""
        extra: list[dict[str, Any]] = []
        for i, s in enumerate(self.lane_stats):
            sel = self.lanes == i
            ran = sel & ~np.isnan(self.execs)
            extra.append(
                {
                    "rejected": int((sel & (self.outcomes == OUTCOME_REJECTED)).sum()),
                    "errors": int((sel & (self.outcomes == OUTCOME_ERROR)).sum()),
                    "batches": s.batches,
                    "mean_batch_size": s.mean_batch_size,
                    "padding_waste": s.padding_waste,
                    "exec_mean_ms": float(1000 * self.execs[ran].mean()) if ran.any() else None,
                }
            )
        return summarize(
            self.arrivals,
            self.lengths,
            self.outcomes,
            self.latencies,
            self.waits,
            buckets=self.lanes,
            bucket_labels=self.labels,
            padding_waste=self.padding_waste,
            mean_batch_size=self.mean_batch_size,
            peak_memory_mb=self.peak_memory_bytes / _MB,
            bucket_extra=extra,
        )


@dataclass
class ReplayLog:
    """What the event loop records as it goes, for `to_run` to turn into a `SimRun`."""

    outcomes: list[int]  # per request: OUTCOME_PENDING until refused or failed (OK at the end)
    request_lanes: list[int]  # per request: its lane at admission, -1 if refused before routing
    rejections: dict[str, int] = field(default_factory=dict)  # error code -> count
    # Five doubles per executed batch (lane, start, exec s, padded length, size), read back
    # as a numpy array without conversion; and each batch's requests.
    batches: array[float] = field(default_factory=lambda: array("d"))
    members: list[list[Request]] = field(default_factory=list)
    events: int = 0  # distinct event instants processed
    peak_active_bytes: float = 0.0  # activation memory at its peak, when several batches overlap

    @classmethod
    def empty(cls, n: int) -> ReplayLog:
        """The log of a run of `n` requests, none answered yet."""
        return cls([OUTCOME_PENDING] * n, [-1] * n)

    def reject(self, i: int, code: str) -> None:
        """Request `i` was refused (never queued, or shed) with error `code`."""
        self.outcomes[i] = OUTCOME_REJECTED
        self.rejections[code] = self.rejections.get(code, 0) + 1

    def to_run(
        self,
        lanes: Lanes,
        arrivals: FloatArray,
        lengths: IntArray,
        cost: CostModel,
        *,
        final_lane_of: Callable[[int], int] | None,
        memory_tracked: bool,
        adaptive: dict[str, Any] | None = None,
        slo_s: float | None = None,
        refit: dict[str, Any] | None = None,
    ) -> SimRun:
        """The run's result. `final_lane_of` (after a re-fit) maps a length to its lane under
        the final boundaries; `memory_tracked`: the peak activation memory was tracked as
        batches overlapped, else it is the largest single batch's."""
        cfg = lanes.cfg
        n = len(self.outcomes)
        # Members of executed batches all completed: a running request never expires.
        out = np.asarray(self.outcomes, dtype=np.int64)
        idx = np.fromiter(map(_handle, chain.from_iterable(self.members)), dtype=np.int64)
        if (out[idx] != OUTCOME_PENDING).any():
            raise RuntimeError("bug: a request ran in a batch after it was answered")
        out[idx] = OUTCOME_OK
        if (out == OUTCOME_PENDING).any():
            left = int((out == OUTCOME_PENDING).sum())
            raise RuntimeError(f"bug: {left} requests left unanswered")
        table = np.frombuffer(self.batches, dtype=np.float64).reshape(-1, 5)
        lanes_b = table[:, 0].astype(np.int64)
        b_exec = table[:, 2]
        pads = table[:, 3].astype(np.int64)
        lane_of_req = self.request_lanes
        if final_lane_of is not None:  # lane numbers changed meaning: count in the final lanes
            lanes_b = np.fromiter(map(final_lane_of, pads.tolist()), np.int64, len(pads))
            len_list = lengths.tolist()
            lane_of_req = [
                final_lane_of(len_list[j]) if v >= 0 else -1 for j, v in enumerate(lane_of_req)
            ]
        sizes = table[:, 4].astype(np.int64)
        peak_active = self.peak_active_bytes
        if not memory_tracked:  # one runner: the peak is the largest single batch
            shapes = np.unique(sizes * (cfg.max_length + 1) + pads)
            peak_active = max(
                (cost.activation_bytes(*divmod(int(v), cfg.max_length + 1)) for v in shapes),
                default=0.0,
            )
        which = np.repeat(np.arange(len(sizes)), sizes)  # batch of each member
        st = np.full(n, np.nan)
        ex = np.full(n, np.nan)
        st[idx] = table[:, 1][which]
        ex[idx] = b_exec[which]
        real_b = np.bincount(which, weights=lengths[idx], minlength=len(sizes))
        k = len(cfg.lanes)
        stats = [
            LaneTotals(int(bt), int(rw), int(re), int(pd), float(bs))
            for bt, rw, re, pd, bs in zip(
                np.bincount(lanes_b, minlength=k),
                np.bincount(lanes_b, weights=sizes, minlength=k),
                np.bincount(lanes_b, weights=real_b, minlength=k),
                np.bincount(lanes_b, weights=sizes * pads, minlength=k),
                np.bincount(lanes_b, weights=b_exec, minlength=k),
                strict=True,
            )
        ]
        return SimRun(
            strategy=cfg.strategy,
            cfg=cfg,
            labels=list(lanes.labels),
            uses_default_boundaries=lanes.default_boundaries and final_lane_of is None,
            arrivals=arrivals,
            lengths=lengths,
            outcomes=out,
            lanes=np.asarray(lane_of_req, dtype=np.int64),
            # A live server's per-request work outside the queue (0 unless calibrated).
            latencies=st + ex - arrivals + cost.request_overhead_s,
            waits=st - arrivals,
            execs=ex,
            lane_stats=stats,
            peak_memory_bytes=cost.weights_bytes + peak_active,
            rejections=self.rejections,
            events=self.events,
            adaptive=adaptive,
            slo_s=slo_s,
            refit=refit,
        )
