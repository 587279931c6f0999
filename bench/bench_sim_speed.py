"""How many requests per second of wall time the simulator replays (target: >= 100k).

Repeats the dev trace (bundled `azure-conv`, MiniLM mapping) back to back `--repeat` times and
simulates it once per strategy, at each `--rate-scale`, best of `--runs`. Prints a Markdown
table with wall-clock and process-CPU rates (CPU time is the steadier figure when other
processes share the cores).

    .venv/bin/python bench/bench_sim_speed.py --cost bench/cost_minilm_cpu_placeholder.json
"""

from __future__ import annotations

import argparse
import platform
import time

import numpy as np

from lenbatch.config import BatchingConfig, Strategy
from lenbatch.costmodel import CostModel
from lenbatch.sim import simulate
from lenbatch.trace import Trace, load_trace, map_trace


def repeated(trace: Trace, times: int) -> Trace:
    """`trace` played `times` times back to back (one mean inter-arrival gap between copies)."""
    assert trace.arrivals is not None
    gap = trace.duration / max(1, len(trace) - 1)
    span = trace.duration + gap
    arrivals = np.concatenate([trace.arrivals + k * span for k in range(times)])
    lengths = np.tile(trace.input_lengths, times)
    return Trace(lengths, arrivals, source=trace.source, notes=(*trace.notes, f"x{times} copies"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cost", required=True, help="cost model JSON")
    ap.add_argument("--repeat", type=int, default=5, help="copies of the trace (default 5)")
    ap.add_argument("--runs", type=int, default=3, help="best of N runs (default 3)")
    ap.add_argument("--length-scale", type=float, default=0.0625)
    ap.add_argument("--max-length", type=int, default=256)
    ap.add_argument("--rate-scale", type=float, action="append", help="default: 1 and 4")
    ap.add_argument("--strategy", action="append", help="default: all")
    args = ap.parse_args()
    cost = CostModel.load(args.cost)
    base = map_trace(
        load_trace("azure-conv"), length_scale=args.length_scale, max_length=args.max_length
    )
    strategies = [Strategy.parse(s) for s in args.strategy] if args.strategy else list(Strategy)
    print(
        f"trace: azure-conv x{args.repeat} copies, lengths x{args.length_scale:g} clipped to "
        f"{args.max_length}; cost model {args.cost}; best of {args.runs} runs; "
        f"python {platform.python_version()} on {platform.machine()}\n"
    )
    print("| strategy | rate scale | requests | events/request | req/s (wall) | req/s (CPU) |")
    print("|---|---:|---:|---:|---:|---:|")
    for rate in args.rate_scale or [1.0, 4.0]:
        trace = repeated(map_trace(base, rate_scale=rate), args.repeat)
        for s in strategies:
            cfg = BatchingConfig(strategy=s)
            walls, cpus = [], []
            events = 0
            for _ in range(args.runs):
                w0, c0 = time.perf_counter(), time.process_time()
                run = simulate(trace, cost, cfg, max_length=args.max_length)
                walls.append(time.perf_counter() - w0)
                cpus.append(time.process_time() - c0)
                events = run.events
            n = len(trace)
            print(
                f"| {s.value} | {rate:g} | {n} | {events / n:.2f} | "
                f"{n / min(walls):,.0f} | {n / min(cpus):,.0f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
