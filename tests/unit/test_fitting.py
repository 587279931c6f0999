"""Boundary fitting: known answers, brute-force optimality of the DPs, and the cost model's
pieces checked against Monte Carlo simulation."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from lenbatch.plan.costmodel import CostModel
from lenbatch.plan.fitting import (
    FitMethod,
    expected_padding_waste,
    fit_boundaries,
    score_boundaries,
)


def _modes(rng: np.random.Generator) -> np.ndarray:
    """Three well-separated modes: 10-20 (50%), 100-120 (30%), 200-210 (20%)."""
    return np.concatenate(
        [rng.integers(10, 21, 500), rng.integers(100, 121, 300), rng.integers(200, 211, 200)]
    )


@pytest.mark.parametrize("method", [FitMethod.KMEANS, FitMethod.OPTIMAL])
def test_separated_modes_split_between_them(method: FitMethod) -> None:
    """Three separated modes and K=3: each boundary is the top of a mode."""
    lengths = _modes(np.random.default_rng(1))
    r = fit_boundaries(lengths, method, 3, 210, max_overlong_share=0.0)
    assert r.boundaries == (20, 120, 210)
    assert r.shares == pytest.approx((0.5, 0.3, 0.2, 0.0))


def test_quantile_equal_mass() -> None:
    """Uniform 1..100 in 4 buckets: cuts at the quartiles 25, 50, 75, 100."""
    r = fit_boundaries(np.arange(1, 101), "quantile", 4, 128)
    assert r.boundaries == (25, 50, 75, 100)
    assert r.shares == pytest.approx((0.25, 0.25, 0.25, 0.25, 0.0))


def test_quantile_merges_coinciding_cuts() -> None:
    """A length repeated over several quantiles gives one boundary, and the reasoning says so."""
    lengths = np.array([5] * 90 + list(range(6, 16)))
    r = fit_boundaries(lengths, "quantile", 4, 16)
    assert r.boundaries == (5, 15)
    assert any("coincided" in line for line in r.reasoning)


def _sse(values: np.ndarray, bounds: tuple[int, ...]) -> float:
    lane = np.searchsorted(np.asarray(bounds), values)
    return float(
        sum(((values[lane == i] - values[lane == i].mean()) ** 2).sum() for i in set(lane))
    )


@pytest.mark.parametrize("seed", range(5))
def test_kmeans_is_exact(seed: int) -> None:
    """The k-means DP reaches the minimal within-bucket squared error of any partition."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 60, 40)
    vals = np.unique(lengths)
    for k in (2, 3):
        r = fit_boundaries(lengths, "kmeans", k, 64)
        best = min(
            _sse(lengths, (*cut, int(vals[-1])))
            for cut in itertools.combinations(vals[:-1].tolist(), k - 1)
        )
        assert _sse(lengths, r.boundaries) == pytest.approx(best, rel=1e-9)


@pytest.mark.parametrize(("seed", "rate"), [(0, None), (1, 200.0), (2, 3000.0), (3, 40.0)])
def test_optimal_is_exact(seed: int, rate: float | None) -> None:
    """The optimal DP's partition scores the minimum over every partition with at most K
    buckets (overlong lane empty or within its share), scored independently by
    score_boundaries."""
    rng = np.random.default_rng(seed)
    support = np.array([2, 5, 9, 14, 20, 27, 33, 41, 50, 62, 75, 150, 170, 199])
    weights = np.array([8, 6, 9, 7, 5, 6, 4, 5, 3, 4, 2, 1, 1, 1], dtype=float)
    lengths = rng.choice(support, size=80, p=weights / weights.sum())
    vals = np.unique(lengths).tolist()
    kw = {"rate": rate, "max_wait_s": 0.02, "max_batch": 16, "overlong_max_batch": 4}
    share_cap = 0.1
    for k in (1, 2, 3):
        r = fit_boundaries(
            lengths, "optimal", k, 256, batch_overhead_tokens=50, max_overlong_share=share_cap, **kw
        )
        best = math.inf
        every = itertools.chain.from_iterable(
            itertools.combinations(vals, j) for j in range(1, k + 1)
        )
        for bounds in every:
            if (lengths > bounds[-1]).mean() > share_cap + 1e-12:
                continue
            obj = score_boundaries(lengths, bounds, 256, batch_overhead_tokens=50, **kw)[0]
            best = min(best, obj)
        assert r.objective == pytest.approx(best, rel=1e-9)
        direct = score_boundaries(lengths, r.boundaries, 256, batch_overhead_tokens=50, **kw)
        assert r.objective == pytest.approx(direct[0], rel=1e-9)


def test_expected_max_matches_monte_carlo() -> None:
    """With full batches, padded tokens per request equal a simulated batch's mean maximum."""
    rng = np.random.default_rng(7)
    lengths = rng.integers(1, 50, 300)
    r = score_boundaries(lengths, (49,), 64, max_batch=6)
    draws = rng.choice(lengths, size=(200_000, 6))
    assert r[2][0].padded_per_request == pytest.approx(draws.max(axis=1).mean(), rel=5e-3)


