"""Invariants of boundary fitting over random length samples (Hypothesis)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lenbatch.plan.fitting import fit_boundaries, score_boundaries

samples = st.lists(st.integers(1, 300), min_size=1, max_size=200)
rates = st.one_of(st.none(), st.floats(1.0, 5000.0))
overheads = st.sampled_from([0.0, 16.0, 128.0, 1000.0])


@settings(max_examples=60, deadline=None)
@given(samples, st.integers(1, 6), rates, overheads)
def test_optimal_never_worse_than_quantile_or_kmeans(
    lengths: list[int], k: int, rate: float | None, overhead: float
) -> None:
    """On the objective it minimises, optimal is at most what quantile and k-means get with
    the same number of buckets (and so, with no overhead, at most their padding waste)."""
    kw = {"rate": rate, "batch_overhead_tokens": overhead}
    for other in ("quantile", "kmeans"):
        theirs = fit_boundaries(lengths, other, k, 300, **kw)
        ours = fit_boundaries(lengths, "optimal", len(theirs.boundaries), 300, **kw)
        assert ours.objective <= theirs.objective * (1 + 1e-9) + 1e-9
        if overhead == 0 and rate is None:
            assert ours.expected_padding_waste <= theirs.expected_padding_waste + 1e-9


@settings(max_examples=60, deadline=None)
@given(samples, st.integers(1, 6), st.sampled_from(["quantile", "kmeans", "optimal"]), rates)
def test_result_is_consistent(lengths: list[int], k: int, method: str, rate: float | None) -> None:
    """Boundaries ascend within the limit, shares cover the traffic, and the reported figures
    are what score_boundaries gives for those boundaries."""
    r = fit_boundaries(lengths, method, k, 300, rate=rate, batch_overhead_tokens=32)
    b = r.boundaries
    assert 1 <= len(b) <= k and list(b) == sorted(set(b)) and b[-1] <= 300
    assert len(r.shares) == len(b) + 1
    assert sum(r.shares) == pytest.approx(1.0)
    assert 0.0 <= r.expected_padding_waste < 1.0
    obj, waste, _ = score_boundaries(lengths, b, 300, rate=rate, batch_overhead_tokens=32)
    assert r.objective == pytest.approx(obj) and r.expected_padding_waste == pytest.approx(waste)
    # every observed length lands in a lane whose range holds it
    for lane in r.lanes:
        inside = [n for n in lengths if lane.lower <= n <= lane.upper]
        assert lane.share == pytest.approx(len(inside) / len(lengths))


@settings(max_examples=40, deadline=None)
@given(samples)
def test_more_buckets_never_pad_more_with_full_batches(lengths: list[int]) -> None:
    """With full batches and no overhead, the optimal padding only falls as K grows."""
    prev = np.inf
    for k in range(1, 5):
        r = fit_boundaries(lengths, "optimal", k, 300, batch_overhead_tokens=0)
        assert r.objective <= prev + 1e-9
        prev = r.objective
