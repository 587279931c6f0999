"""Discrete-event simulation of the engine: the same scheduler, queues and admission code under
a virtual clock, with batch service times from a `CostModel`.

    trace ─► admit (model limit, Admission) ─► Queues ─► schedule() ─► wait for a runner slot
          ─► run for cost.batch_seconds(B, L) (packed: cost.packed_seconds(lengths))
             x cost.slowdown(recent request rate) x a draw from cost.batch_spread
          ─► answer (+ cost.request_overhead_s)

What it mirrors from `lenbatch.embed.engine.Engine`, rule by rule, so predictions match live runs:

* The scheduler config is `core.lanes.resolve_lanes(batching, max_length).cfg`, exactly as
  the engine builds it; `schedule()` may emit up to `cfg.slots` =
  `max_concurrent_batches + prefetch_batches` batches.
* An emitted batch is formed (and collated) at once but only starts when one of
  `max_concurrent_batches` runner slots is free; waiting batches get slots in emission order
  (the engine's `asyncio.Semaphore` is FIFO).
* When a batch starts, members whose deadline has passed are dropped (answered as errors) and
  the rest are padded again to their own longest (or to `pad_to` for `static`).
* `schedule()` runs again after each arrival, each batch completion, each deadline, and at
  `wake_at`. Events at the same instant are applied together before one `schedule()` call, as
  the engine's wake-up event coalesces them.
* Strategy `adaptive` with `refit` (or `boundaries = "auto"`) re-fits the boundaries online
  with the engine's `Refitter` and swap rule (`core.refit.BoundarySwap`): the admitted lengths
  are observed, a pending swap holds new batches, and once nothing is in flight the lanes are
  swapped and the queued requests re-bucketed, before that instant's `schedule()`.
* Inputs over the model limit are rejected (413) unless `truncate`; `Admission.check` refusals
  (length budget, queue bounds, token bucket) count as rejected; expired requests as errors.

What it does not model: cancellations by clients, model failures (bisection), contention
between concurrent batches on one device (each runner slot is an independent server running at
the cost model's speed), and the HTTP layer, tokenization and collation except as a
calibrated cost model carries them (`lenbatch calibrate`): a scale and a constant per batch,
a constant per request, a slowdown of the model by the CPU share that the last second's
requests take, and how much one batch's time varies around its prediction (`batch_spread`:
each batch's time is drawn from it with a random generator seeded by `seed`, so a run is
repeatable). Without that spread every batch of one shape took the same time, and at light
loads, where a P95 is the tail of single-request batches, the prediction fell short: on a
2-core Zen 3 at 0.2x capacity (held-out window), 21-25 % under the live P95 without it and 8-16
% under with it (`bench/results/zen3-model1/adaptive-goodput-heldout/summary-spread.md`).

This module is the event loop; what a run produced (`SimRun`, per-lane totals, the summary) is
built in `lenbatch.plan.simrun` from the loop's record.
"""

from __future__ import annotations

import gc
import heapq
import math
import random
from bisect import bisect_left, bisect_right
from collections import deque

import numpy as np

from lenbatch.config import AdaptiveConfig, AdmissionConfig, BatchingConfig, Strategy
from lenbatch.core.adaptive import AdaptiveState, build_state
from lenbatch.core.admission import Admission
from lenbatch.core.batch import Batch
from lenbatch.core.costfit import CostCoefficients
from lenbatch.core.lanes import resolve_lanes
from lenbatch.core.queues import Queues
from lenbatch.core.refit import BoundarySwap, build_refitter
from lenbatch.core.request import Request
from lenbatch.core.scheduler import schedule
from lenbatch.core.slo import SHED_CODE
from lenbatch.plan.costmodel import CostModel
from lenbatch.plan.simrun import OUTCOME_PENDING, ReplayLog, SimRun
from lenbatch.plan.summary import OUTCOME_ERROR
from lenbatch.plan.trace import Trace

__all__ = ["SimRun", "simulate"]

_INF = math.inf


