"""Admission: decide, before anything is queued, whether a request may enter. Pure.

Checks, in order:

1. what can never be served, however long the client waits (413, never queued, never hangs):
   an input over the model's limit or over the batch token budget, a call with more inputs than
   the queues can ever hold, a call with more tokens than the rate limit's burst;
2. queue bounds, in total and per lane (429 `queue_full` / `bucket_queue_full`);
3. a token bucket counted in tokens, not requests (429 `rate_limited`, with the exact time until
   enough tokens have accrued as `retry_after`).

A rejection names the limit and its value. Only an accepted call takes tokens from the bucket.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from lenbatch.config import AdmissionConfig
from lenbatch.core.errors import InputTooLong, LenbatchError, Overloaded
from lenbatch.core.lanes import SchedulerConfig
from lenbatch.core.queues import Queues

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
        # Both configs are frozen: compute the length limit once (check() runs per call, and
        # per request in the simulator).
        self._longest = self._longest_admissible()
        self._simple = cfg.max_queue_per_bucket is None and self.bucket is None

    def _longest_admissible(self) -> int:
        for lane in self.sched.lanes:
            if lane.pad_to is not None and lane.pad_to > self.sched.max_batch_tokens:
                return 0
        return min(self.sched.max_length, self.sched.max_batch_tokens)

    def longest_admissible(self) -> int:
        """The longest input that can ever be served: model limit and batch budget (0 if a
        lane pads every row past the budget, so that nothing can run)."""
        return self._longest

    def _never_fits(self, lengths: Sequence[int], queues: Queues) -> InputTooLong | None:
        longest = self._longest
        budget = self.sched.max_batch_tokens
        for i, n in enumerate(lengths):
            if n <= longest:
                continue
            if n > self.sched.max_length:
                why = f"the model's limit is {self.sched.max_length} tokens"
            elif n > budget:
                why = f"the batch token budget max_batch_tokens is {budget}"
            else:
                pad = max(p.pad_to or 0 for p in self.sched.lanes)
                why = f"every input is padded to {pad} tokens, over max_batch_tokens={budget}"
            return InputTooLong(
                f"input {i} has {n} tokens; {why}. Shorten it or send truncate=true",
                code="input_too_long",
            )
        if len(lengths) > self.cfg.max_queue_total:
            return InputTooLong(
                f"this call has {len(lengths)} inputs; the queues hold at most "
                f"max_queue_total={self.cfg.max_queue_total}. Split it into smaller calls",
                code="too_many_inputs",
            )
        per_lane = self.cfg.max_queue_per_bucket
        if per_lane is not None:
            for lane, extra in _count_lanes(lengths, queues).items():
                if extra > per_lane:
                    return InputTooLong(
                        f"this call has {extra} inputs for bucket {lane}; a bucket holds at "
                        f"most max_queue_per_bucket={per_lane}. Split it into smaller calls",
                        code="too_many_inputs",
                    )
        if self.bucket is not None and sum(lengths) > self.bucket.burst:
            return InputTooLong(
                f"this call has {sum(lengths)} tokens; the rate limit's burst is "
                f"{int(self.bucket.burst)} tokens. Split it into smaller calls",
                code="call_over_burst",
            )
        return None

    def check(self, lengths: Sequence[int], queues: Queues, now: float) -> LenbatchError | None:
        """None if a call with inputs of `lengths` tokens may be queued, else the error to send.

        On success the call's tokens are taken from the token bucket.
        """
        if (
            self._simple
            and len(lengths) == 1
            and lengths[0] <= self._longest
            and queues.size < self.cfg.max_queue_total
        ):
            return None  # the common case, decided without building anything
        never = self._never_fits(lengths, queues)
        if never is not None:
            return never
        retry = self.cfg.retry_after_s
        if queues.size + len(lengths) > self.cfg.max_queue_total:
            return Overloaded(
                f"queue full: {queues.size} inputs waiting, limit max_queue_total="
                f"{self.cfg.max_queue_total}; retry later",
                retry_after=retry,
                code="queue_full",
            )
        if self.cfg.max_queue_per_bucket is not None:
            for lane, extra in _count_lanes(lengths, queues).items():
                if queues.depth(lane) + extra > self.cfg.max_queue_per_bucket:
                    return Overloaded(
                        f"bucket {lane} queue full: {queues.depth(lane)} inputs waiting, limit "
                        f"max_queue_per_bucket={self.cfg.max_queue_per_bucket}; retry later",
                        retry_after=retry,
                        code="bucket_queue_full",
                    )
        if self.bucket is not None:
            wait = self.bucket.try_take(float(sum(lengths)), now)
            if wait > 0:
                return Overloaded(
                    f"token rate limit: {self.cfg.tokens_per_s:g} tokens/s, burst "
                    f"{int(self.bucket.burst)}; retry in {wait:.2f} s",
                    retry_after=wait,
                    code="rate_limited",
                )
        return None


def _count_lanes(lengths: Sequence[int], queues: Queues) -> dict[int, int]:
    per_lane: dict[int, int] = {}
    for n in lengths:
        lane = queues.lane_of(n)
        per_lane[lane] = per_lane.get(lane, 0) + 1
    return per_lane
