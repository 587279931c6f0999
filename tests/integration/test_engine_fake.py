"""The engine on a real event loop with the deterministic fake runner."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from lenbatch.config import AdmissionConfig, BatchingConfig
from lenbatch.core.collate import Collated
from lenbatch.core.errors import BadInput, DeadlineExceeded, InputTooLong, ModelFailed, Unavailable
from lenbatch.embed.engine import Engine
from lenbatch.runners.fake import FakeRunner


def _ids(n: int, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed)
    return [101, *rng.integers(1000, 30000, n - 2).tolist(), 102]


async def _started(runner: FakeRunner, **batching: object) -> Engine:
    engine = Engine(runner, BatchingConfig(**batching))  # type: ignore[arg-type]
    await engine.start()
    return engine


async def test_results_equal_unbatched_and_in_order() -> None:
    """Concurrent callers are batched together, and each gets its own input's vector."""
    runner = FakeRunner(max_length=128, cost=lambda b, n: 0.01)
    engine = await _started(runner, boundaries=(16, 64), max_batch=8, max_wait_ms=20)
    inputs = [_ids(n, i) for i, n in enumerate([5, 60, 12, 100, 3, 40, 64, 17])]
    try:
        results = await asyncio.gather(*(engine.embed([x]) for x in inputs))
    finally:
        await engine.stop()
    for x, (vec,) in zip(inputs, results, strict=True):
        np.testing.assert_array_equal(vec, runner.vector(x))
    assert max(b.size for b in runner.batches) > 1, "nothing was batched"
    for b in runner.batches:
        assert b.padded_len == max(b.lengths)  # padded only to the batch's longest


async def test_one_call_with_many_inputs_keeps_order() -> None:
    """A multi-input call returns vectors in input order even when inputs land in
    different buckets."""
    runner = FakeRunner(max_length=128)
    engine = await _started(runner, boundaries=(8, 32), max_wait_ms=1)
    inputs = [_ids(n, n) for n in (100, 4, 20, 7, 33)]
    try:
        out = await engine.embed(inputs)
    finally:
        await engine.stop()
    for x, v in zip(inputs, out, strict=True):
        np.testing.assert_array_equal(v, runner.vector(x))
    assert len(runner.batches) >= 3


async def test_too_long_is_an_error_unless_truncated() -> None:
    """Over the model limit: 413-style error naming length and limit; truncate=True cuts."""
    runner = FakeRunner(max_length=16)
    engine = await _started(runner, boundaries=(8,), max_wait_ms=0)
    try:
        with pytest.raises(InputTooLong, match="20 tokens; the model's limit is 16"):
            await engine.embed([_ids(20)])
        (v,) = await engine.embed([_ids(20)], truncate=True)
        np.testing.assert_array_equal(v, runner.vector(_ids(20)[:16]))
        with pytest.raises(BadInput, match="empty"):
            await engine.embed([[]])
    finally:
        await engine.stop()


async def test_cancelled_request_costs_no_compute() -> None:
    """A caller that goes away while queued is removed before its batch runs."""
    runner = FakeRunner(max_length=128, cost=lambda b, n: 0.2)
    engine = await _started(
        runner, boundaries=(16, 64), max_batch=1, max_wait_ms=0, prefetch_batches=0
    )
    try:
        first = asyncio.create_task(engine.embed([_ids(10)]))
        await asyncio.sleep(0.05)  # `first` is running and holds the only slot
        doomed = asyncio.create_task(engine.embed([_ids(50)]))
        await asyncio.sleep(0.01)
        assert engine.queues.size == 1
        doomed.cancel()
        with pytest.raises(asyncio.CancelledError):
            await doomed
        assert engine.queues.size == 0
        await first
        await asyncio.sleep(0.05)
    finally:
        await engine.stop()
    assert [b.lengths for b in runner.batches] == [(10,)]
    assert engine.metrics.stats()["requests"] == {"ok": 1, "cancelled": 1}


async def test_deadline_passes_in_queue() -> None:
    """A request whose deadline passes while queued is answered with a deadline error."""
    runner = FakeRunner(max_length=128, cost=lambda b, n: 0.3)
    engine = await _started(
        runner, boundaries=(16,), max_batch=1, max_wait_ms=0, prefetch_batches=0
    )
    try:
        first = asyncio.create_task(engine.embed([_ids(10)]))
        await asyncio.sleep(0.02)
        with pytest.raises(DeadlineExceeded, match=r"timeout of 0\.050 s passed"):
            await engine.embed([_ids(10, 1)], timeout=0.05)
        await first
    finally:
        await engine.stop()
    assert len(runner.batches) == 1


class _Poisoned(FakeRunner):
    """Raises on any batch containing token id 7."""

    def embed(self, batch: Collated) -> np.ndarray:  # type: ignore[override]
        if (batch.input_ids == 7).any():
            raise ValueError("poison")
        return super().embed(batch)


async def test_poison_input_fails_alone() -> None:
    """A failing batch is bisected: the poison input gets its own error, the rest succeed."""
    runner = _Poisoned(max_length=64)
    engine = await _started(runner, boundaries=(64,), max_batch=8, max_wait_ms=30)
    good = [_ids(10, i) for i in range(5)]
    bad = [101, 7, 102]
    try:
        results = await asyncio.gather(
            *(engine.embed([x]) for x in [*good[:2], bad, *good[2:]]), return_exceptions=True
        )
    finally:
        await engine.stop()
    assert isinstance(results[2], ModelFailed)
    for r, x in zip([*results[:2], *results[3:]], good, strict=True):
        assert not isinstance(r, BaseException)
        np.testing.assert_array_equal(r[0], runner.vector(x))


async def test_queue_bound_rejects_with_retry_after() -> None:
    """A full queue refuses new work with a retryable error naming the limit."""
    from lenbatch.core.errors import Overloaded

    runner = FakeRunner(max_length=64, cost=lambda b, n: 0.2)
    engine = Engine(
        runner,
        BatchingConfig(boundaries=(64,), max_batch=1, max_wait_ms=0, prefetch_batches=0),
        AdmissionConfig(max_queue_total=2),
    )
    await engine.start()
    try:
        tasks = [asyncio.create_task(engine.embed([_ids(5, 0)]))]
        await asyncio.sleep(0.02)  # the first one runs; the next two fill the queue
        tasks += [asyncio.create_task(engine.embed([_ids(5, i)])) for i in (1, 2)]
        await asyncio.sleep(0.02)
        with pytest.raises(Overloaded, match="max_queue_total=2") as info:
            await engine.embed([_ids(5, 9)])
        assert info.value.retry_after is not None
        await asyncio.gather(*tasks)
    finally:
        await engine.stop()


async def test_stop_drains_queued_work_then_refuses() -> None:
    """Stopping finishes what was admitted, then new calls are refused."""
    runner = FakeRunner(max_length=64, cost=lambda b, n: 0.02)
    engine = await _started(runner, boundaries=(64,), max_batch=2, max_wait_ms=5000)
    tasks = [asyncio.create_task(engine.embed([_ids(5, i)])) for i in range(5)]
    await asyncio.sleep(0.01)
    await engine.stop(timeout=5)
    results = await asyncio.gather(*tasks)
    assert len(results) == 5
    with pytest.raises(Unavailable):
        await engine.embed([_ids(5)])
