"""The shedding rule of `adaptive` before issue 24's fix (commit 15341d5), reproduced for the
tests that must tell it from the current one (`test_shedding_prefix.py`).

Before the fix, admission refused a call when `now + ahead + t(1, len) > due`, where `ahead`
was the predicted end of the emitted work (kept even once the runner was idle) plus
everything queued, every lane, every level and due time, in full batches, and the call's own
input was one more batch of its own; finished batches taught the cost model only (the
predicted backlog did not move by measured minus predicted, and there was no drift)."""

from __future__ import annotations

from collections.abc import Sequence

from lenbatch.config import ShedMode
from lenbatch.core.adaptive import AdaptiveState
from lenbatch.core.errors import LenbatchError
from lenbatch.core.lanes import SchedulerConfig
from lenbatch.core.queues import Queues


class PrefixState(AdaptiveState):
    """`AdaptiveState` with the pre-fix admission rule and batch observation."""

    @property
    def drift(self) -> float:
        return 1.0

    def cpu_slowdown(self, now: float, steady: bool = False) -> float:
        return 1.0

    def observe_batch(
        self, lane: int, size: int, padded_len: int, seconds: float, now: float | None = None
    ) -> None:
        self.estimates.observe_batch(lane, size, padded_len, seconds)

    def admit(
        self,
        lengths: Sequence[int],
        due: float,
        queues: Queues,
        cfg: SchedulerConfig,
        now: float,
        priority: int = 0,
    ) -> LenbatchError | None:
        if self.policy.shed is ShedMode.LATE or not lengths:
            return None
        queued, _ = self.queued_work(queues, cfg)  # everything queued
        ahead = max(0.0, self.backlog_end - now) + queued
        own = self.estimates.cost.seconds(1, max(lengths))
        if now + ahead + own <= due:
            return None
        self.shed_counts["admission"] += 1
        return self.policy.refusal(ahead, due - now, own)
