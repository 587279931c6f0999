"""Worker threads for model calls: a call handed to one and awaited on the event loop with
little loop work (`run_in_worker`), and a pool whose threads each keep to a core of their own
(`CoreWorkers`).

`loop.run_in_executor` chains the executor's `concurrent.futures.Future` to an asyncio one: on
the loop that is `wrap_future`, a done-callback under the concurrent future's lock, then a copy
of its state and a cancellation check when it ends. Here the worker hands its result straight
to the asyncio future with one `call_soon_threadsafe`. An engine runs one such call per batch,
every batch; in a `py-spy` profile of the loop under sequential one-line requests the chain
held 5-6 % of the samples (`bench/results/request_cost.md`).

`CoreWorkers` runs each model call on a thread pinned to one core, and gives a call to the
first idle thread in a fixed order. With one torch thread per batch (`make serve`'s line: two
batches in flight on two cores), a light load's forward passes then all run on one core, and
the event loop keeps the other one and its caches: a forward of MiniLM streams its 45 MB of
weights through the core it runs on, and the loop that follows it there, or is moved to it,
finds its own working set evicted. On a 2-core Intel Xeon (family 6 model 167), sequential
one-line calls cost the loop 0.72 of its CPU with a thread pool whose threads run anywhere
(paired `bench/request_cost_ab.py`), and all threads 0.84, with no loss at saturation. Pinned
threads alone, taking calls in any order, gave nothing; the fixed order is what keeps the
forwards off the loop's core. A call that finds every thread busy waits in one shared queue for
the first to finish: given to one thread's own queue, it could wait behind a running call while
the other thread sat idle (6 % fewer calls per second at saturation).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import queue
import threading
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future
from typing import Any, TypeVar

__all__ = ["CoreWorkers", "pinnable_cores", "run_in_worker", "usable_cores"]

T = TypeVar("T")


def run_in_worker(executor: Executor, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
    """`fn(*args)` on `executor`, as a future of the running loop: its result, or what it
    raised. As with `run_in_executor`, a call cancelled before a worker took it does not run,
    and one already running runs to its end (its result is then dropped)."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[T] = loop.create_future()

    def work() -> None:
        if fut.cancelled():  # a plain read of the future's state; at worst the call runs
            return
        try:
            result = fn(*args)
        except BaseException as exc:  # the awaiting side re-raises it, whatever it is
            _hand(loop, _fail, fut, exc)
        else:
            _hand(loop, _resolve, fut, result)

    executor.submit(work)
    return fut


def _hand(loop: asyncio.AbstractEventLoop, fn: Callable[..., None], *args: Any) -> None:
    with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody awaits it
        loop.call_soon_threadsafe(fn, *args)


def _resolve(fut: asyncio.Future[T], result: T) -> None:
    if not fut.done():
        fut.set_result(result)


def _fail(fut: asyncio.Future[Any], exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)


_Item = tuple[Future[Any], Callable[..., Any], tuple[Any, ...], dict[str, Any]]


def usable_cores() -> int:
    """How many cores this process may run on (its CPU affinity where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def pinnable_cores(workers: int) -> list[int] | None:
    """The cores to pin `workers` threads to, one each: this process's usable cores (its CPU
    affinity) when there are exactly `workers` of them, else None (also where the OS has no
    per-thread affinity). With fewer workers than cores the process may share the machine
    (Ray replicas, several servers): pinned the same way, their forwards would crowd onto
    the same first cores, where unpinned threads spread out."""
    if not hasattr(os, "sched_getaffinity") or not hasattr(os, "sched_setaffinity"):
        return None
    cores = sorted(os.sched_getaffinity(0))
    return cores if workers == len(cores) else None


class CoreWorkers(Executor):
    """One worker thread per core in `cores`, each pinned to its core; a call goes to the
    first idle thread in that order (else it waits for whichever thread frees up first).

    Threads start on their first call. Calls still waiting at `shutdown` run first, unless
    `cancel_futures`; a thread whose pinning the OS refuses runs unpinned.
    """

    def __init__(self, cores: Sequence[int], name: str = "lenbatch-core") -> None:
        if not cores:
            raise ValueError("CoreWorkers needs at least one core")
        self.cores = list(cores)
        self._name = name
        self._lock = threading.Lock()
        self._idle = [True] * len(self.cores)
        self._inboxes: list[queue.SimpleQueue[_Item | None]] = [
            queue.SimpleQueue() for _ in self.cores
        ]
        self._threads: list[threading.Thread | None] = [None] * len(self.cores)
        self._waiting: deque[_Item] = deque()  # calls that found no idle thread
        self._closed = False

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        """Run `fn(*args, **kwargs)` on the first idle thread; its future."""
        fut: Future[T] = Future()
        item: _Item = (fut, fn, args, kwargs)
        with self._lock:
            if self._closed:
                raise RuntimeError("cannot schedule new calls after shutdown")
            for i, idle in enumerate(self._idle):
                if idle:
                    self._idle[i] = False
                    if self._threads[i] is None:
                        self._threads[i] = self._start(i)
                    self._inboxes[i].put(item)
                    return fut
            self._waiting.append(item)
        return fut

    def _start(self, i: int) -> threading.Thread:
        t = threading.Thread(
            target=self._work, args=(i,), name=f"{self._name}-{self.cores[i]}", daemon=True
        )
        t.start()
        return t

    def _work(self, i: int) -> None:
        with contextlib.suppress(OSError):  # e.g. a container that forbids it: run unpinned
            os.sched_setaffinity(0, {self.cores[i]})
        inbox = self._inboxes[i]
        item = inbox.get()
        while item is not None:
            fut, fn, args, kwargs = item
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(*args, **kwargs))
                except BaseException as exc:  # the caller's future carries it
                    fut.set_exception(exc)
            del item, fut, fn, args, kwargs  # nothing of a finished call outlives it here
            with self._lock:
                if self._waiting:
                    item = self._waiting.popleft()
                    continue
                self._idle[i] = True
            item = inbox.get()

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """No new calls; the threads end once the calls given them (and, unless
        `cancel_futures`, the waiting ones) have run. `wait`: join them."""
        with self._lock:
            self._closed = True
            if cancel_futures:
                while self._waiting:
                    self._waiting.popleft()[0].cancel()
            threads = [t for t in self._threads if t is not None]
            for inbox, t in zip(self._inboxes, self._threads, strict=True):
                if t is not None:
                    inbox.put(None)
        if wait:
            for t in threads:
                if t is not threading.current_thread():
                    t.join()
