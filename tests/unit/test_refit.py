"""Online re-fit: drift test, the padded-token DP, hysteresis. Explicit times, no sleeps."""

from __future__ import annotations

import numpy as np
import pytest

from lenbatch.core.refit import Refitter, ks_distance, optimal_bounds, padded_per_request


def test_ks_distance_is_zero_for_one_distribution_and_large_after_a_shift() -> None:
    rng = np.random.default_rng(0)
    a = rng.integers(10, 60, 500)
    assert ks_distance(a, a) == 0.0
    assert ks_distance(a, rng.integers(10, 60, 500)) < 0.1
    assert ks_distance(a, rng.integers(100, 250, 500)) == pytest.approx(1.0)


def test_optimal_bounds_match_a_brute_force_search() -> None:
    """The DP finds the least padded tokens over every set of at most k boundaries."""
    import itertools

    rng = np.random.default_rng(3)
    lengths = rng.choice([3, 5, 9, 12, 20, 21, 40], size=60)
    values = sorted(set(lengths.tolist()))
    best = min(
        padded_per_request((*c, values[-1]), lengths, 0.0)
        for r in range(0, 3)
        for c in itertools.combinations(values[:-1], r)
    )
    got = optimal_bounds(lengths, 3, 64)
    assert len(got) <= 3 and got[-1] == values[-1]
    assert padded_per_request(got, lengths, 0.0) == pytest.approx(best)


def _refitter(**kw: object) -> Refitter:
    base: dict[str, object] = {
        "max_length": 256,
        "sample": 400,
        "min_requests": 100,
        "min_interval": 5.0,
        "min_saving": 0.05,
        "buckets": 4,
    }
    base.update(kw)
    return Refitter(**base)  # type: ignore[arg-type]


def test_first_fit_then_only_on_drift_with_hysteresis() -> None:
    """No reference: the first check fits. Same distribution later: no re-fit (KS). A shift to
    long inputs: re-fit, but not before min_interval, and each event is recorded."""
    rng = np.random.default_rng(1)
    rf = _refitter()
    for n in rng.integers(10, 60, 100):
        rf.observe(int(n))
    first = rf.consider(0.0, (256,))
    assert first is not None and first[-1] <= 60
    for n in rng.integers(10, 60, 100):
        rf.observe(int(n))
    assert rf.consider(10.0, first) is None  # no drift
    for n in rng.integers(150, 250, 100):
        rf.observe(int(n))
    assert rf.consider(12.0, first) is not None
    assert len(rf.events) == 2
    ev = rf.events[-1]
    assert ev.old == first and ev.new[-1] >= 200 and ev.ks is not None and ev.saving >= 0.05
    # inside min_interval nothing is even considered
    rf2 = _refitter(min_interval=100.0)
    for n in rng.integers(10, 60, 100):
        rf2.observe(int(n))
    assert rf2.consider(0.0, (256,)) is not None
    for n in rng.integers(150, 250, 100):
        rf2.observe(int(n))
    assert rf2.consider(50.0, (60,)) is None


def test_a_small_saving_never_swaps() -> None:
    """Boundaries that already suit the sample are kept (below min_saving)."""
    rng = np.random.default_rng(2)
    rf = _refitter(min_saving=0.5)
    lengths = rng.integers(10, 60, 100)
    for n in lengths:
        rf.observe(int(n))
    near = optimal_bounds(lengths, 4, 256)
    assert rf.consider(0.0, near) is None
    assert rf.events == []
