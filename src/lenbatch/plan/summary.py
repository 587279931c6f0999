"""One summary shape for simulated and live runs, so predictions and measurements compare
key for key.

`summarize()` takes per-request columns (arrival, length, outcome, latency, queue wait) plus
batch-level figures the caller knows (padding waste, mean batch size, peak memory) and returns
a dict with the keys `simulate --json` and `replay --json` both print:

`requests, completed, errors, rejected, error_rate, duration_s, throughput_rps,
real_tokens_per_s, p50_ms, p95_ms, p99_ms, queue_wait_p50_ms, queue_wait_p95_ms, padding_waste,
mean_batch_size, peak_memory_mb, per_bucket`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from lenbatch.core.totals import percentile

__all__ = ["OUTCOME_ERROR", "OUTCOME_OK", "OUTCOME_REJECTED", "SUMMARY_KEYS", "summarize"]

OUTCOME_OK = 0
OUTCOME_ERROR = 1  # admitted, then failed (model error, deadline, 5xx, transport error)
OUTCOME_REJECTED = 2  # refused at admission (429, 413, 503)

SUMMARY_KEYS = (
    "requests", "completed", "errors", "rejected", "error_rate", "duration_s", "throughput_rps",
    "real_tokens_per_s", "p50_ms", "p95_ms", "p99_ms", "queue_wait_p50_ms", "queue_wait_p95_ms",
    "padding_waste", "mean_batch_size", "peak_memory_mb", "per_bucket",
)  # fmt: skip


def _pct(ms: npt.NDArray[np.float64], q: float) -> float | None:
    return percentile(ms, q) if ms.size else None


def summarize(
    arrivals: Sequence[float] | npt.NDArray[np.float64],
    lengths: Sequence[int] | npt.NDArray[np.int64],
    outcomes: Sequence[int] | npt.NDArray[np.int64],
    latencies_s: Sequence[float] | npt.NDArray[np.float64],
    queue_waits_s: Sequence[float] | npt.NDArray[np.float64] | None = None,
    *,
    buckets: Sequence[int] | npt.NDArray[np.int64] | None = None,
    bucket_labels: Sequence[str] = (),
    padding_waste: float | None = None,
    mean_batch_size: float | None = None,
    peak_memory_mb: float | None = None,
    bucket_extra: Sequence[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Summary of one run. Latencies and waits are seconds (NaN where a request never ran);
    `duration_s` runs from the first arrival to the last completion."""
    arr = np.asarray(arrivals, dtype=np.float64)
    n_tok = np.asarray(lengths, dtype=np.int64)
    out = np.asarray(outcomes, dtype=np.int64)
    lat = np.asarray(latencies_s, dtype=np.float64)
    waits = None if queue_waits_s is None else np.asarray(queue_waits_s, dtype=np.float64)
    ok = out == OUTCOME_OK
    n = len(arr)
    done_at = arr[ok] + lat[ok]
    duration = float(done_at.max() - arr.min()) if ok.any() else 0.0
    completed = int(ok.sum())
    summary: dict[str, Any] = {
        "requests": n,
        "completed": completed,
        "errors": int((out == OUTCOME_ERROR).sum()),
        "rejected": int((out == OUTCOME_REJECTED).sum()),
        "error_rate": float((~ok).sum() / n) if n else 0.0,
        "duration_s": duration,
        "throughput_rps": completed / duration if duration > 0 else 0.0,
        "real_tokens_per_s": float(n_tok[ok].sum()) / duration if duration > 0 else 0.0,
        "p50_ms": _pct(1000 * lat[ok], 50),
        "p95_ms": _pct(1000 * lat[ok], 95),
        "p99_ms": _pct(1000 * lat[ok], 99),
        "queue_wait_p50_ms": None,
        "queue_wait_p95_ms": None,
        "padding_waste": padding_waste,
        "mean_batch_size": mean_batch_size,
        "peak_memory_mb": peak_memory_mb,
        "per_bucket": [],
    }
    if waits is not None:
        w = 1000 * waits[ok & ~np.isnan(waits)]
        summary["queue_wait_p50_ms"] = _pct(w, 50)
        summary["queue_wait_p95_ms"] = _pct(w, 95)
    if buckets is not None:
        b = np.asarray(buckets, dtype=np.int64)
        for i, label in enumerate(bucket_labels):
            sel = b == i
            sel_ok = sel & ok
            row: dict[str, Any] = {
                "bucket": label,
                "requests": int(sel.sum()),
                "completed": int(sel_ok.sum()),
                "p50_ms": _pct(1000 * lat[sel_ok], 50),
                "p95_ms": _pct(1000 * lat[sel_ok], 95),
                "p99_ms": _pct(1000 * lat[sel_ok], 99),
            }
            if waits is not None:
                w = 1000 * waits[sel_ok & ~np.isnan(waits)]
                row["queue_wait_p50_ms"] = _pct(w, 50)
                row["queue_wait_mean_ms"] = float(w.mean()) if w.size else None
            if bucket_extra is not None and i < len(bucket_extra):
                row.update(bucket_extra[i])
            summary["per_bucket"].append(row)
    return summary
