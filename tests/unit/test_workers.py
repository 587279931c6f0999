"""`run_in_worker`: a call on a worker thread, awaited as an asyncio future; `CoreWorkers`: one
pinned thread per core, the first idle one taking each call."""

from __future__ import annotations

import asyncio
import os
import threading
from concurrent.futures import CancelledError, ThreadPoolExecutor

import pytest

from lenbatch.config import BatchingConfig
from lenbatch.embed import engine as embed_engine
from lenbatch.embed.engine import Engine
from lenbatch.runners.fake import FakeRunner
from lenbatch.serving.workers import CoreWorkers, pinnable_cores, run_in_worker

# Two workers on the first and the last usable core (the same one on a 1-core machine: the
# order tests tell threads apart by identity, not by core).
_CORES = sorted(os.sched_getaffinity(0))
_TWO = [_CORES[0], _CORES[-1]]


async def test_the_result_comes_back_from_the_worker_thread() -> None:
    with ThreadPoolExecutor(1) as pool:
        where = await run_in_worker(pool, lambda x: (x * 2, threading.get_ident()), 21)
    assert where[0] == 42
    assert where[1] != threading.get_ident()


async def test_what_the_call_raises_is_raised_to_the_awaiting_side() -> None:
    def boom() -> None:
        raise MemoryError("no room")

    with ThreadPoolExecutor(1) as pool, pytest.raises(MemoryError, match="no room"):
        await run_in_worker(pool, boom)


async def test_a_call_cancelled_before_a_worker_took_it_never_runs() -> None:
    gate, ran = threading.Event(), []
    with ThreadPoolExecutor(1) as pool:
        blocker = run_in_worker(pool, gate.wait)  # the only worker is busy
        queued = run_in_worker(pool, ran.append, "queued")
        queued.cancel()
        gate.set()
        await blocker
        await run_in_worker(pool, ran.append, "after")  # the queued one has had its turn
    assert ran == ["after"]


async def test_a_running_call_cancelled_runs_to_its_end_and_its_result_is_dropped() -> None:
    started, gate, done = threading.Event(), threading.Event(), []
    errors: list[dict[str, object]] = []
    asyncio.get_running_loop().set_exception_handler(lambda _loop, ctx: errors.append(ctx))

    def slow() -> str:
        started.set()
        gate.wait()
        done.append(True)
        return "late"

    with ThreadPoolExecutor(1) as pool:
        fut = run_in_worker(pool, slow)
        await asyncio.to_thread(started.wait)
        fut.cancel()
        gate.set()
        await run_in_worker(pool, lambda: None)  # after `slow` ended on the same worker
        await asyncio.sleep(0)  # its hand-off callback runs on the loop, finding it cancelled
    assert done == [True] and fut.cancelled()
    assert errors == []  # no "invalid state" from setting a cancelled future


def _where() -> tuple[int, set[int]]:
    return threading.get_ident(), os.sched_getaffinity(0)


def test_each_core_worker_keeps_to_its_core() -> None:
    pool = CoreWorkers(_TWO)
    try:
        gate = threading.Event()
        first = pool.submit(lambda: (_where(), gate.wait()))  # holds the first thread
        second = pool.submit(_where)  # so the second thread takes this one
        ident2, cores2 = second.result(timeout=10)
        gate.set()
        (ident1, cores1), _ = first.result(timeout=10)
        assert cores1 == {_TWO[0]} and cores2 == {_TWO[1]}
        assert ident1 != ident2
    finally:
        pool.shutdown()


def test_an_idle_first_worker_takes_every_call() -> None:
    """A light load's calls all run on the first core's thread, one after another."""
    pool = CoreWorkers(_TWO)
    try:
        idents = {pool.submit(threading.get_ident).result(timeout=10) for _ in range(30)}
        gate = threading.Event()
        busy = pool.submit(lambda: (threading.get_ident(), gate.wait()))
        other = pool.submit(threading.get_ident).result(timeout=10)
        gate.set()
        assert idents == {busy.result(timeout=10)[0]}  # the first thread, every time
        assert other not in idents
    finally:
        pool.shutdown()


