"""Trace analysis: nearest-rank percentiles, arrival rate and burstiness, the length log, plots."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from lenbatch.plan.analysis import (
    analyze,
    arrival_stats,
    format_summary,
    length_stats,
    plot_histogram,
)
from lenbatch.plan.trace import Trace, load_trace, map_trace

FIX = Path(__file__).parent.parent / "fixtures"


def test_percentiles_are_nearest_rank() -> None:
    """p50..p99 equal numpy's nearest-rank percentiles (method='inverted_cdf')."""
    x = np.random.default_rng(0).integers(1, 5000, 1001)
    s = length_stats(x)
    for q in (50, 75, 90, 95, 99):
        assert getattr(s, f"p{q}") == np.percentile(x, q, method="inverted_cdf")
    assert (s.count, s.min, s.max) == (1001, x.min(), x.max())
    assert s.mean == pytest.approx(x.mean())


def test_small_sample_percentiles_are_observed_values() -> None:
    """On [1, 2, 3, 4] nearest rank gives p50 = 2 and p75 = 3 (no interpolation)."""
    s = length_stats([4, 1, 3, 2])
    assert (s.p50, s.p75, s.p99) == (2, 3, 4)


def test_arrival_counts() -> None:
    """Per-second counts [3, 1, 3] (whole seconds): mean rate, peak, burstiness var/mean."""
    t = [0.0, 0.1, 0.2, 1.5, 2.1, 2.2, 2.3, 3.9]
    a = arrival_stats(t)
    assert a is not None
    counts = np.array([3, 1, 3])
    assert a.duration_s == pytest.approx(3.9)
    assert a.mean_rate == pytest.approx(8 / 3.9)
    assert a.peak_rate == 3
    assert a.burstiness == pytest.approx(counts.var() / counts.mean())


def test_sliding_peak_sees_bursts_across_bins() -> None:
    """Five arrivals within 0.5 s that straddle a bin edge (bins start at the first arrival):
    binned peak 4, sliding peak 5."""
    a = arrival_stats([0.0, 0.7, 0.8, 0.9, 1.1, 1.2, 5.0])
    assert a is not None and (a.peak_rate, a.peak_rate_sliding) == (4, 5)


def test_no_arrivals() -> None:
    """Traces without timestamps have no arrival statistics; JSON rates are None."""
    s = analyze(load_trace(FIX / "sharegpt_head10.csv"))
    assert s.arrivals is None
    out = s.to_json()
    assert out["mean_rate"] is None and out["peak_rate"] is None and out["count"] == 10
    assert "no timestamps" in format_summary(s)


def test_limit_counts_and_notes() -> None:
    """With a limit, inputs at it are counted and the mapping notes are reported."""
    # halved: 187 198 440 46 46 190 656 194 121 104 197 197 -> five over 195
    t = map_trace(load_trace(FIX / "azure_conv_head12.csv"), length_scale=0.5, max_length=195)
    s = analyze(t, max_length=195)
    assert s.at_limit == 5 and s.over_limit == 0
    text = format_summary(s)
    assert "input lengths x0.5" in text and "clipped 5 inputs to 195 tokens" in text


def test_length_log_timings() -> None:
    """A length log adds statuses and per-bucket waits, ordered by bucket length."""
    s = analyze(load_trace(FIX / "lengthlog.jsonl"))
    assert s.log is not None
    assert s.log.statuses == {"ok": 3, "expired": 1}
    assert [b["bucket"] for b in s.log.per_bucket] == ["1-32", "33-64", "overlong(129-256)"]
    first = s.log.per_bucket[0]
    assert first["requests"] == 2 and first["queue_wait_ms"]["mean"] == pytest.approx(6.0)
    assert s.log.per_bucket[2]["queue_wait_ms"] == {}  # never ran
    assert s.log.queue_wait_ms["p50"] == 4.5  # nearest rank of [2, 4.5, 10]


@pytest.mark.parametrize("log_x", [False, True])
def test_plot_writes_png(tmp_path: Path, log_x: bool) -> None:
    """The histogram is a PNG file."""
    t = Trace(input_lengths=np.random.default_rng(1).integers(1, 300, 500))
    out = plot_histogram(t, tmp_path / "h.png", log_x=log_x)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_empty_trace_is_an_error() -> None:
    """Nothing left after mapping is reported, not summarised as zeros."""
    with pytest.raises(ValueError, match="empty"):
        analyze(Trace(input_lengths=np.array([], dtype=np.int64)))
