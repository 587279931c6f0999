"""The report generator on fixed data: tables, ratios, predictions and plots."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lenbatch.replay.driver import ReplayResult
from lenbatch.replay.records import RunRecord, ratio
from lenbatch.replay.report import write_report


def _summary(
    p50: float, p95: float, tok_s: float, waste: float | None, **kw: Any
) -> dict[str, Any]:
    s: dict[str, Any] = {
        "requests": 100, "completed": 98, "errors": 1, "rejected": 1, "error_rate": 0.02,
        "duration_s": 10.0, "throughput_rps": 9.8, "real_tokens_per_s": tok_s,
        "p50_ms": p50, "p95_ms": p95, "p99_ms": 2 * p95, "queue_wait_p50_ms": 3.0,
        "queue_wait_p95_ms": 9.0, "padding_waste": waste, "mean_batch_size": 4.0,
        "peak_memory_mb": 500.0, "per_bucket": [],
        "driver": {"clients": 16, "cpu_s": 1.5, "cpu_share": 0.15, "send_lateness_p50_ms": 0.4,
                   "send_lateness_p99_ms": 2.5, "send_lateness_max_ms": 7.0, "not_sent": 0},
    }  # fmt: skip
    s.update(kw)
    return s


def _result() -> ReplayResult:
    n = 50
    sched = np.linspace(0, 4.9, n)
    return ReplayResult(
        scheduled=sched, sent=sched + 0.001, done=sched + 0.05 + 0.01 * (np.arange(n) % 5),
        lengths=np.full(n, 30), status=np.full(n, 200), outcomes=np.zeros(n, dtype=np.int64),
        errors=[None] * n, first_token=np.full(n, np.nan),
        output_tokens=np.zeros(n, dtype=np.int64),
        token_gaps=np.zeros(0), wall_s=5.0, driver_cpu_s=0.5, clients=16,
    )  # fmt: skip


def _records() -> list[RunRecord]:
    lanes = [
        {"server_bucket": "1-16", "padding_waste": 0.05, "mean_exec_ms": 20.0},
        {"server_bucket": "17-32", "padding_waste": 0.10, "mean_exec_ms": 30.0},
    ]
    bucketed = _summary(
        40.0, 80.0, 1500.0, 0.07,
        server={"mean_exec_ms": 25.0, "lanes": lanes},
        per_bucket=[{"bucket": "1-16", "requests": 60, "p50_ms": 30.0, "p95_ms": 50.0,
                     "padding_waste": 0.05, "mean_batch_size": 5.0}],
    )  # fmt: skip
    fifo = _summary(
        50.0, 100.0, 1000.0, 0.4,
        server={"mean_exec_ms": 40.0, "lanes": [{"server_bucket": "all", "padding_waste": 0.4}]},
    )  # fmt: skip
    naive = _summary(30.0, 160.0, 750.0, None)
    return [
        RunRecord(
            "fifo",
            "strategy",
            1.0,
            fifo,
            _result(),
            {"p50_ms": 45.0, "p95_ms": 110.0, "throughput_rps": 9.8, "padding_waste": 0.38},
        ),
        RunRecord("bucketed", "strategy", 1.0, bucketed, _result()),
        RunRecord("naive", "peer", 1.0, naive, _result()),
    ]


def test_ratio_handles_missing_values() -> None:
    """Ratios need both numbers and a non-zero reference."""
    assert ratio(3, 2) == 1.5
    assert ratio(None, 2) is None and ratio(3, 0) is None


def test_report_tables_show_ratios_against_fifo_and_the_peer(tmp_path: Path) -> None:
    """Each row is divided by fifo's and by the naive peer's figures at the same rate."""
    path = write_report(tmp_path, _records(), {"command": "lenbatch bench x", "machine": "m"})
    text = path.read_text()
    rows: dict[str, str] = {}
    for line in text.split("## Results", 1)[1].splitlines():  # first table: the main one
        if line.startswith("| "):
            rows.setdefault(line.split("|")[1].strip(), line)
    cells = [c.strip() for c in rows["bucketed"].split("|")[1:-1]]
    # tok/s vs fifo, P95 vs fifo, tok/s vs naive, P95 vs naive
    assert cells[-4:] == ["1.50×", "0.80×", "2.00×", "0.50×"]
    assert cells[9] == "7.0 %"  # padding waste
    naive_cells = [c.strip() for c in rows["naive"].split("|")[1:-1]]
    assert naive_cells[9] == "–"  # a peer reports no padding waste
    assert "lenbatch bench x" in text and "Machine: m" in text


@pytest.mark.slow
def test_report_puts_predictions_beside_live_figures(tmp_path: Path) -> None:
    """Predicted P50/P95/throughput appear with the signed difference from live."""
    text = write_report(tmp_path, _records(), {}).read_text()
    line = next(x for x in text.splitlines() if x.startswith("| fifo | 45.0 / 50.0"))
    assert "| -10 % |" in line and "| +10 % |" in line  # P50 45 vs 50, P95 110 vs 100


@pytest.mark.slow
def test_report_without_predictions_says_why(tmp_path: Path) -> None:
    """With no prediction at all, the report prints the given note instead of a table."""
    records = [RunRecord(r.name, r.kind, r.rate, r.summary, r.result) for r in _records()]
    text = write_report(tmp_path, records, {"prediction_note": "no cost model"}).read_text()
    assert "no cost model" in text


@pytest.mark.slow
def test_plots_are_written_as_png(tmp_path: Path) -> None:
    """The four plots exist, are PNG files, and are linked from the report."""
    text = write_report(tmp_path, _records(), {}).read_text()
    for name in ("latency_cdf.png", "throughput.png", "waste_per_bucket.png", "queue_vs_exec.png"):
        data = (tmp_path / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"]({name})" in text


@pytest.mark.slow
def test_rate_sweep_adds_a_plot(tmp_path: Path) -> None:
    """With several rates, a P95-vs-throughput plot is added."""
    recs = _records()
    recs += [RunRecord(r.name, r.kind, 2.0, r.summary, r.result) for r in _records()]
    write_report(tmp_path, recs, {})
    assert (tmp_path / "rate_sweep.png").exists()


def test_headline_picks_the_highest_rate_within_the_bound_and_the_saturation_point(
    tmp_path: Path,
) -> None:
    """Per server over a sweep: highest rate with P95 <= 1 s and few failures, light-load P95
    (the lowest rate), the most real tokens/s at any rate, the largest RSS, and the ratio to
    the oracle where one is given."""
    from lenbatch.replay.tables import headline_rows

    def run(name: str, rate: float, p95: float, tok: float, err: float, rss: float) -> RunRecord:
        s = _summary(p95 / 2, p95, tok, None, error_rate=err, peak_memory_mb=rss,
                     offered_rps=10 * rate)  # fmt: skip
        return RunRecord(name, "strategy" if name == "fifo" else "peer", rate, s)

    records = [
        run("fifo", 0.5, 80.0, 500.0, 0.0, 400.0),
        run("fifo", 1.0, 900.0, 1000.0, 0.0, 450.0),
        run("fifo", 2.0, 4000.0, 1200.0, 0.10, 430.0),  # past the bound, but the most tok/s
        run("peer", 0.5, 1500.0, 300.0, 0.0, 900.0),  # never within the bound
        run("peer", 1.0, 800.0, 350.0, 0.05, 950.0),  # within P95 but too many failures
    ]
    oracle = {"fifo": {"real_tokens_per_s": 2400.0}}
    rows = {h["name"]: h for h in headline_rows(records, oracle)}
    fifo, peer = rows["fifo"], rows["peer"]
    assert (fifo["slo_rate"], fifo["slo_real_tokens_per_s"], fifo["slo_offered_rps"]) == (
        1.0, 1000.0, 10.0,
    )  # fmt: skip
    assert (fifo["light_p95_ms"], fifo["saturation_rate"]) == (80.0, 2.0)
    assert fifo["saturation_real_tokens_per_s"] == 1200.0 and fifo["peak_memory_mb"] == 450.0
    assert fifo["of_oracle"] == 0.5
    assert peer["slo_rate"] is None and peer["of_oracle"] is None
    text = write_report(tmp_path, records, {"oracle": oracle, "oracle_note": "Oracle: test"})
    md = text.read_text()
    head = md.split("## Headline", 1)[1].split("## Results", 1)[0]
    assert "| fifo | x1 (10.0 req/s) | 1,000 | 80.0 (x0.5) | 1,200 (x2, 10.0 % failed) |" in head
    assert "| 450 | 2,400 | 50.0 % |" in head
    assert "| peer | none in this sweep |" in head and "Oracle: test" in head
    assert "slower than this machine" not in head
    stale = {"fifo": {"real_tokens_per_s": 1000.0}}  # a strategy above its own bound
    md = write_report(tmp_path, records, {"oracle": stale}).read_text()
    assert "**The cost model is slower than this machine**: fifo served more" in md
