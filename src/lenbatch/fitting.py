"""Bucket boundaries fitted to a length sample: equal-mass quantiles, exact 1-D k-means, or the
partition that minimises the expected cost of serving the sample.

One model scores every method, so their results compare on one scale:

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

Pure numpy. The DPs run over the sorted unique lengths with their counts.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Literal

import numpy as np
import numpy.typing as npt

from lenbatch.costmodel import CostModel

__all__ = [
    "AUTO_MAX_BUCKETS",
    "DEFAULT_BATCH_OVERHEAD_TOKENS",
    "DEFAULT_GAIN_THRESHOLD",
    "DEFAULT_MAX_OVERLONG_SHARE",
    "FitMethod",
    "FitResult",
    "LaneFit",
    "expected_padding_waste",
    "fit_boundaries",
    "score_boundaries",
]

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
_ColumnFn = Callable[[int], FloatArray]  # b -> cost of the group a..b for a = 0..b

# MiniLM on a 2-core CPU: a batch costs ~25 ms on top of ~5k padded tokens/s, i.e. about 128
# tokens' worth. Used only when neither a cost model nor an explicit overhead is given.
DEFAULT_BATCH_OVERHEAD_TOKENS = 128.0
# `auto` stops adding buckets once one more would cut the objective by less than this fraction.
DEFAULT_GAIN_THRESHOLD = 0.03
AUTO_MAX_BUCKETS = 12
# `optimal` may leave at most this share of traffic, the longest, to the overlong lane.
DEFAULT_MAX_OVERLONG_SHARE = 0.05


class FitMethod(StrEnum):
    """How boundaries are chosen."""

    QUANTILE = "quantile"  # equal-mass quantiles of the length sample
    KMEANS = "kmeans"  # exact 1-D k-means (minimal within-bucket squared error), by DP
    OPTIMAL = "optimal"  # minimal expected padded tokens + batch overhead per request, by DP

    @classmethod
    def parse(cls, name: str | FitMethod) -> FitMethod:
        """The method called `name`, or a ValueError listing the valid names."""
        try:
            return cls(str(name).strip().lower())
        except ValueError:
            valid = ", ".join(m.value for m in cls)
            raise ValueError(f"unknown fit method {name!r}; choose one of: {valid}") from None


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


@dataclass(frozen=True)
class FitResult:
    """Fitted boundaries and what the model predicts for them."""

    method: FitMethod
    # Ascending upper bounds; the last one < max_length leaves an overlong lane above it,
    # == max_length means none.
    boundaries: tuple[int, ...]
    expected_padding_waste: float  # token-weighted, under the model in the module docstring
    shares: tuple[float, ...]  # fraction of traffic per lane (buckets + overlong)
    reasoning: tuple[str, ...]  # human-readable lines (esp. for auto K)
    objective: float = math.nan  # expected cost per request, token-equivalents
    lanes: tuple[LaneFit, ...] = ()
    max_length: int = 0
    excluded: int = 0  # sample lengths over max_length, left out (a server rejects them)


@dataclass(frozen=True)
class _Model:
    """The batching model's parameters (see the module docstring)."""

    rate: float | None
    max_wait_s: float
    max_batch: int
    overlong_max_batch: int
    overlong_max_wait_s: float
    overhead: float  # token-equivalents per batch

    def params(self, overlong: bool) -> tuple[int, float]:
        if overlong:
            return self.overlong_max_batch, self.overlong_max_wait_s
        return self.max_batch, self.max_wait_s


# ---------------------------------------------------------------------------- the model


def _support(lengths: npt.ArrayLike, max_length: int) -> tuple[IntArray, FloatArray, int]:
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


def _batch_pmf(mu: FloatArray, cap: int) -> FloatArray:
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


