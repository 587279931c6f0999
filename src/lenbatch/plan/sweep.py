"""Rate sweep and capacity: how much load each strategy sustains within a latency SLO.

The trace is replayed (simulated) at increasing rate scales. A point is *sustainable* when
every check holds:

* P95 latency of completed requests is at most the SLO;
* at least `min_completed` (99 %) of the offered requests completed (no rejections or
  expiries beyond that);
* the server keeps up: after the last arrival it finishes within twice the SLO or 5 % of the
  trace's span, whichever is longer; a queue that grew without bound is still draining then.

The *capacity* of a strategy is the highest throughput among its sustainable points; after the
grid, the gap between the best sustainable rate and the next higher grid rate is bisected a few
times to tighten it. Every sweep is reported beside the offline oracle (`lenbatch.plan.oracle`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lenbatch.config import AdmissionConfig, BatchingConfig, Strategy
from lenbatch.plan.costmodel import CostModel
from lenbatch.plan.oracle import Oracle, oracle_for
from lenbatch.plan.sim import SimRun, simulate
from lenbatch.plan.trace import Trace, map_trace

__all__ = [
    "Probe",
    "StrategySweep",
    "SweepPoint",
    "SweepResult",
    "default_rates",
    "judge",
    "offered_rps",
    "plot_sweep",
    "sweep",
]

MIN_COMPLETED = 0.99
MAX_DRAIN = 0.05


@dataclass(frozen=True)
class SweepPoint:
    """One simulated run at one rate scale."""

    rate_scale: float
    offered_rps: float
    summary: dict[str, Any]
    sustainable: bool
    reason: str  # why it is not sustainable ("" when it is)

    @property
    def throughput_rps(self) -> float:
        """Completed requests per second."""
        return float(self.summary["throughput_rps"])


@dataclass
class StrategySweep:
    """All points of one strategy, ordered by rate."""

    strategy: str
    points: list[SweepPoint] = field(default_factory=list)

    @property
    def capacity(self) -> SweepPoint | None:
        """The sustainable point with the highest throughput (None if there is none)."""
        ok = [p for p in self.points if p.sustainable]
        return max(ok, key=lambda p: p.throughput_rps) if ok else None


@dataclass
class SweepResult:
    """A sweep of several strategies over one trace, cost model and SLO."""

    slo_p95_ms: float
    base_rps: float  # offered rate of the trace at rate scale 1
    oracle: Oracle
    strategies: list[StrategySweep]

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict: oracle, and per strategy its capacity and every point."""
        o = self.oracle
        return {
            "slo_p95_ms": self.slo_p95_ms,
            "base_rps": self.base_rps,
            "oracle": {
                "throughput_rps": o.throughput_rps,
                "real_tokens_per_s": o.real_tokens_per_s,
                "padding_waste": o.padding_waste,
                "mean_batch_size": o.mean_batch_size,
                "batches": o.batches,
            },
            "strategies": [
                {
                    "strategy": s.strategy,
                    "capacity_rps": None if s.capacity is None else s.capacity.throughput_rps,
                    "capacity_rate_scale": None if s.capacity is None else s.capacity.rate_scale,
                    "fraction_of_oracle": None
                    if s.capacity is None or o.throughput_rps == 0
                    else s.capacity.throughput_rps / o.throughput_rps,
                    "points": [
                        {
                            "rate_scale": p.rate_scale,
                            "offered_rps": p.offered_rps,
                            "sustainable": p.sustainable,
                            "reason": p.reason,
                            "summary": p.summary,
                        }
                        for p in s.points
                    ],
                }
                for s in self.strategies
            ],
        }


def offered_rps(trace: Trace) -> float:
    """Requests per second the trace offers (count over the span of its arrivals)."""
    if trace.duration <= 0:
        raise ValueError("the trace needs at least two distinct arrival times to set a rate")
    return len(trace) / trace.duration


def judge(
    summary: dict[str, Any],
    offered: float,
    slo_p95_ms: float,
    *,
    min_completed: float = MIN_COMPLETED,
    max_drain: float = MAX_DRAIN,
) -> tuple[bool, str]:
    """(sustainable?, reason if not) for one run's summary at `offered` requests per second."""
    n = summary["requests"]
    done = summary["completed"]
    if n == 0:
        return False, "no requests"
    if done < min_completed * n:
        return False, f"completed {done / n:.1%} of offered"
    p95 = summary["p95_ms"]
    if p95 is None or p95 > slo_p95_ms:
        return False, f"P95 {p95:.0f} ms > SLO {slo_p95_ms:g} ms"
    # A server that keeps up answers the last arrivals within about their latency; one whose
    # queue grew is still draining long after the trace ended.
    span = n / offered
    drain = summary["duration_s"] - span
    if drain > max(2 * slo_p95_ms / 1000, max_drain * span):
        return False, f"falls behind: still serving {drain:.1f} s after the last arrival"
    return True, ""


def default_rates(base_rps: float, oracle_rps: float) -> list[float]:
    """Rate scales whose offered load runs from 5 % to 110 % of the oracle's throughput."""
    fractions = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.1)
    return [f * oracle_rps / base_rps for f in fractions]


Progress = Callable[[str, SweepPoint], None]


