"""The benchmark report's PNG plots from replayed runs: latency CDF, throughput over time,
padding waste per bucket, queue wait against execution and, with several rates, P95 against
throughput (matplotlib, headless)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from lenbatch.plan.summary import OUTCOME_OK
from lenbatch.replay.records import RunRecord

__all__ = ["write_plots"]


def _ok_latencies_ms(r: RunRecord) -> np.ndarray[Any, Any]:
    assert r.result is not None
    lat = r.result.latencies
    return np.sort(1000 * lat[~np.isnan(lat)])


def write_plots(records: Sequence[RunRecord], out_dir: Path) -> list[str]:
    """Latency CDF, throughput over time, padding waste per bucket, queue wait vs execution
    and, with several rates, P95 against throughput. Returns the file names written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written: list[str] = []
    # The most loaded point: where the strategies differ (at light load they all look alike).
    base = [r for r in records if r.rate == max(x.rate for x in records)] if records else []
    with_cols = [r for r in base if r.result is not None]

    def save(fig: Any, name: str) -> None:
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=100)
        plt.close(fig)
        written.append(name)

    if with_cols:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for r in with_cols:
            ms = _ok_latencies_ms(r)
            assert r.result is not None
            total = len(r.result.outcomes)  # failed requests never complete: the curve
            if ms.size:  # tops out at the fraction answered
                ax.step(ms, np.arange(1, ms.size + 1) / total, where="post", label=r.label)
        ax.set(xscale="log", xlabel="latency (ms, log)", ylabel="fraction of all requests")
        ax.set_title("Latency CDF (failed requests never reach the top)")
        ax.grid(alpha=0.3)
        ax.legend()
        save(fig, "latency_cdf.png")

        fig, ax = plt.subplots(figsize=(7, 4.5))
        for r in with_cols:
            assert r.result is not None
            t, rate = _sliding_rate(r.result.done[r.result.outcomes == OUTCOME_OK])
            ax.plot(t, rate, label=r.label)
        first = with_cols[0].result
        assert first is not None
        t, rate = _sliding_rate(first.scheduled)
        ax.plot(t, rate, "k--", lw=1, label="offered")
        ax.set(xlabel="time (s)", ylabel=f"requests per second ({_WINDOW_S:g} s window)")
        ax.set_title("Throughput over time (completed vs offered)")
        ax.grid(alpha=0.3)
        ax.legend()
        save(fig, "throughput.png")

    wasted = [r for r in base if any(b.get("padding_waste") is not None for b in _rows(r))]
    if wasted:
        fig, ax = plt.subplots(figsize=(8, 4.5))
        labels: list[str] = []
        for r in wasted:
            for b in _rows(r):
                if b["bucket"] not in labels:
                    labels.append(b["bucket"])
        width = 0.8 / len(wasted)
        for k, r in enumerate(wasted):
            vals = {b["bucket"]: b.get("padding_waste") for b in _rows(r)}
            xs = [i + k * width for i, lab in enumerate(labels) if vals.get(lab) is not None]
            ys = [100 * float(vals[lab]) for lab in labels if vals.get(lab) is not None]  # type: ignore[arg-type]
            ax.bar(xs, ys, width=width, label=r.label)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(labels))], labels, rotation=30)
        ax.set(ylabel="padding waste (%)", title="Padding waste per bucket (server lanes)")
        ax.legend()
        save(fig, "waste_per_bucket.png")

    timed = [r for r in base if (r.summary.get("server") or {}).get("mean_exec_ms") is not None]
    if timed:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        pos = np.arange(len(timed), dtype=np.float64)
        waits = [r.summary.get("queue_wait_p50_ms") or 0.0 for r in timed]
        waits95 = [r.summary.get("queue_wait_p95_ms") or 0.0 for r in timed]
        execs = [r.summary["server"]["mean_exec_ms"] for r in timed]
        ax.bar(pos - 0.27, waits, 0.27, label="queue wait P50")
        ax.bar(pos, waits95, 0.27, label="queue wait P95")
        ax.bar(pos + 0.27, execs, 0.27, label="execution per batch (mean)")
        ax.set_xticks(pos, [r.label for r in timed])
        ax.set(ylabel="ms", title="Queue wait vs execution (server side)")
        ax.legend()
        save(fig, "queue_vs_exec.png")

    if len({r.rate for r in records}) > 1:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for name in dict.fromkeys(r.name for r in records):
            pts = sorted((r.rate, r.summary) for r in records if r.name == name)
            ax.plot(
                [s["real_tokens_per_s"] for _, s in pts],
                [s["p95_ms"] or np.nan for _, s in pts],
                marker="o",
                label=name,
            )
        ax.set(xlabel="real tokens/s served", ylabel="P95 latency (ms)", yscale="log")
        ax.set_title("Rate sweep: P95 vs throughput")
        ax.grid(alpha=0.3)
        ax.legend()
        save(fig, "rate_sweep.png")
    return written


_WINDOW_S = 5.0


def _sliding_rate(times: np.ndarray[Any, Any]) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """Events per second over a trailing window, on a 0.5 s grid (batches make 1 s bins spiky)."""
    if times.size == 0:
        return np.zeros(0), np.zeros(0)
    ts = np.sort(times)
    grid = np.arange(0.0, float(ts[-1]) + 0.5, 0.5)
    counts = np.searchsorted(ts, grid, side="right") - np.searchsorted(
        ts, grid - _WINDOW_S, side="right"
    )
    return grid, counts / _WINDOW_S


def _rows(r: RunRecord) -> list[dict[str, Any]]:
    """The server's own lanes (with their padding waste), as `bucket` rows."""
    lanes = (r.summary.get("server") or {}).get("lanes") or []
    return [{**lane, "bucket": lane["server_bucket"]} for lane in lanes]
