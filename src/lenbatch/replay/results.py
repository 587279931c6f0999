"""`ReplayResult`, the per-request columns of one live run, and its summary: the shared keys
(`summary.SUMMARY_KEYS`, as `simulate` prints) computed from those columns, plus what the server
says about its batches (`GET /stats`, counted over the run only) and what the driver says about
itself."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from lenbatch.plan.summary import OUTCOME_OK, summarize
from lenbatch.plan.trace import FloatArray, IntArray

__all__ = ["LLM_GOOD_ITL_S", "LLM_GOOD_TTFT_S", "ReplayResult", "summarize_replay"]

# What a streamed completion must meet to count in `llm_goodput`.
LLM_GOOD_TTFT_S = 1.0
LLM_GOOD_ITL_S = 0.150


@dataclass
class ReplayResult:
    """Per-request columns of one run (seconds from the run's start) and the driver's costs."""

    scheduled: FloatArray
    sent: FloatArray  # when the request's task started sending (NaN: never sent)
    done: FloatArray  # when the answer (or error) was complete
    lengths: IntArray
    status: IntArray  # HTTP status, 0 for no response
    outcomes: IntArray
    errors: list[str | None]
    first_token: FloatArray  # NaN unless streamed
    output_tokens: IntArray
    token_gaps: FloatArray  # all inter-chunk gaps (streamed completions)
    wall_s: float
    driver_cpu_s: float
    clients: int
    stats_before: dict[str, Any] | None = None
    stats_after: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def latencies(self) -> FloatArray:
        """End-to-end seconds from send to complete answer (NaN if not ok)."""
        lat = self.done - self.sent
        return np.where(self.outcomes == OUTCOME_OK, lat, np.nan)

    @property
    def lateness(self) -> FloatArray:
        """How late each send was against its schedule, seconds (sent requests only)."""
        ok = ~np.isnan(self.sent)
        return np.maximum(self.sent[ok] - self.scheduled[ok], 0.0)

    def to_json(self) -> dict[str, Any]:
        """JSON-ready columns (NaN becomes null)."""
        out: dict[str, Any] = {}
        for k, v in asdict(self).items():
            if isinstance(v, np.ndarray):
                out[k] = [None if isinstance(x, float) and math.isnan(x) else x for x in v.tolist()]
            else:
                out[k] = v
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ReplayResult:
        """Inverse of `to_json`."""
        floats = ("scheduled", "sent", "done", "first_token", "token_gaps")
        ints = ("lengths", "status", "outcomes", "output_tokens")
        kw = dict(data)
        for k in floats:
            kw[k] = np.asarray([np.nan if x is None else x for x in data[k]], dtype=np.float64)
        for k in ints:
            kw[k] = np.asarray(data[k], dtype=np.int64)
        return cls(**kw)


def _ms_pct(values: FloatArray, q: float) -> float | None:
    v = values[~np.isnan(values)]
    if v.size == 0:
        return None
    return float(1000 * np.percentile(v, q, method="inverted_cdf"))


def _stats_delta(
    before: dict[str, Any] | None, after: dict[str, Any] | None
) -> tuple[dict[str, Any], list[dict[str, Any]]] | None:
    """Batch figures of the run alone: counters after minus before (the server may have
    answered warm-up requests before the run)."""
    if after is None or "per_bucket" not in after:
        return None
    prev = {row["bucket"]: row for row in (before or {}).get("per_bucket", [])}
    lanes = []
    tot = {"batches": 0, "requests": 0, "real": 0, "padded": 0, "exec_s": 0.0}
    for row in after["per_bucket"]:
        p = prev.get(row["bucket"], {})
        batches = row.get("batches", 0) - p.get("batches", 0)
        reqs = row.get("requests", 0) - p.get("requests", 0)
        real = row.get("real_tokens", 0) - p.get("real_tokens", 0)
        padded = row.get("padded_tokens", 0) - p.get("padded_tokens", 0)
        exec_s = (
            row.get("mean_exec_ms", 0.0) * row.get("batches", 0)
            - p.get("mean_exec_ms", 0.0) * p.get("batches", 0)
        ) / 1000
        for k, v in (
            ("batches", batches),
            ("requests", reqs),
            ("real", real),
            ("padded", padded),
            ("exec_s", exec_s),
        ):
            tot[k] += v
        lanes.append(
            {
                "server_bucket": row["bucket"],
                "batches": batches,
                "padding_waste": 1 - real / padded if padded else None,
                "mean_batch_size": reqs / batches if batches else None,
                "mean_exec_ms": 1000 * exec_s / batches if batches else None,
                "server_queue_wait_p50_ms": row.get("queue_wait_p50_ms"),
                "server_queue_wait_p95_ms": row.get("queue_wait_p95_ms"),
            }
        )
    overall = {
        "padding_waste": 1 - tot["real"] / tot["padded"] if tot["padded"] else None,
        "mean_batch_size": tot["requests"] / tot["batches"] if tot["batches"] else None,
        "batches": tot["batches"],
        "real_tokens": tot["real"],
        "padded_tokens": tot["padded"],
        "mean_exec_ms": 1000 * tot["exec_s"] / tot["batches"] if tot["batches"] else None,
    }
    return overall, lanes


def summarize_replay(
    result: ReplayResult,
    *,
    boundaries: list[int] | tuple[int, ...] | None = None,
    max_length: int | None = None,
) -> dict[str, Any]:
    """The shared summary (`summary.SUMMARY_KEYS`, as `simulate` prints) of a live run, plus
    `server` (its strategy and batch figures from `/stats`), `driver` (CPU time, send
    lateness) and, for streamed completions, TTFT / inter-token / output-token figures.

    Per-bucket rows use `boundaries` if given, else the server's own buckets (from `/stats`);
    padding waste, batch size and execution time come from the server when its lanes are those
    buckets. Padding waste and batch size are counted over this run only.
    """
    from lenbatch.core.buckets import BucketSet

    after = result.stats_after
    delta = _stats_delta(result.stats_before, after)
    server_bounds = list(after.get("boundaries", [])) if after else None
    lengths = result.lengths
    top = int(max(lengths.max(initial=1), max_length or 1))
    bucket_idx = None
    labels: list[str] = []
    extra: list[dict[str, Any]] | None = None
    bounds = list(boundaries) if boundaries is not None else server_bounds
    if bounds:
        bucket_set = BucketSet(tuple(bounds), max(top, bounds[-1]))
        labels = bucket_set.labels()
        bucket_idx = np.searchsorted(np.asarray(bounds), lengths, side="left")
        if delta is not None and server_bounds == bounds and len(delta[1]) == len(labels):
            labels = [lane["server_bucket"] for lane in delta[1]]  # the server's own names
            extra = delta[1]
    elif bounds is not None and delta is not None:  # the server has one queue
        labels = [delta[1][0]["server_bucket"]] if delta[1] else ["all"]
        bucket_idx = np.zeros(len(lengths), dtype=np.int64)
        extra = delta[1][:1]
    arrivals = np.where(np.isnan(result.sent), result.scheduled, result.sent)
    summary = summarize(
        arrivals,
        lengths,
        result.outcomes,
        result.latencies,
        None,
        buckets=bucket_idx,
        bucket_labels=labels,
        padding_waste=None if delta is None else delta[0]["padding_waste"],
        mean_batch_size=None if delta is None else delta[0]["mean_batch_size"],
        peak_memory_mb=(after or {}).get("memory", {}).get("peak_rss_mb"),
        bucket_extra=extra,
    )
    if after is not None:
        summary["queue_wait_p50_ms"] = after.get("queue_wait_p50_ms")
        summary["queue_wait_p95_ms"] = after.get("queue_wait_p95_ms")
        summary["server"] = {
            "strategy": after.get("strategy"),
            "model": after.get("model"),
            "boundaries": server_bounds,
            "batches": None if delta is None else delta[0]["batches"],
            "real_tokens": None if delta is None else delta[0]["real_tokens"],
            "padded_tokens": None if delta is None else delta[0]["padded_tokens"],
            "mean_exec_ms": None if delta is None else delta[0]["mean_exec_ms"],
            "memory": after.get("memory"),
            "lanes": None if delta is None else delta[1],
        }
    late = result.lateness
    summary["driver"] = {
        "clients": result.clients,
        "wall_s": result.wall_s,
        "cpu_s": result.driver_cpu_s,
        "cpu_share": result.driver_cpu_s / result.wall_s if result.wall_s > 0 else None,
        "not_sent": int(np.isnan(result.sent).sum()),
        "send_lateness_p50_ms": _ms_pct(late, 50),
        "send_lateness_p99_ms": _ms_pct(late, 99),
        "send_lateness_max_ms": float(1000 * late.max()) if late.size else None,
    }
    errs: dict[str, int] = {}
    for e in result.errors:
        if e is not None:
            key = e.split(":")[0] if not e.startswith("HTTP") else e[:8]
            errs[key] = errs.get(key, 0) + 1
    summary["error_kinds"] = errs
    if not np.isnan(result.first_token).all():
        ok = result.outcomes == OUTCOME_OK
        ttft = np.where(ok, result.first_token - result.sent, np.nan)
        total_out = int(result.output_tokens[ok].sum())
        dur = summary["duration_s"]
        summary.update(
            ttft_p50_ms=_ms_pct(ttft, 50),
            ttft_p95_ms=_ms_pct(ttft, 95),
            ttft_p99_ms=_ms_pct(ttft, 99),
            itl_p50_ms=_ms_pct(result.token_gaps, 50),
            itl_p95_ms=_ms_pct(result.token_gaps, 95),
            output_tokens=total_out,
            output_tokens_per_s=total_out / dur if dur > 0 else 0.0,
        )
        # A generation server's goodput (the bar of strategy adaptive for causal LMs): answers
        # whose first token came within 1 s and whose later tokens came 150 ms apart on average.
        n_out = result.output_tokens
        gaps = np.where(
            n_out > 1, (result.done - result.first_token) / np.maximum(n_out - 1, 1), 0.0
        )
        good = int((ok & (ttft <= LLM_GOOD_TTFT_S) & (gaps <= LLM_GOOD_ITL_S)).sum())
        summary["llm_goodput"] = {
            "ttft_s": LLM_GOOD_TTFT_S,
            "mean_itl_s": LLM_GOOD_ITL_S,
            "good": good,
            "per_s": good / dur if dur > 0 else 0.0,
        }
    return summary
