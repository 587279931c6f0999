"""The online re-fit of a serving engine's boundaries (strategy `adaptive`).

The lengths admitted are sampled as they arrive; when the re-fitter (`core.refit`) proposes
boundaries that would save enough padding, new batches are held until nothing is in flight,
and the new batching settings are handed to the engine, which swaps its lanes atomically
(queued requests re-bucketed, batch caps, admission and metrics relabelled). The decisions are
the core's and are shared with the simulator; what is here is the engine's side of them.
"""

from __future__ import annotations

import logging
from typing import Any

from lenbatch.config import AdaptiveConfig
from lenbatch.core.adaptive import AdaptiveState
from lenbatch.core.refit import BoundarySwap, Fitter, build_refitter

__all__ = ["LiveRefit"]

log = logging.getLogger("lenbatch.embed.engine")


class LiveRefit:
    """Watches admitted lengths and says when, and to what, a running engine's boundaries
    change; `adaptive` is told to hold new batches while a swap waits for the runner."""

    def __init__(
        self, ac: AdaptiveConfig, max_length: int, adaptive: AdaptiveState, fitter: Fitter
    ) -> None:
        co = adaptive.cost.coefficients
        self.refitter = build_refitter(ac, max_length, co.a, co.b, fitter)
        self.swap = BoundarySwap(self.refitter)
        self.adaptive = adaptive

    def observe(self, length: int) -> None:
        """An input of `length` tokens was admitted."""
        self.refitter.observe(length)

    def step(
        self, now: float, old: tuple[int, ...], inflight: int, accepting: bool, queued: int
    ) -> tuple[int, ...] | None:
        """The boundaries to swap the lanes from `old` to now, or None: no re-fit proposed, or
        batches still in flight (new ones are held meanwhile). `accepting`: the engine takes
        new work (no re-fit is considered otherwise); `queued`: requests to be re-bucketed."""
        new = self.swap.step(now, old, inflight, accepting)
        self.adaptive.hold = self.swap.holding
        if new is None:
            return None
        ev = self.refitter.events[-1]
        log.info(
            "re-fit: boundaries %s -> %s (drift KS %s, predicted saving %.1f%%, %d queued "
            "requests re-bucketed)",
            list(old),
            list(new),
            "n/a" if ev.ks is None else f"{ev.ks:.3f}",
            100 * ev.saving,
            queued,
        )
        return new

    def describe(self) -> dict[str, Any]:
        """The re-fitter's state and history, for `/stats`."""
        return self.refitter.describe()
