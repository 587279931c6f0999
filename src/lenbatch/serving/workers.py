"""A model call handed to a worker thread and awaited on the event loop, for less loop work.

`loop.run_in_executor` chains the executor's `concurrent.futures.Future` to an asyncio one: on
the loop that is `wrap_future`, a done-callback under the concurrent future's lock, then a copy
of its state and a cancellation check when it ends. Here the worker hands its result straight
to the asyncio future with one `call_soon_threadsafe`. An engine runs one such call per batch,
every batch; in a `py-spy` profile of the loop under sequential one-line requests the chain
held 5-6 % of the samples (`bench/results/request_cost.md`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any, TypeVar

__all__ = ["run_in_worker"]

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
