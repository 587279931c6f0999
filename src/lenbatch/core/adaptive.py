"""The `adaptive` strategy: batches formed from a cost model and deadlines. Pure, clock injected.

The engine and the simulator both own one `AdaptiveState` and pass it to `schedule()`; it holds
what the strategy learns (`core.adaptive_learning`, its base, over `core.estimates`: the online
cost model, a per-lane arrival rate, the padded length each lane's batches reach), its policy
(`core.slo`: SLOs, due times, levels) and its admission side (`core.shedding`), and decides
here with them. Lanes are the bucketed ones.

Every request has a due time: arrival + the SLO of its priority level (or the call's own
timeout). With `B` rows padded to `L`, a batch takes `t(B, L)` seconds (`OnlineCostModel`),
and may start at `now + ahead` (`ahead`: predicted work still on the runner). Per decision:

1. **Shedding** (`shed` 429/503), a last resort: a request at the head of its lane that
   cannot meet its due time even alone (`now + ahead + t(1, len) > due`) is answered at once,
   and at admission a call is refused only when it cannot finish by its due time even ahead
   of every queued request it may jump (`admit`, `core.shedding`). Both scale the model's
   times by `drift`, how much slower or faster the last few batches ran than predicted, and
   by the slowdown the request-side CPU (HTTP, tokenization) causes at the current arrival
   rate (`core.occupancy`). While full batches can serve the arrivals of the last few seconds
   (`drains`: a burst on a load that drains), a head predicted late by no more than 2 % of
   its SLO is kept: a coin flip that `bucketed` takes and often wins (on a 2-core Intel Xeon,
   bursts at 230/s, six alternated rounds: 90.1 % in time against 88.9 %, with the same
   goodput at 1.5x and 3x capacity, where the tolerance is off). Each is recorded with what
   was predicted (`decisions`, in `/stats`). `shed = late` keeps them and serves them late.
2. **Formation**: each lane's candidate takes its requests in order (strict priority levels,
   FIFO within a level; a request that waited `aging` counts as the top level) up to
   `max_batch`, the token budget, and while the grown batch still meets every member's due time
   that it can still meet (a member already late alone does not hold the batch back).
3. **Late binding** (`late_binding`): once the runner's batch slots would be busy
   `fill_load` of the time serving requests one by one (below that there is model time to
   spare and waiting only adds latency), a lane short of its target waits to fill, while (a)
   one more request raises real tokens per model-second by `fill_gain` and (b) its latest feasible
   start (`min due - t(B, L) - ahead`) is not reached. The target is the largest `b` with
   `t(b, L) + (b - 1) / rate <= SLO / 2` (Nexus' rule, in padded tokens), filling no further
   than it pays; the wait it implies, `(target - 1) / rate`, is bounded by `min_wait` and
   `max_wait`, and scaled by `(load - fill_load) / fill_ramp` (at most 1): the wait grows with
   the load instead of switching on at one value of a noisy estimate (on an Intel Xeon family
   6 model 167, at 0.5x capacity the load sat at 0.68-0.79 against a step at 0.7, and the
   simulator's P95 there moved 39 -> 86 ms between two cost models of the same server; with
   the ramp 33 -> 50 ms). While the runner is busy a lane short of its target keeps filling
   (the batch would only wait in the prefetch slot), unless its latest start has come.
4. **Choice**: among ready lanes, the highest level first, then a batch that meets its
   deadline before one that cannot, then the earliest latest-start (Clockwork's rule).
5. **Merges** (`merge`): a batch leaving short of full is topped up with requests of the next
   shorter lanes, in their order, while the marginal cost of one more row at this padded length
   (`t(B + 1, L) - t(B, L)`) is below its share of the batch it would otherwise run in
   (`t(n, L_j) / n` with the `n` requests its lane holds) and no due time breaks.
"""

from __future__ import annotations

import math
from collections import deque
from itertools import islice
from typing import Any

from lenbatch.config import AdaptiveConfig, ShedMode
from lenbatch.core.adaptive_learning import AdaptiveLearning
from lenbatch.core.batch import Batch, Decision
from lenbatch.core.costfit import PROFILE_PRIOR_WEIGHT, CostCoefficients, OnlineCostModel
from lenbatch.core.lanes import SchedulerConfig
from lenbatch.core.queues import Queues
from lenbatch.core.request import Request
from lenbatch.core.shedding import full_rows
from lenbatch.core.slo import AdaptivePolicy, check_slo, derive_slo