@dataclass(frozen=True)
class Probe:
    """Runs one batching config on the trace at one rate scale and judges the result."""

    trace: Trace
    cost: CostModel
    admission: AdmissionConfig | None
    slo_p95_ms: float
    max_length: int = 256
    truncate: bool = False
    seed: int = 0  # of the draws from the cost model's batch spread

    @property
    def base_rps(self) -> float:
        """The trace's offered rate at scale 1."""
        return offered_rps(self.trace)

    def __call__(self, batching: BatchingConfig, scale: float) -> SweepPoint:
        """Simulate at `scale` x the trace's rate; the point and its verdict."""
        t = map_trace(self.trace, rate_scale=scale) if scale != 1.0 else self.trace
        run: SimRun = simulate(
            t, self.cost, batching, self.admission, max_length=self.max_length,
            truncate=self.truncate, seed=self.seed,
        )  # fmt: skip
        summ = run.summary()
        offered = self.base_rps * scale
        ok, why = judge(summ, offered, self.slo_p95_ms)
        return SweepPoint(scale, offered, summ, ok, why)


def sweep(
    trace: Trace,
    cost: CostModel,
    batching: BatchingConfig,
    admission: AdmissionConfig | None = None,
    *,
    strategies: Sequence[Strategy],
    slo_p95_ms: float,
    rates: Sequence[float] | None = None,
    refine: int = 4,
    max_length: int = 256,
    truncate: bool = False,
    progress: Progress | None = None,
    seed: int = 0,
) -> SweepResult:
    """Simulate `trace` at each rate scale (default: `default_rates`) for each strategy, then
    bisect `refine` times below the first unsustainable rate above the best sustainable one
    (`seed`: of the draws from the cost model's batch spread, `plan.sim.simulate`)."""
    if slo_p95_ms <= 0:
        raise ValueError(f"the SLO must be positive, got {slo_p95_ms} ms")
    probe = Probe(trace, cost, admission, slo_p95_ms, max_length, truncate, seed)
    base = probe.base_rps
    orc = oracle_for(trace.input_lengths, cost, batching, max_length=max_length, truncate=truncate)
    grid = sorted(rates) if rates else default_rates(base, orc.throughput_rps)
    if any(r <= 0 for r in grid):
        raise ValueError(f"rate scales must be positive, got {list(grid)}")
    out = []
    for strategy in strategies:
        cfg = batching.model_copy(update={"strategy": strategy})
        ss = StrategySweep(strategy.value)

        def run(scale: float, s: StrategySweep = ss, c: BatchingConfig = cfg) -> SweepPoint:
            p = probe(c, scale)
            s.points.append(p)
            if progress is not None:
                progress(s.strategy, p)
            return p

        for scale in grid:
            run(scale)
        best = ss.capacity
        lo = best.rate_scale if best is not None else None
        above = [p.rate_scale for p in ss.points if lo is not None and p.rate_scale > lo]
        hi = min((r for r in above if not _at(ss, r).sustainable), default=None)
        for _ in range(refine if lo is not None and hi is not None else 0):
            assert lo is not None and hi is not None
            mid = math.sqrt(lo * hi)
            if run(mid).sustainable:
                lo = mid
            else:
                hi = mid
        ss.points.sort(key=lambda p: p.rate_scale)
        out.append(ss)
    return SweepResult(slo_p95_ms, base, orc, out)


def _at(ss: StrategySweep, scale: float) -> SweepPoint:
    return next(p for p in ss.points if p.rate_scale == scale)


def plot_sweep(result: SweepResult, path: str | Path, title: str = "") -> None:
    """Write a PNG of P95 latency against offered load per strategy, with the SLO, the oracle
    and each strategy's capacity marked (P95 above 30x the SLO runs off the top)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for s in result.strategies:
        pts = [p for p in s.points if p.summary["p95_ms"] is not None]
        (line,) = ax.plot(
            [p.offered_rps for p in pts],
            [p.summary["p95_ms"] for p in pts],
            marker="o",
            markersize=3,
            label=s.strategy,
        )
        bad = [p for p in pts if not p.sustainable]
        ax.scatter(
            [p.offered_rps for p in bad],
            [p.summary["p95_ms"] for p in bad],
            marker="x",
            color=line.get_color(),
            s=25,
        )
        cap = s.capacity
        if cap is not None:
            ax.scatter(
                [cap.offered_rps],
                [cap.summary["p95_ms"]],
                marker="*",
                s=150,
                color=line.get_color(),
                zorder=5,
            )
    ax.axhline(result.slo_p95_ms, color="grey", linestyle="--", label="P95 SLO")
    ax.axvline(result.oracle.throughput_rps, color="black", linestyle=":", label="oracle")
    ax.set_yscale("log")
    top = max((p.summary["p95_ms"] or 0 for s in result.strategies for p in s.points), default=0)
    if top > 30 * result.slo_p95_ms:  # overload runs off to hours; keep the SLO region legible
        ax.set_ylim(top=30 * result.slo_p95_ms)
    ax.set_xlabel("offered load (requests/s)")
    ax.set_ylabel("P95 latency (ms)")
    ax.set_title(title or "P95 vs offered load (x: not sustainable, *: capacity)")
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
