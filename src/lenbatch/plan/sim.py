"""Discrete-event simulation of the engine: the same scheduler, queues and admission code under
a virtual clock, with batch service times from a `CostModel`.

    trace ─► admit (model limit, Admission) ─► Queues ─► schedule() ─► wait for a runner slot
          ─► run for cost.batch_seconds(B, L) x cost.slowdown(recent request rate)
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
calibrated cost model carries them (`lenbatch calibrate`): a constant per batch, a constant per
request, and a slowdown of the model by the CPU share that the last second's requests take.
"""

from __future__ import annotations

import gc
import heapq
import math
from array import array
from bisect import bisect_left, bisect_right
from collections import deque
from dataclasses import dataclass, field
from itertools import chain
from operator import attrgetter
from typing import Any

import numpy as np
import numpy.typing as npt

from lenbatch.config import AdaptiveConfig, AdmissionConfig, BatchingConfig, Strategy
from lenbatch.core.adaptive import AdaptiveState, build_state
from lenbatch.core.admission import Admission
from lenbatch.core.batch import Batch
from lenbatch.core.costfit import CostCoefficients
from lenbatch.core.lanes import SchedulerConfig, resolve_lanes
from lenbatch.core.queues import Queues
from lenbatch.core.refit import BoundarySwap, build_refitter
from lenbatch.core.request import Request
from lenbatch.core.scheduler import schedule
from lenbatch.core.slo import SHED_CODE
from lenbatch.plan.costmodel import CostModel
from lenbatch.plan.summary import OUTCOME_ERROR, OUTCOME_OK, OUTCOME_REJECTED, summarize
from lenbatch.plan.trace import Trace

__all__ = ["LaneStats", "SimRun", "simulate"]

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

_PENDING = -1
_handle = attrgetter("handle")
_INF = math.inf
_MB = 1024 * 1024


@dataclass(slots=True)
class LaneStats:
    """Batch-level totals of one lane over a run."""

    batches: int = 0
    rows: int = 0
    real_tokens: int = 0
    padded_tokens: int = 0
    busy_s: float = 0.0


@dataclass
class SimRun:
    """Everything one simulated run produced: per-request columns and per-lane batch totals."""

    strategy: Strategy
    cfg: SchedulerConfig
    labels: list[str]
    uses_default_boundaries: bool
    arrivals: FloatArray
    lengths: IntArray  # after truncation
    outcomes: IntArray  # OUTCOME_OK / OUTCOME_ERROR / OUTCOME_REJECTED
    lanes: IntArray  # lane each request was routed to; -1 if rejected before routing
    latencies: FloatArray  # seconds from arrival to answer (NaN unless answered OK)
    waits: FloatArray  # seconds from arrival to its batch's start (NaN unless it ran)
    execs: FloatArray  # its batch's execution seconds (NaN unless it ran)
    lane_stats: list[LaneStats]
    peak_memory_bytes: float
    rejections: dict[str, int] = field(default_factory=dict)  # error code -> count
    events: int = 0  # distinct event instants processed (each ran `schedule()` once)
    adaptive: dict[str, Any] | None = None  # `adaptive`'s state at the end (as in /stats)
    # The online re-fit's record at the end (as in /stats), None when it was off. After a
    # re-fit `cfg`, `labels`, `lanes` and `lane_stats` are those of the final boundaries: each
    # request and batch counted in the final lane of its length (a batch: its padded length).
    refit: dict[str, Any] | None = None
    slo_s: float | None = None  # `adaptive`'s SLO (its lowest level), for goodput

    @property
    def padding_waste(self) -> float | None:
        """Token-weighted padding waste over all executed batches."""
        padded = sum(s.padded_tokens for s in self.lane_stats)
        real = sum(s.real_tokens for s in self.lane_stats)
        return 1.0 - real / padded if padded else None

    @property
    def mean_batch_size(self) -> float | None:
        """Mean rows per executed batch."""
        batches = sum(s.batches for s in self.lane_stats)
        return sum(s.rows for s in self.lane_stats) / batches if batches else None

    @property
    def busy_s(self) -> float:
        """Total execution seconds over all batches (summed over runner slots)."""
        return sum(s.busy_s for s in self.lane_stats)

    def summary(self) -> dict[str, Any]:
        """The shared run summary (`lenbatch.plan.summary.summarize` keys), per-bucket rows extended
        with rejected/errors, batch totals and the queue-wait vs execution split."""
        extra: list[dict[str, Any]] = []
        for i, s in enumerate(self.lane_stats):
            sel = self.lanes == i
            ran = sel & ~np.isnan(self.execs)
            extra.append(
                {
                    "rejected": int((sel & (self.outcomes == OUTCOME_REJECTED)).sum()),
                    "errors": int((sel & (self.outcomes == OUTCOME_ERROR)).sum()),
                    "batches": s.batches,
                    "mean_batch_size": s.rows / s.batches if s.batches else None,
                    "padding_waste": 1 - s.real_tokens / s.padded_tokens
                    if s.padded_tokens
                    else None,
                    "exec_mean_ms": float(1000 * self.execs[ran].mean()) if ran.any() else None,
                }
            )
        return summarize(
            self.arrivals,
            self.lengths,
            self.outcomes,
            self.latencies,
            self.waits,
            buckets=self.lanes,
            bucket_labels=self.labels,
            padding_waste=self.padding_waste,
            mean_batch_size=self.mean_batch_size,
            peak_memory_mb=self.peak_memory_bytes / _MB,
            bucket_extra=extra,
        )


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
) -> SimRun:
    """Replay `trace` (one single-input call per row, at its arrival time) through the engine's
    admission, queues and scheduler with service times from `cost`; run until every admitted
    request is answered.

    Strategy `adaptive` runs with `adaptive` (default settings if None) and an online cost
    model that learns from the simulated batch times, seeded from `cost` when
    `adaptive_prior` (as `serve --cost FILE` seeds it), else from the generic prior."""
    # The loop allocates many small objects that never form cycles; the cyclic collector
    # only costs time here (up to a third of the run), so it is paused for the replay.
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _replay(
            trace,
            cost,
            batching or BatchingConfig(),
            admission or AdmissionConfig(),
            max_length,
            truncate,
            adaptive or AdaptiveConfig(),
            adaptive_prior,
        )
    finally:
        if was_enabled:
            gc.enable()


