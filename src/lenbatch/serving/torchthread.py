"""One OS thread for a serving process's multi-threaded torch work: loading and running models.

libgomp (torch's OpenMP runtime on Linux) keeps a pool of worker threads for each thread that
starts a parallel region, and once the threads it manages outnumber the CPUs it stops spinning
between regions (GOMP's "throttled" spin count, 100 spins instead of ~300,000): each of a
forward pass's hundreds of small parallel regions then waits for a sleeping thread to be woken.
A model loaded on the main thread (a pool there) and run on an engine's worker thread (a second
pool) is in exactly that state on a 2-core machine, and `GOMP_SPINCOUNT` does not lift the
throttle. Measured on a 2-core Intel Xeon (family 6 model 167), two threads: 200 small bf16
linears + SiLU took 47-49 ms on the thread that started the first pool and 106-108 ms on a
second thread (`bench/results/llm-decode-peers-xeon/`); a SmolLM2 decode step in the server
took 72-78 ms against 49 ms alone.

So a process loads its models on `torch_executor()`'s single thread (`on_torch_thread`), and
engines that run one unit at a time with several torch threads (generation) run their units on
that same thread, leaving the main thread to the event loop. Intel's OpenMP (`libiomp5`,
which vLLM preloads) has no such throttle, but it is a dependency of its own.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

__all__ = ["on_torch_thread", "torch_executor"]

T = TypeVar("T")

_lock = threading.Lock()
_executor: ThreadPoolExecutor | None = None
_thread_id: int | None = None

_NAME = "lenbatch-torch"


def _remember_thread() -> None:
    global _thread_id
    _thread_id = threading.get_ident()


def torch_executor() -> ThreadPoolExecutor:
    """The process's one thread for multi-threaded torch work (created on first use, never
    shut down: engines that share it wait for their own work instead)."""
    global _executor
    with _lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(1, _NAME, initializer=_remember_thread)
        return _executor


def on_torch_thread(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """`fn(*args, **kwargs)` run on the torch thread (directly when already on it); blocks
    until it returns, and raises what it raised."""
    if threading.get_ident() == _thread_id:
        return fn(*args, **kwargs)
    return torch_executor().submit(fn, *args, **kwargs).result()