def _lane_cost(
    emax: FloatArray,
    ns: Sequence[int],
    share: FloatArray,
    cap: int,
    wait: float,
    model: _Model,
) -> tuple[FloatArray, FloatArray, FloatArray]:
    """(E[N], padded tokens per request, cost per request) of lanes with traffic `share`.

    `emax[:, i]` is E[max of ns[i] draws] for each lane. Without a rate every batch has `cap`
    requests, so only that column is read; with one, `ns` must start with 1..cap.
    """
    if model.rate is None:
        mean_n = np.full(len(share), float(cap))
        padded = emax[:, list(ns).index(cap)]
    else:
        pmf = _batch_pmf(share * model.rate * wait, cap)
        n = np.arange(1, cap + 1, dtype=np.float64)
        mean_n = pmf @ n
        padded = (pmf * n[None, :] * emax[:, :cap]).sum(axis=1) / mean_n
    return mean_n, padded, padded + model.overhead / mean_n


def _poisson_cutoff(mu: float, eps: float = 1e-12) -> int:
    """Smallest t with P(Poisson(mu) >= t) < eps: batch sizes beyond 1 + t need no tracking."""
    t, p, cdf = 0, math.exp(-mu) if mu < 700 else 0.0, 0.0
    if p == 0.0:
        return 10**9  # huge mu: batches are always full, keep every column
    while 1.0 - cdf >= eps and t < 10**6:
        cdf += p
        t += 1
        p *= mu / t
    return t


def _expected_max(values: IntArray, counts: FloatArray, cap: int) -> FloatArray:
    """E[max of n draws] for n = 1..cap from the distribution (values, counts), directly:
    `E[max] = v_last - sum_j (v_{j+1} - v_j) * F(v_j)^n`."""
    cdf = np.cumsum(counts)[:-1] / counts.sum()
    gaps = np.diff(values).astype(np.float64)
    n = np.arange(1, cap + 1, dtype=np.float64)
    out: FloatArray = float(values[-1]) - (gaps[:, None] * cdf[:, None] ** n[None, :]).sum(axis=0)
    return out


def _lanes_of(values: IntArray, boundaries: Sequence[int]) -> IntArray:
    """Lane index of each value: bucket i holds (b[i-1], b[i]], the overlong lane the rest."""
    return np.searchsorted(np.asarray(boundaries, dtype=np.int64), values, side="left")