def _replay(
    trace: Trace,
    cost: CostModel,
    batching: BatchingConfig,
    adm_cfg: AdmissionConfig,
    max_length: int,
    truncate: bool,
    adaptive_cfg: AdaptiveConfig,
    adaptive_prior: bool,
) -> SimRun:
    """`simulate`'s event loop, with its defaults resolved and the collector paused."""
    if trace.arrivals is None:
        raise ValueError(
            f"trace {trace.source or '(unnamed)'} has no arrival times; the simulator needs them"
        )
    lanes = resolve_lanes(batching, max_length)
    cfg = lanes.cfg
    n = len(trace)
    arrivals = np.asarray(trace.arrivals, dtype=np.float64)
    raw = np.asarray(trace.input_lengths, dtype=np.int64)
    lengths = np.minimum(raw, max_length) if truncate else raw.copy()
    arr_list: list[float] = arrivals.tolist()
    len_list: list[int] = lengths.tolist()

    # Per request, only what cannot be derived from the batch log afterwards.
    outcome = [_PENDING] * n  # set here for rejections and expiries; OK is filled in at the end
    lane_of_req = [-1] * n
    rejections: dict[str, int] = {}
    # The batch log: five doubles per executed batch (lane, start, exec s, padded length,
    # size), read back as a numpy array without conversion; and each batch's requests.
    log = array("d")
    ran: list[list[Request]] = []

    queues = Queues(cfg)
    adm = Admission(adm_cfg, cfg, arr_list[0] if n else 0.0)
    timeout = adm_cfg.request_timeout_s
    check = adm.check
    push = queues.push
    batch_done = queues.batch_done
    latency = cost.batch_seconds
    slowdown = cost.slowdown
    contended = cost.cpu_per_request_s > 0
    act_bytes = cost.activation_bytes
    lane_pol = cfg.lanes
    slots = cfg.slots
    heappush = heapq.heappush
    heappop = heapq.heappop

    ad: AdaptiveState | None = None
    if cfg.strategy is Strategy.ADAPTIVE:
        prior = CostCoefficients.from_profile(cost.to_json()) if adaptive_prior else None
        ad = build_state(
            adaptive_cfg,
            prior,
            cfg,
            longest=Admission(adm_cfg, cfg).longest_admissible(),
            concurrency=batching.max_concurrent_batches,
        )
    arrive = ad.on_arrival if ad is not None else None
    # Online re-fit of the boundaries (adaptive; always on with boundaries = "auto"): the
    # engine's re-fitter and swap rule, fed the same admitted lengths.
    swap: BoundarySwap | None = None
    if ad is not None and (adaptive_cfg.refit or batching.auto_boundaries):
        co = ad.cost.coefficients
        swap = BoundarySwap(build_refitter(adaptive_cfg, max_length, co.a, co.b))
    observe = swap.refitter.observe if swap is not None else None

    runners_free = batching.max_concurrent_batches
    # With one runner the peak is the largest batch; with several, sum what overlaps.
    track_memory = runners_free > 1
    log_extend = log.extend
    ran_append = ran.append
    # heap of (end, seq, lane, activation bytes, size, padded length, exec s)
    running: list[tuple[float, int, int, float, int, int, float]] = []
    waiting: deque[Batch] = deque()  # emitted, collated, waiting for a runner slot (FIFO)
    deadlines: deque[tuple[float, Request]] = deque()  # (deadline, request), by deadline
    active_bytes = 0.0
    peak_active = 0.0
    seq = 0
    wake_at = _INF
    events = 0
    i = 0
    next_arrival = arr_list[0] if n else _INF

    def start(batch: Batch, now: float) -> None:
        """A runner slot takes `batch` at `now` (the engine's `_run_batch` after acquire)."""
        nonlocal runners_free, active_bytes, peak_active, seq
        reqs = batch.requests
        pad = batch.padded_len
        if timeout is not None:
            live = []
            for r in reqs:
                if outcome[r.handle] != _PENDING:
                    continue  # expired while the batch waited for its slot
                if r.deadline is not None and r.deadline <= now:
                    outcome[r.handle] = OUTCOME_ERROR
                    continue
                live.append(r)
            if not live:
                batch_done(batch.lane)  # the slot is released at once; re-scheduled after
                return
            if len(live) != len(reqs):
                reqs = live
                pad = lane_pol[batch.lane].pad_to or max(r.length for r in live)
        runners_free -= 1
        size = len(reqs)
        dt = latency(size, pad)
        if contended:  # the request rate over the last second slows the model (calibrated)
            recent = bisect_right(arr_list, now) - bisect_left(arr_list, now - 1.0)
            dt *= slowdown(float(recent))
        log_extend((batch.lane, now, dt, pad, size))
        ran_append(reqs)
        ab = 0.0
        if track_memory:
            ab = act_bytes(size, pad)
            active_bytes += ab
            if active_bytes > peak_active:
                peak_active = active_bytes
        seq += 1
        heappush(running, (now + dt, seq, batch.lane, ab, size, pad, dt))

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

        # 1. Batches finishing now free their slot, which goes to the next waiting batch.
        while running and running[0][0] <= now:
            _, _, lane, ab, b_size, b_pad, b_dt = heappop(running)
            if ad is not None:  # the engine's own timing of the batch, as the engine learns it
                ad.observe_batch(lane, b_size, b_pad, b_dt)
            active_bytes -= ab
            runners_free += 1
            batch_done(lane)
            while waiting and runners_free > 0:
                start(waiting.popleft(), now)

        # 2. Deadlines passing now: requests not yet running expire (the engine's timer).
        while deadlines and deadlines[0][0] <= now:
            r = deadlines.popleft()[1]
            if outcome[r.handle] == _PENDING and queues.remove(r):
                outcome[r.handle] = OUTCOME_ERROR
            # not in a queue: running (it will finish) or in a prepared batch (dropped at start)

        # 3. Arrivals now: model limit, admission, queue.
        while next_arrival <= now:
            length = len_list[i]
            if length < 1 or length > max_length:
                outcome[i] = OUTCOME_REJECTED
                code = "invalid_input" if length < 1 else "input_too_long"
                rejections[code] = rejections.get(code, 0) + 1
            else:
                refusal = check([length], queues, now)
                due = 0.0
                if refusal is None and ad is not None:
                    due = ad.due_of(next_arrival, 0, timeout)
                    refusal = ad.admit([length], due, queues, cfg, now)
                if refusal is None:
                    r = Request(length, next_arrival, None, "", None, 0, -1, i)
                    if timeout is not None:
                        r.deadline = next_arrival + timeout
                        deadlines.append((r.deadline, r))
                    lane_of_req[i] = push(r)
                    if arrive is not None:
                        r.due = due
                        arrive(r.lane, length, next_arrival)
                    if observe is not None:
                        observe(length)
                else:
                    outcome[i] = OUTCOME_REJECTED
                    lane_of_req[i] = queues.lane_of(length)
                    rejections[refusal.code] = rejections.get(refusal.code, 0) + 1
            i += 1
            next_arrival = arr_list[i] if i < n else _INF

        # 4. A pending re-fit holds new batches; with nothing in flight the lanes swap and the
        # queued requests are re-bucketed (the engine's `_maybe_refit`, before its schedule()).
        if swap is not None:
            assert ad is not None
            new = swap.step(now, cfg.boundaries, queues.inflight_total)
            ad.hold = swap.holding
            if new is not None:
                batching = batching.model_copy(update={"boundaries": new, "auto_boundaries": False})
                lanes = resolve_lanes(batching, max_length)
                cfg = lanes.cfg
                queues.rebucket(cfg)
                adm.sched = cfg
                ad.reset_lanes(cfg)
                lane_pol = cfg.lanes
                slots = cfg.slots

        # 5. One scheduling decision for this instant, exactly as the engine's loop makes it.
        # With nothing queued or no free slot, `schedule()` returns an empty decision without
        # a timer (tested in test_sim.py); skip the call then, it is most of the events.
        if not queues.size or queues.inflight_total >= slots:
            wake_at = _INF
            continue
        decision = schedule(queues, now, cfg, ad)
        for r in decision.expired:
            outcome[r.handle] = OUTCOME_ERROR
        for r in decision.shed:  # answered at once (429/503): never ran, like a refusal
            outcome[r.handle] = OUTCOME_REJECTED
            rejections[SHED_CODE] = rejections.get(SHED_CODE, 0) + 1
        for batch in decision.batches:
            if runners_free > 0 and not waiting:
                start(batch, now)
            else:
                waiting.append(batch)
        wake_at = _INF if decision.wake_at is None else decision.wake_at

    # Members of executed batches all completed: a running request never expires.
    out = np.asarray(outcome, dtype=np.int64)
    idx = np.fromiter(map(_handle, chain.from_iterable(ran)), dtype=np.int64)
    if (out[idx] != _PENDING).any():
        raise RuntimeError("bug: a request ran in a batch after it was answered")
    out[idx] = OUTCOME_OK
    if (out == _PENDING).any():
        raise RuntimeError(f"bug: {int((out == _PENDING).sum())} requests left unanswered")
    table = np.frombuffer(log, dtype=np.float64).reshape(-1, 5)
    lanes_b = table[:, 0].astype(np.int64)
    b_exec = table[:, 2]
    pads = table[:, 3].astype(np.int64)
    refits = swap is not None and bool(swap.refitter.events)
    if refits:  # lane numbers changed meaning: count everything in the final lanes
        lanes_b = np.fromiter(map(queues.lane_of, pads.tolist()), np.int64, len(pads))
        lane_of_req = [
            queues.lane_of(len_list[j]) if v >= 0 else -1 for j, v in enumerate(lane_of_req)
        ]
    sizes = table[:, 4].astype(np.int64)
    if not track_memory:  # one runner: the peak is the largest single batch
        shapes = np.unique(sizes * (cfg.max_length + 1) + pads)
        peak_active = max(
            (act_bytes(*divmod(int(v), cfg.max_length + 1)) for v in shapes), default=0.0
        )
    which = np.repeat(np.arange(len(sizes)), sizes)  # batch of each member
    st = np.full(n, np.nan)
    ex = np.full(n, np.nan)
    st[idx] = table[:, 1][which]
    ex[idx] = b_exec[which]
    real_b = np.bincount(which, weights=lengths[idx], minlength=len(sizes))
    k = len(cfg.lanes)
    stats = [
        LaneStats(int(bt), int(rw), int(re), int(pd), float(bs))
        for bt, rw, re, pd, bs in zip(
            np.bincount(lanes_b, minlength=k),
            np.bincount(lanes_b, weights=sizes, minlength=k),
            np.bincount(lanes_b, weights=real_b, minlength=k),
            np.bincount(lanes_b, weights=sizes * pads, minlength=k),
            np.bincount(lanes_b, weights=b_exec, minlength=k),
            strict=True,
        )
    ]
    return SimRun(
        strategy=cfg.strategy,
        cfg=cfg,
        labels=list(lanes.labels),
        uses_default_boundaries=lanes.default_boundaries and not refits,
        arrivals=arrivals,
        lengths=lengths,
        outcomes=out,
        lanes=np.asarray(lane_of_req, dtype=np.int64),
        # A live server's per-request work outside the queue (0 unless calibrated).
        latencies=st + ex - arrivals + cost.request_overhead_s,
        waits=st - arrivals,
        execs=ex,
        lane_stats=stats,
        peak_memory_bytes=cost.weights_bytes + peak_active,
        rejections=rejections,
        events=events,
        adaptive=None
        if ad is None
        else ad.describe(list(lanes.labels), float(arrivals[-1]) if n else 0.0),
        slo_s=None if ad is None else ad.policy.level_slo[0],
        refit=None if swap is None else swap.refitter.describe(),
    )