def test_a_call_that_finds_every_thread_busy_runs_on_the_first_to_free_up() -> None:
    pool = CoreWorkers(_TWO)
    gates = [threading.Event(), threading.Event()]
    try:
        started = [threading.Event(), threading.Event()]

        def hold(i: int) -> int:
            started[i].set()
            gates[i].wait()
            return threading.get_ident()

        held = [pool.submit(hold, i) for i in (0, 1)]
        for e in started:
            assert e.wait(10)
        waiting = pool.submit(threading.get_ident)
        assert not waiting.done()
        gates[1].set()  # the second thread frees up first
        assert waiting.result(timeout=10) == held[1].result(timeout=10)
        gates[0].set()
        assert held[0].result(timeout=10) != held[1].result()
    finally:
        for g in gates:  # a failure above must not leave a thread held
            g.set()
        pool.shutdown()


def test_a_core_worker_call_raises_to_its_future() -> None:
    pool = CoreWorkers(_TWO[:1])
    try:
        with pytest.raises(MemoryError, match="no room"):
            pool.submit(_raise, MemoryError("no room")).result(timeout=10)
        assert pool.submit(sum, [1, 2]).result(timeout=10) == 3  # the thread lives on
    finally:
        pool.shutdown()


def _raise(exc: BaseException) -> None:
    raise exc


def test_shutdown_runs_the_waiting_calls_unless_cancelled_and_refuses_new_ones() -> None:
    for cancel in (False, True):
        pool = CoreWorkers(_TWO[:1])
        gate, ran = threading.Event(), []
        busy = pool.submit(gate.wait)
        waiting = pool.submit(ran.append, "waiting")
        threading.Timer(0.05, gate.set).start()
        pool.shutdown(wait=True, cancel_futures=cancel)
        assert busy.result(timeout=10) is True
        if cancel:
            assert ran == [] and waiting.cancelled()
            with pytest.raises(CancelledError):
                waiting.result()
        else:
            assert ran == ["waiting"] and waiting.done()
        with pytest.raises(RuntimeError, match="after shutdown"):
            pool.submit(ran.append, "late")


async def test_run_in_worker_on_core_workers() -> None:
    pool = CoreWorkers(_TWO)
    try:
        assert await run_in_worker(pool, lambda x: x + 1, 41) == 42
    finally:
        pool.shutdown()


def test_workers_are_pinned_only_when_they_match_the_usable_cores() -> None:
    assert pinnable_cores(len(_CORES)) == _CORES
    assert pinnable_cores(len(_CORES) + 1) is None
    if len(_CORES) > 1:  # fewer workers than cores: the process may share the machine
        assert pinnable_cores(len(_CORES) - 1) is None


@pytest.mark.parametrize("pin", [True, False])
def test_the_engine_pins_its_workers_with_one_torch_thread_each(
    monkeypatch: pytest.MonkeyPatch, pin: bool
) -> None:
    monkeypatch.setattr(embed_engine, "_torch_threads", lambda: 1)
    batching = BatchingConfig(max_concurrent_batches=len(_CORES), pin_workers=pin)
    engine = Engine(FakeRunner(), batching)
    try:
        assert isinstance(engine._executor, CoreWorkers) is pin
        assert engine.batches.executor is engine._executor
        assert engine.stats()["workers"] == {
            "batches_at_once": len(_CORES),
            "pinned_cores": _CORES if pin else None,
            "torch_threads": 1,
        }
    finally:
        engine._executor.shutdown()
    monkeypatch.setattr(embed_engine, "_torch_threads", lambda: 2)  # a team per call
    engine = Engine(FakeRunner(), batching)
    assert isinstance(engine._executor, ThreadPoolExecutor)
    assert engine.stats()["workers"]["pinned_cores"] is None
    engine._executor.shutdown()