def simulate(
    trace: Trace,
    cost: CostModel,
    batching: BatchingConfig | None = None,
    admission: AdmissionConfig | None = None,
    *,
    max_length: int = 256,
    truncate: bool = False,
    adaptive: AdaptiveConfig | None = None,
    adaptive_prior: bool = True,
    seed: int = 0,
) -> SimRun:
    """Replay `trace` (one single-input call per row, at its arrival time) through the engine's
    admission, queues and scheduler with service times from `cost`; run until every admitted
    request is answered.

    Strategy `adaptive` runs with `adaptive` (default settings if None) and an online cost
    model that learns from the simulated batch times, seeded from `cost` when
    `adaptive_prior` (as `serve --cost FILE` seeds it), else from the generic prior. `seed`
    seeds the draws from `cost.batch_spread` (none without one)."""
    # The loop allocates many small objects that never form cycles; the cyclic collector
    # only costs time here (up to a third of the run), so it is paused for the replay.
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        replay = _Replay(
            trace,
            cost,
            batching or BatchingConfig(),
            admission or AdmissionConfig(),
            max_length,
            truncate,
            adaptive or AdaptiveConfig(),
            adaptive_prior,
            seed,
        )
        return replay.run()
    finally:
        if was_enabled:
            gc.enable()


class _Replay:
    """One simulated run: the engine's queues, scheduler and runner slots under a virtual
    clock, advanced one event instant at a time (`run`). Each instant applies, in order, the
    batches finishing (`complete`), the deadlines passing (`expire`), the arrivals (`arrive`),
    a pending re-fit (`refit`), and then makes one scheduling decision (`decide`)."""

    def __init__(
        self,
        trace: Trace,
        cost: CostModel,
        batching: BatchingConfig,
        adm_cfg: AdmissionConfig,
        max_length: int,
        truncate: bool,
        adaptive_cfg: AdaptiveConfig,
        adaptive_prior: bool,
        seed: int = 0,
    ) -> None:
        if trace.arrivals is None:
            raise ValueError(
                f"trace {trace.source or '(unnamed)'} has no arrival times; the simulator "
                "needs them"
            )
        self.batching = batching
        self.max_length = max_length
        self.cost = cost
        # A packed runner computes each row's real tokens only: its batches cost what their
        # lengths cost (`CostModel.packed_seconds`), not rows x the longest, as a padded one
        # does (what the live server's /stats and `lenbatch calibrate` count too).
        self.packed = cost.execution == "packed"
        self.draw = random.Random(seed).random if cost.batch_spread else None
        self.lanes = resolve_lanes(batching, max_length)
        cfg = self.cfg = self.lanes.cfg
        n = len(trace)
        self.arrivals = np.asarray(trace.arrivals, dtype=np.float64)
        raw = np.asarray(trace.input_lengths, dtype=np.int64)
        self.lengths = np.minimum(raw, max_length) if truncate else raw.copy()
        self.arr_list: list[float] = self.arrivals.tolist()
        self.len_list: list[int] = self.lengths.tolist()
        self.log = ReplayLog.empty(n)

        self.queues = Queues(cfg)
        self.adm = Admission(adm_cfg, cfg, self.arr_list[0] if n else 0.0)
        self.timeout = adm_cfg.request_timeout_s
        self.ad: AdaptiveState | None = None
        if cfg.strategy is Strategy.ADAPTIVE:
            prior = CostCoefficients.from_profile(cost.to_json()) if adaptive_prior else None
            self.ad = build_state(
                adaptive_cfg,
                prior,
                cfg,
                longest=Admission(adm_cfg, cfg).longest_admissible(),
                concurrency=batching.max_concurrent_batches,
                cores=max(1, cost.cpu_cores),
            )
            # the request-side CPU the live engine measures, as the cost model says it
            self.ad.request_cpu.per_request_s = max(0.0, cost.cpu_per_request_s)
        # Online re-fit of the boundaries (adaptive; always on with boundaries = "auto"): the
        # engine's re-fitter and swap rule, fed the same admitted lengths.
        self.swap: BoundarySwap | None = None
        if self.ad is not None and (adaptive_cfg.refit or batching.auto_boundaries):
            co = self.ad.cost.coefficients
            self.swap = BoundarySwap(build_refitter(adaptive_cfg, max_length, co.a, co.b))

        self.runners_free = batching.max_concurrent_batches
        # With one runner the peak is the largest batch; with several, sum what overlaps.
        self.track_memory = self.runners_free > 1
        # heap of (end, seq, lane, activation bytes, size, padded length, exec s)
        self.running: list[tuple[float, int, int, float, int, int, float]] = []
        self.waiting: deque[Batch] = deque()  # emitted, collated, waiting for a slot (FIFO)
        self.deadlines: deque[tuple[float, Request]] = deque()  # (deadline, request), in order
        self.active_bytes = 0.0
        self.seq = 0
        self.next = 0  # index of the next arrival

    def run(self) -> SimRun:
        """Replay every event, then build the result."""
        # Once per event instant (millions in a long trace): each step is called only when it
        # has work, and what the loop reads is kept in locals.
        running, deadlines, queues, swap = self.running, self.deadlines, self.queues, self.swap
        next_arrival = self.arr_list[0] if self.arr_list else _INF
        wake_at = _INF
        slots = self.cfg.slots
        events = 0
        while True:
            # The next instant anything happens.
            now = next_arrival
            if running and running[0][0] < now:
                now = running[0][0]
            if wake_at < now:
                now = wake_at
            if deadlines and deadlines[0][0] < now:
                now = deadlines[0][0]
            if now == _INF:
                break
            events += 1
            if running and running[0][0] <= now:
                self.complete(now)
            if deadlines and deadlines[0][0] <= now:
                self.expire(now)
            if next_arrival <= now:
                next_arrival = self.arrive(now)
            if swap is not None:
                self.refit(now)
                slots = self.cfg.slots
            # With nothing queued or no free slot, `schedule()` returns an empty decision
            # without a timer (tested in test_sim_queueing.py); skip the call then, it is
            # most of the events.
            if not queues.size or queues.inflight_total >= slots:
                wake_at = _INF
            else:
                wake_at = self.decide(now)
        self.log.events = events
        return self.result()

    def complete(self, now: float) -> None:
        """Batches finishing at `now` free their slot, which goes to the next waiting batch."""
        running = self.running
        ad = self.ad
        while running and running[0][0] <= now:
            _, _, lane, ab, b_size, b_pad, b_dt = heapq.heappop(running)
            if ad is not None:  # the engine's own timing of the batch, as the engine learns it
                ad.observe_batch(lane, b_size, b_pad, b_dt, now)
            self.active_bytes -= ab
            self.runners_free += 1
            self.queues.batch_done(lane)
            while self.waiting and self.runners_free > 0:
                self.start(self.waiting.popleft(), now)

    def expire(self, now: float) -> None:
        """Deadlines passing at `now`: requests not yet running expire (the engine's timer)."""
        deadlines = self.deadlines
        outcome = self.log.outcomes
        while deadlines and deadlines[0][0] <= now:
            r = deadlines.popleft()[1]
            if outcome[r.handle] == OUTCOME_PENDING and self.queues.remove(r):
                outcome[r.handle] = OUTCOME_ERROR
            # not in a queue: running (it will finish) or in a prepared batch (dropped at start)

    def arrive(self, now: float) -> float:
        """Arrivals at `now`: model limit, admission, queue. Returns the next arrival time."""
        # Mostly one arrival per call: names are looked up where used, not bound up front.
        i = self.next
        at = self.arr_list[i]
        while at <= now:
            length = self.len_list[i]
            if length < 1 or length > self.max_length:
                self.log.reject(i, "invalid_input" if length < 1 else "input_too_long")
            else:
                queues = self.queues
                ad = self.ad
                refusal = self.adm.check([length], queues, now)
                due = 0.0
                if refusal is None and ad is not None:
                    due = ad.due_of(at, 0, self.timeout)
                    refusal = ad.admit([length], due, queues, self.cfg, now)
                if refusal is None:
                    r = Request(length, at, None, "", None, 0, -1, i)
                    if self.timeout is not None:
                        r.deadline = at + self.timeout
                        self.deadlines.append((r.deadline, r))
                    self.log.request_lanes[i] = queues.push(r)
                    if ad is not None:
                        r.due = due
                        ad.on_arrival(r.lane, length, at)
                    if self.swap is not None:
                        self.swap.refitter.observe(length)
                else:
                    self.log.request_lanes[i] = queues.lane_of(length)
                    self.log.reject(i, refusal.code)
            i += 1
            at = self.arr_list[i] if i < len(self.arr_list) else _INF
        self.next = i
        return at

    def refit(self, now: float) -> None:
        """A pending re-fit holds new batches; with nothing in flight the lanes swap and the
        queued requests are re-bucketed (the engine's `_maybe_refit`, before its schedule())."""
        swap, ad = self.swap, self.ad
        assert swap is not None and ad is not None
        new = swap.step(now, self.cfg.boundaries, self.queues.inflight_total)
        ad.hold = swap.holding
        if new is not None:
            update = {"boundaries": new, "auto_boundaries": False}
            self.batching = self.batching.model_copy(update=update)
            self.lanes = resolve_lanes(self.batching, self.max_length)
            self.cfg = self.lanes.cfg
            self.queues.rebucket(self.cfg)
            self.adm.sched = self.cfg
            ad.reset_lanes(self.cfg)

    def decide(self, now: float) -> float:
        """One scheduling decision for this instant, exactly as the engine's loop makes it
        (`run` calls it only with something queued and a free slot)."""
        decision = schedule(self.queues, now, self.cfg, self.ad)
        log = self.log
        for r in decision.expired:
            log.outcomes[r.handle] = OUTCOME_ERROR
        for r in decision.shed:  # answered at once (429/503): never ran, like a refusal
            log.reject(r.handle, SHED_CODE)
        for batch in decision.batches:
            if self.runners_free > 0 and not self.waiting:
                self.start(batch, now)
            else:
                self.waiting.append(batch)
        return _INF if decision.wake_at is None else decision.wake_at

    def start(self, batch: Batch, now: float) -> None:
        """A runner slot takes `batch` at `now` (the engine's `_run_batch` after acquire)."""
        reqs = batch.requests
        pad = batch.padded_len
        outcome = self.log.outcomes
        if self.timeout is not None:
            live = []
            for r in reqs:
                if outcome[r.handle] != OUTCOME_PENDING:
                    continue  # expired while the batch waited for its slot
                if r.deadline is not None and r.deadline <= now:
                    outcome[r.handle] = OUTCOME_ERROR
                    continue
                live.append(r)
            if not live:
                self.queues.batch_done(batch.lane)  # the slot is released at once
                return
            if len(live) != len(reqs):
                reqs = live
                pad = self.cfg.lanes[batch.lane].pad_to or max(r.length for r in live)
        self.runners_free -= 1
        size = len(reqs)
        cost = self.cost
        if self.packed:
            dt = cost.packed_seconds([r.length for r in reqs])
        else:
            dt = cost.batch_seconds(size, pad)
        if cost.cpu_per_request_s > 0:  # the last second's request rate slows the model
            arr = self.arr_list
            recent = bisect_right(arr, now) - bisect_left(arr, now - 1.0)
            dt *= cost.slowdown(float(recent))
        if self.draw is not None:
            dt *= cost.spread_factor(self.draw())
        self.log.batches.extend((batch.lane, now, dt, pad, size))
        self.log.members.append(reqs)
        ab = 0.0
        if self.track_memory:
            ab = cost.activation_bytes(size, pad)
            self.active_bytes += ab
            if self.active_bytes > self.log.peak_active_bytes:
                self.log.peak_active_bytes = self.active_bytes
        self.seq += 1
        heapq.heappush(self.running, (now + dt, self.seq, batch.lane, ab, size, pad, dt))

    def result(self) -> SimRun:
        """The run's `SimRun`, once every admitted request is answered."""
        ad, swap = self.ad, self.swap
        refits = swap is not None and bool(swap.refitter.events)
        n = len(self.arr_list)
        return self.log.to_run(
            self.lanes,
            self.arrivals,
            self.lengths,
            self.cost,
            final_lane_of=self.queues.lane_of if refits else None,
            memory_tracked=self.track_memory,
            adaptive=None
            if ad is None
            else ad.describe(list(self.lanes.labels), float(self.arrivals[-1]) if n else 0.0),
            slo_s=None if ad is None else ad.policy.level_slo[0],
            refit=None if swap is None else swap.refitter.describe(),
        )
