"""What the `adaptive` strategy learns from the traffic it sees: the online cost model (batch
seconds by shape) and, per lane, the arrival rate, the mean request length and the padded length
its batches reach. Pure: the caller's clock stamps every observation.

The decisions (`core.adaptive`) and the admission side (`core.shedding`) read these estimates;
only the engine's (or simulator's) observations write them: `on_arrival` per admitted request,
`observe_batch` per finished batch, `reset` when the lanes change.
"""

from __future__ import annotations

import math

from lenbatch.core.costfit import OnlineCostModel
from lenbatch.core.lanes import SchedulerConfig

__all__ = ["STEADY_WINDOW_S", "LaneEstimates"]

# Time constant of the steady arrival rate (`LaneEstimates.steady_rate`): long enough that a
# burst of a quarter second barely moves it, short enough to follow a load that lasts.
STEADY_WINDOW_S = 5.0


class LaneEstimates:
    """The online cost model plus per-lane rates and lengths, for one `SchedulerConfig`."""

    def __init__(self, cost: OnlineCostModel, rate_window: float, cfg: SchedulerConfig) -> None:
        self.cost = cost
        self.rate_window = rate_window  # time constant of the arrival-rate average (s)
        self._steady = 0.0  # all lanes' arrival rate over STEADY_WINDOW_S, as of `_steady_at`
        self._steady_at = 0.0
        self.reset(cfg)

    def reset(self, cfg: SchedulerConfig) -> None:
        """Start per-lane estimates afresh for `cfg`'s lanes (start-up, or after a re-fit)."""
        n = len(cfg.lanes)
        self.last_rate = [0.0] * n  # arrival rate as of each lane's last arrival (req/s)
        self.last_arrival = [0.0] * n
        self.padded = [float(p.upper) for p in cfg.lanes]  # padded length batches reach
        self.mean_len = [float(p.upper) / 2 for p in cfg.lanes]  # mean request length
        # the sum of the lanes' `rate`s, kept as one decaying average (the lanes share its time
        # constant), as of `_total_at`: read on every decision, summed it cost ~40 calls a request
        self._total = 0.0
        self._total_at = 0.0

    @property
    def lanes(self) -> int:
        """Number of lanes estimated."""
        return len(self.last_rate)

    def on_arrival(self, lane: int, length: int, now: float) -> None:
        """A request of `length` tokens joined `lane` at `now` (updates its arrival rate)."""
        tau = self.rate_window
        self.last_rate[lane] = (
            self.last_rate[lane] * math.exp(-(now - self.last_arrival[lane]) / tau) + 1 / tau
        )
        self.last_arrival[lane] = now
        self._total = self.total_rate(now) + 1 / tau
        self._total_at = now
        self.mean_len[lane] += 0.05 * (length - self.mean_len[lane])
        self._steady = self.steady_rate(now) + 1 / STEADY_WINDOW_S
        self._steady_at = now

    def rate(self, lane: int, now: float) -> float:
        """Estimated arrival rate of `lane` at `now` (requests/s, decaying average)."""
        dt = max(0.0, now - self.last_arrival[lane])
        return self.last_rate[lane] * math.exp(-dt / self.rate_window)

    def total_rate(self, now: float) -> float:
        """All lanes' arrival rate at `now`: the sum of `rate` over the lanes."""
        return self._total * math.exp(-max(0.0, now - self._total_at) / self.rate_window)

    def steady_rate(self, now: float) -> float:
        """All lanes' arrival rate at `now` as a decaying average over `STEADY_WINDOW_S`: the
        rate a queue drains under, where `rate` follows a burst within a second."""
        return self._steady * math.exp(-max(0.0, now - self._steady_at) / STEADY_WINDOW_S)

    def observe_batch(self, lane: int, size: int, padded_len: int, seconds: float) -> None:
        """A batch of `lane` ran `size` rows padded to `padded_len` in `seconds`."""
        self.cost.observe(size, padded_len, seconds)
        if 0 <= lane < len(self.padded):
            self.padded[lane] += 0.1 * (padded_len - self.padded[lane])

    def load(self, now: float) -> float:
        """The runner's busy share if every request ran alone: sum over lanes of arrival
        rate x predicted time of one request of the lane's mean length."""
        co = self.cost.coefficients
        tau = self.rate_window
        total = 0.0
        # `rate(i, now) * co.seconds(1, n)`, written out: this runs on every scheduling pass,
        # and most lanes of most passes have no arrivals to decay
        for rate, at, n in zip(self.last_rate, self.last_arrival, self.mean_len, strict=True):
            if rate > 0:
                total += rate * math.exp(-max(0.0, now - at) / tau) * co.seconds(1, n)
        return total