__all__ = ["AdaptivePolicy", "AdaptiveState", "build_state", "check_slo", "derive_slo"]

_INF = math.inf
_FILL_SHARE = 0.5  # share of the SLO that waiting to fill plus the batch itself may use
_SHED_TOLERANCE = 0.02  # share of its SLO a request at a lane's head may be predicted late by
# and still be kept, while full batches can serve the arrivals of the last few seconds


def build_state(
    ac: AdaptiveConfig,
    prior: CostCoefficients | None,
    cfg: SchedulerConfig,
    *,
    longest: int,
    concurrency: int = 1,
    cores: int = 1,
) -> AdaptiveState:
    """The state an engine (or simulated run) starts with: an online cost model seeded from
    `prior` (None: the generic prior), the SLO given or derived from it, and checked against
    the longest admissible input (ValueError, saying why, when no batch could meet it)."""
    if prior is not None:  # measured on this processor: worth more than a few batches
        model = OnlineCostModel(prior, ac.cost_window, prior_weight=PROFILE_PRIOR_WEIGHT)
    else:
        model = OnlineCostModel(None, ac.cost_window)
    slo = ac.slo_ms / 1000 if ac.slo_ms is not None else derive_slo(model, longest)
    policy = AdaptivePolicy.from_config(ac, slo)
    check_slo(policy, model, longest)
    return AdaptiveState(policy, model, cfg, concurrency=concurrency, cores=cores)


