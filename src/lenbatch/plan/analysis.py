"""What a trace's traffic looks like: length percentiles, arrival rate, burstiness.

Percentiles are nearest-rank (`numpy.percentile(..., method="inverted_cdf")`), so every figure
is a length some request really had. Arrival figures count requests per one-second bin from the
first arrival: the mean rate, the peak bin, the peak over any sliding second, and the
burstiness `variance / mean` of the per-second counts (1 for Poisson arrivals, more when
requests come in bursts). For the server's own length log, queue wait and execution time are
summarised too, overall and per bucket.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from lenbatch.plan.trace import Trace

__all__ = [
    "PERCENTILES",
    "ArrivalStats",
    "LengthStats",
    "LogStats",
    "TraceSummary",
    "analyze",
    "arrival_stats",
    "format_summary",
    "length_stats",
    "plot_histogram",
]

PERCENTILES = (50, 75, 90, 95, 99)


@dataclass(frozen=True)
class LengthStats:
    """Token-length statistics; percentiles are observed values (nearest rank)."""

    count: int
    min: int
    max: int
    mean: float
    p50: int
    p75: int
    p90: int
    p95: int
    p99: int


@dataclass(frozen=True)
class ArrivalStats:
    """Arrival-process statistics over one-second bins from the first request."""

    duration_s: float
    mean_rate: float  # requests / duration
    peak_rate: int  # most requests in one bin
    peak_rate_sliding: int  # most requests in any one-second window
    burstiness: float  # variance / mean of per-second counts (whole seconds only)


@dataclass(frozen=True)
class LogStats:
    """What a length log adds: outcomes and timings (ms), overall and per bucket."""

    statuses: dict[str, int]
    queue_wait_ms: dict[str, float]  # p50, p95, p99, mean of requests that ran
    exec_ms: dict[str, float]
    per_bucket: list[dict[str, Any]]


@dataclass(frozen=True)
class TraceSummary:
    """Everything `lenbatch analyze` reports about one (mapped) trace."""

    source: str
    notes: tuple[str, ...]
    input: LengthStats
    output: LengthStats | None
    arrivals: ArrivalStats | None
    max_length: int | None = None
    at_limit: int = 0  # inputs of exactly max_length tokens (where clipped ones land)
    over_limit: int = 0  # inputs over max_length (kept to test rejection)
    log: LogStats | None = None

    def to_json(self) -> dict[str, Any]:
        """Flat summary keys (`count`, `p50`..`p99`, `max`, `mean_rate`, `peak_rate`, ...) plus
        nested `output`, `log` and the mapping `notes`. Rates are None without timestamps."""
        out: dict[str, Any] = {"source": self.source, "notes": list(self.notes)}
        out.update(asdict(self.input))
        arr = asdict(self.arrivals) if self.arrivals is not None else {}
        for key in ArrivalStats.__dataclass_fields__:
            out[key] = arr.get(key)
        out["output"] = None if self.output is None else asdict(self.output)
        if self.max_length is not None:
            out.update(max_length=self.max_length, at_limit=self.at_limit)
            out["over_limit"] = self.over_limit
        if self.log is not None:
            out["log"] = asdict(self.log)
        return out


def _pct(x: npt.NDArray[Any], q: float) -> float:
    return float(np.percentile(x, q, method="inverted_cdf"))


def length_stats(lengths: npt.ArrayLike) -> LengthStats:
    """Count, min, max, mean and nearest-rank p50/p75/p90/p95/p99 of `lengths`."""
    x = np.asarray(lengths, dtype=np.int64)
    if x.size == 0:
        raise ValueError("no lengths to summarise (the trace is empty after mapping)")
    p = {f"p{q}": int(_pct(x, q)) for q in PERCENTILES}
    return LengthStats(
        count=int(x.size), min=int(x.min()), max=int(x.max()), mean=float(x.mean()), **p
    )


def arrival_stats(arrivals: npt.ArrayLike) -> ArrivalStats | None:
    """Rate and burstiness of sorted arrival times in seconds (None if under two requests or
    all at one instant)."""
    t = np.asarray(arrivals, dtype=np.float64)
    if t.size < 2:
        return None
    t = t - t[0]
    duration = float(t[-1])
    if duration <= 0:
        return None
    per_second = np.bincount(np.floor(t).astype(np.int64))
    whole = per_second[: math.floor(duration)]  # the last, partial second would bias D
    if whole.size < 2:
        whole = per_second
    mean = float(whole.mean())
    # Most arrivals in [t_i, t_i + 1 s): a sliding window anchored at each request.
    sliding = int((np.searchsorted(t, t + 1.0, side="left") - np.arange(t.size)).max())
    return ArrivalStats(
        duration_s=duration,
        mean_rate=t.size / duration,
        peak_rate=int(per_second.max()),
        peak_rate_sliding=sliding,
        burstiness=float(whole.var() / mean) if mean > 0 else math.nan,
    )


def _timing(ms: npt.NDArray[np.float64]) -> dict[str, float]:
    ran = ms[~np.isnan(ms)]
    if ran.size == 0:
        return {}
    return {
        "p50": _pct(ran, 50),
        "p95": _pct(ran, 95),
        "p99": _pct(ran, 99),
        "mean": float(ran.mean()),
    }


def _log_stats(trace: Trace) -> LogStats | None:
    needed = ("status", "bucket", "queue_wait_ms", "exec_ms")
    if not all(k in trace.extra for k in needed):
        return None
    status, bucket = trace.extra["status"], trace.extra["bucket"]
    wait = trace.extra["queue_wait_ms"].astype(np.float64)
    exe = trace.extra["exec_ms"].astype(np.float64)
    names, counts = np.unique(status, return_counts=True)
    per_bucket = []
    # Order buckets by their shortest member, overlong last, as the server lists them.
    labels = sorted(np.unique(bucket), key=lambda b: int(trace.input_lengths[bucket == b].min()))
    for label in labels:
        sel = bucket == label
        per_bucket.append(
            {
                "bucket": str(label),
                "requests": int(sel.sum()),
                "share": float(sel.mean()),
                "queue_wait_ms": _timing(wait[sel]),
                "exec_ms": _timing(exe[sel]),
            }
        )
    return LogStats(
        statuses={str(n): int(c) for n, c in zip(names, counts, strict=True)},
        queue_wait_ms=_timing(wait),
        exec_ms=_timing(exe),
        per_bucket=per_bucket,
    )


def analyze(trace: Trace, max_length: int | None = None) -> TraceSummary:
    """Summarise a (mapped) trace. With `max_length`, also count inputs at and over it."""
    lengths = trace.input_lengths
    return TraceSummary(
        source=trace.source,
        notes=trace.notes,
        input=length_stats(lengths),
        output=None if trace.output_lengths is None else length_stats(trace.output_lengths),
        arrivals=None if trace.arrivals is None else arrival_stats(trace.arrivals),
        max_length=max_length,
        at_limit=0 if max_length is None else int((lengths == max_length).sum()),
        over_limit=0 if max_length is None else int((lengths > max_length).sum()),
        log=_log_stats(trace),
    )


def _stats_row(name: str, s: LengthStats) -> str:
    pcts = "  ".join(f"{getattr(s, f'p{q}'):>6}" for q in PERCENTILES)
    return f"{name:<14}{s.count:>8}{s.min:>7}{s.mean:>9.1f}  {pcts}{s.max:>8}"


def _timing_text(t: dict[str, float]) -> str:
    if not t:
        return "-"
    return f"p50 {t['p50']:.1f}  p95 {t['p95']:.1f}  p99 {t['p99']:.1f}  mean {t['mean']:.1f}"


def format_summary(s: TraceSummary) -> str:
    """The human-readable report `lenbatch analyze` prints."""
    lines = [f"trace: {s.source}"]
    lines += [f"mapping: {note}" for note in s.notes] or ["mapping: none (raw lengths and times)"]
    head = "  ".join(f"{'p' + str(q):>6}" for q in PERCENTILES)
    lines.append("")
    lines.append(f"{'tokens':<14}{'count':>8}{'min':>7}{'mean':>9}  {head}{'max':>8}")
    lines.append(_stats_row("input length", s.input))
    if s.output is not None:
        lines.append(_stats_row("output length", s.output))
    if s.max_length is not None:
        n = s.input.count
        lines.append(
            f"at the limit ({s.max_length} tokens): {s.at_limit} ({100 * s.at_limit / n:.2f}%)"
            + (f"; over it: {s.over_limit} ({100 * s.over_limit / n:.2f}%)" if s.over_limit else "")
        )
    lines.append("")
    a = s.arrivals
    if a is None:
        lines.append("arrivals: no timestamps in this trace")
    else:
        lines.append(
            f"arrivals: {a.duration_s:.1f} s, mean {a.mean_rate:.2f} req/s, peak {a.peak_rate} "
            f"req in one second ({a.peak_rate_sliding} in any sliding second), burstiness "
            f"(var/mean of per-second counts) {a.burstiness:.2f}"
        )
    if s.log is not None:
        lines.append("")
        statuses = ", ".join(f"{k} {v}" for k, v in sorted(s.log.statuses.items()))
        lines.append(f"length log: {statuses}")
        lines.append(f"  queue wait ms: {_timing_text(s.log.queue_wait_ms)}")
        lines.append(f"  exec ms:       {_timing_text(s.log.exec_ms)}")
        for row in s.log.per_bucket:
            lines.append(
                f"  bucket {row['bucket']:>18}: {row['requests']:>6} req "
                f"({100 * row['share']:5.1f}%), wait {_timing_text(row['queue_wait_ms'])}"
            )
    return "\n".join(lines)


def plot_histogram(trace: Trace, path: str | Path, *, log_x: bool = False, bins: int = 80) -> Path:
    """Write a PNG histogram of input lengths with the p50..p99 markers; returns the path."""
    from matplotlib.figure import Figure  # Agg canvas, no pyplot global state

    lengths = trace.input_lengths
    stats = length_stats(lengths)
    lo, hi = max(1, stats.min), max(stats.max, stats.min + 1)
    edges = np.geomspace(lo, hi + 1, bins + 1) if log_x else np.linspace(lo, hi + 1, bins + 1)
    # Lengths are integers: edges on half-integers, so no bin is empty for want of an integer.
    edges = np.unique(np.floor(edges)) - 0.5
    fig = Figure(figsize=(9, 4.5), layout="constrained")
    ax = fig.subplots()
    ax.hist(lengths, bins=edges.tolist(), color="#4c72b0", alpha=0.85)
    colors = ("#55a868", "#c4ad46", "#dd8452", "#c44e52", "#8172b3")
    for q, color in zip(PERCENTILES, colors, strict=True):
        value = getattr(stats, f"p{q}")
        ax.axvline(value, color=color, linestyle="--", linewidth=1.2, label=f"p{q} = {value}")
    if log_x:
        ax.set_xscale("log")
    ax.set_xlabel("input length (tokens)")
    ax.set_ylabel("requests")
    mapping = "; ".join(trace.notes) or "raw"
    ax.set_title(f"{Path(trace.source).name}: {stats.count} requests ({mapping})", fontsize=9)
    ax.legend(fontsize=8)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    return out
