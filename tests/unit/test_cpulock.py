"""The bench lock (`replay.cpulock`): one benchmark at a time, and no wait on one's own parent."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lenbatch.replay.cpulock import HELD_ENV, exclusive_cpu

HOLD = """
import fcntl, sys, time
f = open(sys.argv[1], "a")
fcntl.flock(f, fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(float(sys.argv[2]))
"""


def _holder(path: Path, seconds: float) -> subprocess.Popen[str]:
    """Another process holding the lock for `seconds`, started once it holds it."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(path), str(seconds)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def test_waits_while_another_benchmark_holds_the_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A second benchmark says it waits and starts only once the first lets go; inside, its
    children are told the lock is held."""
    monkeypatch.delenv(HELD_ENV, raising=False)
    lock = tmp_path / "bench.lock"
    holder = _holder(lock, 0.6)
    t0 = time.monotonic()
    with exclusive_cpu(path=lock):
        waited = time.monotonic() - t0
        assert os.environ.get(HELD_ENV) == "1"
    holder.wait(timeout=10)
    assert waited >= 0.4
    assert "waiting for" in capsys.readouterr().err
    assert HELD_ENV not in os.environ


def test_a_child_of_the_holder_does_not_wait(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With `LENBATCH_BENCH_LOCK_HELD=1` (a parent holds the lock) it does not touch the lock,
    so a recipe's `lenbatch bench` step does not wait on the recipe; `enabled=False` neither."""
    lock = tmp_path / "bench.lock"
    holder = _holder(lock, 5.0)
    try:
        for held, enabled in (("1", True), ("0", False)):
            monkeypatch.setenv(HELD_ENV, held)
            t0 = time.monotonic()
            with exclusive_cpu(enabled, path=lock):
                pass
            assert time.monotonic() - t0 < 0.5
    finally:
        holder.kill()
        holder.wait(timeout=10)
