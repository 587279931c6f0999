"""Length ranges across replicas: which replica group owns which input lengths.

Inside one replica, buckets keep lengths apart. Across replicas, a router that ignores length
(random, power of two choices) hands every replica the whole mix again, so each replica's
buckets fill N times slower. Here the length axis is cut into one contiguous range per replica
group instead, so a group sees only its own lengths and its buckets fill as fast as one server's.

The cuts give each group a similar share of *model time*. A request of length L is padded to
about the upper bound Lp of its bucket (the overlong lane: to L itself), and with a cost model
`a + b*B*L + c*B*L^2` seconds per batch (`core.costfit`) and its bucket's mean batch size B it
costs `a/B + b*Lp + c*Lp^2` seconds (`RequestCost`): the per-call cost `a` weighs on short
inputs, which run in small, fast batches, and the quadratic term on long ones. Without a cost
model the weight is Lp, padded tokens (the first plan, before any batch was timed). The share
is measured on the lengths seen lately (a window), starting from a prior of one request per
bucket at the bucket's middle. Cuts sit on bucket boundaries when that is balanced enough (a
bucket then lives on one group only); otherwise at the exact quantile. When the window's mix
or the cost model drifts so a group's share leaves the tolerance, the cuts are recomputed
(`LengthRanges.observe` and `set_cost` say when).

`assign_groups` keeps replicas in their group across membership changes (a restarted replica
takes the place of the one that died), and `rank_replicas` orders a group's replicas for one
call, spilling to the least-loaded replica elsewhere when every owner is saturated (a count
of calls in flight) or when the owners' expected queue wait (seconds of model time in flight)
exceeds another replica's by more than `spill_wait`.

Pure: no clock, no I/O, no Ray.
"""

from __future__ import annotations

import itertools
import math
from bisect import bisect_left
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from lenbatch.core.costfit import CostCoefficients

__all__ = [
    "LengthRanges",
    "RangePlan",
    "RequestCost",
    "assign_groups",
    "padded_work",
    "plan_ranges",
    "rank_replicas",
]


def padded_work(length: int, boundaries: Sequence[int], max_length: int) -> int:
    """Padded tokens a request of `length` costs at most: its bucket's upper bound, or its own
    length in the overlong lane (batches there are padded to their longest member)."""
    i = bisect_left(boundaries, length)
    if i < len(boundaries):
        return min(boundaries[i], max_length)
    return min(length, max_length)


@dataclass(frozen=True, slots=True)
class RequestCost:
    """Model seconds one request costs, by its length: `a/B + b*Lp + c*Lp^2`, Lp its padded
    length and B its lane's mean batch size (`batch[lane]`, 1 where unknown). Without
    coefficients: Lp, padded tokens."""

    coefficients: CostCoefficients | None = None
    batch: tuple[float, ...] = field(default=())

    def of(self, length: int, boundaries: Sequence[int], max_length: int) -> float:
        """The weight of one request of `length` tokens."""
        lp = padded_work(length, boundaries, max_length)
        co = self.coefficients
        if co is None:
            return float(lp)
        lane = bisect_left(boundaries, length)
        b = self.batch[lane] if lane < len(self.batch) else 1.0
        b = max(1.0, b)
        return co.seconds(b, lp) / b


PADDED_TOKENS = RequestCost()


@dataclass(frozen=True, slots=True)
class RangePlan:
    """Group `g` owns lengths in `(cuts[g-1], cuts[g]]`; the first group everything up to
    `cuts[0]`, the last everything above `cuts[-1]`. `shares` is each group's fraction of the
    work (`RequestCost`) of the sample the plan was made from."""

    cuts: tuple[int, ...]
    shares: tuple[float, ...]

    @property
    def groups(self) -> int:
        """How many groups the plan cuts the lengths into."""
        return len(self.cuts) + 1

    def owner(self, length: int) -> int:
        """The group that owns inputs of `length` tokens."""
        return bisect_left(self.cuts, length)

    def describe(self) -> list[dict[str, object]]:
        """One row per group: its length range and work share (for /stats)."""
        rows: list[dict[str, object]] = []
        lo = 1
        for g in range(self.groups):
            hi = self.cuts[g] if g < len(self.cuts) else None
            rows.append({"group": g, "min_len": lo, "max_len": hi, "work_share": self.shares[g]})
            if hi is not None:
                lo = hi + 1
        return rows


