"""Admission: decide, before anything is queued, whether a request may enter. Pure.

Checks, in order: inputs the model or any batch can never take (413, never queued, never hang);
queue bounds, total and per lane (429); a token bucket counted in tokens, not requests (429 with
the time until enough tokens have accrued). Rejections say which limit and its value.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from lenbatch.config import AdmissionConfig, SchedulerConfig
from lenbatch.errors import InputTooLong, LenbatchError, Overloaded
from lenbatch.queues import Queues

__all__ = ["Admission", "TokenBucket"]


class TokenBucket:
    """A bucket of `burst` tokens refilled at `rate` tokens per second."""

    __slots__ = ("burst", "last", "rate", "tokens")

    def __init__(self, rate: float, burst: float, now: float) -> None:
        if rate <= 0 or burst <= 0:
            raise ValueError(f"token bucket needs rate > 0 and burst > 0 (got {rate}, {burst})")
        self.rate = rate
        self.burst = burst
        self.tokens = burst
        self.last = now

    def _refill(self, now: float) -> None:
        if now > self.last:
            self.tokens = min(self.burst, self.tokens + (now - self.last) * self.rate)
            self.last = now

    def try_take(self, n: float, now: float) -> float:
        """Take `n` tokens if available and return 0; else take nothing and return the seconds
        until they will be (infinite if `n` exceeds the burst size)."""
        self._refill(now)
        if n <= self.tokens:
            self.tokens -= n
            return 0.0
        if n > self.burst:
            return math.inf
        return (n - self.tokens) / self.rate


class Admission:
    """The admission rules for one scheduler configuration."""

    def __init__(self, cfg: AdmissionConfig, sched: SchedulerConfig, now: float = 0.0) -> None:
        self.cfg = cfg
        self.sched = sched
        self.bucket: TokenBucket | None = None
        if cfg.tokens_per_s is not None:
            burst = cfg.burst_tokens or cfg.tokens_per_s
            self.bucket = TokenBucket(cfg.tokens_per_s, burst, now)

    def longest_admissible(self) -> int:
        """The longest input that can ever be served: model limit and batch budget."""
        limit = self.sched.max_length
        for lane in self.sched.lanes:
            # static padding: every row costs pad_to tokens; one row must fit the budget
            if lane.pad_to is not None and lane.pad_to > self.sched.max_batch_tokens:
                return 0
        return min(limit, self.sched.max_batch_tokens)

    def check(self, lengths: Sequence[int], queues: Queues, now: float) -> LenbatchError | None:
        """None if a call with inputs of `lengths` tokens may be queued, else the error to send.

        On success the call's tokens are taken from the token bucket.
        """
        longest = self.longest_admissible()
        for i, n in enumerate(lengths):
            if n > longest:
                why = (
                    f"the model's limit is {self.sched.max_length} tokens"
                    if n > self.sched.max_length
                    else f"the batch token budget is {self.sched.max_batch_tokens}"
                )
                return InputTooLong(
                    f"input {i} has {n} tokens; {why}. Shorten it or send truncate=true"
                )
        total = queues.size + len(lengths)
        if total > self.cfg.max_queue_total:
            return Overloaded(
                f"queue full: {queues.size} requests waiting, limit max_queue_total="
                f"{self.cfg.max_queue_total}",
                retry_after=1.0,
            )
        if self.cfg.max_queue_per_bucket is not None:
            per_lane: dict[int, int] = {}
            for n in lengths:
                lane = queues.lane_of(n)
                per_lane[lane] = per_lane.get(lane, 0) + 1
            for lane, extra in per_lane.items():
                if queues.depth(lane) + extra > self.cfg.max_queue_per_bucket:
                    return Overloaded(
                        f"bucket {lane} queue full: {queues.depth(lane)} waiting, limit "
                        f"max_queue_per_bucket={self.cfg.max_queue_per_bucket}",
                        retry_after=1.0,
                    )
        if self.bucket is not None:
            need = float(sum(lengths))
            wait = self.bucket.try_take(need, now)
            if wait == math.inf:
                return InputTooLong(
                    f"this call has {int(need)} tokens; the rate limit's burst is "
                    f"{int(self.bucket.burst)} tokens. Split it into smaller calls"
                )
            if wait > 0:
                return Overloaded(
                    f"token rate limit: {self.cfg.tokens_per_s:g} tokens/s, burst "
                    f"{int(self.bucket.burst)}; retry in {wait:.2f} s",
                    retry_after=wait,
                )
        return None
