"""Invariants of the pure scheduler under random configs, workloads and service times.

A small event loop drives `schedule()` the way the engine does (on arrivals, completions and
`wake_at`) with a virtual clock, and probes it at random moments in between: a probe must never
find work that should already have run.
"""

from __future__ import annotations

import heapq
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lenbatch.config import Strategy
from lenbatch.core.batch import Batch
from lenbatch.core.lanes import SchedulerConfig
from lenbatch.core.queues import Queues
from lenbatch.core.request import Request
from lenbatch.core.scheduler import schedule
from tests.property.strategies import Arrival, scheduler_configs, workloads


class Violation(AssertionError):
    """An invariant broke."""


def _lane_ready(q: Queues, lane: int, now: float, cfg: SchedulerConfig) -> bool:
    """Independent statement of readiness (not the scheduler's code)."""
    dq = q.lanes[lane]
    pol = cfg.lanes[lane]
    if not dq:
        return False
    if pol.quota is not None and q.inflight[lane] >= pol.quota:
        return False
    if dq[0].arrival + pol.max_wait <= now or len(dq) >= pol.max_batch:
        return True
    # the budget is full if the head plus the next request cannot share one batch
    pad = 0
    for rows, r in enumerate(dq, start=1):
        pad = pol.pad_to or max(pad, r.length)
        if pad * rows > cfg.max_batch_tokens:
            return rows > 1
    return False


def drive(
    cfg: SchedulerConfig, work: list[Arrival], service_per_token: float, seed: int
) -> dict[int, str]:
    """Run the workload to the end; returns how each request ended (by index)."""
    rng = random.Random(seed)
    q = Queues(cfg)
    reqs = [
        Request(a.length, a.t, None, deadline=None if a.timeout is None else a.t + a.timeout)
        for a in work
    ]
    index = {id(r): i for i, r in enumerate(reqs)}
    outcome: dict[int, str] = {}
    running: list[tuple[float, int, Batch]] = []
    last_taken = [-1] * len(cfg.lanes)
    nxt, now, wake, seq, steps = 0, 0.0, None, 0, 0
    while nxt < len(reqs) or running or q.size:
        steps += 1
        if steps > 100_000:
            raise Violation("no progress")
        candidates = [
            t
            for t in (
                reqs[nxt].arrival if nxt < len(reqs) else None,
                running[0][0] if running else None,
                wake,
            )
            if t is not None
        ]
        if not candidates:
            raise Violation(f"{q.size} requests wait with no arrival, batch or timer to move them")
        t_next = min(candidates)
        if t_next > now:  # probe strictly between events: nothing may be due yet
            probe = now + rng.random() * (t_next - now)
            if now < probe < t_next:  # rounding may land it on an endpoint: skip those
                d = schedule(q, probe, cfg)
                if d.batches or d.expired:
                    raise Violation(f"work became due at {probe} before the next event {t_next}")
        now = t_next
        while running and running[0][0] <= now:
            _, _, done = heapq.heappop(running)
            q.batch_done(done.lane)
        while nxt < len(reqs) and reqs[nxt].arrival <= now:
            q.push(reqs[nxt])
            nxt += 1
        d = schedule(q, now, cfg)
        for r in d.expired:
            i = index[id(r)]
            if i in outcome:
                raise Violation(f"request {i} answered twice")
            if r.deadline is None or r.deadline > now:
                raise Violation(f"request {i} expired before its deadline")
            outcome[i] = "expired"
        for b in d.batches:
            check_batch(b, cfg, now, index, outcome, last_taken)
            seq += 1
            dur = service_per_token * b.padded_tokens + 1e-4
            heapq.heappush(running, (now + dur, seq, b))
        for lane, pol in enumerate(cfg.lanes):
            if pol.quota is not None and q.inflight[lane] > pol.quota:
                raise Violation(f"lane {lane} has {q.inflight[lane]} batches, quota {pol.quota}")
        if q.inflight_total < cfg.slots:
            for lane in range(len(cfg.lanes)):
                if _lane_ready(q, lane, now, cfg):
                    raise Violation(f"lane {lane} is due at {now} but a runner slot is free")
        if d.wake_at is not None and d.wake_at <= now:
            raise Violation(f"wake_at {d.wake_at} is not in the future (now {now})")
        wake = d.wake_at
    return outcome


def check_batch(
    b: Batch,
    cfg: SchedulerConfig,
    now: float,
    index: dict[int, int],
    outcome: dict[int, str],
    last_taken: list[int],
) -> None:
    """Caps, padding and FIFO order of one emitted batch."""
    pol = cfg.lanes[b.lane]
    if not 1 <= b.size <= pol.max_batch:
        raise Violation(f"batch of {b.size} in lane {b.lane} (max_batch {pol.max_batch})")
    if b.padded_tokens > cfg.max_batch_tokens:
        raise Violation(f"batch of {b.padded_tokens} tokens > budget {cfg.max_batch_tokens}")
    if any(b.padded_len < r.length for r in b.requests):
        raise Violation("padded length shorter than a member")
    if pol.pad_to is not None and b.padded_len != pol.pad_to:
        raise Violation("static batch not padded to the model limit")
    for r in b.requests:
        i = index[id(r)]
        if i in outcome:
            raise Violation(f"request {i} answered twice")
        if r.deadline is not None and r.deadline <= now:
            raise Violation(f"expired request {i} was batched")
        outcome[i] = "ran"
        if r.lane != b.lane:
            raise Violation("request batched outside its lane")
        if cfg.strategy is not Strategy.SORTED:
            if i < last_taken[b.lane]:
                raise Violation(f"lane {b.lane} not FIFO: {i} after {last_taken[b.lane]}")
            last_taken[b.lane] = i


@pytest.mark.slow
@settings(max_examples=200, deadline=None)
@given(
    cfg=scheduler_configs(),
    data=st.data(),
    per_token=st.sampled_from([0.0, 1e-5, 1e-4]),
    seed=st.integers(0, 2**16),
)
def test_scheduler_invariants(
    cfg: SchedulerConfig, data: st.DataObject, per_token: float, seed: int
) -> None:
    """Every request answered exactly once; caps, padding, FIFO, max wait and quota hold."""
    work = data.draw(workloads(cfg.max_length))
    outcome = drive(cfg, work, per_token, seed)
    assert sorted(outcome) == list(range(len(work))), "some request was never answered"
    for i, a in enumerate(work):
        if outcome[i] == "expired":
            assert a.timeout is not None


def test_overlong_lane_is_served_under_a_flood_of_short_requests() -> None:
    """Short requests that always fill batches cannot starve an overdue overlong request."""
    from tests.helpers import sched_cfg

    cfg = sched_cfg(
        boundaries=(16,),
        max_length=128,
        max_batch=4,
        max_wait_ms=1000,
        overlong_max_wait_ms=5,
        max_concurrent_batches=1,
        prefetch_batches=0,
    )
    q = Queues(cfg)
    long_req = Request(100, 0.0, None)
    q.push(long_req)
    now = 0.0
    served_at = None
    for _step in range(50):
        for k in range(8):  # twice what one batch can take, every step
            q.push(Request(8, now + k * 1e-6, None))
        (b,) = schedule(q, now, cfg).batches
        if long_req in b.requests:
            served_at = now
            break
        now += 0.002  # each batch runs 2 ms
        q.batch_done(b.lane)
    assert served_at is not None, "overlong request starved"
    assert served_at <= 0.005 + 0.002  # its max wait plus one running batch
