"""Invariants of strategy `adaptive` under random configs, policies, workloads and service times.

A small event loop drives `schedule()` with an `AdaptiveState` the way the engine and the
simulator do (on arrivals, completions and `wake_at`, feeding batch timings back to the cost
model). Every request must end exactly once (ran, expired or shed), batches keep the caps and
the token budget, each lane is served in arrival order (one priority level), and the loop never
stalls.
"""

from __future__ import annotations

import heapq

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lenbatch.config import BatchingConfig, ShedMode, Strategy
from lenbatch.core.adaptive import AdaptivePolicy, AdaptiveState
from lenbatch.core.batch import Batch
from lenbatch.core.costfit import CostCoefficients, OnlineCostModel
from lenbatch.core.lanes import SchedulerConfig, resolve_scheduler
from lenbatch.core.queues import Queues
from lenbatch.core.request import Request
from lenbatch.core.scheduler import schedule
from tests.property.strategies import Arrival, workloads

pytestmark = pytest.mark.slow


class Violation(AssertionError):
    """An invariant broke."""


@st.composite
def adaptive_setups(draw: st.DrawFn) -> tuple[SchedulerConfig, AdaptivePolicy]:
    """Random lanes, caps and budget; random switches and SLO."""
    max_length = draw(st.sampled_from([32, 64, 128]))
    picks = draw(st.sets(st.integers(1, max_length), min_size=1, max_size=5))
    cfg = resolve_scheduler(
        BatchingConfig(
            strategy=Strategy.ADAPTIVE,
            boundaries=tuple(sorted(picks)),
            max_batch=draw(st.integers(1, 8)),
            max_batch_tokens=draw(st.integers(max_length, 6 * max_length)),
            overlong_max_batch=draw(st.integers(1, 4)),
            overlong_max_inflight=draw(st.integers(1, 2)),
            max_concurrent_batches=draw(st.integers(1, 2)),
            prefetch_batches=draw(st.integers(0, 1)),
        ),
        max_length,
    )
    policy = AdaptivePolicy(
        level_slo=(draw(st.sampled_from([0.01, 0.05, 0.5, 5.0])),),
        min_wait=draw(st.sampled_from([0.0, 0.001])),
        max_wait=draw(st.sampled_from([0.0, 0.005, 0.05])),
        late_binding=draw(st.booleans()),
        fill_gain=draw(st.sampled_from([0.0, 0.1])),
        fill_load=draw(st.sampled_from([0.0, 0.7])),
        merge=draw(st.booleans()),
        shed=draw(st.sampled_from(list(ShedMode))),
    )
    return cfg, policy


def drive(
    cfg: SchedulerConfig,
    policy: AdaptivePolicy,
    work: list[Arrival],
    per_token: float,
    swaps: list[tuple[int, SchedulerConfig]] | None = None,
) -> dict[int, str]:
    """Run the workload to the end; returns how each request ended (by index). `swaps`: at
    step k, ask for a lane swap to that config, done as the engine does it (new batches held
    until nothing is in flight, then `Queues.rebucket`)."""
    pending: list[tuple[int, SchedulerConfig]] = sorted(swaps or [], key=lambda s: s[0])
    target: SchedulerConfig | None = None
    cost = CostCoefficients(1e-3, per_token, 0.0)
    state = AdaptiveState(policy, OnlineCostModel(cost), cfg)
    q = Queues(cfg)
    reqs = [
        Request(a.length, a.t, None, deadline=None if a.timeout is None else a.t + a.timeout)
        for a in work
    ]
    index = {id(r): i for i, r in enumerate(reqs)}
    outcome: dict[int, str] = {}
    running: list[tuple[float, int, Batch]] = []
    last_taken: dict[int, int] = {}
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
        now = min(candidates)
        while running and running[0][0] <= now:
            _, _, done = heapq.heappop(running)
            q.batch_done(done.lane)
        while nxt < len(reqs) and reqs[nxt].arrival <= now:
            r = reqs[nxt]
            r.due = state.due_of(r.arrival, 0, None)
            state.on_arrival(q.push(r), r.length, now)
            nxt += 1
        if target is None and pending and steps >= pending[0][0]:
            target = pending.pop(0)[1]
            state.hold = True
        if target is not None and q.inflight_total == 0:
            size = q.size
            q.rebucket(target)
            if q.size != size:
                raise Violation("the swap changed the number of queued requests")
            cfg, target = target, None
            state.reset_lanes(cfg)
            state.hold = False
            last_taken.clear()  # lanes have new meanings; each new lane is in arrival order
        d = schedule(q, now, cfg, state)
        if state.hold and (d.batches or d.expired or d.shed):
            raise Violation("a batch left while a swap was pending")
        for kind, rs in (("expired", d.expired), ("shed", d.shed)):
            for r in rs:
                i = index[id(r)]
                if i in outcome:
                    raise Violation(f"request {i} answered twice")
                outcome[i] = kind
                if kind == "expired" and (r.deadline is None or r.deadline > now):
                    raise Violation(f"request {i} expired before its deadline")
        if policy.shed is ShedMode.LATE and d.shed:
            raise Violation("shed with shed = late")
        for b in d.batches:
            check_batch(b, cfg, now, index, outcome, last_taken)
            seq += 1
            dur = cost.seconds(b.size, b.padded_len)
            state.observe_batch(b.lane, b.size, b.padded_len, dur)
            heapq.heappush(running, (now + dur, seq, b))
        if d.merges and not policy.merge:
            raise Violation("merged with merge off")
        if q.inflight_total > cfg.slots:
            raise Violation(f"{q.inflight_total} batches in flight, {cfg.slots} slots")
        for lane, pol in enumerate(cfg.lanes):
            if pol.quota is not None and q.inflight[lane] > pol.quota:
                raise Violation(f"lane {lane} has {q.inflight[lane]} batches, quota {pol.quota}")
        if d.wake_at is not None and d.wake_at <= now:
            raise Violation(f"wake_at {d.wake_at} is not in the future (now {now})")
        if q.size != sum(len(x) for x in q.lanes):
            raise Violation("queue size out of step with the lanes")
        wake = d.wake_at
    return outcome


