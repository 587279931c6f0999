"""bench/waterfall.py's pure parts: how it forms batches and reads per-thread CPU."""

from __future__ import annotations

import importlib.util
import os
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def waterfall() -> Any:
    """bench/waterfall.py imported as a module."""
    spec = importlib.util.spec_from_file_location("waterfall", BENCH / "waterfall.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_batches_keep_to_a_bucket_and_its_row_and_token_caps(waterfall: Any) -> None:
    batching = SimpleNamespace(
        boundaries=(10, 100), max_batch=3, max_batch_tokens=200, overlong_max_batch=1
    )
    lengths = [5, 50, 6, 7, 8, 90, 95, 300, 301]
    batches = waterfall.form_batches(lengths, batching)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))  # each once
    assert batches == [[0, 2, 3], [4], [1, 5], [6], [7], [8]]
    for b in batches:
        assert len(b) <= 3
        assert len(b) == 1 or max(lengths[i] for i in b) * len(b) <= 200


def test_thread_cpu_sees_a_busy_thread_and_not_an_idle_one(waterfall: Any) -> None:
    tids: dict[str, int] = {}
    read = threading.Event()  # the threads stay alive until /proc has been read
    spun = threading.Event()

    def busy() -> None:
        tids["busy"] = threading.get_native_id()
        end = time.thread_time() + 0.3
        while time.thread_time() < end:
            pass
        spun.set()
        read.wait()

    def idle() -> None:
        tids["idle"] = threading.get_native_id()
        read.wait()

    before = waterfall.thread_cpu(os.getpid())
    threads = [threading.Thread(target=f) for f in (busy, idle)]
    for t in threads:
        t.start()
    assert spun.wait(30)
    after = waterfall.thread_cpu(os.getpid())
    read.set()
    for t in threads:
        t.join()
    delta = waterfall.cpu_delta(before, after)
    assert delta[tids["busy"]][1] >= 0.2
    assert delta[tids["idle"]][1] < 0.05
    cpu = waterfall.split_cpu(delta, {tids["busy"]})
    assert cpu.runner >= 0.2
