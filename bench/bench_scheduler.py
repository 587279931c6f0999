"""Cost of the pure scheduler per request (target: <= 50 us), without the simulator around it.

Two loads per strategy, lengths from the dev trace (`azure-conv`, MiniLM mapping):

* `stream`: one request arrives, `schedule()` runs, every emitted batch finishes at once; the
  clock advances past max_wait every 8 arrivals so timers fire too (the engine's light load).
* `backlog`: 20k requests already queued, then `schedule()` + `batch_done()` until empty (the
  engine under overload: deep queues, full batches; `sorted` sorts a window per batch).

Only the time inside `schedule()` is counted (perf_counter around each call), divided by the
number of requests scheduled. Best of `--runs`. The frozen copy of the scheduler before it was
optimised (`tests/property/reference_scheduler.py`) is timed in the same run, side by side.

    bench/run.py scheduler            # or: bench/run.py scheduler -- --requests 5000 --runs 3
"""

from __future__ import annotations

import argparse
import importlib.util
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from lenbatch.config import BatchingConfig, Strategy
from lenbatch.core.batch import Decision
from lenbatch.core.lanes import SchedulerConfig, resolve_lanes
from lenbatch.core.queues import Queues
from lenbatch.core.request import Request
from lenbatch.core.scheduler import schedule
from lenbatch.plan.trace import load_trace, map_trace

Scheduler = Callable[[Queues, float, SchedulerConfig], Any]
REFERENCE = Path(__file__).resolve().parent.parent / "tests" / "property" / "reference_scheduler.py"


def reference() -> Scheduler | None:
    """The pre-optimisation scheduler, if the tests folder is there."""
    if not REFERENCE.exists():
        return None
    spec = importlib.util.spec_from_file_location("reference_scheduler", REFERENCE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["reference_scheduler"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    fn: Scheduler = module.schedule
    return fn


def stream(cfg: SchedulerConfig, lengths: list[int], schedule: Scheduler = schedule) -> float:
    """Seconds spent in schedule() for a stream of single arrivals."""
    q = Queues(cfg)
    spent = 0.0
    now = 0.0
    wait = max(p.max_wait for p in cfg.lanes)
    for k, n in enumerate(lengths):
        now += wait * 1.01 if k % 8 == 0 else 1e-5
        q.push(Request(n, now))
        t0 = time.perf_counter()
        d: Decision = schedule(q, now, cfg)
        spent += time.perf_counter() - t0
        for b in d.batches:
            q.batch_done(b.lane)
    while q.size:  # flush the tail so every request is scheduled once
        now += wait * 1.01
        t0 = time.perf_counter()
        d = schedule(q, now, cfg)
        spent += time.perf_counter() - t0
        for b in d.batches:
            q.batch_done(b.lane)
    return spent


def backlog(cfg: SchedulerConfig, lengths: list[int], schedule: Scheduler = schedule) -> float:
    """Seconds spent in schedule() draining a deep queue."""
    q = Queues(cfg)
    for k, n in enumerate(lengths):
        q.push(Request(n, k * 1e-6))
    now = 1.0
    spent = 0.0
    while q.size:
        t0 = time.perf_counter()
        d = schedule(q, now, cfg)
        spent += time.perf_counter() - t0
        for b in d.batches:
            q.batch_done(b.lane)
    return spent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=20_000)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    trace = map_trace(load_trace("azure-conv"), length_scale=0.05, max_length=256)
    lengths = np.resize(trace.input_lengths, args.requests).tolist()
    print(
        f"{args.requests} requests, lengths from azure-conv x0.05 clipped to 256, default "
        f"batching config per strategy; best of {args.runs}; python "
        f"{platform.python_version()}\n"
    )
    ref = reference()
    print("| strategy | load | us/request | us/request, before optimisation | speed-up |")
    print("|---|---|---:|---:|---:|")
    for s in Strategy:
        cfg = resolve_lanes(BatchingConfig(strategy=s), 256).cfg
        for name, fn in (("stream", stream), ("backlog", backlog)):
            best = min(fn(cfg, lengths) for _ in range(args.runs))
            old = "-"
            ratio = "-"
            if ref is not None:
                before = min(fn(cfg, lengths, ref) for _ in range(args.runs))
                old = f"{1e6 * before / len(lengths):.2f}"
                ratio = f"{before / best:.2f}x"
            per = 1e6 * best / len(lengths)
            print(f"| {s.value} | {name} | {per:.2f} | {old} | {ratio} |", flush=True)


if __name__ == "__main__":
    main()
