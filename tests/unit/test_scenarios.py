"""Scenarios: seeded arrivals with lengths drawn from given real-length pools."""

from __future__ import annotations

import numpy as np
import pytest

from lenbatch.replay.scenarios import build_scenario

POOLS = {
    "short": np.arange(10, 40, dtype=np.int64),
    "paragraph": np.arange(60, 200, dtype=np.int64),
    "speech": np.arange(2000, 3000, dtype=np.int64),
    "output": np.arange(50, 60, dtype=np.int64),
}


@pytest.mark.parametrize("name", ["bursts", "long-heavy", "mixed"])
def test_same_seed_same_traffic(name: str) -> None:
    """A scenario is reproducible by seed and changes with it."""
    a = build_scenario(name, POOLS, rate=20, duration_s=30, seed=5)
    b = build_scenario(name, POOLS, rate=20, duration_s=30, seed=5)
    c = build_scenario(name, POOLS, rate=20, duration_s=30, seed=6)
    assert a.arrivals is not None and b.arrivals is not None and c.arrivals is not None
    assert np.array_equal(a.arrivals, b.arrivals)
    assert np.array_equal(a.input_lengths, b.input_lengths)
    assert not np.array_equal(a.input_lengths[:50], c.input_lengths[:50])
    assert np.all(np.diff(a.arrivals) >= 0) and a.arrivals[0] == 0.0
    assert abs(len(a) / 30 - 20) < 4  # mean rate close to the asked one
    pool_values = np.concatenate([POOLS["short"], POOLS["paragraph"], POOLS["speech"]])
    assert np.isin(a.input_lengths, pool_values).all()
    assert a.output_lengths is not None and np.isin(a.output_lengths, POOLS["output"]).all()


def test_bursts_concentrate_short_requests() -> None:
    """Most requests fall in the 0.25 s burst windows, and those are short."""
    t = build_scenario("bursts", POOLS, rate=20, duration_s=30, seed=1, period_s=5)
    assert t.arrivals is not None
    per_second = np.bincount(t.arrivals.astype(int))
    assert per_second.max() >= 0.7 * 20 * 5 * 0.9  # a burst's worth in one second
    in_burst = per_second[per_second > 20]
    assert in_burst.sum() > 0.6 * len(t)
    assert np.median(t.input_lengths) < 40


def test_long_heavy_is_mostly_long() -> None:
    """long-heavy draws about 70 % of its requests from the speech pool."""
    t = build_scenario("long-heavy", POOLS, rate=30, duration_s=30, seed=2)
    share = float(np.mean(t.input_lengths >= 2000))
    assert 0.6 < share < 0.8


def test_mixed_is_mostly_short() -> None:
    """mixed: about half short, 15 % speech-length."""
    t = build_scenario("mixed", POOLS, rate=30, duration_s=30, seed=3)
    assert 0.4 < float(np.mean(t.input_lengths < 40)) < 0.6
    assert 0.08 < float(np.mean(t.input_lengths >= 2000)) < 0.22


def test_bad_scenario_is_a_clear_error() -> None:
    """Unknown names and non-positive rates are refused with the valid choices."""
    with pytest.raises(ValueError, match="bursts, long-heavy, mixed"):
        build_scenario("flood", POOLS, rate=1, duration_s=1)
    with pytest.raises(ValueError, match="positive"):
        build_scenario("mixed", POOLS, rate=0, duration_s=1)


def test_swing_and_onoff_follow_their_load_phases() -> None:
    """swing: the middle third carries ~16x the rate of the outer ones (over 5x once the trace
    is shifted to start at 0); onoff: the first 30 % of each period ~30x the rest's."""
    t = build_scenario("swing", POOLS, rate=40, duration_s=60, seed=4)
    assert t.arrivals is not None
    n = np.histogram(t.arrivals, bins=[0, 20, 40, 60.001])[0]
    assert n[1] > 5 * max(n[0], n[2], 1)
    t = build_scenario("onoff", POOLS, rate=40, duration_s=60, seed=4)
    assert t.arrivals is not None
    on = (t.arrivals % 5.0) < 1.5
    assert on.sum() / 1.5 > 10 * (~on).sum() / 3.5


def test_drift_moves_from_short_to_long_halfway() -> None:
    """drift: few speech-length inputs before the middle, about 40 % after."""
    t = build_scenario("drift", POOLS, rate=40, duration_s=60, seed=5)
    assert t.arrivals is not None
    first = t.arrivals < 30
    assert float(np.mean(t.input_lengths[first] >= 2000)) < 0.02
    assert 0.3 < float(np.mean(t.input_lengths[~first] >= 2000)) < 0.5


def test_bimodal_is_half_short_half_speech() -> None:
    t = build_scenario("bimodal", POOLS, rate=40, duration_s=30, seed=6)
    assert 0.4 < float(np.mean(t.input_lengths >= 2000)) < 0.6
    assert float(np.mean((t.input_lengths >= 60) & (t.input_lengths < 2000))) == 0.0
