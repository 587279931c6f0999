"""Per-lane batch totals and nearest-rank percentiles, shared by the metrics and the simulator."""

from __future__ import annotations

import math
from collections import deque

import numpy as np
import pytest

from lenbatch.core.totals import LaneTotals, percentile


def test_percentile_is_nearest_rank_on_lists_deques_and_arrays() -> None:
    """An observed value, the same for every container; NaN when there is none."""
    values = [5.0, 1.0, 4.0, 2.0, 3.0]
    for container in (values, deque(values), np.asarray(values)):
        assert percentile(container, 50) == 3.0
        assert percentile(container, 95) == 5.0
        assert percentile(container, 0) == 1.0
    x = np.random.default_rng(0).random(101)
    assert percentile(x, 90) == np.percentile(x, 90, method="inverted_cdf")
    assert math.isnan(percentile([], 50)) and math.isnan(percentile(np.array([]), 50))


def test_lane_totals_waste_and_mean_batch_size() -> None:
    """Token-weighted waste and requests per batch; None before any batch."""
    assert LaneTotals().padding_waste is None and LaneTotals().mean_batch_size is None
    t = LaneTotals(batches=2, requests=6, real_tokens=30, padded_tokens=40, exec_s=0.5)
    assert t.padding_waste == pytest.approx(0.25)
    assert t.mean_batch_size == 3.0
