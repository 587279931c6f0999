"""Process and device memory readings, kept apart: weights, activations, the rest.

On CUDA, `torch.cuda.max_memory_allocated` is exact for tensors. On CPU the best available
figure is the resident set: `peak_rss` is the process high-water mark (Linux `ru_maxrss`) and
`current_rss` reads `/proc/self/statm`, so activations are estimated as the peak above the
resident set measured just after the weights were loaded.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import resource
import sys

__all__ = ["current_rss", "peak_rss", "release_freed_memory"]


def peak_rss() -> int:
    """Highest resident set size of this process so far, in bytes."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def current_rss() -> int:
    """Resident set size of this process now, in bytes (peak RSS where /proc is missing)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            pages = int(f.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return peak_rss()


def release_freed_memory() -> None:
    """Ask glibc's malloc to hand the memory it holds freed back to the OS (`malloc_trim(0)`,
    every arena); a no-op on another C library. Costs one pass over the heaps: for a point in
    time after which that memory is not needed soon (start-up's warm-up and calibration), not
    for the serving path."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
