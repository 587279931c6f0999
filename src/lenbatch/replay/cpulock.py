"""One benchmark at a time: an exclusive lock on `/tmp/lenbatch-bench.lock`.

Two benchmarks on the same cores measure nothing, so `lenbatch bench` and `bench/run.py` both
hold this lock while they run. A caller that holds it already (`bench/run.py` running `lenbatch
bench` as one step of a recipe) says so to its children with `LENBATCH_BENCH_LOCK_HELD=1`: a
second `flock` on the same file from a child would wait on its own parent forever.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sys
from collections.abc import Iterator
from pathlib import Path

__all__ = ["HELD_ENV", "LOCK", "exclusive_cpu"]

LOCK = Path("/tmp/lenbatch-bench.lock")
HELD_ENV = "LENBATCH_BENCH_LOCK_HELD"


@contextlib.contextmanager
def exclusive_cpu(
    enabled: bool = True, who: str = "lenbatch bench", path: Path = LOCK
) -> Iterator[None]:
    """Hold the bench lock while the block runs, waiting (and saying so) while another
    benchmark holds it. Does nothing when `enabled` is false or a parent process holds the
    lock (`LENBATCH_BENCH_LOCK_HELD=1`); while held, children see that variable."""
    if not enabled or os.environ.get(HELD_ENV) == "1":
        yield
        return
    with path.open("a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"{who}: waiting for {path}: another benchmark runs", file=sys.stderr, flush=True)
            fcntl.flock(f, fcntl.LOCK_EX)
        before = os.environ.get(HELD_ENV)
        os.environ[HELD_ENV] = "1"
        try:
            yield
        finally:
            if before is None:
                os.environ.pop(HELD_ENV, None)
            else:
                os.environ[HELD_ENV] = before
