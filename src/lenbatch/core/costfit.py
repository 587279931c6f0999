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
refitted), so predictions never fall as a batch grows. Pure: no clock.

`spread_quantiles` says how much measured batch times vary around a prediction (the quantiles
of measured / predicted, scaled to mean 1): what a simulator draws each batch's time from, so
its tails are the server's.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "GENERIC_PRIOR",
    "PROFILE_PRIOR_WEIGHT",
    "SPREAD_MIN_SAMPLES",
    "SPREAD_POINTS",
    "SPREAD_WINDOW",
    "CostCoefficients",
    "OnlineCostModel",
    "spread_quantiles",
]

SPREAD_POINTS = 21  # quantiles at probabilities 0, 0.05, ..., 1
SPREAD_MIN_SAMPLES = 30  # fewer samples than this give no spread
# the last batches whose measured / predicted time an adaptive server's spread is over
# (`/stats` `batch_spread`: what `simulate --cost URL` draws each batch's time from)
SPREAD_WINDOW = 512


def spread_quantiles(ratios: Iterable[float]) -> list[float]:
    """`SPREAD_POINTS` quantiles (probabilities 0 to 1, evenly spaced) of measured / predicted
    batch times `ratios`, scaled to mean 1 and rounded to 4 digits; empty with fewer than
    `SPREAD_MIN_SAMPLES` samples or a mean that is not positive."""
    x = np.asarray(list(ratios), dtype=np.float64)
    if len(x) < SPREAD_MIN_SAMPLES or not x.mean() > 0:
        return []
    q = np.quantile(x / x.mean(), np.linspace(0.0, 1.0, SPREAD_POINTS))
    return [round(float(v), 4) for v in q]


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

    __slots__ = (
        "_buf",
        "_fit",
        "_fitted_at",
        "_len",
        "_next",
        "_prior_rows",
        "_prior_sums",
        "_prior_weight",
        "_since_exact",
        "_sums",
        "observed",
        "prior",
        "source",
    )

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
        # The window as a ring of (rows, padded length, seconds), in a numpy array: `fit_error`
        # reads it as it is. The fit itself reads only `_sums`, the window's normal equations
        # kept as plain floats, a batch added and the one it displaces taken out (below).
        self._buf = np.zeros((window, 3), dtype=np.float64)
        self._len = 0  # rows of `_buf` in use
        self._next = 0  # the row the next observation overwrites (the oldest once full)
        self._prior_rows = np.array(
            [(b, n, self.prior.seconds(b, n)) for b, n in _PRIOR_SHAPES], dtype=np.float64
        )
        self._prior_sums = _sums(self._prior_rows.tolist())
        self._sums = [0.0] * 9
        self._since_exact = 0  # observations since `_sums` was last summed afresh
        self._fit = self.prior
        self._fitted_at = 0  # `observed` when the fit was last computed
        self.observed = 0  # batches seen since start (the window keeps the latest)

    @property
    def window(self) -> int:
        """The most batches the fit is over (the latest ones)."""
        return int(self._buf.shape[0])

    def observe(self, batch: int, padded_len: int, seconds: float) -> None:
        """Record one batch's measured execution time."""
        if batch < 1 or padded_len < 1 or not seconds > 0 or not math.isfinite(seconds):
            return  # a failed or degenerate timing carries no information about cost
        row = self._buf[self._next]
        if self._len == self.window:  # the oldest leaves the window
            _add(self._sums, float(row[0]), float(row[1]), float(row[2]), -1.0)
        row[0], row[1], row[2] = batch, padded_len, seconds
        _add(self._sums, float(batch), float(padded_len), float(seconds), 1.0)
        self._next = (self._next + 1) % self.window
        self._len = min(self._len + 1, self.window)
        self.observed += 1
        self._since_exact += 1
        if self._since_exact >= self.window:  # what adding and taking out rounded, once a window
            self._sums = _sums(self._buf[: self._len].tolist())
            self._since_exact = 0

    @property
    def coefficients(self) -> CostCoefficients:
        """The current fit, refitted lazily: after every batch while the window is young, then
        every `window / 32` batches (the scheduler reads it on every decision)."""
        new = self.observed - self._fitted_at
        if new and (self.observed < 32 or new >= max(1, self.window // 32)):
            self._fit = self._refit()
            self._fitted_at = self.observed
        return self._fit

    def seconds(self, batch: float, padded_len: float) -> float:
        """Predicted seconds of one batch of `batch` rows padded to `padded_len` tokens."""
        return self.coefficients.seconds(batch, padded_len)

    def fit_error(self) -> float | None:
        """Relative RMS error of the current fit over the window (None before any batch)."""
        if not self._len:
            return None
        co = self.coefficients
        b, n, y = self._buf[: self._len].T
        bl = b * n
        errs = (co.a + co.b * bl + co.c * bl * n - y) / y
        return float(math.sqrt(float(np.mean(errs * errs))))

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
            "window": self._len,
            "observed_batches": self.observed,
            "fit_error": err,
        }

    def _refit(self) -> CostCoefficients:
        # The prior fades as the window fills (to a trace that keeps a degenerate window,
        # e.g. one shape only, from leaving the other terms undetermined).
        fill = self._len / self.window
        w_prior = self._prior_weight * max(0.02, 1.0 - fill) / len(_PRIOR_SHAPES)
        # Weighted least squares with relative residuals: each row (1, B*L, B*L^2) / seconds
        # against 1, the prior's rows weighed `w_prior`. Its normal equations are the window's
        # running sums plus the prior's, so a refit costs no pass over the rows and no numpy
        # call: numpy's element-wise calls release the GIL, and on the event loop, with a
        # runner thread busy, taking it back cost 244 us a refit against 31 alone (Intel Xeon
        # family 6 model 167, 2 cores; sequential one-line requests).
        t = [u + w_prior * p for u, p in zip(self._sums, self._prior_sums, strict=True)]
        gram = [[t[0], t[1], t[2]], [t[1], t[3], t[4]], [t[2], t[4], t[5]]]
        rhs = t[6:9]
        # Columns scaled to a unit diagonal for conditioning; then each active set's fit is a
        # solve of at most 3 x 3, and lstsq over the rows only where that system is singular.
        scale = [math.sqrt(gram[i][i]) or 1.0 for i in range(3)]
        g = [[gram[i][j] / (scale[i] * scale[j]) for j in range(3)] for i in range(3)]
        r = [rhs[i] / scale[i] for i in range(3)]
        active = [0, 1, 2]
        coef = [0.0, 0.0, 0.0]
        while active:
            sol = _solve_small([[g[i][j] for j in active] for i in active], [r[i] for i in active])
            if sol is None:
                sol = self._lstsq(active, w_prior)
            else:
                sol = [v / scale[i] for v, i in zip(sol, active, strict=True)]
            if min(sol) >= 0:
                coef = [0.0, 0.0, 0.0]
                for v, i in zip(sol, active, strict=True):
                    coef[i] = v
                break
            active.pop(sol.index(min(sol)))  # drop the most negative term and refit the rest
        return CostCoefficients(coef[0], coef[1], coef[2])

    def _lstsq(self, active: list[int], w_prior: float) -> list[float]:
        """The weighted fit of the `active` terms by lstsq over every row: where the normal
        equations are too near singular to solve as they are."""
        data = np.concatenate([self._buf[: self._len], self._prior_rows])
        bat, pad, y = data[:, 0], data[:, 1], data[:, 2]
        w = np.ones(len(data))
        w[self._len :] = w_prior
        x = np.stack([np.ones_like(y), bat * pad, bat * pad * pad], axis=1)
        sw = np.sqrt(w) / y
        xs = x[:, active] * sw[:, None]
        scale = np.sqrt((xs * xs).sum(axis=0))
        scale[scale == 0] = 1.0
        sol = np.linalg.lstsq(xs / scale, y * sw, rcond=None)[0] / scale
        return [float(v) for v in sol]


def _add(sums: list[float], batch: float, padded_len: float, seconds: float, sign: float) -> None:
    """Add (`sign` 1) or take out (-1) one batch's terms of the normal equations: with
    u = (1, B*L, B*L^2) / seconds, the six distinct entries of u u^T, then u (the right side:
    each row's target is 1)."""
    bl = batch * padded_len
    u0 = 1.0 / seconds
    u1 = bl * u0
    u2 = bl * padded_len * u0
    sums[0] += sign * u0 * u0
    sums[1] += sign * u0 * u1
    sums[2] += sign * u0 * u2
    sums[3] += sign * u1 * u1
    sums[4] += sign * u1 * u2
    sums[5] += sign * u2 * u2
    sums[6] += sign * u0
    sums[7] += sign * u1
    sums[8] += sign * u2


def _sums(rows: list[list[float]]) -> list[float]:
    """The normal equations' sums over `rows` of (rows, padded length, seconds), afresh."""
    sums = [0.0] * 9
    for b, n, y in rows:
        _add(sums, b, n, y, 1.0)
    return sums


def _solve_small(a: list[list[float]], b: list[float]) -> list[float] | None:
    """`x` with `a @ x = b` for a small square `a` (Gaussian elimination with partial
    pivoting, in plain floats: numpy's call overhead is most of a 3 x 3 solve), or None when
    `a` is singular or nearly so (a pivot under 1e-12 of a unit-diagonal matrix)."""
    n = len(b)
    m = [[*row, b[i]] for i, row in enumerate(a)]
    for k in range(n):
        p = max(range(k, n), key=lambda i: abs(m[i][k]))
        if abs(m[p][k]) < 1e-12:
            return None
        m[k], m[p] = m[p], m[k]
        for i in range(k + 1, n):
            f = m[i][k] / m[k][k]
            for j in range(k, n + 1):
                m[i][j] -= f * m[k][j]
    x = [0.0] * n
    for i in range(n - 1, -1, -1):
        x[i] = (m[i][n] - sum(m[i][j] * x[j] for j in range(i + 1, n))) / m[i][i]
    return x
