"""One replayed run as the report sees it (`RunRecord`), and the cell formats every table of the
benchmark report uses (numbers rounded, missing values as a dash, ratios and percentages)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from lenbatch.replay.driver import ReplayResult

__all__ = [
    "MAX_ERROR_RATE",
    "SLO_P95_MS",
    "RunRecord",
    "fmt",
    "pct",
    "ratio",
    "relative_diff",
    "times",
]

SLO_P95_MS = 1000.0  # the headline's latency bound
MAX_ERROR_RATE = 0.01  # a rate "meets" the bound only with at most this share of failures


@dataclass
class RunRecord:
    """One replay of the benchmark traffic against one server at one rate."""

    name: str  # strategy (`fifo`, `bucketed`, ...) or peer (`naive`, `ray`)
    kind: str  # "strategy" or "peer"
    rate: float  # arrival-rate multiplier of this run (1.0 without a sweep)
    summary: dict[str, Any]
    result: ReplayResult | None = None
    predicted: dict[str, Any] | None = None

    @property
    def label(self) -> str:
        """Name, with the rate when it is not 1."""
        return self.name if self.rate == 1.0 else f"{self.name} @x{self.rate:g}"


def fmt(value: Any, digits: int = 1) -> str:
    """A table cell: numbers rounded, missing values as a dash."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


def ratio(a: Any, b: Any) -> float | None:
    """a / b, or None when either is missing or b is zero."""
    if a is None or b is None or b == 0:
        return None
    return float(a) / float(b)


def times(value: float | None) -> str:
    """A ratio as `1.23×`; a dash when missing."""
    return "–" if value is None else f"{value:.2f}×"


def pct(value: Any) -> str:
    """A share as `12.3 %`; a dash when missing."""
    return "–" if value is None else f"{100 * float(value):.1f} %"


def relative_diff(pred: Any, live: Any) -> str:
    """How far `pred` is from `live`, as `+12 %`; a dash when either is missing."""
    r = ratio(pred, live)
    return "–" if r is None else f"{100 * (r - 1):+.0f} %"