def test_batch_size_model_matches_simulation() -> None:
    """A lane's mean batch is E[min(max_batch, 1 + Poisson(share*rate*wait))]."""
    lengths = np.array([10] * 30 + [100] * 70)
    rate, wait, cap = 400.0, 0.01, 4
    lanes = score_boundaries(lengths, (10, 100), 128, rate=rate, max_wait_s=wait, max_batch=cap)[2]
    rng = np.random.default_rng(3)
    for lane, share in zip(lanes, (0.3, 0.7), strict=False):
        sim = np.minimum(cap, 1 + rng.poisson(share * rate * wait, 400_000)).mean()
        assert lane.mean_batch == pytest.approx(sim, rel=5e-3)


def test_waste_is_token_weighted() -> None:
    """One bucket, full batches of 2, lengths 1 and 3 equally likely: padded E[max] = 2.5,
    mean length 2, so waste 1 - 2/2.5 = 0.2."""
    assert expected_padding_waste([1, 3], (3,), 3, max_batch=2) == pytest.approx(0.2)


def test_too_many_buckets_lose_at_low_rate() -> None:
    """With little traffic and a batch overhead, splitting starves the queues: auto keeps few
    buckets, 12 k-means buckets cost more, and optimal asked for 12 uses fewer and says why."""
    lengths = _modes(np.random.default_rng(2))
    kw = {"rate": 300.0, "batch_overhead_tokens": 128.0}
    r = fit_boundaries(lengths, "optimal", "auto", 256, **kw)
    assert 1 <= len(r.boundaries) <= 4
    assert any(line.startswith("chose K=") for line in r.reasoning)
    fine = fit_boundaries(lengths, "kmeans", 12, 256, **kw)
    assert len(fine.boundaries) == 12 and fine.objective > r.objective
    capped = fit_boundaries(lengths, "optimal", 12, 256, **kw)
    assert len(capped.boundaries) < 12 and capped.objective <= r.objective
    assert any("more would cost more" in line for line in capped.reasoning)


def test_auto_keeps_more_buckets_when_batches_are_full() -> None:
    """Under heavy traffic (full batches) a broad distribution earns several buckets."""
    lengths = np.random.default_rng(4).integers(1, 257, 5000)
    r = fit_boundaries(lengths, "optimal", "auto", 256)
    assert 3 <= len(r.boundaries) <= 12


def test_overlong_lane_takes_a_sparse_tail() -> None:
    """A 2% tail far above the bulk goes to the overlong lane when allowed, not otherwise."""
    rng = np.random.default_rng(5)
    lengths = np.concatenate([rng.integers(10, 40, 980), rng.integers(200, 256, 20)])
    kw = {"rate": 2000.0, "max_wait_s": 0.01, "batch_overhead_tokens": 64.0}
    free = fit_boundaries(lengths, "optimal", 1, 256, **kw)
    assert free.boundaries == (39,)
    assert free.shares[-1] == pytest.approx(0.02)
    shut = fit_boundaries(lengths, "optimal", 1, 256, max_overlong_share=0.0, **kw)
    assert shut.boundaries == (int(lengths.max()),)


def test_overlong_lengths_are_excluded() -> None:
    """Lengths over max_length are left out of the fit and counted."""
    r = fit_boundaries([5, 6, 7, 500], "quantile", 1, 64)
    assert r.excluded == 1 and r.boundaries == (7,)


def test_overhead_from_cost_model() -> None:
    """A cost model's const/per_token is the batch overhead in tokens."""
    cost = CostModel(const=0.02, per_token=1e-4)
    lengths = _modes(np.random.default_rng(6))
    a = fit_boundaries(lengths, "optimal", 2, 256, rate=500, cost=cost)
    b = fit_boundaries(lengths, "optimal", 2, 256, rate=500, batch_overhead_tokens=200)
    assert a.objective == pytest.approx(b.objective)
    with pytest.raises(ValueError, match="per_token"):
        fit_boundaries(lengths, "optimal", 2, 256, cost=CostModel(const=0.02))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"lengths": [], "method": "optimal", "buckets": 2}, "empty"),
        ({"lengths": [3], "method": "median", "buckets": 2}, "unknown fit method"),
        ({"lengths": [3], "method": "optimal", "buckets": 0}, "positive integer"),
        ({"lengths": [0, 3], "method": "optimal", "buckets": 1}, "at least 1 token"),
    ],
)
def test_bad_input(kwargs: dict[str, object], match: str) -> None:
    """Bad input raises a ValueError that says what is wrong."""
    with pytest.raises(ValueError, match=match):
        fit_boundaries(max_length=64, **kwargs)  # type: ignore[arg-type]
