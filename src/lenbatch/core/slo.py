"""The `adaptive` strategy's policy: its knobs, the SLO of each priority level, when a request is
due, its level in service order, and the answer it gets when shed. Pure, clock injected.

Every request has a due time: arrival + the SLO of its priority level (or the call's own
timeout). A request that waited `aging` runs as the top level. The default SLO is derived from
the cost model (`derive_slo`), and an SLO that the longest admissible input cannot meet even
alone is refused at start-up (`check_slo`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lenbatch.config import AdaptiveConfig, ShedMode
from lenbatch.core.costfit import OnlineCostModel
from lenbatch.core.errors import LenbatchError, Overloaded, Unavailable
from lenbatch.core.request import Request

__all__ = ["SHED_CODE", "AdaptivePolicy", "check_slo", "derive_slo"]

SHED_CODE = "deadline_unmeetable"  # the error code of a request shed for its deadline


@dataclass(frozen=True, slots=True)
class AdaptivePolicy:
    """The strategy's knobs, resolved (seconds)."""

    level_slo: tuple[float, ...]  # SLO of each priority level, lowest level first
    min_wait: float = 0.0
    max_wait: float = 0.1
    late_binding: bool = True
    fill_gain: float = 0.1
    fill_load: float = 0.7
    fill_ramp: float = 0.3  # load span over which the fill window grows to its full length
    rate_window: float = 1.0
    merge: bool = True
    shed: ShedMode = ShedMode.REJECT_429
    aging: float = 1.0

    @property
    def levels(self) -> int:
        """Number of priority levels."""
        return len(self.level_slo)

    @classmethod
    def from_config(cls, ac: AdaptiveConfig, slo: float) -> AdaptivePolicy:
        """From the `[adaptive]` settings, with `slo` (seconds) for levels not given one."""
        if ac.priority_slo_ms is not None:
            level_slo = tuple(v / 1000 for v in ac.priority_slo_ms)
        else:
            level_slo = (slo,) * ac.priority_levels
        return cls(
            level_slo=level_slo,
            min_wait=ac.min_wait_ms / 1000,
            max_wait=ac.max_wait_ms / 1000,
            late_binding=ac.late_binding,
            fill_gain=ac.fill_gain,
            fill_load=ac.fill_above_load,
            fill_ramp=ac.fill_ramp,
            rate_window=ac.rate_window_s,
            merge=ac.merge,
            shed=ac.shed,
            aging=ac.aging_ms / 1000,
        )

    def slo_of(self, priority: int) -> float:
        """The SLO (seconds) of a priority level."""
        return self.level_slo[min(max(priority, 0), self.levels - 1)]

    def due_of(self, arrival: float, priority: int, timeout: float | None) -> float:
        """When a request arriving at `arrival` is due: its call's timeout, else its level's SLO."""
        return arrival + (timeout if timeout is not None else self.slo_of(priority))

    def due(self, r: Request) -> float:
        """When `r` is due: the due time stamped at admission, else its level's SLO."""
        return r.due if r.due is not None else r.arrival + self.slo_of(r.priority)

    def level(self, r: Request, now: float) -> int:
        """`r`'s level in service order at `now`: its priority, or the top once it has aged."""
        top = self.levels - 1
        if now - r.arrival >= self.aging:
            return top  # aged: runs as the top level (FIFO among them: it is older)
        return min(max(r.priority, 0), top)

    def refusal(self, ahead: float, budget: float, own: float) -> LenbatchError:
        """The answer (429 or 503 by `shed`, with Retry-After) of a request predicted to miss
        its due time: `ahead` seconds of work before it, `own` seconds its own, `budget`
        seconds it had."""
        retry = max(0.05, ahead)
        msg = (
            f"predicted to miss its deadline: about {ahead * 1000:.0f} ms of work is queued "
            f"ahead of it and it takes {own * 1000:.0f} ms, over its budget of "
            f"{max(budget, 0.0) * 1000:.0f} ms; retry in {retry:.2f} s"
        )
        if self.shed is ShedMode.REJECT_503:
            return Unavailable(msg, retry_after=retry, code=SHED_CODE)
        return Overloaded(msg, retry_after=retry, code=SHED_CODE)


def derive_slo(cost: OnlineCostModel, longest: int) -> float:
    """The default SLO: four times the predicted time of the longest input alone, >= 100 ms."""
    return max(0.1, 4 * cost.seconds(1, longest))


def check_slo(policy: AdaptivePolicy, cost: OnlineCostModel, longest: int) -> None:
    """Refuse (ValueError, saying why) an SLO that the longest admissible input cannot meet
    even alone on an idle runner: every batch holding it would miss it."""
    alone = cost.seconds(1, longest)
    for level, slo in enumerate(policy.level_slo):
        if slo < alone:
            which = f"priority level {level}'s SLO" if policy.levels > 1 else "the SLO"
            raise ValueError(
                f"{which} of {slo * 1000:.0f} ms is below the predicted time of the longest "
                f"admissible input alone ({alone * 1000:.0f} ms for 1 x {longest} tokens, by "
                f"the cost model): no batch holding it could meet it. Raise slo_ms to at "
                f"least {math.ceil(alone * 1000)} or lower the model's max_length"
            )