class AdaptiveState(AdaptiveLearning):
    """What `adaptive` knows and has done: cost model, per-lane rates, counters. Owned by the
    engine or the simulator, passed to `schedule()`; times come from the caller's clock.

    What it learns and reports is `core.adaptive_learning.AdaptiveLearning`, its base; its
    admission side (`admit`, `shed_error`, `queued_work`) `core.shedding.Shedding`; the
    decision (`schedule`) is here."""

    # ------------------------------------------------------------------ the decision

    def _ordered(self, q: deque[Request], now: float, limit: int) -> list[Request]:
        """The first `limit` requests of a lane in service order: by level, FIFO within."""
        pol = self.policy
        if pol.levels > 1:
            p0 = q[0].priority
            if any(r.priority != p0 for r in q):  # one level: arrival order is service order
                ordered = sorted(q, key=lambda r: (-pol.level(r, now), r.arrival))
                return ordered[:limit]
        return list(islice(q, limit))

    def target_batch(self, lane: int, cfg: SchedulerConfig, now: float, slo: float) -> int:
        """The batch `lane` waits for: largest `b` with `t(b, L) + (b - 1) / rate` within half
        the SLO `slo`, filling only while one more row pays (`fill_gain`)."""
        pol = cfg.lanes[lane]
        est = self.estimates
        pad = est.padded[lane]
        cap = full_rows(pol.max_batch, cfg.max_batch_tokens, pad)
        lam = est.last_rate[lane]  # as of the lane's last arrival: see `fill_window`
        if lam <= 0:
            return 1
        co = est.cost.coefficients
        budget = _FILL_SHARE * slo
        gain = 1 + self.policy.fill_gain
        best = 1
        prev = co.seconds(1, pad)
        for b in range(2, cap + 1):
            t = co.seconds(b, pad)
            if t + (b - 1) / lam > budget:
                break
            if (b / t) < gain * ((b - 1) / prev):  # one more row no longer pays
                break
            best, prev = b, t
        return best

    def fill_window(self, lane: int, target: int, now: float) -> float:
        """Seconds the lane's oldest request may wait for `target` rows: (target - 1) / rate,
        within [min_wait, max_wait]."""
        pol = self.policy
        # The rate as of the lane's last arrival, not decayed to `now`: between arrivals the
        # window stays put, so the timer set for its end finds the lane ready.
        lam = self.estimates.last_rate[lane]
        raw = (target - 1) / lam if target > 1 and lam > 0 else 0.0
        return min(pol.max_wait, max(pol.min_wait, raw))

    def schedule(self, queues: Queues, now: float, cfg: SchedulerConfig) -> Decision:
        """`schedule()` for strategy `adaptive` (see the module docstring)."""
        d = Decision()
        if self.hold:
            return d  # the swap happens once in-flight batches finish (their completion wakes)
        co = self.cost.coefficients
        pol = self.policy
        budget_tokens = cfg.max_batch_tokens
        free = cfg.slots - queues.inflight_total
        # Filling a batch buys model time; below `fill_load` (the runner's busy share were
        # every request run alone) there is time to spare, and waiting only adds latency.
        # Above it the fill window grows with the load over `fill_ramp` (`share`).
        load = self.load(now)
        fill = pol.late_binding and not self.draining and load >= pol.fill_load
        share = min(1.0, (load - pol.fill_load) / pol.fill_ramp) if fill and pol.fill_ramp else 1.0
        # a batch's due-time checks use the model's times as the last batches measured them and
        # as the request-side CPU slows them now, as shedding does: a batch the bare fit says
        # is in time would otherwise run its last members late
        scale = self.drift * self.cpu_slowdown(now)
        tol = _SHED_TOLERANCE if self.drains(now, cfg) else 0.0
        keep_late = tol > 0 or pol.shed is ShedMode.LATE  # heads late alone may be batched
        while free > 0 and queues.size:
            busy = queues.inflight_total >= self.concurrency
            ahead = max(0.0, self.backlog_end - now) if busy else 0.0
            start = now + ahead
            best: tuple[tuple[int, int, float], int, list[Request], int, float] | None = None
            wake = _INF
            for i, q in enumerate(queues.lanes):
                if not q:
                    continue
                lp = cfg.lanes[i]
                if lp.quota is not None and queues.inflight[i] >= lp.quota:
                    continue
                cap = lp.max_batch
                window = self._head(queues, i, now, start, cap, d, scale, tol)
                if not window:
                    continue
                members: list[Request] = []
                pad = 0
                real = 0
                min_due = meet_due = _INF  # the members' first due time; the first they can meet
                limited = False
                dead: list[Request] = []
                for r in window:
                    if r.deadline is not None and r.deadline <= now:
                        dead.append(r)  # past its hard deadline (timeout): 504, never run
                        continue
                    new_pad = lp.pad_to or max(pad, r.length)
                    if len(members) >= cap or new_pad * (len(members) + 1) > budget_tokens:
                        limited = True
                        break
                    # one already late alone (kept by the tolerance, or `shed = late`) does
                    # not hold the batch back: only due times it can still meet do
                    due = pol.due(r)
                    late = keep_late and start + scale * co.seconds(1, r.length) > due
                    new_meet = meet_due if late else min(meet_due, due)
                    grown = scale * co.seconds(len(members) + 1, new_pad)
                    if members and start + grown > new_meet:
                        limited = True  # growing further would break a member's due time
                        break
                    members.append(r)
                    pad, real, meet_due = new_pad, real + r.length, new_meet
                    min_due = min(min_due, due)
                if dead:
                    d.expired.extend(dead)
                    queues.remove_many(dead)
                if not members:
                    continue
                n = len(members)
                limited = limited or n >= cap
                exec_s = co.seconds(n, pad)
                latest = min_due - scale * exec_s  # latest feasible start
                level = max(pol.level(r, now) for r in members)
                head = members[0]
                target = self.target_batch(i, cfg, now, pol.due(head) - head.arrival)
                window_s = self.fill_window(i, target, now) * share
                self.target[i] = target
                self.wait[i] = window_s
                oldest = min(r.arrival for r in members)
                ready = (
                    limited
                    or not fill
                    or latest <= start
                    # `now >= oldest + window_s`, not `now - oldest >= ...`: the timer below
                    # fires at exactly that sum, and must find the lane ready
                    or (not busy and (n >= target or now >= oldest + window_s))
                )
                if not ready and not busy and not self._fill_pays(co, n, pad, real, i):
                    ready = True
                if not ready:
                    if not busy:  # a busy runner's completion re-runs the decision anyway
                        wake = min(wake, latest, oldest + window_s)
                    continue
                key = (-level, 0 if latest >= start else 1, latest)
                if best is None or key < best[0]:
                    best = (key, i, members, pad, exec_s)
            if best is None:
                d.wake_at = wake if wake < _INF else None
                return d
            _, lane, members, pad, exec_s = best
            queues.remove_many(members)
            if pol.merge and lane > 0 and not cfg.lanes[lane].pad_to:
                exec_s = self._top_up(queues, cfg, lane, members, pad, start, now, d, scale)
            end = start + scale * exec_s
            self.late += sum(1 for r in members if pol.due(r) < end)
            queues.batch_started(lane)
            d.batches.append(Batch(lane, members, pad))
            self.backlog_end = max(now, self.backlog_end) + exec_s / self.concurrency
            free -= 1
        return d

    def _fill_pays(self, co: Any, n: int, pad: int, real: int, lane: int) -> bool:
        """True while one more request of the lane's mean length raises real tokens per
        model-second by at least `fill_gain`."""
        nxt = self.estimates.mean_len[lane]
        new_pad = max(float(pad), nxt)
        now_rate = real / co.seconds(n, pad)
        new_rate = (real + nxt) / co.seconds(n + 1, new_pad)
        return bool(new_rate > (1 + self.policy.fill_gain) * now_rate)

    def _head(
        self,
        queues: Queues,
        lane: int,
        now: float,
        start: float,
        cap: int,
        d: Decision,
        scale: float,
        tol: float = 0.0,
    ) -> list[Request]:
        """The lane's first `cap` requests in service order, after taking out those whose
        hard deadline passed (expired) and, unless `shed = late`, those that can no longer
        meet their due time even alone (shed), the model's times multiplied by `scale` (the
        decision's drift x request-side CPU slowdown); one predicted late by no more than
        `tol` of its SLO budget is kept."""
        q = queues.lanes[lane]
        co = self.cost.coefficients
        shed_on = self.policy.shed is not ShedMode.LATE
        while True:
            window = self._ordered(q, now, cap)
            gone: list[Request] = []
            for r in window:
                if r.deadline is not None and r.deadline <= now:
                    d.expired.append(r)
                    gone.append(r)
                elif start + scale * co.seconds(1, r.length) > self.policy.due(r) + tol * (
                    self.policy.due(r) - r.arrival
                ):
                    if shed_on:
                        d.shed.append(r)
                        gone.append(r)
                        self.shed_counts["queue"] += 1
                        due = self.policy.due(r)
                        finish = start + scale * co.seconds(1, r.length)
                        running = start - now
                        self._record(
                            "queue",
                            now,
                            r.length,
                            1,
                            lane,
                            r.priority,
                            due,
                            start,
                            finish,
                            running,
                            0.0,
                            len(gone) - 1,
                            queues,
                        )
                    else:
                        break  # served late: counted when its batch is emitted
                else:
                    break  # the rest is checked when it reaches the head
            if not gone:
                return window
            queues.remove_many(gone)
            if not q:
                return []

    def _top_up(
        self,
        queues: Queues,
        cfg: SchedulerConfig,
        lane: int,
        members: list[Request],
        pad: int,
        start: float,
        now: float,
        d: Decision,
        scale: float = 1.0,
    ) -> float:
        """Merge requests of the next shorter lanes into `members` while it pays and every
        member still meets its due time (the batch's time times `scale`); returns the batch's
        predicted seconds (unscaled)."""
        co = self.cost.coefficients
        cap = cfg.lanes[lane].max_batch
        min_due = min(self.policy.due(r) for r in members)
        exec_s = co.seconds(len(members), pad)
        for j in range(lane - 1, -1, -1):
            q = queues.lanes[j]
            if not q or len(members) >= cap or pad * (len(members) + 1) > cfg.max_batch_tokens:
                break
            jcap = cfg.lanes[j].max_batch
            window = self._ordered(q, now, jcap)
            left = min(len(q), jcap)
            taken: list[Request] = []
            for r in window:
                n = len(members)
                if n >= cap or pad * (n + 1) > cfg.max_batch_tokens:
                    break
                if r.deadline is not None and r.deadline <= now:
                    continue  # the lane's own turn expires it
                grown = co.seconds(n + 1, pad)
                own_pad = max(x.length for x in window[len(taken) :])
                own_share = co.seconds(left, own_pad) / left
                new_due = min(min_due, self.policy.due(r))
                if grown - exec_s >= own_share or start + scale * grown > new_due:
                    break
                members.append(r)
                taken.append(r)
                exec_s, min_due = grown, new_due
                left -= 1
                d.merges.append((j, lane))
                self.merges[(j, lane)] = self.merges.get((j, lane), 0) + 1
            if taken:
                queues.remove_many(taken)
            if len(taken) < len(window):
                break  # this lane stopped paying: the lanes below it would pay even less
        return exec_s
