"""The online cost model: batch time as a function of batch shape, fitted continuously from the
engine's own batch timings.

    seconds(B, L) = a + b*B*L + c*B*L^2

B is the batch size and L the padded length (the `profile` form without its per-row term, which
is zero on every profile measured so far). The fit is weighted least squares over a sliding
window of the most recent batches, each weighted by 1/seconds so that a 20 ms batch counts as
much as a 2 s one (the error that matters is relative). A prior (a profile's coefficients, or a
generic CPU guess when there is none) enters as pseudo-observations at typical shapes, worth
`prior_weight` batches in all: it decides while there is little data and fades as the window
fills. Coefficients are kept non-negative (a term fitted negative is dropped and the rest
refitted), so predictions never fall as a batch grows. Pure: numpy only, no clock.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["GENERIC_PRIOR", "PROFILE_PRIOR_WEIGHT", "CostCoefficients", "OnlineCostModel"]


@dataclass(frozen=True, slots=True)
class CostCoefficients:
    """`a + b*B*L + c*B*L^2` seconds: fixed cost per call, per padded token, per token x L."""

    a: float
    b: float
    c: float = 0.0

    def seconds(self, batch: float, padded_len: float) -> float:
        """Predicted seconds of one batch of `batch` rows padded to `padded_len` tokens."""
        bl = batch * padded_len
        return self.a + self.b * bl + self.c * bl * padded_len

    @classmethod
    def from_profile(cls, data: Mapping[str, Any]) -> CostCoefficients:
        """From a `lenbatch profile` / `calibrate` JSON dict (`const`, `per_token`,
        `per_token_sq`, times a calibrated `batch_scale` and plus a calibrated
        `batch_overhead_s` where there are)."""
        scale = float(data.get("batch_scale", 1.0))
        a = scale * float(data.get("const", 0.0)) + float(data.get("batch_overhead_s", 0.0))
        b = scale * float(data.get("per_token", 0.0))
        return cls(a, b, scale * float(data.get("per_token_sq", 0.0)))


# MiniLM-sized encoder on a small CPU: ~20 ms per call and ~4k padded tokens/s. Only used when
# no profile is given; the window replaces it within a few dozen batches.
GENERIC_PRIOR = CostCoefficients(0.02, 2.5e-4, 0.0)
# Shapes the prior is expressed at (rows, padded length), and how many real batches it weighs
# by default (a guess: a few batches overrule it).
_PRIOR_SHAPES = ((1, 16), (1, 128), (8, 64), (16, 128), (4, 256))
_PRIOR_WEIGHT = 4.0
# What a profile measured on this processor weighs (`core.adaptive.build_state`): a start-up
# calibration times 16 shapes up to full batches, where a server's first batches are a
# trickle's single rows. Weighed as 4, a dozen of those rows (cold, up to twice the profile)
# moved the per-token cost 1.6x before the first burst; as 32, the first bursts' drain time
# was predicted at 0.86-1.16x of what it took instead of 1.08-1.33x (Intel Xeon family 6
# model 167, 2 cores; `bench/run.py bursts-drain`, bench/results/adaptive-goodput/).
PROFILE_PRIOR_WEIGHT = 32.0


class OnlineCostModel:
    """A sliding-window fit of `a + b*B*L + c*B*L^2` to observed batch timings."""

    __slots__ = ("_fit", "_fitted_at", "_obs", "_prior_weight", "observed", "prior", "source")

    def __init__(
        self,
        prior: CostCoefficients | None = None,
        window: int = 256,
        prior_weight: float = _PRIOR_WEIGHT,
    ) -> None:
        if window < 3:
            raise ValueError(f"the cost model's window needs at least 3 batches, got {window}")
        if not prior_weight > 0:
            raise ValueError(f"the prior's weight must be > 0 batches, got {prior_weight}")
        self.source = "profile" if prior is not None else "generic prior"
        self.prior = prior or GENERIC_PRIOR
        self._prior_weight = prior_weight
        self._obs: deque[tuple[float, float, float]] = deque(maxlen=window)
        self._fit = self.prior
        self._fitted_at = 0  # `observed` when the fit was last computed
        self.observed = 0  # batches seen since start (the window keeps the latest)

    def observe(self, batch: int, padded_len: int, seconds: float) -> None:
        """Record one batch's measured execution time."""
        if batch < 1 or padded_len < 1 or not seconds > 0 or not math.isfinite(seconds):
            return  # a failed or degenerate timing carries no information about cost
        self._obs.append((float(batch), float(padded_len), float(seconds)))
        self.observed += 1

    @property
    def coefficients(self) -> CostCoefficients:
        """The current fit, refitted lazily: after every batch while the window is young, then
        every `window / 32` batches (the scheduler reads it on every decision)."""
        new = self.observed - self._fitted_at
        if new and (self.observed < 32 or new >= max(1, (self._obs.maxlen or 32) // 32)):
            self._fit = self._refit()
            self._fitted_at = self.observed
        return self._fit

    def seconds(self, batch: float, padded_len: float) -> float:
        """Predicted seconds of one batch of `batch` rows padded to `padded_len` tokens."""
        return self.coefficients.seconds(batch, padded_len)

    def fit_error(self) -> float | None:
        """Relative RMS error of the current fit over the window (None before any batch)."""
        if not self._obs:
            return None
        co = self.coefficients
        errs = [(co.seconds(b, n) - y) / y for b, n, y in self._obs]
        return math.sqrt(sum(e * e for e in errs) / len(errs))

    def describe(self) -> dict[str, Any]:
        """What `/stats` shows: coefficients, where the prior came from, window and error."""
        co = self.coefficients
        err = self.fit_error()
        return {
            "form": "a + b*B*L + c*B*L^2 seconds",
            "a_s": co.a,
            "b_s_per_token": co.b,
            "c_s_per_token_sq": co.c,
            "prior": self.source,
            "window": len(self._obs),
            "observed_batches": self.observed,
            "fit_error": err,
        }

    def _refit(self) -> CostCoefficients:
        rows = [(b, n, y, 1.0) for b, n, y in self._obs]
        # The prior fades as the window fills (to a trace that keeps a degenerate window,
        # e.g. one shape only, from leaving the other terms undetermined).
        fill = len(self._obs) / (self._obs.maxlen or len(self._obs) or 1)
        w_prior = self._prior_weight * max(0.02, 1.0 - fill) / len(_PRIOR_SHAPES)
        rows += [(b, n, self.prior.seconds(b, n), w_prior) for b, n in _PRIOR_SHAPES]
        data = np.asarray(rows, dtype=np.float64)
        bat, pad, y, w = data[:, 0], data[:, 1], data[:, 2], data[:, 3]
        x = np.stack([np.ones_like(y), bat * pad, bat * pad * pad], axis=1)
        # Weighted by 1/y: the residuals are relative. Columns scaled for conditioning.
        sw = np.sqrt(w) / y
        xs = x * sw[:, None]
        ys = y * sw
        active = [0, 1, 2]
        coef = np.zeros(3)
        while active:
            sub = xs[:, active]
            scale = np.linalg.norm(sub, axis=0)
            scale[scale == 0] = 1.0
            sol, *_ = np.linalg.lstsq(sub / scale, ys, rcond=None)
            sol = sol / scale
            if (sol >= 0).all():
                coef[:] = 0.0
                coef[active] = sol
                break
            active.pop(int(np.argmin(sol)))  # drop the most negative term and refit the rest
        return CostCoefficients(float(coef[0]), float(coef[1]), float(coef[2]))
