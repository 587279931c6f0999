"""What the `adaptive` strategy learns and reports: the base of `core.adaptive.AdaptiveState`,
apart from the decisions it makes with it (`core/adaptive.py`). Pure, clock injected.

The state holds its policy (`core.slo`), the per-lane estimates (`core.estimates`: the online
cost model, arrival rates, the padded length each lane's batches reach), the request-side CPU
(`core.occupancy`) and its counters. The shell reports to it (`on_arrival`, `observe_batch`);
the decisions and admission (`core.shedding`, its base) read what it derives: the arrival rate,
the load, and `drift` / `queue_drift`, how much slower or faster batches ran than the cost
model predicted. `describe` is what `/stats` shows of the strategy.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from typing import Any

from lenbatch.core.costfit import SPREAD_WINDOW, OnlineCostModel, spread_quantiles
from lenbatch.core.decisions import DecisionLog
from lenbatch.core.estimates import LaneEstimates
from lenbatch.core.lanes import SchedulerConfig
from lenbatch.core.occupancy import RequestCpu
from lenbatch.core.shedding import Shedding
from lenbatch.core.slo import AdaptivePolicy

__all__ = ["AdaptiveLearning"]

_INF = math.inf
_DRIFT_ALPHA = 0.2  # weight of the newest batch in the measured / predicted average (~5 batches)
_QUEUE_DRIFT_ALPHA = 0.05  # the same average over ~20 batches: the speed a queue drains at
_DRIFT_MAX = 4.0  # one batch moves the average by at most this factor (a stall is not a trend)


class AdaptiveLearning(Shedding):
    """What `adaptive` knows and has done: cost model, per-lane rates, counters, and what it
    learns from the batches the runner reports; `AdaptiveState` adds the decisions.

    Its admission side (`admit`, `shed_error`, `queued_work`) is `core.shedding.Shedding`."""

    def __init__(
        self,
        policy: AdaptivePolicy,
        cost: OnlineCostModel,
        cfg: SchedulerConfig,
        *,
        concurrency: int = 1,
        cores: int = 1,
    ) -> None:
        self.policy = policy
        self.estimates = LaneEstimates(cost, policy.rate_window, cfg)
        self.shed_counts = {"admission": 0, "queue": 0}
        self.concurrency = max(1, concurrency)
        self.draining = False  # flush: no waiting to fill
        self.hold = False  # a lane swap is pending: emit nothing until the runner is idle
        self.backlog_end = -_INF  # predicted time the runner(s) finish what was emitted
        self.merges: dict[tuple[int, int], int] = {}
        self.late = 0  # requests kept although predicted late (shed = late)
        self.decisions = DecisionLog()  # why each request was refused or shed
        self._log_drift = 0.0  # log of the recent measured / predicted batch time
        self._log_queue_drift = 0.0  # the same over more batches (`queue_drift`)
        self._ratios: deque[float] = deque(maxlen=SPREAD_WINDOW)  # measured / predicted
        # CPU per request outside the model call, on the `cores` the model shares (measured
        # live by the engine; the simulator sets the cost model's)
        self.request_cpu = RequestCpu(cores)
        self.arrivals = 0  # requests arrived so far (the per-request CPU's denominator)
        self.reset_lanes(cfg)

    @property
    def cost(self) -> OnlineCostModel:
        """The online cost model the decisions predict batch times with."""
        return self.estimates.cost

    def reset_lanes(self, cfg: SchedulerConfig) -> None:
        """Start per-lane estimates afresh for `cfg`'s lanes (start-up, or after a re-fit)."""
        n = len(cfg.lanes)
        self.estimates.reset(cfg)
        self.wait = [0.0] * n  # the current fill window per lane (s), for /stats
        self.target = [1] * n  # the current target batch per lane
        self.merges = {}
        # rows from which a lane's batch is "full" for `queue_drift`: half the batch its
        # queue drains in (row cap, or the token budget at the lane's longest)
        budget = max(1, cfg.max_batch_tokens)
        self.drain_rows = [
            max(1, min(p.max_batch, budget // max(1, p.pad_to or p.upper)) // 2) for p in cfg.lanes
        ]

    # ------------------------------------------------------------------ what the shell reports

    def slo_of(self, priority: int) -> float:
        """The SLO (seconds) of a priority level."""
        return self.policy.slo_of(priority)

    def due_of(self, arrival: float, priority: int, timeout: float | None) -> float:
        """When a request arriving at `arrival` is due: its call's timeout, else its level's SLO."""
        return self.policy.due_of(arrival, priority, timeout)

    def on_arrival(self, lane: int, length: int, now: float) -> None:
        """A request of `length` tokens joined `lane` at `now` (updates its arrival rate)."""
        self.arrivals += 1
        self.estimates.on_arrival(lane, length, now)

    def rate(self, lane: int, now: float) -> float:
        """Estimated arrival rate of `lane` at `now` (requests/s, decaying average)."""
        return self.estimates.rate(lane, now)

    def cpu_slowdown(self, now: float, steady: bool = False) -> float:
        """How much slower batches run now because of the request-side CPU at the current
        arrival rate (`core.occupancy.cpu_slowdown`; 1.0 before it was measured); with
        `steady`, at the arrival rate of the last few seconds (`LaneEstimates.steady_rate`)."""
        if self.request_cpu.per_request_s <= 0:
            return 1.0
        est = self.estimates
        return self.request_cpu.slowdown(est.steady_rate(now) if steady else est.total_rate(now))

    def observe_batch(
        self, lane: int, size: int, padded_len: int, seconds: float, now: float | None = None
    ) -> None:
        """A batch of `lane` ran `size` rows padded to `padded_len` in `seconds` (ending at
        `now`): the cost model learns it, and the predicted end of the emitted work moves by
        what the batch took beyond (or short of) its prediction, so errors do not pile up over
        a burst. With `now`, the seconds are divided by the request-side CPU slowdown of the
        moment first: the model learns the batch's own cost, and the slowdown of the arrival
        rate is applied where the predictions are used."""
        if now is not None:
            slow = self.cpu_slowdown(now)
            if self.backlog_end > -_INF:  # the backlog moves by the slowed, real time
                real = seconds
                seconds /= slow
                self.backlog_end += (real - seconds) / self.concurrency
            else:
                seconds /= slow
        predicted = self.cost.coefficients.seconds(size, padded_len)
        if seconds > 0 and predicted > 0:
            if self.backlog_end > -_INF:
                self.backlog_end += (seconds - predicted) / self.concurrency
            # the last few batches' measured / predicted time, against the fit of the moment:
            # the window's fit follows a change of speed (another process on the cores) only
            # over dozens of batches, the shedding decisions at once
            ratio = min(_DRIFT_MAX, max(1 / _DRIFT_MAX, seconds / predicted))
            self._ratios.append(ratio)
            self._log_drift += _DRIFT_ALPHA * (math.log(ratio) - self._log_drift)
            full = not 0 <= lane < len(self.drain_rows) or size >= self.drain_rows[lane]
            if full:
                # a queue drains in full batches: only they say how fast it will. A trickle's
                # single rows run on weights gone cold and pay the per-call overheads, up to
                # twice their share of the fit; counted here, they made admission refuse
                # bursts that full batches then served in time.
                log_ratio = math.log(ratio)
                self._log_queue_drift += _QUEUE_DRIFT_ALPHA * (log_ratio - self._log_queue_drift)
        self.estimates.observe_batch(lane, size, padded_len, seconds)

    @property
    def drift(self) -> float:
        """How much slower (above 1) or faster the last few batches ran than the cost model
        predicted them: shedding scales its predictions by it."""
        return math.exp(self._log_drift)

    @property
    def queue_drift(self) -> float:
        """`drift` over the last ~20 full batches (at least half their lane's cap): what
        admission scales the queued work by. The work in flight runs under the conditions of
        the moment (a burst's flood of requests slows it); a queue drains over the next
        second, mostly after the flood, and in full batches."""
        return math.exp(self._log_queue_drift)

    def load(self, now: float) -> float:
        """The runner's busy share if every request ran alone: sum over lanes of arrival
        rate x predicted time of one request of the lane's mean length, over the batches it
        runs at once (`concurrency`: two one-thread batches serve twice the requests)."""
        return self.estimates.load(now) / self.concurrency

    # ------------------------------------------------------------------ what /stats shows

    def describe(self, labels: Sequence[str], now: float) -> dict[str, Any]:
        """The strategy's current state: windows, targets and rates per lane, cost model,
        merges per lane pair, sheds, priority levels."""
        pol = self.policy
        return {
            "slo_ms": [round(s * 1000, 3) for s in pol.level_slo],
            "switches": {
                "late_binding": pol.late_binding,
                "fill_above_load": pol.fill_load,
                "fill_ramp": pol.fill_ramp,
                "merge": pol.merge,
                "shed": pol.shed.value,
                "priority_levels": pol.levels,
            },
            "min_wait_ms": pol.min_wait * 1000,
            "max_wait_ms": pol.max_wait * 1000,
            "aging_ms": pol.aging * 1000,
            "load": self.load(now),
            # predicted seconds until the emitted work is done (fluid, per runner slot)
            "backlog_ms": max(0.0, self.backlog_end - now) * 1000,
            # the HTTP and tokenization CPU per request, and how much it slows batches now and
            # at the steady rate (what admission prices the queue at)
            "request_cpu": {
                **self.request_cpu.describe(),
                "slowdown": round(self.cpu_slowdown(now), 4),
                "steady_rate": round(self.estimates.steady_rate(now), 3),
                "steady_slowdown": round(self.cpu_slowdown(now, steady=True), 4),
            },
            "lanes": [
                {
                    "bucket": labels[i] if i < len(labels) else str(i),
                    "arrival_rate": self.rate(i, now),
                    "target_batch": self.target[i],
                    "fill_window_ms": self.wait[i] * 1000,
                    "padded_len": self.estimates.padded[i],
                }
                for i in range(self.estimates.lanes)
            ],
            "cost_model": {
                **self.cost.describe(),
                "recent_drift": self.drift,
                "queue_drift": self.queue_drift,
                # quantiles of the last batches' measured / predicted time, mean 1 (empty
                # before 30 batches): how much one batch's time varies around the fit
                "batch_spread": spread_quantiles(self._ratios),
            },
            "merges": [
                {"from": labels[a] if a < len(labels) else str(a), "into": labels[b], "n": n}
                for (a, b), n in sorted(self.merges.items())
                if b < len(labels)
            ],
            "shed": dict(self.shed_counts),
            "served_late": self.late,
            "decisions": self.decisions.summary(now),
        }
