"""The figures every report of a run shares: per-lane batch totals (with the padding waste and
mean batch size they imply) and nearest-rank percentiles. The engines' metrics and the
simulator both count with these, so live and simulated runs report alike. Pure: numpy only.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["LaneTotals", "percentile"]


def percentile(values: Iterable[float] | npt.NDArray[Any], q: float) -> float:
    """Nearest-rank percentile `q` (0-100) of `values`, an observed value; NaN when empty."""
    x = np.asarray(values, dtype=np.float64)
    if x.size == 0:
        return float("nan")
    return float(np.percentile(x, q, method="inverted_cdf"))


@dataclass(slots=True)
class LaneTotals:
    """Batch-level totals of one lane: batches, the requests they ran, real and padded tokens,
    and their execution seconds."""

    batches: int = 0
    requests: int = 0
    real_tokens: int = 0
    padded_tokens: int = 0
    exec_s: float = 0.0

    @property
    def padding_waste(self) -> float | None:
        """1 - real / padded tokens; None before any batch."""
        return 1 - self.real_tokens / self.padded_tokens if self.padded_tokens else None

    @property
    def mean_batch_size(self) -> float | None:
        """Requests per batch; None before any batch."""
        return self.requests / self.batches if self.batches else None
