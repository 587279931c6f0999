"""Deadline-aware shedding for the `adaptive` strategy: refuse at admission a call that cannot
meet its due time, and answer a queued request that no longer can. Pure, clock injected.

With `B` rows padded to `L`, a batch takes `t(B, L)` seconds (the online cost model). Shedding
is a last resort: a call is refused at admission (429/503 with Retry-After, by `shed`) only
when, even served as early as the scheduler would ever serve it, it cannot finish by its due
time. What it cannot jump is counted ahead of it: the work still on the runner(s) (none when
nothing is in flight) and the queued requests of its own priority level or above that are due
no later than it (lane by lane in full batches, its own inputs in its lane: `queued_work`);
queued requests of lower levels or later due times would be served after it. Then its own
`t(1, len)`. The scheduler sheds a request at the head of its lane that cannot meet its due
time even alone (within a tolerance of 2 % of its SLO while the load drains:
`AdaptiveState.drains`). `shed = late` refuses nothing: such requests are kept and served late.

The predictions are kept honest by what the runner measures: each finished batch moves the
predicted end of the emitted work by its measured minus predicted time, and the shedding
decisions scale the cost model's times by `drift`, the recent measured / predicted ratio
(a moving average over about five batches, `AdaptiveState.observe_batch`): a slowdown (another
process on the cores) or a speed-up counts at once, not only once the window's fit has moved.
The queued work ahead of a call is scaled by `queue_drift`, the same ratio over about twenty
batches: a queue drains over the next second, and a burst's flood of requests slows only the
batches that run while it is parsed (on a 2-core Intel Xeon, bursts at half of capacity: with
the five-batch ratio adaptive refused 27-65 of 1,908 calls that `bucketed` served in time,
with the twenty-batch one 0-1). Only full batches (half their lane's cap or more) count in
it, because a queue drains in full batches: a trickle's single rows run up to twice their
share of the fit (cold weights, per-call overheads), and counted they made a fresh server
refuse 2.6-5.1 % of the `bursts` scenario's calls, against 0.7-1.2 % without them. They are
also multiplied by the request-side CPU slowdown at the arrival rate
(`core.occupancy.cpu_slowdown`: the HTTP and tokenization CPU per request, measured live,
takes its share of the cores the model runs on): the call's own batch at the
current rate (a one-second average, which follows a burst at once), the queued work at the
steady rate (a five-second average, `LaneEstimates.steady_rate`). The queue drains after a
burst has been parsed; priced at the burst's rate, on the same Xeon at half of capacity,
adaptive refused 3-6 % of the `bursts` scenario's calls that `bucketed` served in time (goodput
0.94-0.95x `bucketed`'s); priced at the steady rate, 0-0.7 % (+4.5 % goodput, alternated
A/B), with the same goodput at 1.5x and 3x capacity, where the steady and the current rate
agree.

Every refusal and shed is recorded with what was predicted (`core.decisions.DecisionLog`).

`Shedding` is the admission side of `core.adaptive.AdaptiveState` (its base class), kept apart
from the batch-forming side; it reads the state's policy, estimates and backlog.
"""

from __future__ import annotations

from collections.abc import Sequence

from lenbatch.config import ShedMode
from lenbatch.core.decisions import DecisionLog, ShedDecision
from lenbatch.core.errors import LenbatchError
from lenbatch.core.estimates import LaneEstimates
from lenbatch.core.lanes import SchedulerConfig
from lenbatch.core.queues import Queues
from lenbatch.core.request import Request
from lenbatch.core.slo import AdaptivePolicy

__all__ = ["Shedding", "full_rows"]