def _score(
    values: IntArray,
    counts: FloatArray,
    boundaries: Sequence[int],
    max_length: int,
    model: _Model,
) -> tuple[float, float, tuple[LaneFit, ...]]:
    """(objective, padding waste, lanes) of `boundaries`, evaluated directly."""
    total = counts.sum()
    lane_of = _lanes_of(values, boundaries)
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
        emax = _expected_max(v, c, cap)[None, :]
        mean_n, padded, cost = _lane_cost(
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


def _check_boundaries(boundaries: Sequence[int], max_length: int) -> tuple[int, ...]:
    b = tuple(int(x) for x in boundaries)
    if not b:
        raise ValueError("boundaries must not be empty")
    if b[0] < 1 or any(x >= y for x, y in itertools.pairwise(b)):
        raise ValueError(f"boundaries must be positive and strictly increasing, got {list(b)}")
    if b[-1] > max_length:
        raise ValueError(f"last boundary {b[-1]} exceeds max_length {max_length}")
    return b


def _make_model(
    rate: float | None,
    max_wait_s: float,
    max_batch: int,
    overlong_max_batch: int,
    overlong_max_wait_s: float,
    overhead: float,
) -> _Model:
    if rate is not None and rate <= 0:
        raise ValueError(f"rate must be positive (requests per second), got {rate}")
    if max_wait_s < 0 or overlong_max_wait_s < 0:
        raise ValueError("max waits must not be negative")
    if max_batch < 1 or overlong_max_batch < 1:
        raise ValueError(f"max batch sizes must be at least 1, got {max_batch}")
    if overhead < 0:
        raise ValueError(f"batch overhead must not be negative, got {overhead}")
    return _Model(rate, max_wait_s, max_batch, overlong_max_batch, overlong_max_wait_s, overhead)


def score_boundaries(
    lengths: npt.ArrayLike,
    boundaries: Sequence[int],
    max_length: int,
    *,
    rate: float | None = None,
    max_wait_s: float = 0.01,
    max_batch: int = 32,
    overlong_max_batch: int = 8,
    overlong_max_wait_s: float = 0.05,
    batch_overhead_tokens: float = 0.0,
) -> tuple[float, float, tuple[LaneFit, ...]]:
    """(objective, expected padding waste, per-lane figures) of given boundaries under the
    model in the module docstring. Lengths over `max_length` are left out."""
    values, counts, _ = _support(lengths, max_length)
    b = _check_boundaries(boundaries, max_length)
    model = _make_model(
        rate, max_wait_s, max_batch, overlong_max_batch, overlong_max_wait_s, batch_overhead_tokens
    )
    return _score(values, counts, b, max_length, model)


def expected_padding_waste(
    lengths: npt.ArrayLike,
    boundaries: Sequence[int],
    max_length: int,
    *,
    rate: float | None = None,
    max_wait_s: float = 0.01,
    max_batch: int = 32,
    overlong_max_batch: int = 8,
    overlong_max_wait_s: float = 0.05,
) -> float:
    """Token-weighted padding waste, `1 - real / padded tokens`, that `boundaries` are expected
    to leave on traffic like `lengths` (model in the module docstring; `rate=None`: full
    batches)."""
    return score_boundaries(
        lengths,
        boundaries,
        max_length,
        rate=rate,
        max_wait_s=max_wait_s,
        max_batch=max_batch,
        overlong_max_batch=overlong_max_batch,
        overlong_max_wait_s=overlong_max_wait_s,
    )[1]


# ---------------------------------------------------------------------------- the methods


def _quantile_bounds(lengths: IntArray, values: IntArray, k: int) -> tuple[int, ...]:
    """Equal-mass cut points: the nearest-rank quantiles at i/k, i = 1..k (duplicates merge)."""
    qs = np.arange(1, k + 1) / k
    cuts = np.quantile(lengths, qs, method="inverted_cdf").astype(np.int64)
    cuts[-1] = values[-1]
    return tuple(int(x) for x in np.unique(cuts))


def _kmeans_dp(values: IntArray, counts: FloatArray, kmax: int) -> list[tuple[int, ...]]:
    """Exact weighted 1-D k-means for k = 1..kmax by DP over the sorted unique values: the
    partitions into k contiguous groups with minimal within-group squared error. Returns the
    boundaries (each group's largest value) for each k."""
    u = len(values)
    x = values.astype(np.float64) - float(np.average(values, weights=counts))  # for precision
    w1 = np.concatenate(([0.0], np.cumsum(counts)))
    s1 = np.concatenate(([0.0], np.cumsum(counts * x)))
    s2 = np.concatenate(([0.0], np.cumsum(counts * x * x)))

    def column(b: int) -> FloatArray:
        # SSE of groups a..b for a = 0..b
        w = w1[b + 1] - w1[: b + 1]
        s = s1[b + 1] - s1[: b + 1]
        sse: FloatArray = np.maximum(0.0, (s2[b + 1] - s2[: b + 1]) - s * s / w)
        return sse

    _, back = _partition_dp(u, kmax, column)
    return [_backtrack(values, back, k, u - 1) for k in range(1, min(kmax, u) + 1)]


def _partition_dp(u: int, kmax: int, column: _ColumnFn) -> tuple[FloatArray, npt.NDArray[np.intp]]:
    """Min-cost partition of items 0..u-1 into k contiguous groups, for every k <= kmax.

    `column(b)` gives the cost of the group a..b for a = 0..b. `f[k, b]` is the best cost of
    covering 0..b with k groups; `back[k, b]` the start of the last group.
    """
    kmax = min(kmax, u)
    f = np.full((kmax + 1, u), np.inf)
    back = np.zeros((kmax + 1, u), dtype=np.intp)
    for b in range(u):
        cost = column(b)
        f[1, b] = cost[0]
        if b == 0 or kmax < 2:
            continue
        # k groups ending at b: the last group is a..b (a >= 1), the rest cover 0..a-1.
        cand = f[1:kmax, :b] + cost[None, 1 : b + 1]
        best = np.argmin(cand, axis=1)
        f[2:, b] = cand[np.arange(kmax - 1), best]
        back[2:, b] = best + 1
    return f, back


def _backtrack(values: IntArray, back: npt.NDArray[np.intp], k: int, end: int) -> tuple[int, ...]:
    """Boundaries (each group's largest value) of the best k groups covering 0..end."""
    bounds: list[int] = []
    b = end
    for kk in range(k, 0, -1):
        bounds.append(int(values[b]))
        b = int(back[kk, b]) - 1  # back[1, b] is 0: the first group starts at the first value
    if b != -1:
        raise AssertionError("bug: DP backtrack did not reach the first length")
    return tuple(reversed(bounds))


def _optimal_dp(
    values: IntArray, counts: FloatArray, kmax: int, model: _Model, max_overlong_share: float
) -> list[tuple[float, tuple[int, ...]]]:
    """For k = 1..kmax buckets: (minimal objective, boundaries), the overlong lane included in
    the search: empty, or holding the longest lengths up to `max_overlong_share` of traffic.
    (Unbounded, it would swallow everything: its longer wait makes bigger batches, and the
    objective does not price waiting. It is meant for the rare tail.)

    A group a..b costs `share * (padded tokens + overhead / E[N])` per request. Its
    `E[max of n draws]` is `v_b - R_n(a, b)` with `R_n(a, b) = sum_{j=a}^{b-1} (v_{j+1} - v_j)
    (G(a, j) / G(a, b))^n`, G(a, j) the count of values a..j. Stepping b to b+1 gives
    `R_n(a, b+1) = (R_n(a, b) + v_{b+1} - v_b) * (G(a, b) / G(a, b+1))^n`: every ratio is at
    most 1, so nothing overflows, and one pass over b yields every group's exact cost in
    O(U^2 * max_batch).
    """
    u = len(values)
    total = counts.sum()
    cap_b, wait_b = model.params(False)
    cap_o, wait_o = model.params(True)
    if model.rate is None:
        ns = sorted({cap_b, cap_o})  # full batches: only these sizes occur
    else:
        # Batch sizes past the Poisson tail cutoff have no weight worth tracking (< 1e-12).
        cut = _poisson_cutoff(model.rate * max(wait_b, wait_o))
        cap_b, cap_o = min(cap_b, max(cut, 1)), min(cap_o, max(cut, 1))
        ns = list(range(1, max(cap_b, cap_o) + 1))
    n = np.asarray(ns, dtype=np.float64)
    consecutive = ns == list(range(1, len(ns) + 1))
    cum = np.concatenate(([0.0], np.cumsum(counts)))  # cum[j + 1] = count of values 0..j
    gaps = np.diff(values).astype(np.float64)
    rem = np.zeros((u, len(ns)))  # rem[a] = R_n(a, b) for the current b

    def column(b: int) -> FloatArray:
        if b > 0:
            ratio = (cum[b] - cum[:b]) / (cum[b + 1] - cum[:b])
            if consecutive:  # ratio^1, ratio^2, ... by running products: no pow, no exp
                powers = np.cumprod(np.broadcast_to(ratio[:, None], (b, len(ns))), axis=1)
            else:
                powers = ratio[:, None] ** n[None, :]
            rem[:b] += gaps[b - 1]
            rem[:b] *= powers
        share = (cum[b + 1] - cum[: b + 1]) / total
        emax = float(values[b]) - rem[: b + 1]
        cost: FloatArray = share * _lane_cost(emax, ns, share, cap_b, wait_b, model)[2]
        return cost

    f, back = _partition_dp(u, kmax, column)
    # After the pass, rem holds R_n(a, u-1): the overlong lane starting at a.
    share = (total - cum[:u]) / total
    over = share * _lane_cost(float(values[-1]) - rem, ns, share, cap_o, wait_o, model)[2]
    out = []
    for k in range(1, min(kmax, u) + 1):
        best, bounds = float(f[k, u - 1]), _backtrack(values, back, k, u - 1)
        # k buckets over 0..a-1 (a >= k), the overlong lane over a..u-1
        starts = np.arange(k, u)
        starts = starts[share[starts] <= max_overlong_share + 1e-12]
        if len(starts):
            with_over = f[k, starts - 1] + over[starts]
            i = int(np.argmin(with_over))
            if with_over[i] < best:
                best = float(with_over[i])
                bounds = _backtrack(values, back, k, int(starts[i]) - 1)
        out.append((best, bounds))
    return out


def _overhead(batch_overhead_tokens: float | None, cost: CostModel | None) -> tuple[float, str]:
    """The per-batch overhead in token-equivalents, and a line saying where it came from."""
    if batch_overhead_tokens is not None:
        return float(batch_overhead_tokens), (
            f"per-batch overhead: {batch_overhead_tokens:g} token-equivalents (given)"
        )
    if cost is not None:
        if cost.per_token <= 0:
            raise ValueError(
                "the cost model has per_token = 0, so its per-batch cost cannot be expressed "
                "in tokens; pass batch_overhead_tokens (--batch-overhead-tokens) instead"
            )
        h = cost.const / cost.per_token
        return h, (
            f"per-batch overhead: {h:.0f} token-equivalents (cost model {cost.model or '?'}: "
            f"const {cost.const * 1e3:.2f} ms / {cost.per_token * 1e6:.3f} us per token)"
        )
    return DEFAULT_BATCH_OVERHEAD_TOKENS, (
        f"per-batch overhead: {DEFAULT_BATCH_OVERHEAD_TOKENS:g} token-equivalents (default, "
        "about MiniLM on a small CPU; measure yours with `lenbatch profile` and pass --cost)"
    )


def _candidates(
    method: FitMethod,
    lengths: IntArray,
    values: IntArray,
    counts: FloatArray,
    kmax: int,
    model: _Model,
    max_overlong_share: float,
) -> list[tuple[int, ...]]:
    """The method's boundaries for k = 1..kmax buckets."""
    if method is FitMethod.QUANTILE:
        return [_quantile_bounds(lengths, values, k) for k in range(1, kmax + 1)]
    if method is FitMethod.KMEANS:
        return _kmeans_dp(values, counts, kmax)
    return [b for _, b in _optimal_dp(values, counts, kmax, model, max_overlong_share)]


def _pick_k(objectives: Sequence[float], threshold: float) -> tuple[int, str]:
    """Smallest k after which one more bucket gains less than `threshold` (relative)."""
    for k in range(1, len(objectives)):
        gain = 1.0 - objectives[k] / objectives[k - 1] if objectives[k - 1] > 0 else 0.0
        if gain < threshold:
            effect = (
                f"cut the cost by only {100 * gain:.1f}%"
                if gain >= 0
                else f"raise the cost by {-100 * gain:.1f}% (smaller batches)"
            )
            return k, (
                f"chose K={k}: one more bucket (K={k + 1}) would {effect}; "
                f"threshold {100 * threshold:g}%"
            )
    k = len(objectives)
    return k, f"chose K={k}: every bucket up to the search limit gained over the threshold"


def _lane_line(lane: LaneFit) -> str:
    if lane.overlong and lane.lower > lane.upper:
        return "  overlong lane: none (the last boundary is the length limit)"
    name = f"overlong {lane.lower}-{lane.upper}" if lane.overlong else f"{lane.lower}-{lane.upper}"
    if lane.share == 0:
        return f"  lane {name:>17}: no requests in the sample"
    return (
        f"  lane {name:>17}: {100 * lane.share:5.1f}% of requests, batch ~{lane.mean_batch:5.2f}, "
        f"{lane.padded_per_request:7.1f} padded tokens/request, "
        f"waste {100 * lane.padding_waste:4.1f}%"
    )


def fit_boundaries(
    lengths: npt.ArrayLike,
    method: FitMethod | str,
    buckets: int | Literal["auto"],
    max_length: int,
    *,
    rate: float | None = None,
    max_wait_s: float = 0.01,
    max_batch: int = 32,
    batch_overhead_tokens: float | None = None,
    cost: CostModel | None = None,
    overlong_max_batch: int = 8,
    overlong_max_wait_s: float = 0.05,
    gain_threshold: float = DEFAULT_GAIN_THRESHOLD,
    max_auto_buckets: int = AUTO_MAX_BUCKETS,
    max_overlong_share: float = DEFAULT_MAX_OVERLONG_SHARE,
) -> FitResult:
    """Fit bucket boundaries to a length sample (see the module docstring for the model).

    `buckets` is the number of buckets below the overlong lane, or `"auto"`: try 1 to
    `max_auto_buckets` and keep the K after which one more bucket cuts the expected cost per
    request by less than `gain_threshold`. Lengths over `max_length` are left out (a server
    rejects them). The per-batch overhead is `batch_overhead_tokens`, else the cost model's
    `const / per_token`, else `DEFAULT_BATCH_OVERHEAD_TOKENS`.

    `quantile` and `kmeans` cover every observed length with the buckets (the overlong lane
    then only catches lengths the sample never showed); `optimal` may also hand the longest
    lengths, up to `max_overlong_share` of the traffic, to the overlong lane when that costs
    less.
    """
    fit_method = FitMethod.parse(method)
    arr = np.asarray(lengths, dtype=np.int64).ravel()
    values, counts, excluded = _support(arr, max_length)
    overhead, overhead_line = _overhead(batch_overhead_tokens, cost)
    model = _make_model(
        rate, max_wait_s, max_batch, overlong_max_batch, overlong_max_wait_s, overhead
    )
    auto = buckets == "auto"
    if auto:
        kmax = max_auto_buckets
    elif isinstance(buckets, int) and not isinstance(buckets, bool) and buckets >= 1:
        kmax = buckets
    else:
        raise ValueError(f"buckets must be a positive integer or 'auto', got {buckets!r}")
    u = len(values)
    reasoning = [
        f"sample: {int(counts.sum())} requests within max_length={max_length}, {u} distinct "
        f"lengths" + (f"; {excluded} longer ones left out (rejected)" if excluded else ""),
        (
            f"batching model: {rate:g} req/s, max_wait {max_wait_s * 1e3:g} ms, max_batch "
            f"{max_batch}; overlong lane max_batch {overlong_max_batch}, max_wait "
            f"{overlong_max_wait_s * 1e3:g} ms"
            if rate is not None
            else f"batching model: no arrival rate, so every batch is full (max_batch "
            f"{max_batch}; overlong lane {overlong_max_batch})"
        ),
        overhead_line,
    ]
    if not 0 <= max_overlong_share <= 1:
        raise ValueError(f"max_overlong_share must be in [0, 1], got {max_overlong_share}")
    if fit_method is FitMethod.OPTIMAL:
        reasoning.append(
            f"the overlong lane may take the longest requests, up to "
            f"{100 * max_overlong_share:g}% of traffic, where that lowers the cost"
        )
    if kmax > u:
        reasoning.append(f"only {u} distinct lengths: at most {u} buckets")
        kmax = u
    in_limit = arr[arr <= max_length]
    cands = _candidates(fit_method, in_limit, values, counts, kmax, model, max_overlong_share)
    scored = [_score(values, counts, b, max_length, model) for b in cands]
    if auto:
        reasoning.append(
            f"{fit_method.value} for K = 1..{kmax} (cost = token-equivalents/request):"
        )
        for k, (bounds, (obj, waste, _)) in enumerate(zip(cands, scored, strict=True), start=1):
            gain = "" if k == 1 else f", gain {100 * (1 - obj / scored[k - 2][0]):5.1f}%"
            reasoning.append(
                f"  K={k:2d}: cost {obj:8.2f}, waste {100 * waste:5.1f}%{gain}  {list(bounds)}"
            )
        k, why = _pick_k([s[0] for s in scored], gain_threshold)
        reasoning.append(why)
    else:
        k = kmax
    bounds = cands[k - 1]
    objective, waste, lanes = scored[k - 1]
    if len(bounds) < k:
        reasoning.append(
            f"{len(bounds)} distinct boundaries instead of {k}: equal-mass cuts coincided "
            "on heavily repeated lengths"
        )
    reasoning.append(
        f"{fit_method.value}: boundaries {list(bounds)}, expected padding waste "
        f"{100 * waste:.1f}%, cost {objective:.2f} token-equivalents/request"
    )
    reasoning.extend(_lane_line(lane) for lane in lanes)
    return FitResult(
        method=fit_method,
        boundaries=bounds,
        expected_padding_waste=waste,
        shares=tuple(lane.share for lane in lanes),
        reasoning=tuple(reasoning),
        objective=objective,
        lanes=lanes,
        max_length=max_length,
        excluded=excluded,
    )
