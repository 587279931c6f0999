"""Profiling: the fitted cost model recovers a fake runner's known cost, NNLS is optimal, and
the memory probes measure what they claim."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import numpy as np
import pytest

from lenbatch.core.clock import FakeClock
from lenbatch.plan.costmodel import CostModel
from lenbatch.plan.profile import (
    RssMemoryProbe,
    bucket_max_batches,
    fit_cost_model,
    format_table,
    nnls,
    profile_runner,
)
from lenbatch.runners.fake import FakeRunner

T = TypeVar("T")

CONST, PER_ROW, PER_TOKEN, PER_TOKEN_SQ = 0.004, 2e-4, 3e-6, 2e-9
BATCHES, LENGTHS = (1, 2, 4, 8, 16), (8, 16, 32, 64, 128)


def _latency(b: int, n: int) -> float:
    return CONST + PER_ROW * b + PER_TOKEN * b * n + PER_TOKEN_SQ * b * n * n


class _KnownMemory:
    """A probe that reports a known activation size for the batch the runner last saw."""

    method = "test"

    def __init__(self, runner: FakeRunner) -> None:
        self.runner = runner

    def measure(self, call: Callable[[], T]) -> tuple[T, float]:
        result = call()
        seen = self.runner.batches[-1]
        bl = seen.size * seen.padded_len
        return result, 1e5 + 40.0 * bl + 0.5 * bl * seen.padded_len


def test_recovers_known_latency_coefficients() -> None:
    """On a fake runner charging a known cost to a fake clock, the fit returns that cost."""
    clock = FakeClock()
    runner = FakeRunner(max_length=128, cost=_latency, clock=clock)
    points = profile_runner(runner, BATCHES, LENGTHS, repeats=3, warmup=1, clock=clock)
    assert len(points) == 25
    assert all(p.latency_s == pytest.approx(_latency(p.batch, p.padded_len)) for p in points)
    cost = fit_cost_model(points)
    assert cost.const == pytest.approx(CONST, rel=1e-6)
    assert cost.per_row == pytest.approx(PER_ROW, rel=1e-6)
    assert cost.per_token == pytest.approx(PER_TOKEN, rel=1e-6)
    assert cost.per_token_sq == pytest.approx(PER_TOKEN_SQ, rel=1e-6)
    assert cost.fit_error < 1e-9


def test_recovers_known_memory_coefficients() -> None:
    """Activation memory reported per point is fitted back to its known coefficients."""
    clock = FakeClock()
    runner = FakeRunner(max_length=128, cost=_latency, clock=clock)
    points = profile_runner(
        runner, BATCHES, LENGTHS, repeats=1, warmup=0, clock=clock, probe=_KnownMemory(runner)
    )
    cost = fit_cost_model(points, weights_bytes=9e7, memory_method="test")
    assert (cost.act_const, cost.act_per_token, cost.act_per_token_sq) == pytest.approx(
        (1e5, 40.0, 0.5), rel=1e-6
    )
    assert cost.memory(4, 64) == pytest.approx(9e7 + 1e5 + 40 * 256 + 0.5 * 256 * 64)


def test_runs_every_point_with_full_rows() -> None:
    """Each point runs warm-up + repeats + one memory call on B rows of exactly L tokens."""
    runner = FakeRunner(max_length=64)
    profile_runner(runner, (1, 3), (5, 64), repeats=2, warmup=1)
    shapes = [(b.size, b.padded_len) for b in runner.batches]
    assert sorted(set(shapes)) == [(1, 5), (1, 64), (3, 5), (3, 64)]
    assert all(shapes.count(s) == 4 for s in set(shapes))
    assert all(set(b.lengths) == {b.padded_len} for b in runner.batches)


def test_median_of_repeats() -> None:
    """The kept latency is the median of the timed runs, with the spread alongside."""
    clock = FakeClock()
    charges = iter([0.5, 0.1, 0.3, 0.2])  # warm-up (not timed), then three timed runs

    def cost(b: int, n: int) -> float:
        return next(charges, 0.0)

    runner = FakeRunner(max_length=8, cost=cost, clock=clock)
    (p,) = profile_runner(runner, (1,), (8,), repeats=3, warmup=1, clock=clock)
    assert (p.latency_s, p.latency_min_s, p.latency_max_s) == pytest.approx((0.2, 0.1, 0.3))


def test_rejects_lengths_over_the_limit() -> None:
    """A padded length the model cannot take is refused up front, naming the limit."""
    with pytest.raises(ValueError, match="limit of 64"):
        profile_runner(FakeRunner(max_length=64), (1,), (128,))


def test_nnls_meets_kkt_conditions() -> None:
    """NNLS result is feasible and optimal: zero gradient on used columns, non-negative
    gradient on the ones held at zero (checked on problems where plain LS goes negative)."""
    rng = np.random.default_rng(0)
    for _ in range(20):
        a = rng.normal(size=(30, 4))
        y = a @ np.array([1.0, -2.0, 0.5, 0.0]) + rng.normal(scale=0.1, size=30)
        x = nnls(a, y)
        grad = a.T @ (a @ x - y)
        assert (x >= 0).all()
        assert np.allclose(grad[x > 0], 0, atol=1e-8)
        assert (grad[x == 0] >= -1e-8).all()


def test_rss_probe_sees_an_allocation() -> None:
    """A 64 MiB array alive when the call returns is counted by the RSS probe."""
    probe = RssMemoryProbe()
    arr, peak = probe.measure(lambda: np.ones(64 * 2**20 // 8))
    assert arr.nbytes == 64 * 2**20
    assert peak >= 0.9 * 64 * 2**20


def test_bucket_max_batches_under_budget() -> None:
    """Per-bucket max batch: the largest B whose predicted memory fits the budget."""
    cost = CostModel(const=0.0, weights_bytes=1000.0, act_per_token=10.0)
    # memory(B, L) = 1000 + 10*B*L; budget 5000 -> B*L <= 400
    assert bucket_max_batches(cost, (16, 100, 400, 401), 5000.0) == [25, 4, 1, 0]


def test_table_lists_points_and_fit() -> None:
    """The printed table has one row per point and the fitted formula with its error."""
    clock = FakeClock()
    runner = FakeRunner(max_length=128, cost=_latency, clock=clock)
    points = profile_runner(runner, BATCHES, LENGTHS, repeats=1, warmup=0, clock=clock)
    text = format_table(fit_cost_model(points))
    assert len([line for line in text.splitlines() if line.strip()[:1].isdigit()]) == 25
    assert "relative RMS error 0.0%" in text