def _shares(
    cuts: Sequence[int], lengths: Sequence[int], work: Sequence[float], groups: int
) -> tuple[float, ...]:
    per = [0.0] * groups
    for n, w in zip(lengths, work, strict=True):
        per[bisect_left(cuts, n)] += w
    total = sum(per) or 1.0
    return tuple(x / total for x in per)


def plan_ranges(
    lengths: Sequence[int],
    boundaries: Sequence[int],
    max_length: int,
    groups: int,
    *,
    tolerance: float = 0.1,
    cost: RequestCost = PADDED_TOKENS,
) -> RangePlan:
    """Cut the length axis into `groups` ranges of similar work (`cost`: model seconds, or
    padded tokens by default) on `lengths`.

    Each cut is placed where the cumulative work of the length-sorted sample crosses `g/groups`.
    If a bucket boundary lies close enough that every group's share stays within
    `(1 + tolerance) / groups`, the boundary is taken instead, so a bucket is not split
    between two groups. Cuts are strictly increasing; with fewer distinct lengths than groups,
    the spare groups own ranges nothing falls in.
    """
    if groups < 1:
        raise ValueError(f"groups must be at least 1, got {groups}")
    if groups == 1:
        return RangePlan((), (1.0,))
    sample = sorted(max(1, min(int(n), max_length)) for n in lengths) or [1]
    work = [cost.of(n, boundaries, max_length) for n in sample]
    total = float(sum(work))
    cuts: list[int] = []
    acc, i = 0.0, 0
    for g in range(1, groups):
        target = total * g / groups
        while i < len(sample) and acc + work[i] <= target:
            acc += work[i]
            i += 1
        # The quantile cut: the last length whose cumulative work stays under the target.
        cut = sample[i - 1] if i > 0 else sample[0]
        floor = cuts[-1] + 1 if cuts else 1
        cuts.append(max(cut, floor))
    exact = tuple(cuts)
    limit = (1 + tolerance) / groups
    snapped = list(exact)
    for k, cut in enumerate(exact):
        nearest = sorted((abs(b - cut), b) for b in boundaries if b < max_length)
        for _, b in nearest[:3]:
            trial = [*snapped[:k], b, *snapped[k + 1 :]]
            if any(x >= y for x, y in itertools.pairwise(trial)):
                continue
            if max(_shares(trial, sample, work, groups)) <= limit:
                snapped = trial
                break
    final = tuple(snapped)
    return RangePlan(final, _shares(final, sample, work, groups))


