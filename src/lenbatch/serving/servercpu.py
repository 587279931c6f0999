"""The CPU the server spends outside the model call, read from the operating system: what
`core.occupancy.RequestCpu` turns into CPU seconds per request.

`request_side_cpu_s` sums the CPU time of this process's Python threads except the model's
worker threads (named with the runner executor's prefix): the event loop (HTTP parsing, JSON,
answers, scheduling) and the tokenizer pool. torch's intra-op threads are not Python threads
and are never counted. On Linux each thread's time is read from
`/proc/self/task/<tid>/schedstat` (nanoseconds on the CPU); where that does not exist, only the
calling thread's (`time.thread_time`, the event loop when called from it).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

__all__ = ["request_side_cpu_s"]

_TASKS = Path("/proc/self/task")


def _thread_cpu_s(tid: int) -> float | None:
    try:
        text = (_TASKS / str(tid) / "schedstat").read_text()
    except OSError:
        return None
    return int(text.split()[0]) / 1e9


def request_side_cpu_s(exclude_prefix: str = "lenbatch-runner") -> float:
    """Cumulative CPU seconds of this process's threads outside the model call (see the module
    docstring). A thread that ended takes its CPU with it: a reading can go down."""
    total = 0.0
    for t in threading.enumerate():
        if t.name.startswith(exclude_prefix) or t.native_id is None:
            continue
        cpu = _thread_cpu_s(t.native_id)
        if cpu is None:
            return time.thread_time()
        total += cpu
    return total