def check_batch(
    b: Batch,
    cfg: SchedulerConfig,
    now: float,
    index: dict[int, int],
    outcome: dict[int, str],
    last_taken: dict[int, int],
) -> None:
    """Caps, padding, lanes and FIFO order of one emitted batch."""
    pol = cfg.lanes[b.lane]
    if not 1 <= b.size <= pol.max_batch:
        raise Violation(f"batch of {b.size} in lane {b.lane} (max_batch {pol.max_batch})")
    if b.padded_tokens > cfg.max_batch_tokens:
        raise Violation(f"batch of {b.padded_tokens} tokens > budget {cfg.max_batch_tokens}")
    if b.padded_len != max(r.length for r in b.requests):
        raise Violation("not padded to the batch's longest member")
    for r in b.requests:
        i = index[id(r)]
        if i in outcome:
            raise Violation(f"request {i} answered twice")
        if r.deadline is not None and r.deadline <= now:
            raise Violation(f"expired request {i} was batched")
        outcome[i] = "ran"
        if r.lane > b.lane:
            raise Violation("a request joined a shorter lane's batch")
        if i < last_taken.get(r.lane, -1):
            raise Violation(f"lane {r.lane} not FIFO: {i} after {last_taken[r.lane]}")
        last_taken[r.lane] = i


@settings(max_examples=200, deadline=None)
@given(
    setup=adaptive_setups(),
    data=st.data(),
    per_token=st.sampled_from([0.0, 1e-5, 1e-4]),
)
def test_adaptive_invariants(
    setup: tuple[SchedulerConfig, AdaptivePolicy], data: st.DataObject, per_token: float
) -> None:
    """Every request ends exactly once; caps, budget, lanes, FIFO and progress hold."""
    cfg, policy = setup
    work = data.draw(workloads(cfg.max_length))
    outcome = drive(cfg, policy, work, per_token)
    assert sorted(outcome) == list(range(len(work))), "some request was never answered"
    for i, a in enumerate(work):
        if outcome[i] == "expired":
            assert a.timeout is not None


@settings(max_examples=150, deadline=None)
@given(
    setup=adaptive_setups(),
    data=st.data(),
    per_token=st.sampled_from([1e-5, 1e-4]),
)
def test_refit_under_load_loses_duplicates_and_reorders_nothing(
    setup: tuple[SchedulerConfig, AdaptivePolicy], data: st.DataObject, per_token: float
) -> None:
    """Lane swaps to random boundaries in the middle of a workload: every request still ends
    exactly once, and each lane stays FIFO (checked in `drive`)."""
    cfg, policy = setup
    work = data.draw(workloads(cfg.max_length))
    n_swaps = data.draw(st.integers(1, 3))
    swaps = []
    for _ in range(n_swaps):
        picks = data.draw(st.sets(st.integers(1, cfg.max_length), min_size=1, max_size=5))
        new = resolve_scheduler(
            BatchingConfig(
                strategy=Strategy.ADAPTIVE,
                boundaries=tuple(sorted(picks)),
                max_batch=cfg.lanes[0].max_batch,
                max_batch_tokens=cfg.max_batch_tokens,
                max_concurrent_batches=1,
                prefetch_batches=cfg.slots - 1,
            ),
            cfg.max_length,
        )
        swaps.append((data.draw(st.integers(1, 40)), new))
    outcome = drive(cfg, policy, work, per_token, swaps)
    assert sorted(outcome) == list(range(len(work))), "some request was never answered"
