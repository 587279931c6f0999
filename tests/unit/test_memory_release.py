"""`release_freed_memory`: glibc's freed heap goes back to the OS (the start-up trim)."""

from __future__ import annotations

import platform

import pytest

from lenbatch.runners.memory import current_rss, release_freed_memory


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_release_freed_memory_returns_the_freed_heap() -> None:
    """Blocks below glibc's mmap threshold come from the heap; freed with one kept alive at
    the top, glibc keeps their pages resident until asked to trim."""
    blocks = [bytes(64 * 1024) for _ in range(3200)]  # ~200 MB, each written (resident)
    keep = blocks[-1]
    del blocks
    held = current_rss()
    release_freed_memory()
    released = held - current_rss()
    assert keep  # alive to here: the heap's top stays in use
    assert released > 100 * 2**20, f"only {released / 2**20:.0f} MB handed back"
