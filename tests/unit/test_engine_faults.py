"""Engine under failure: poison inputs, out-of-memory, crashes, deadlines, cancellation, drain.

The runner is a `FakeRunner` behind a `FaultyRunner`; tests that need the runner busy hold it on
an event (`hold`) rather than sleeping, so outcomes never depend on timing.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Sequence
from typing import Any

import numpy as np
import pytest

from lenbatch.config import AdmissionConfig, BatchingConfig, RecoveryConfig
from lenbatch.core.clock import FakeClock
from lenbatch.core.errors import (
    DeadlineExceeded,
    LenbatchError,
    ModelFailed,
    OutOfMemory,
    Unavailable,
)
from lenbatch.embed.engine import Engine, EngineState
from lenbatch.runners.fake import FakeRunner
from lenbatch.runners.faulty import FaultyRunner

POISON = 7


def ids(n: int, token: int = 2000) -> list[int]:
    """A token-id input of `n` tokens."""
    return [101, *([token] * (n - 2)), 102]


def make(
    faulty: FaultyRunner,
    *,
    max_batch: int = 8,
    max_wait_ms: float = 1000.0,
    clock: FakeClock | None = None,
    recovery: RecoveryConfig | None = None,
    admission: AdmissionConfig | None = None,
) -> Engine:
    """A single-queue (fifo) engine: a batch flushes as soon as `max_batch` requests wait."""
    batching = BatchingConfig(strategy="fifo", max_batch=max_batch, max_wait_ms=max_wait_ms)
    return Engine(faulty, batching, admission, recovery=recovery, clock=clock)


@pytest.fixture
def fake() -> FakeRunner:
    return FakeRunner()


@pytest.fixture
async def started() -> AsyncIterator[list[Engine]]:
    """Engines registered here are stopped after the test, whatever happened."""
    engines: list[Engine] = []
    yield engines
    for e in engines:
        await e.stop(timeout=1.0)


async def run_calls(engine: Engine, inputs: Sequence[list[int]], **kw: Any) -> list[Any]:
    """One call per input, all submitted together; results or the exceptions raised."""
    calls = [engine.embed([x], **kw) for x in inputs]
    return list(await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 10))


async def until(cond: Any, timeout: float = 5.0) -> None:
    """Yield to the loop until `cond()` holds (event-driven state, not a timing assert)."""
    async with asyncio.timeout(timeout):
        while not cond():
            await asyncio.sleep(0.001)


async def test_poison_input_fails_alone_and_the_rest_succeed(
    fake: FakeRunner, started: list[Engine]
) -> None:
    """A batch of 8 with one poison input: 7 correct vectors, one 500 naming no input."""
    engine = make(FaultyRunner(fake, poison_token=POISON))
    started.append(engine)
    await engine.start()
    inputs = [ids(4, 2000 + i) for i in range(8)]
    inputs[5] = [101, 3000, POISON, 102]
    results = await run_calls(engine, inputs)
    for i, (x, res) in enumerate(zip(inputs, results, strict=True)):
        if i == 5:
            assert isinstance(res, ModelFailed) and res.status == 500
            assert "PoisonInput" in res.message and str(POISON) not in res.message
        else:
            np.testing.assert_array_equal(res[0], fake.vector(x))
    assert fake.batches[0].size == 4  # the first good half after the failing batch of 8
    assert engine.metrics.stats()["model_failures"]["error"] >= 2
    assert engine.ready


async def test_two_poison_inputs_each_fail_alone(fake: FakeRunner, started: list[Engine]) -> None:
    """Bisection isolates every poison input, not just the first one."""
    engine = make(FaultyRunner(fake, poison_length=5))
    started.append(engine)
    await engine.start()
    inputs = [ids(5) if i in (0, 6) else ids(3, 2000 + i) for i in range(8)]
    results = await run_calls(engine, inputs)
    failed = [i for i, r in enumerate(results) if isinstance(r, ModelFailed)]
    assert failed == [0, 6]
    assert sum(b.size for b in fake.batches) == 6  # each good input ran exactly once


async def test_multi_input_call_names_the_failing_input(
    fake: FakeRunner, started: list[Engine]
) -> None:
    """In one call of several inputs, the error says which input failed."""
    engine = make(FaultyRunner(fake, poison_token=POISON), max_batch=4)
    started.append(engine)
    await engine.start()
    with pytest.raises(ModelFailed, match=r"^input 2: the model failed"):
        await engine.embed([ids(3), ids(4), [101, POISON, 102], ids(5)])
    await until(lambda: engine.unanswered == 0)


async def test_oom_splits_the_batch_and_lowers_the_cap_for_a_cooldown(
    fake: FakeRunner, started: list[Engine]
) -> None:
    """An OOM batch is split and retried (all succeed), its lane capped at half until the
    cool-down passes; the cap shows in /stats data and metrics."""
    clock = FakeClock()
    engine = make(
        FaultyRunner(fake, oom_tokens=16),
        clock=clock,
        recovery=RecoveryConfig(oom_cooldown_s=30.0),
    )
    started.append(engine)
    await engine.start()
    inputs = [ids(4, 2000 + i) for i in range(8)]  # 8 x 4 = 32 padded tokens > 16
    results = await run_calls(engine, inputs)
    for x, res in zip(inputs, results, strict=True):
        np.testing.assert_array_equal(res[0], fake.vector(x))
    assert [b.size for b in fake.batches] == [4, 4]
    assert engine.caps.cap(0) == 4 and engine.cfg.lanes[0].max_batch == 4
    assert b'lenbatch_batch_cap{bucket="all"} 4.0' in engine.metrics.prometheus()
    assert engine.metrics.stats()["model_failures"] == {"oom": 1}
    # while capped, new batches are formed at most 4 wide from the start
    fake.batches.clear()
    await run_calls(engine, [ids(4) for _ in range(8)])
    assert [b.size for b in fake.batches] == [4, 4]
    clock.advance(30.0)
    fake.batches.clear()
    await run_calls(engine, [ids(2) for _ in range(8)])  # 16 padded tokens: fits
    assert [b.size for b in fake.batches] == [8]
    assert engine.caps.cap(0) == 8
    assert engine.caps.describe(clock.now(), engine.lane_labels)[0]["current"] == 8


@pytest.mark.parametrize("kind", ["memory", "cuda"])
async def test_input_that_ooms_alone_gets_503_with_retry_after(
    fake: FakeRunner, started: list[Engine], kind: str
) -> None:
    """An input too big for memory even alone is answered 503 `out_of_memory`."""
    engine = make(FaultyRunner(fake, oom_tokens=4, oom_kind=kind), max_batch=1)  # type: ignore[arg-type]
    started.append(engine)
    await engine.start()
    [res] = await run_calls(engine, [ids(6)])
    assert isinstance(res, OutOfMemory) and res.status == 503 and res.retry_after
    assert "6 tokens" in res.message
    [ok] = await run_calls(engine, [ids(3)])
    np.testing.assert_array_equal(ok[0], fake.vector(ids(3)))


async def test_runner_crash_fails_every_waiting_request_and_turns_not_ready(
    fake: FakeRunner, started: list[Engine]
) -> None:
    """RunnerCrashed: the failing batch, the prefetched one and the queued ones all get 503;
    the engine reports failed with the reason, and new calls are refused."""
    hold = threading.Event()
    engine = make(FaultyRunner(fake, crash_after=1, hold=hold), max_batch=1, max_wait_ms=0)
    started.append(engine)
    await engine.start()
    tasks = [asyncio.create_task(engine.embed([ids(3 + i)])) for i in range(5)]
    await until(lambda: engine.queues.size == 3)  # 1 running, 1 prefetched, 3 queued
    hold.set()
    done = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 5)
    assert isinstance(done[0], list)  # the first batch ran before the crash
    for err in done[1:]:
        assert isinstance(err, Unavailable) and err.status == 503
        assert err.code == "runner_failed" and "RunnerCrashed" in err.message
    assert engine.state is EngineState.FAILED and not engine.ready
    assert engine.failure is not None and "RunnerCrashed" in engine.failure
    with pytest.raises(Unavailable, match="must be restarted"):
        await engine.embed([ids(3)])
    assert engine.unanswered == 0
    assert b"lenbatch_ready 0.0" in engine.metrics.prometheus()


async def test_sticky_failures_are_detected_by_a_probe(
    fake: FakeRunner, started: list[Engine]
) -> None:
    """A runner that fails everything (a broken device) is declared crashed once a known-good
    probe input fails too."""
    engine = make(
        FaultyRunner(fake, crash_after=0, crash_kind="sticky"),
        max_batch=1,
        max_wait_ms=0,
        recovery=RecoveryConfig(probe_after_failures=3),
    )
    started.append(engine)
    await engine.start()
    results = [(await run_calls(engine, [ids(3)]))[0] for _ in range(3)]
    assert [type(r) for r in results] == [ModelFailed, ModelFailed, Unavailable]
    assert engine.state is EngineState.FAILED
    assert engine.failure is not None and "probe" in engine.failure


async def test_a_hung_runner_is_declared_crashed_after_the_batch_timeout(
    fake: FakeRunner, started: list[Engine]
) -> None:
    """A batch that never returns: past `batch_timeout_s` its requests and the queued ones get
    503 and the engine reports failed, instead of hanging with it."""
    hold = threading.Event()
    engine = make(
        FaultyRunner(fake, hold=hold),
        max_batch=1,
        max_wait_ms=0,
        recovery=RecoveryConfig(batch_timeout_s=0.05),
    )
    started.append(engine)
    try:
        await engine.start()
        results = await run_calls(engine, [ids(3), ids(4), ids(5)])
        for err in results:
            assert isinstance(err, Unavailable) and err.code == "runner_failed"
        assert engine.failure is not None and "longer than 0.05 s" in engine.failure
    finally:
        hold.set()


async def test_a_flood_of_poison_inputs_does_not_take_the_server_down(
    fake: FakeRunner, started: list[Engine]
) -> None:
    """Many poison inputs in a row: the probe succeeds, the engine stays ready."""
    engine = make(
        FaultyRunner(fake, poison_token=POISON),
        max_batch=1,
        max_wait_ms=0,
        recovery=RecoveryConfig(probe_after_failures=2),
    )
    started.append(engine)
    await engine.start()
    for _ in range(6):
        [res] = await run_calls(engine, [[101, POISON, 102]])
        assert isinstance(res, ModelFailed)
    assert engine.ready
    [ok] = await run_calls(engine, [ids(4)])
    np.testing.assert_array_equal(ok[0], fake.vector(ids(4)))


async def test_expired_requests_are_dropped_before_running_with_504(
    fake: FakeRunner, started: list[Engine]
) -> None:
    """Requests whose deadline passes while they wait (prefetched or queued) get 504 and never
    reach the model; the running one finishes."""
    hold = threading.Event()
    engine = make(FaultyRunner(fake, hold=hold), max_batch=1, max_wait_ms=0)
    started.append(engine)
    await engine.start()
    running = asyncio.create_task(engine.embed([ids(3)]))
    await until(lambda: engine.queues.inflight_total == 1)
    late = [asyncio.create_task(engine.embed([ids(4 + i)], timeout=0.05)) for i in range(2)]
    for t in late:
        with pytest.raises(DeadlineExceeded, match="dropped before running") as info:
            await asyncio.wait_for(t, 5)
        assert info.value.status == 504
    hold.set()
    await asyncio.wait_for(running, 5)
    assert [b.lengths for b in fake.batches] == [(3,)]
    assert engine.metrics.stats()["requests"] == {"ok": 1, "expired": 2}


async def test_cancelled_callers_leave_the_queue_and_cost_nothing(
    fake: FakeRunner, started: list[Engine]
) -> None:
    """A cancelled call (client gone) is removed whether queued or prefetched, is counted once
    as cancelled, and its inputs never run."""
    hold = threading.Event()
    engine = make(FaultyRunner(fake, hold=hold), max_batch=1, max_wait_ms=0)
    started.append(engine)
    await engine.start()
    tasks = [asyncio.create_task(engine.embed([ids(3 + i)])) for i in range(3)]
    await until(lambda: engine.queues.size == 1)  # running, prefetched, queued
    tasks[2].cancel()
    tasks[1].cancel()
    await until(lambda: engine.queues.size == 0 and engine.unanswered == 1)
    hold.set()
    await asyncio.wait_for(tasks[0], 5)
    assert [b.lengths for b in fake.batches] == [(3,)]
    assert engine.metrics.stats()["requests"] == {"ok": 1, "cancelled": 2}


async def test_drain_refuses_new_work_and_answers_admitted(
    fake: FakeRunner, started: list[Engine]
) -> None:
    """While draining, new calls get 503 `shutting_down`; admitted ones still complete."""
    hold = threading.Event()
    engine = make(FaultyRunner(fake, hold=hold), max_batch=4, max_wait_ms=60_000)
    started.append(engine)
    await engine.start()
    running = asyncio.create_task(engine.embed([ids(3)] * 4))
    await until(lambda: engine.queues.inflight_total == 1)
    waiting = asyncio.create_task(engine.embed([ids(5)]))  # alone: would wait 60 s to fill
    await until(lambda: engine.queues.size == 1)
    engine.begin_drain()
    with pytest.raises(Unavailable) as info:
        await engine.embed([ids(3)])
    assert info.value.code == "shutting_down" and info.value.retry_after
    hold.set()
    await asyncio.wait_for(asyncio.gather(running, waiting), 5)  # flushed without waiting
    await engine.stop(timeout=1.0)
    assert engine.state is EngineState.STOPPED


async def test_stop_after_drain_timeout_answers_everything_left(
    fake: FakeRunner, started: list[Engine]
) -> None:
    """If the drain times out, running and queued requests get 503; none hangs."""
    hold = threading.Event()
    engine = make(FaultyRunner(fake, hold=hold), max_batch=1, max_wait_ms=0)
    started.append(engine)
    await engine.start()
    tasks = [asyncio.create_task(engine.embed([ids(3 + i)])) for i in range(4)]
    await until(lambda: engine.queues.size == 2)
    await engine.stop(timeout=0.05)
    results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 5)
    hold.set()
    for err in results:
        assert isinstance(err, Unavailable) and err.code == "shutdown"
        assert "drain timeout" in err.message
    assert engine.unanswered == 0


@pytest.mark.slow
async def test_no_state_is_kept_per_answered_request(
    started: list[Engine], monkeypatch: pytest.MonkeyPatch
) -> None:
    """After many answered calls (some cancelled) the engine holds no request, task or timer,
    and its own allocations do not grow with the request count."""
    import gc
    import tracemalloc

    import lenbatch.serving.metrics

    # The metrics' recent-sample windows are bounded (10k); a small bound lets the warm-up
    # fill them, so any growth left is per-request state.
    monkeypatch.setattr(lenbatch.serving.metrics, "_WINDOW", 100)

    engine = make(FaultyRunner(FakeRunner(record=False)), max_batch=8, max_wait_ms=1)
    started.append(engine)
    await engine.start()
    loop = asyncio.get_running_loop()

    def live_timers() -> int:
        return sum(1 for h in loop._scheduled if not h.cancelled())  # type: ignore[attr-defined]

    async def rounds(n: int) -> None:
        for _ in range(n):
            calls = [engine.embed([ids(3 + i % 5)], timeout=30.0) for i in range(16)]
            cancelled = asyncio.ensure_future(engine.embed([ids(4)], timeout=30.0))
            await asyncio.sleep(0)
            cancelled.cancel()
            await asyncio.gather(*calls)

    engine_files = (  # where the engine's code lives since the restructure
        "*/lenbatch/embed/engine.py",
        "*/lenbatch/embed/batches.py",
        "*/lenbatch/serving/lifecycle.py",
        "*/lenbatch/serving/engine.py",
        "*/lenbatch/serving/ledger.py",
        "*/lenbatch/core/request.py",
        "*/lenbatch/core/queues.py",
    )
    # Traced from before the warm-up: the interpreter's free lists then hold traced blocks at
    # both snapshots. Started after it, every block a free list took in during the measured
    # rounds counted as growth where it was first allocated (up to ~20 KB that does not grow
    # with the request count: the free lists are bounded).
    tracemalloc.start(1)
    try:
        await rounds(10)
        await until(lambda: engine.unanswered == 0)
        baseline_timers = live_timers()
        gc.collect()
        before = tracemalloc.take_snapshot()
        await rounds(60)  # ~1000 more requests
        await until(lambda: engine.unanswered == 0)
        gc.collect()
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    filters = [tracemalloc.Filter(True, f) for f in engine_files]
    diff = after.filter_traces(filters).compare_to(before.filter_traces(filters), "lineno")
    growth = sum(d.size_diff for d in diff)
    assert growth < 20_000, [str(d) for d in diff[:5]]
    assert engine.unanswered == 0 and not engine._batch_tasks
    assert engine.queues.size == 0 and engine.queues.inflight_total == 0
    assert live_timers() <= baseline_timers
    stats = engine.metrics.stats()["requests"]
    assert stats["ok"] == 70 * 16 and stats["cancelled"] == 70


async def test_errors_never_quote_the_runner_message(started: list[Engine]) -> None:
    """A runner whose exception message quotes the input: neither the answer nor the log
    carries it (only the exception type)."""

    class Quoting(FakeRunner):
        def embed(self, batch):  # type: ignore[no-untyped-def]
            raise ValueError(f"cannot embed {batch.input_ids.tolist()} SECRET-CANARY")

    engine = make(FaultyRunner(Quoting()), max_batch=1, max_wait_ms=0)
    started.append(engine)
    await engine.start()
    [res] = await run_calls(engine, [ids(3)])
    assert isinstance(res, LenbatchError) and "SECRET-CANARY" not in res.message
    assert "ValueError" in res.message
