"""The model that scores a set of bucket boundaries: expected padded tokens and batch overhead
per request, and the padding waste they leave. `lenbatch.plan.fitting` searches for boundaries with
it; `score_boundaries` and `expected_padding_waste` evaluate given ones.

- Requests arrive at `rate` per second (Poisson) with lengths drawn from the sample.
- A lane (a bucket, or the overlong lane above the last boundary) that receives a share `s` of
  the traffic opens a batch with one request and collects the arrivals of `max_wait`, up to
  `max_batch`: its batch size is `N = min(max_batch, 1 + Poisson(s * rate * max_wait))`, about
  `min(max_batch, 1 + s * rate * max_wait)` requests. Without a rate every batch is full
  (`N = max_batch`, the heavy-traffic limit). The model ignores queueing behind a busy runner,
  which only makes real batches larger.
- A batch is padded to its longest member, so it costs `N * E[max of N draws]` padded tokens,
  with the expectation taken exactly over the lane's empirical length distribution (not the
  lane's upper bound).
- Each batch also costs a fixed overhead of `h` token-equivalents (a cost model's `const`
  divided by its `per_token`), paid once per batch, so `h / E[N]` per request.

The objective is the expected cost per request, `sum_i s_i * (E[N_i M_i] / E[N_i] + h / E[N_i])`
in token-equivalents; the expected padding waste is `1 - E[length] / E[padded tokens per
request]`, token-weighted. More lanes cut padding but split the traffic, so each lane's batches
get smaller and pay the overhead more often: this is what makes too many buckets lose.

Pure numpy.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypedDict, Unpack

import numpy as np
import numpy.typing as npt

from lenbatch.plan.trace import FloatArray, IntArray

__all__ = [
    "BatchModel",
    "BatchParams",
    "LaneFit",
    "batch_pmf",
    "check_boundaries",
    "expected_max",
    "expected_padding_waste",
    "lane_cost",
    "length_support",
    "poisson_cutoff",
    "score_boundaries",
    "score_partition",
]


@dataclass(frozen=True)
class LaneFit:
    """One lane of a fitted partition, as the model sees it."""

    lower: int  # shortest length the lane takes
    upper: int  # longest length the lane takes (the model limit for the overlong lane)
    share: float  # fraction of the sample's requests
    mean_batch: float  # E[N]
    padded_per_request: float  # E[N * max] / E[N]: padded tokens per request
    padding_waste: float  # 1 - mean length / padded_per_request (0 for an empty lane)
    overlong: bool = False


class BatchParams(TypedDict, total=False):
    """`BatchModel`'s fields but the overhead, as keyword arguments (each has its default)."""

    rate: float | None
    max_wait_s: float
    max_batch: int
    overlong_max_batch: int
    overlong_max_wait_s: float


@dataclass(frozen=True)
class BatchModel:
    """The batching model's parameters (see the module docstring)."""

    rate: float | None = None  # requests per second; None: every batch full
    max_wait_s: float = 0.01
    max_batch: int = 32
    overlong_max_batch: int = 8
    overlong_max_wait_s: float = 0.05
    overhead: float = 0.0  # token-equivalents per batch

    def __post_init__(self) -> None:
        if self.rate is not None and self.rate <= 0:
            raise ValueError(f"rate must be positive (requests per second), got {self.rate}")
        if self.max_wait_s < 0 or self.overlong_max_wait_s < 0:
            raise ValueError("max waits must not be negative")
        if self.max_batch < 1 or self.overlong_max_batch < 1:
            raise ValueError(f"max batch sizes must be at least 1, got {self.max_batch}")
        if self.overhead < 0:
            raise ValueError(f"batch overhead must not be negative, got {self.overhead}")

    def params(self, overlong: bool) -> tuple[int, float]:
        """(max batch, max wait in seconds) of a bucket or of the overlong lane."""
        if overlong:
            return self.overlong_max_batch, self.overlong_max_wait_s
        return self.max_batch, self.max_wait_s


