"""Rate sweep: sustainability verdicts, capacity, and the plot."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from lenbatch.config import BatchingConfig, Strategy
from lenbatch.plan.costmodel import CostModel
from lenbatch.plan.sweep import default_rates, judge, offered_rps, plot_sweep, sweep
from lenbatch.plan.trace import Trace

COST = CostModel(const=0.004, per_token=2e-5)


def summary(**kw: object) -> dict[str, object]:
    base: dict[str, object] = {
        "requests": 100, "completed": 100, "p95_ms": 50.0, "duration_s": 10.1,
    }  # fmt: skip
    return {**base, **kw}


@pytest.mark.parametrize(
    ("changes", "ok", "why"),
    [
        ({}, True, ""),
        ({"p95_ms": 120.0}, False, "P95 120 ms > SLO 100 ms"),
        ({"completed": 98}, False, "completed 98.0% of offered"),
        ({"duration_s": 10.2}, True, ""),  # drained within 2 x SLO after the last arrival
        ({"duration_s": 10.6}, False, "falls behind: still serving 0.6 s"),
        ({"completed": 0, "p95_ms": None}, False, "completed 0.0%"),
    ],
)
def test_judge(changes: dict[str, object], ok: bool, why: str) -> None:
    """Sustainable needs P95 within the SLO, 99 % completed, and no backlog left to drain
    after the last arrival (100 requests at 10/s span 10 s; 2 x SLO = 0.2 s)."""
    verdict, reason = judge(summary(**changes), offered=10.0, slo_p95_ms=100.0)
    assert verdict is ok
    assert reason.startswith(why)


def poisson_trace(n: int = 1500, rate: float = 20.0) -> Trace:
    rng = np.random.default_rng(5)
    arrivals = np.cumsum(rng.exponential(1 / rate, n))
    lengths = np.clip(rng.lognormal(3.2, 0.9, n).astype(np.int64), 1, 256)
    return Trace(lengths, arrivals - arrivals[0], source="synthetic")


def test_sweep_finds_a_capacity_below_the_oracle_and_where_it_breaks(tmp_path: Path) -> None:
    """Each strategy sustains its capacity point, fails just above it, stays under the oracle;
    the plot is written."""
    t = poisson_trace(800)
    res = sweep(
        t, COST, BatchingConfig(), strategies=[Strategy.FIFO, Strategy.BUCKETED],
        slo_p95_ms=150.0, rates=[1, 4, 16, 32, 64], refine=3,
    )  # fmt: skip
    assert res.base_rps == pytest.approx(offered_rps(t))
    for s in res.strategies:
        cap = s.capacity
        assert cap is not None and cap.sustainable
        assert cap.throughput_rps <= res.oracle.throughput_rps
        assert cap.summary["p95_ms"] <= 150.0
        higher = [p for p in s.points if p.rate_scale > cap.rate_scale]
        assert higher and not higher[0].sustainable
        assert [p.rate_scale for p in s.points] == sorted(p.rate_scale for p in s.points)
    out = tmp_path / "sweep.png"
    plot_sweep(res, out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    js = res.to_json()
    assert [s["strategy"] for s in js["strategies"]] == ["fifo", "bucketed"]


def test_default_rates_span_the_oracle() -> None:
    """Without --rates, offered load runs from 5 % to 110 % of the oracle's throughput."""
    rates = default_rates(base_rps=10.0, oracle_rps=200.0)
    assert rates[0] == pytest.approx(1.0)
    assert rates[-1] == pytest.approx(22.0)
    assert rates == sorted(rates)


def test_sweep_with_an_impossible_slo_has_no_capacity() -> None:
    """An SLO below the fastest single batch cannot be met at any rate."""
    res = sweep(poisson_trace(300), COST, BatchingConfig(), strategies=[Strategy.FIFO],
                slo_p95_ms=1.0, rates=[0.5, 1.0])  # fmt: skip
    assert res.strategies[0].capacity is None
    assert all(not p.sustainable for p in res.strategies[0].points)


def test_sweep_rejects_bad_input() -> None:
    """Clear errors for a non-positive SLO or rate."""
    with pytest.raises(ValueError, match="SLO"):
        sweep(poisson_trace(50), COST, BatchingConfig(), strategies=[Strategy.FIFO], slo_p95_ms=0)
    with pytest.raises(ValueError, match="rate scales"):
        sweep(poisson_trace(50), COST, BatchingConfig(), strategies=[Strategy.FIFO],
              slo_p95_ms=10, rates=[0.0, 1.0])  # fmt: skip
