"""Bucket boundaries fitted to a length sample: equal-mass quantiles, exact 1-D k-means, or the
partition that minimises the expected cost of serving the sample.

One model (`lenbatch.plan.padmodel`: expected padded tokens plus a per-batch overhead per request,
with each lane's batch size following its share of the arrival rate) scores every method, so
their results compare on one scale, and `auto` picks the number of buckets on it. The DPs run
over the sorted distinct lengths with their counts. Pure numpy.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Literal

import numpy as np
import numpy.typing as npt

from lenbatch.plan.costmodel import CostModel
from lenbatch.plan.padmodel import (
    BatchModel,
    LaneFit,
    expected_padding_waste,
    lane_cost,
    length_support,
    poisson_cutoff,
    score_boundaries,
    score_partition,
)
from lenbatch.plan.trace import FloatArray, IntArray

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
    # (at most K buckets: fewer where another one would only cost more)

    @classmethod
    def parse(cls, name: str | FitMethod) -> FitMethod:
        """The method called `name`, or a ValueError listing the valid names."""
        try:
            return cls(str(name).strip().lower())
        except ValueError:
            valid = ", ".join(m.value for m in cls)
            raise ValueError(f"unknown fit method {name!r}; choose one of: {valid}") from None


@dataclass(frozen=True)
class FitResult:
    """Fitted boundaries and what the model predicts for them."""

    method: FitMethod
    # Ascending upper bounds; the last one < max_length leaves an overlong lane above it,
    # == max_length means none.
    boundaries: tuple[int, ...]
    expected_padding_waste: float  # token-weighted, under the model in `lenbatch.plan.padmodel`
    shares: tuple[float, ...]  # fraction of traffic per lane (buckets + overlong)
    reasoning: tuple[str, ...]  # human-readable lines (esp. for auto K)
    objective: float = math.nan  # expected cost per request, token-equivalents
    lanes: tuple[LaneFit, ...] = ()
    max_length: int = 0
    excluded: int = 0  # sample lengths over max_length, left out (a server rejects them)


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
    values: IntArray, counts: FloatArray, kmax: int, model: BatchModel, max_overlong_share: float
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
        cut = poisson_cutoff(model.rate * max(wait_b, wait_o))
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
        cost: FloatArray = share * lane_cost(emax, ns, share, cap_b, wait_b, model)[2]
        return cost

    f, back = _partition_dp(u, kmax, column)
    # After the pass, rem holds R_n(a, u-1): the overlong lane starting at a.
    share = (total - cum[:u]) / total
    over = share * lane_cost(float(values[-1]) - rem, ns, share, cap_o, wait_o, model)[2]
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
    model: BatchModel,
    max_overlong_share: float,
) -> list[tuple[int, ...]]:
    """The method's boundaries for k = 1..kmax buckets."""
    if method is FitMethod.QUANTILE:
        return [_quantile_bounds(lengths, values, k) for k in range(1, kmax + 1)]
    if method is FitMethod.KMEANS:
        return _kmeans_dp(values, counts, kmax)
    # At most k buckets: where one more only costs (its queue would starve), keep fewer
    # rather than spend the extra boundaries on slivers of traffic.
    out: list[tuple[int, ...]] = []
    best = math.inf
    for obj, bounds in _optimal_dp(values, counts, kmax, model, max_overlong_share):
        if obj < best * (1 - 1e-12):
            best = obj
            out.append(bounds)
        else:
            out.append(out[-1])
    return out


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
    """Fit bucket boundaries to a length sample, scored by the model in `lenbatch.plan.padmodel`.

    `buckets` is the number of buckets below the overlong lane, or `"auto"`: try 1 to
    `max_auto_buckets` and keep the K after which one more bucket cuts the expected cost per
    request by less than `gain_threshold`. Lengths over `max_length` are left out (a server
    rejects them). The per-batch overhead is `batch_overhead_tokens`, else the cost model's
    `const / per_token`, else `DEFAULT_BATCH_OVERHEAD_TOKENS`.

    `quantile` and `kmeans` cover every observed length with the buckets (the overlong lane
    then only catches lengths the sample never showed); `optimal` may also hand the longest
    lengths, up to `max_overlong_share` of the traffic, to the overlong lane when that costs
    less, and uses at most `buckets` buckets: fewer where another would only cost more.
    """
    fit_method = FitMethod.parse(method)
    arr = np.asarray(lengths, dtype=np.int64).ravel()
    values, counts, excluded = length_support(arr, max_length)
    overhead, overhead_line = _overhead(batch_overhead_tokens, cost)
    model = BatchModel(
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
    scored = [score_partition(values, counts, b, max_length, model) for b in cands]
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
    if len(bounds) < k and fit_method is FitMethod.QUANTILE:
        reasoning.append(
            f"{len(bounds)} distinct boundaries instead of {k}: equal-mass cuts coincided "
            "on heavily repeated lengths"
        )
    elif len(bounds) < k:
        reasoning.append(
            f"{len(bounds)} buckets instead of {k}: more would cost more here (smaller "
            "batches pay the per-batch overhead more often than padding saves)"
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