def length_support(lengths: npt.ArrayLike, max_length: int) -> tuple[IntArray, FloatArray, int]:
    """Sorted unique lengths within the limit, their counts, and how many were over it."""
    arr = np.asarray(lengths, dtype=np.int64).ravel()
    if arr.size == 0:
        raise ValueError("cannot fit boundaries to an empty length sample")
    if max_length < 1:
        raise ValueError(f"max_length must be at least 1, got {max_length}")
    if (arr < 1).any():
        raise ValueError(f"lengths must be at least 1 token, got {int(arr.min())}")
    within = arr[arr <= max_length]
    if within.size == 0:
        raise ValueError(f"every length in the sample is over max_length={max_length}")
    values, counts = np.unique(within, return_counts=True)
    return values.astype(np.int64), counts.astype(np.float64), int(arr.size - within.size)


def batch_pmf(mu: FloatArray, cap: int) -> FloatArray:
    """P(N = n) for n = 1..cap, one row per entry of `mu`: N = min(cap, 1 + Poisson(mu))."""
    n = np.arange(1, cap, dtype=np.float64)
    if len(mu) and float(mu.max()) > 700:
        # exp(-mu) would underflow while mu^n/n! is huge: work in logs for these rows.
        lgam = np.array([math.lgamma(k) for k in n])
        logp = -mu[:, None] + (n[None, :] - 1) * np.log(np.maximum(mu, 1e-300))[:, None]
        head = np.exp(logp - lgam[None, :])
    else:
        # p(1) = e^-mu, p(n+1) = p(n) * mu / n: one exp per row instead of one per entry.
        steps = np.empty((len(mu), max(cap - 1, 0)))
        if cap > 1:
            steps[:, 0] = np.exp(-mu)
            steps[:, 1:] = mu[:, None] / n[None, :-1]
        head = np.cumprod(steps, axis=1)
    tail = np.maximum(0.0, 1.0 - head.sum(axis=1))  # the cap absorbs the rest
    return np.concatenate((head, tail[:, None]), axis=1)


def lane_cost(
    emax: FloatArray,
    ns: Sequence[int],
    share: FloatArray,
    cap: int,
    wait: float,
    model: BatchModel,
) -> tuple[FloatArray, FloatArray, FloatArray]:
    """(E[N], padded tokens per request, cost per request) of lanes with traffic `share`.

    `emax[:, i]` is E[max of ns[i] draws] for each lane. Without a rate every batch has `cap`
    requests, so only that column is read; with one, `ns` must start with 1..cap.
    """
    if model.rate is None:
        mean_n = np.full(len(share), float(cap))
        padded = emax[:, list(ns).index(cap)]
    else:
        pmf = batch_pmf(share * model.rate * wait, cap)
        n = np.arange(1, cap + 1, dtype=np.float64)
        mean_n = pmf @ n
        padded = (pmf * n[None, :] * emax[:, :cap]).sum(axis=1) / mean_n
    return mean_n, padded, padded + model.overhead / mean_n


def poisson_cutoff(mu: float, eps: float = 1e-12) -> int:
    """Smallest t with P(Poisson(mu) >= t) < eps: batch sizes beyond 1 + t need no tracking."""
    t, p, cdf = 0, math.exp(-mu) if mu < 700 else 0.0, 0.0
    if p == 0.0:
        return 10**9  # huge mu: batches are always full, keep every column
    while 1.0 - cdf >= eps and t < 10**6:
        cdf += p
        t += 1
        p *= mu / t
    return t


def expected_max(values: IntArray, counts: FloatArray, cap: int) -> FloatArray:
    """E[max of n draws] for n = 1..cap from the distribution (values, counts), directly:
    `E[max] = v_last - sum_j (v_{j+1} - v_j) * F(v_j)^n`."""
    cdf = np.cumsum(counts)[:-1] / counts.sum()
    gaps = np.diff(values).astype(np.float64)
    n = np.arange(1, cap + 1, dtype=np.float64)
    out: FloatArray = float(values[-1]) - (gaps[:, None] * cdf[:, None] ** n[None, :]).sum(axis=0)
    return out


