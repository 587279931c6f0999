"""Injected time: every timestamp in lenbatch comes from a `Clock`.

The scheduler and simulator never read the wall clock themselves; the engine stamps a request's
arrival once, from its clock, and tests drive a `FakeClock` instead of sleeping.
"""

from __future__ import annotations

import time
from typing import Protocol

__all__ = ["Clock", "FakeClock", "MonotonicClock"]


class Clock(Protocol):
    """Anything that tells the current time in seconds (monotonic, arbitrary origin)."""

    def now(self) -> float:
        """Current time in seconds."""
        ...


class MonotonicClock:
    """The real clock: `time.monotonic()`."""

    def now(self) -> float:
        """Current monotonic time in seconds."""
        return time.monotonic()


class FakeClock:
    """A clock that only moves when told to; for tests and the simulator."""

    def __init__(self, start: float = 0.0) -> None:
        self._now = start

    def now(self) -> float:
        """The time this clock was last set to."""
        return self._now

    def advance(self, dt: float) -> None:
        """Move time forward by `dt` seconds (never backwards)."""
        if dt < 0:
            raise ValueError(f"FakeClock cannot go backwards (dt={dt})")
        self._now += dt

    def set(self, t: float) -> None:
        """Jump to absolute time `t` (must not be earlier than now)."""
        if t < self._now:
            raise ValueError(f"FakeClock cannot go backwards ({t} < {self._now})")
        self._now = t
