"""`BatchRunner` on its own: a batch in, what it came to out, with no engine anywhere.

The runner is a `FakeRunner` behind a `FaultyRunner`; requests are bare `core.Request`s and the
two questions the runner asks mid-run (has the runner failed? is this request still wanted?)
are plain callables.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from lenbatch.config import RecoveryConfig
from lenbatch.core.batch import Batch
from lenbatch.core.clock import FakeClock
from lenbatch.core.request import Request
from lenbatch.embed.batches import (
    BatchEvent,
    BatchRunner,
    Crashed,
    Expired,
    Failed,
    Refused,
    Returned,
    Started,
)
from lenbatch.runners.fake import FakeRunner
from lenbatch.runners.faulty import FaultyRunner

POISON = 7


def ids(n: int, token: int = 2000) -> list[int]:
    """A token-id input of `n` tokens."""
    return [101, *([token] * (n - 2)), 102]


def batch(inputs: list[list[int]], clock: FakeClock, deadline: float | None = None) -> Batch:
    requests: list[Request[Any]] = [
        Request(len(x), clock.now(), x, deadline=deadline) for x in inputs
    ]
    return Batch(0, requests, max(len(x) for x in inputs))


def run(
    runner: FaultyRunner,
    b: Batch,
    clock: FakeClock,
    *,
    recovery: RecoveryConfig | None = None,
    failed: Callable[[], bool] = lambda: False,
    wanted: Callable[[Request[Any]], bool] = lambda r: True,
) -> list[BatchEvent]:
    """Every event of running `b` once, in order."""

    async def go() -> list[BatchEvent]:
        with ThreadPoolExecutor(1) as pool:
            br = BatchRunner(runner, runner.info, pool, 1, recovery or RecoveryConfig(), clock)
            return [e async for e in br.run(b, None, failed=failed, wanted=wanted)]

    return asyncio.run(go())


def test_a_good_batch_is_one_call_with_its_figures() -> None:
    """One `Started`, one `Returned` with a vector per request, in order, and its tokens."""
    fake, clock = FakeRunner(), FakeClock()
    inputs = [ids(3), ids(5, 2001)]
    events = run(FaultyRunner(fake), batch(inputs, clock), clock)
    assert [type(e) for e in events] == [Started, Returned]
    done = events[1]
    assert isinstance(done, Returned)
    assert (done.size, done.real_tokens, done.padded_tokens, done.width) == (2, 8, 10, 5)
    for x, v in zip(inputs, done.vectors, strict=True):
        np.testing.assert_array_equal(v, fake.vector(x))
    assert done.queue_waits == [0.0, 0.0]


def test_a_poison_input_is_bisected_out_and_fails_alone() -> None:
    """A failed call of 4 is bisected: each half's call comes out as it returns, and only the
    poison input ends with an error."""
    fake, clock = FakeRunner(), FakeClock()
    inputs = [ids(4, 2000 + i) for i in range(4)]
    inputs[3] = [101, POISON, 102]
    b = batch(inputs, clock)
    events = run(FaultyRunner(fake, poison_token=POISON), b, clock)
    kinds = [type(e).__name__ for e in events]
    assert kinds == [
        "Started", "Failed",  # the whole batch
        "Started", "Returned",  # first half: answered before the second half runs
        "Started", "Failed",  # second half
        "Started", "Returned",  # its good input
        "Started", "Failed",  # the poison input, alone
    ]  # fmt: skip
    first = events[1]
    assert isinstance(first, Failed) and (first.kind, first.size, first.errors) == ("error", 4, [])
    last = events[-1]
    assert isinstance(last, Failed) and [r for r, _ in last.errors] == [b.requests[3]]
    assert "PoisonInput" in last.errors[0][1].message
    answered = [r for e in events if isinstance(e, Returned) for r in e.requests]
    assert answered == b.requests[:3]


def test_out_of_memory_splits_and_says_which_cap_to_lower() -> None:
    """An out-of-memory call of 8 reports the size that failed (the cap to lower), then its
    halves run and return."""
    fake, clock = FakeRunner(), FakeClock()
    b = batch([ids(4, 2000 + i) for i in range(8)], clock)  # 32 padded tokens > 16
    events = run(FaultyRunner(fake, oom_tokens=16), b, clock)
    oom = [e for e in events if isinstance(e, Failed)]
    assert [(e.kind, e.size, e.errors) for e in oom] == [("oom", 8, [])]
    assert [e.size for e in events if isinstance(e, Returned)] == [4, 4]


def test_a_crash_reports_the_reason_and_the_requests_in_flight() -> None:
    """`RunnerCrashed` ends the run with one `Crashed` naming the call's requests."""
    clock = FakeClock()
    b = batch([ids(3), ids(4)], clock)
    events = run(FaultyRunner(FakeRunner(), crash_after=0), b, clock)
    assert [type(e) for e in events] == [Started, Crashed]
    crashed = events[1]
    assert isinstance(crashed, Crashed) and "RunnerCrashed" in crashed.reason
    assert crashed.requests == b.requests


def test_a_failing_probe_turns_sticky_failures_into_a_crash() -> None:
    """After `probe_after_failures` failed calls, a failing known-good probe means a crash."""
    clock = FakeClock()
    faulty = FaultyRunner(FakeRunner(), crash_after=0, crash_kind="sticky")
    events = run(
        faulty, batch([ids(3)], clock), clock, recovery=RecoveryConfig(probe_after_failures=1)
    )
    assert [type(e) for e in events] == [Started, Failed, Crashed]
    crashed = events[2]
    assert isinstance(crashed, Crashed) and "probe" in crashed.reason


def test_members_not_wanted_or_expired_cost_nothing() -> None:
    """A cancelled member is dropped silently and an expired one reported, before any call;
    once the runner has failed, nothing runs at all."""
    fake, clock = FakeRunner(), FakeClock()
    b = batch([ids(3), ids(4), ids(5)], clock)
    b.requests[2].deadline = clock.now()  # its deadline has come
    gone = b.requests[0]
    events = run(FaultyRunner(fake), b, clock, wanted=lambda r: r is not gone)
    assert [type(e) for e in events] == [Expired, Started, Returned]
    assert events[0].requests == [b.requests[2]]  # type: ignore[union-attr]
    assert [s.lengths for s in fake.batches] == [(4,)]
    refused = run(FaultyRunner(fake), batch([ids(3)], clock), clock, failed=lambda: True)
    assert [type(e) for e in refused] == [Refused]
    assert len(fake.batches) == 1


class SegmentsSeen(FakeRunner):
    """A fake runner that keeps the segment ids of every batch it ran."""

    def __init__(self) -> None:
        super().__init__()
        self.segments: list[np.ndarray | None] = []

    def embed(self, batch: Any) -> np.ndarray:
        self.segments.append(batch.token_type_ids)
        return super().embed(batch)


def test_segment_ids_of_pairs_reach_the_runner() -> None:
    """A request's segment ids are padded with its tokens into the batch the runner gets;
    a request without them counts as segment 0."""
    runner, clock = SegmentsSeen(), FakeClock()
    b = batch([ids(4), ids(3)], clock)
    b.requests[0].token_type_ids = [0, 0, 1, 1]
    events = run(FaultyRunner(runner), b, clock)
    assert [type(e) for e in events] == [Started, Returned]
    (seen,) = runner.segments
    assert seen is not None
    np.testing.assert_array_equal(seen, [[0, 0, 1, 1], [0, 0, 0, 0]])
    run(FaultyRunner(runner), batch([ids(3)], clock), clock)
    assert runner.segments[-1] is None  # single texts: no segment ids at all