def lanes_of(values: IntArray, boundaries: Sequence[int]) -> IntArray:
    """Lane index of each value: bucket i holds (b[i-1], b[i]], the overlong lane the rest."""
    return np.searchsorted(np.asarray(boundaries, dtype=np.int64), values, side="left")


def score_partition(
    values: IntArray,
    counts: FloatArray,
    boundaries: Sequence[int],
    max_length: int,
    model: BatchModel,
) -> tuple[float, float, tuple[LaneFit, ...]]:
    """(objective, padding waste, lanes) of `boundaries`, evaluated directly."""
    total = counts.sum()
    lane_of = lanes_of(values, boundaries)
    lanes: list[LaneFit] = []
    objective = padded_total = 0.0
    for i in range(len(boundaries) + 1):
        overlong = i == len(boundaries)
        lower = 1 if i == 0 else boundaries[i - 1] + 1
        upper = max_length if overlong else boundaries[i]
        sel = lane_of == i
        if not sel.any():
            lanes.append(LaneFit(lower, upper, 0.0, 0.0, 0.0, 0.0, overlong))
            continue
        v, c = values[sel], counts[sel]
        share = float(c.sum() / total)
        cap, wait = model.params(overlong)
        emax = expected_max(v, c, cap)[None, :]
        mean_n, padded, cost = lane_cost(
            emax, range(1, cap + 1), np.array([share]), cap, wait, model
        )
        mean_len = float((v * c).sum() / c.sum())
        objective += share * float(cost[0])
        padded_total += share * float(padded[0])
        waste = max(0.0, 1.0 - mean_len / float(padded[0]))  # 0 up to rounding
        lanes.append(
            LaneFit(lower, upper, share, float(mean_n[0]), float(padded[0]), waste, overlong)
        )
    mean_length = float((values * counts).sum() / total)
    return objective, max(0.0, 1.0 - mean_length / padded_total), tuple(lanes)


def check_boundaries(boundaries: Sequence[int], max_length: int) -> tuple[int, ...]:
    b = tuple(int(x) for x in boundaries)
    if not b:
        raise ValueError("boundaries must not be empty")
    if b[0] < 1 or any(x >= y for x, y in itertools.pairwise(b)):
        raise ValueError(f"boundaries must be positive and strictly increasing, got {list(b)}")
    if b[-1] > max_length:
        raise ValueError(f"last boundary {b[-1]} exceeds max_length {max_length}")
    return b


def score_boundaries(
    lengths: npt.ArrayLike,
    boundaries: Sequence[int],
    max_length: int,
    *,
    batch_overhead_tokens: float = 0.0,
    **batching: Unpack[BatchParams],
) -> tuple[float, float, tuple[LaneFit, ...]]:
    """(objective, expected padding waste, per-lane figures) of given boundaries under the
    model in the module docstring, with `batching` as in `BatchModel` (its defaults where not
    given). Lengths over `max_length` are left out."""
    values, counts, _ = length_support(lengths, max_length)
    b = check_boundaries(boundaries, max_length)
    model = BatchModel(**batching, overhead=batch_overhead_tokens)
    return score_partition(values, counts, b, max_length, model)


def expected_padding_waste(
    lengths: npt.ArrayLike,
    boundaries: Sequence[int],
    max_length: int,
    **batching: Unpack[BatchParams],
) -> float:
    """Token-weighted padding waste, `1 - real / padded tokens`, that `boundaries` are expected
    to leave on traffic like `lengths` (model in the module docstring; `rate=None`: full
    batches)."""
    return score_boundaries(lengths, boundaries, max_length, **batching)[1]