def _prior(boundaries: Sequence[int], max_length: int) -> list[int]:
    """One request per bucket at its middle (and the overlong lane's): the mix assumed before
    any traffic is seen."""
    uppers = [*[b for b in boundaries if b < max_length], max_length]
    out, lo = [], 0
    for up in uppers:
        out.append(max(1, (lo + 1 + up) // 2))
        lo = up
    return out


class LengthRanges:
    """The live range plan: cuts from the fitted boundaries and the lengths seen lately,
    re-planned when the mix drifts.

    `observe(lengths)` records inputs; every `check_every` inputs (once `min_sample` have been
    seen) it measures each group's share of the window's work under the current cuts and
    re-plans if one leaves `(1 ± drift) / groups`; `set_cost` swaps the per-request cost (a new
    fit of the cost model) and checks at once. `owner(length)` answers with the current plan.
    """

    def __init__(
        self,
        boundaries: Sequence[int],
        max_length: int,
        groups: int,
        *,
        window: int = 4096,
        check_every: int = 128,
        min_sample: int = 128,
        drift: float = 0.25,
        tolerance: float = 0.1,
    ) -> None:
        if check_every < 1 or window < 1:
            raise ValueError("window and check_every must be at least 1")
        self.boundaries = tuple(sorted(boundaries))
        self.max_length = max_length
        self.groups = groups
        self.drift = drift
        self.tolerance = tolerance
        self.check_every = check_every
        self.min_sample = min_sample
        self.window: deque[int] = deque(maxlen=window)
        self.cost = PADDED_TOKENS
        self.plan = plan_ranges(
            _prior(self.boundaries, max_length), self.boundaries, max_length, groups,
            tolerance=tolerance,
        )  # fmt: skip
        self.rebalances = 0
        self._since_check = 0

    def owner(self, length: int) -> int:
        """The group that owns inputs of `length` tokens now."""
        return self.plan.owner(length)

    def observe(self, lengths: Iterable[int]) -> bool:
        """Record the lengths of admitted inputs; True if this re-planned the cuts."""
        n = 0
        for x in lengths:
            self.window.append(int(x))
            n += 1
        self._since_check += n
        if self._since_check < self.check_every or len(self.window) < self.min_sample:
            return False
        self._since_check = 0
        return self._maybe_replan()

    def set_cost(self, cost: RequestCost) -> bool:
        """Weigh requests by `cost` from now on; True if this re-planned the cuts."""
        self.cost = cost
        if len(self.window) < self.min_sample:
            return False
        self._since_check = 0
        return self._maybe_replan()

    def weight(self, length: int) -> float:
        """What one request of `length` tokens costs under the current weighting."""
        return self.cost.of(length, self.boundaries, self.max_length)

    def current_shares(self) -> tuple[float, ...]:
        """Each group's share of the window's work under the current cuts."""
        sample = list(self.window)
        work = [self.weight(n) for n in sample]
        return _shares(self.plan.cuts, sample, work, self.groups)

    def _maybe_replan(self) -> bool:
        if self.groups == 1:
            return False
        shares = self.current_shares()
        even = 1 / self.groups
        if all(abs(s - even) <= self.drift * even for s in shares):
            return False
        new = plan_ranges(
            list(self.window), self.boundaries, self.max_length, self.groups,
            tolerance=self.tolerance, cost=self.cost,
        )  # fmt: skip
        if new.cuts == self.plan.cuts:
            return False
        self.plan = new
        self.rebalances += 1
        return True


def assign_groups(previous: Mapping[str, int], live: Iterable[str], groups: int) -> dict[str, int]:
    """Replica id -> group for the `live` replicas, keeping each one's previous group.

    A new replica (a restart, a scale-up) joins the group with the fewest members, lowest
    group first, new ids in sorted order, so the result does not depend on arrival order.
    """
    live_ids = sorted(set(live))
    out = {r: previous[r] for r in live_ids if r in previous and 0 <= previous[r] < groups}
    members = [0] * groups
    for g in out.values():
        members[g] += 1
    for r in live_ids:
        if r in out:
            continue
        g = min(range(groups), key=lambda k: (members[k], k))
        out[r] = g
        members[g] += 1
    return out


def rank_replicas(
    owner: int,
    groups: Mapping[str, int],
    loads: Mapping[str, int],
    spill_at: int,
    waits: Mapping[str, float] | None = None,
    spill_wait: float = math.inf,
) -> tuple[list[list[str]], bool]:
    """Replica ids to try for a call owned by group `owner`, best rank first, and whether the
    first choice is a spill (a replica outside the owning group).

    The owners come first, least loaded first (by expected wait `waits`, seconds of model time
    in flight, when given; then by calls in flight); the other replicas follow as the fallback
    (Ray moves to the next rank when a whole rank is full). The least-loaded other replica goes
    first instead (the call spills) if every owner has `spill_at` or more calls in flight and
    it has fewer, or if the owners' least expected wait exceeds its own by more than
    `spill_wait` seconds. An owning group with no live replica spills too.
    """
    wait = waits or {}

    def load(r: str) -> tuple[float, int, str]:
        return (wait.get(r, 0.0), loads.get(r, 0), r)

    owners = sorted((r for r, g in groups.items() if g == owner), key=load)
    others = sorted((r for r, g in groups.items() if g != owner), key=load)
    if not owners:
        return ([others] if others else []), bool(others)
    if others:
        best, other = owners[0], others[0]
        least = min(loads.get(r, 0) for r in owners)
        by_count = least >= spill_at and loads.get(other, 0) < least
        by_wait = wait.get(best, 0.0) - wait.get(other, 0.0) > spill_wait
        if by_count or by_wait:
            return [rank for rank in ([other], owners, others[1:]) if rank], True
    return [rank for rank in (owners, others) if rank], False
