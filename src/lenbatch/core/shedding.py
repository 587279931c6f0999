"""Deadline-aware shedding for the `adaptive` strategy: refuse at admission a call that cannot
meet its due time, and answer a queued request that no longer can. Pure, clock injected.

With `B` rows padded to `L`, a batch takes `t(B, L)` seconds (the online cost model). A call is
refused at admission (429/503 with Retry-After, by `shed`) when its due time lies before the
predicted end of the work ahead of it: what the runner still has plus everything queued, lane
by lane in full batches (`queued_work`), plus its own `t(1, len)`. The scheduler sheds a
request at the head of its lane that cannot meet its due time even alone. `shed = late`
refuses nothing: such requests are kept and served late.

`Shedding` is the admission side of `core.adaptive.AdaptiveState` (its base class), kept apart
from the batch-forming side; it reads the state's policy, estimates and backlog.
"""

from __future__ import annotations

from collections.abc import Sequence

from lenbatch.config import ShedMode
from lenbatch.core.errors import LenbatchError
from lenbatch.core.estimates import LaneEstimates
from lenbatch.core.lanes import SchedulerConfig
from lenbatch.core.queues import Queues
from lenbatch.core.request import Request
from lenbatch.core.slo import AdaptivePolicy

__all__ = ["Shedding"]


class Shedding:
    """Admission refusals and the answers of shed requests, for `AdaptiveState`."""

    policy: AdaptivePolicy
    estimates: LaneEstimates
    concurrency: int  # batches the runner(s) execute at once
    backlog_end: float  # predicted time the runner(s) finish what was emitted
    shed_counts: dict[str, int]  # "admission": refused; "queue": shed from a lane

    def queued_work(self, queues: Queues, cfg: SchedulerConfig) -> float:
        """Predicted seconds to run everything queued, lane by lane in full batches."""
        co = self.estimates.cost.coefficients
        padded = self.estimates.padded
        work = 0.0
        for i, q in enumerate(queues.lanes):
            n = len(q)
            if not n:
                continue
            cap = cfg.lanes[i].max_batch
            pad = padded[i]
            cap = max(1, min(cap, int(cfg.max_batch_tokens // max(pad, 1.0))))
            full, rest = divmod(n, cap)
            work += full * co.seconds(cap, pad)
            if rest:
                work += co.seconds(rest, pad)
        return work / self.concurrency

    def admit(
        self,
        lengths: Sequence[int],
        due: float,
        queues: Queues,
        cfg: SchedulerConfig,
        now: float,
    ) -> LenbatchError | None:
        """None if a call of `lengths` due at `due` can meet it given the work predicted ahead
        of it; else the 429/503 (with Retry-After) to answer at once. Never refuses with
        `shed = late`."""
        if self.policy.shed is ShedMode.LATE or not lengths:
            return None
        ahead = max(0.0, self.backlog_end - now) + self.queued_work(queues, cfg)
        own = self.estimates.cost.seconds(1, max(lengths))
        if now + ahead + own <= due:
            return None
        self.shed_counts["admission"] += 1
        return self.policy.refusal(ahead, due - now, own)

    def shed_error(self, r: Request, now: float) -> LenbatchError:
        """The answer of a queued request shed because it can no longer meet its due time."""
        ahead = max(0.0, self.backlog_end - now)
        own = self.estimates.cost.seconds(1, r.length)
        return self.policy.refusal(ahead, self.policy.due(r) - r.arrival, own)