def full_rows(max_batch: int, max_batch_tokens: int, padded_len: float) -> int:
    """Rows in a full batch of a lane: its row cap, or the token budget at `padded_len`."""
    return max(1, min(max_batch, int(max_batch_tokens // max(padded_len, 1.0))))


class Shedding:
    """Admission refusals and the answers of shed requests, for `AdaptiveState`."""

    policy: AdaptivePolicy
    estimates: LaneEstimates
    concurrency: int  # batches the runner(s) execute at once
    backlog_end: float  # predicted time the runner(s) finish what was emitted
    shed_counts: dict[str, int]  # "admission": refused; "queue": shed from a lane
    decisions: DecisionLog  # why each was refused or shed

    @property
    def drift(self) -> float:
        """Recent measured / predicted batch time (`AdaptiveState.drift`)."""
        raise NotImplementedError

    @property
    def queue_drift(self) -> float:
        """`drift` over more batches (`AdaptiveState.queue_drift`)."""
        raise NotImplementedError

    def cpu_slowdown(self, now: float, steady: bool = False) -> float:
        """The request-side CPU slowdown at `now` (`AdaptiveState.cpu_slowdown`)."""
        raise NotImplementedError

    def running_work(self, queues: Queues, now: float) -> float:
        """Predicted seconds until a runner slot frees up for queued work: what was emitted
        and has not finished, 0 when nothing is in flight (a stale prediction is not work)."""
        if queues.inflight_total <= 0:
            return 0.0
        return max(0.0, self.backlog_end - now)

    def drains(self, now: float, cfg: SchedulerConfig) -> bool:
        """Whether full batches can serve the arrivals of the last few seconds: the steady
        arrival rate (`LaneEstimates.steady_rate`) x a request's share of a full batch of its
        lane (lanes mixed as the current rates mix them), slowed as the queue's drain is
        (`queue_drift`, the request-side CPU at the steady rate), within the batches the
        runner runs at once. A burst on such a load drains; a sustained overload does not."""
        est = self.estimates
        steady = est.steady_rate(now)
        if steady <= 0:
            return True
        co = est.cost.coefficients
        total = share = 0.0
        for i, lp in enumerate(cfg.lanes):
            rate = est.rate(i, now)
            if rate <= 0:
                continue
            pad = est.padded[i]
            cap = full_rows(lp.max_batch, cfg.max_batch_tokens, pad)
            total += rate
            share += rate * co.seconds(cap, pad) / cap
        if total <= 0:
            return True
        busy = steady * (share / total) * self.queue_drift * self.cpu_slowdown(now, steady=True)
        return busy < self.concurrency

    def queued_work(
        self,
        queues: Queues,
        cfg: SchedulerConfig,
        due: float | None = None,
        priority: int = 0,
        extra: Sequence[int] = (),
    ) -> tuple[float, int]:
        """Predicted seconds to run the queued requests a call due at `due` with `priority`
        cannot jump (all of them when `due` is None), lane by lane in full batches, with the
        call's own inputs of lengths `extra` in their lanes; and how many requests that is
        (not counting `extra`)."""
        co = self.estimates.cost.coefficients
        padded = self.estimates.padded
        pol = self.policy
        own: dict[int, int] = {}
        for n in extra:
            lane = queues.lane_of(n)
            own[lane] = own.get(lane, 0) + 1
        work = 0.0
        ahead = 0
        for i, q in enumerate(queues.lanes):
            if not q:
                n = 0
            elif due is None:
                n = len(q)
            else:
                n = sum(1 for r in q if r.priority >= priority and pol.due(r) <= due)
            ahead += n
            n += own.get(i, 0)
            if not n:
                continue
            pad = padded[i]
            cap = full_rows(cfg.lanes[i].max_batch, cfg.max_batch_tokens, pad)
            full, rest = divmod(n, cap)
            work += full * co.seconds(cap, pad)
            if rest:
                work += co.seconds(rest, pad)
        return work / self.concurrency, ahead

    def admit(
        self,
        lengths: Sequence[int],
        due: float,
        queues: Queues,
        cfg: SchedulerConfig,
        now: float,
        priority: int = 0,
    ) -> LenbatchError | None:
        """None if a call of `lengths` due at `due` can meet it given the work predicted ahead
        of it that it cannot jump (see the module docstring); else the 429/503 (with
        Retry-After) to answer at once, recorded in the decision log. Never refuses with
        `shed = late`."""
        if self.policy.shed is ShedMode.LATE or not lengths:
            return None
        running = self.running_work(queues, now)
        co = self.estimates.cost.coefficients
        longest = max(lengths)
        # the model's times as the last batches measured them, and as the request-side CPU
        # of the current arrival rate slows them (`core.occupancy`)
        slowdown = self.cpu_slowdown(now)
        own = self.drift * slowdown * co.seconds(1, longest)
        queued, ahead = self.queued_work(queues, cfg, due, priority, lengths)
        # the queue drains over the next second: at the arrival rate of the last few seconds,
        # not at a burst's, whose requests are parsed by the time they queue
        queued *= self.queue_drift * self.cpu_slowdown(now, steady=True)
        # `queued` holds the call's own inputs in their lanes' batches: it ends with them
        finish = now + running + max(queued, own)
        if finish <= due:
            return None
        self.shed_counts["admission"] += 1
        lane = queues.lane_of(longest)
        start = now + running
        self._record(
            "admission",
            now,
            longest,
            len(lengths),
            lane,
            priority,
            due,
            start,
            finish,
            running,
            queued,
            ahead,
            queues,
        )
        # Retry-After: the work ahead of it (its own share taken out of its lane's batches)
        return self.policy.refusal(running + max(0.0, queued - own), due - now, own)

    def _record(
        self,
        where: str,
        now: float,
        length: int,
        inputs: int,
        lane: int,
        priority: int,
        due: float,
        start: float,
        finish: float,
        running: float,
        queued: float,
        ahead: int,
        queues: Queues,
    ) -> None:
        co = self.estimates.cost.coefficients
        self.decisions.record(
            ShedDecision(
                at=now,
                where=where,
                length=length,
                inputs=inputs,
                lane=lane,
                priority=priority,
                due_in=due - now,
                start_in=start - now,
                finish_in=finish - now,
                running_s=running,
                queued_s=queued,
                queue_ahead=ahead,
                queued=queues.size,
                inflight=queues.inflight_total,
                cost_a_s=co.a,
                cost_b_s=co.b,
                cost_c_s=co.c,
                observed_batches=self.estimates.cost.observed,
                drift=self.drift,
                queue_drift=self.queue_drift,
            )
        )

    def shed_error(self, r: Request, now: float) -> LenbatchError:
        """The answer of a queued request shed because it can no longer meet its due time."""
        ahead = max(0.0, self.backlog_end - now)
        own = self.estimates.cost.seconds(1, r.length)
        return self.policy.refusal(ahead, self.policy.due(r) - r.arrival, own)
