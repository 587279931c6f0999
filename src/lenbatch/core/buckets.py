"""Length buckets: which queue a request of a given token length joins.

A `BucketSet` is a list of upper bounds plus an overlong lane for everything above the last
bound (up to the model's limit). Bucket `i` holds lengths in `(bounds[i-1], bounds[i]]`; the
overlong lane has index `len(bounds)`. Pure: no I/O, no clock.
"""

from __future__ import annotations

import itertools
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["BucketSet", "default_boundaries"]


@dataclass(frozen=True, slots=True)
class BucketSet:
    """Bucket upper bounds (tokens, strictly increasing) and the model's length limit."""

    bounds: tuple[int, ...]
    max_length: int

    def __post_init__(self) -> None:
        if not self.bounds:
            raise ValueError("a BucketSet needs at least one boundary")
        if any(b >= c for b, c in itertools.pairwise(self.bounds)):
            raise ValueError(f"boundaries must be strictly increasing, got {list(self.bounds)}")
        if self.bounds[0] < 1:
            raise ValueError(f"boundaries must be positive, got {list(self.bounds)}")
        if self.bounds[-1] > self.max_length:
            raise ValueError(
                f"last boundary {self.bounds[-1]} exceeds max length {self.max_length}"
            )

    @property
    def overlong(self) -> int:
        """Index of the overlong lane."""
        return len(self.bounds)

    @property
    def n_lanes(self) -> int:
        """Number of queues: one per bound plus the overlong lane."""
        return len(self.bounds) + 1

    def bucket_of(self, length: int) -> int:
        """Index of the bucket for `length` tokens; `overlong` above the last bound.

        Raises ValueError for lengths the model cannot take (over `max_length`) or below 1.
        """
        if length < 1:
            raise ValueError(f"length must be at least 1 token, got {length}")
        if length > self.max_length:
            raise ValueError(f"length {length} exceeds the model's limit of {self.max_length}")
        return bisect_left(self.bounds, length)

    def upper(self, index: int) -> int:
        """Longest length bucket `index` holds (the model limit for the overlong lane)."""
        return self.bounds[index] if index < len(self.bounds) else self.max_length

    def lower(self, index: int) -> int:
        """Shortest length bucket `index` holds."""
        return 1 if index == 0 else self.bounds[index - 1] + 1

    def label(self, index: int) -> str:
        """Human-readable name of a bucket, e.g. `33-64` or `overlong(129-256)`."""
        if index == self.overlong and self.lower(index) > self.upper(index):
            return "overlong(none)"  # the last boundary is the model limit: nothing is overlong
        span = f"{self.lower(index)}-{self.upper(index)}"
        return f"overlong({span})" if index == self.overlong else span

    def labels(self) -> list[str]:
        """Labels of every lane, overlong last."""
        return [self.label(i) for i in range(self.n_lanes)]

    def counts(self, lengths: Sequence[int]) -> list[int]:
        """How many of `lengths` fall in each lane (lengths over the limit are not counted)."""
        out = [0] * self.n_lanes
        for n in lengths:
            if 1 <= n <= self.max_length:
                out[self.bucket_of(n)] += 1
        return out


def default_boundaries(max_length: int) -> tuple[int, ...]:
    """Boundaries used when none are configured and none were fitted: powers of two from 16
    below the model's limit, then the limit itself, so that every input the model takes has a
    lane of full batches (the overlong lane then takes nothing).

    The top half of the limit used to be the overlong lane (8 rows a batch, one batch in
    flight). On long-input traffic (the dev trace at `--length-scale 0.1 --max-length 256`,
    MiniLM, 2 cores, an Intel Xeon family 6 model 167) that lane held up both its own
    requests and the workers: with the limit as the last boundary, 1.11x the tokens/s past
    saturation and half the P95 at a quarter of it (`bench/results/cpu_layout.md`).

    This is a placeholder shape, not a fit: `lenbatch fit` derives boundaries from real
    traffic and should replace it.
    """
    out: list[int] = []
    b = 16
    while b < max_length:
        out.append(b)
        b *= 2
    return (*out, max_length)
