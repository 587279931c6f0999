"""How many requests per second of wall time the simulator replays (target: >= 100k).

Repeats the dev trace (bundled `azure-conv`, the project's MiniLM mapping: lengths x0.05,
clipped to 256) back to back `--repeat` times and simulates it once per strategy and
`--rate-scale`, best of `--runs`, with the default batching config. Low rates are the hard case:
each request then costs three events (arrival, max-wait timer, completion). Prints a Markdown
table with wall-clock and process-CPU rates. When other processes share the cores, both are
low; the last column is then the better estimate of an idle machine: the best of `--slices`
short runs (the first 3000 requests), each short enough to often get a core to itself.

    bench/run.py sim-speed -- --cost bench/results/cost_minilm_cpu.json
"""

from __future__ import annotations

import argparse
import platform
import time

import numpy as np

from lenbatch.config import BatchingConfig, Strategy
from lenbatch.plan.costmodel import CostModel
from lenbatch.plan.sim import simulate
from lenbatch.plan.trace import Trace, load_trace, map_trace


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
    ap.add_argument("--cost", default="bench/results/cost_minilm_cpu.json", help="cost model JSON")
    ap.add_argument("--repeat", type=int, default=5, help="copies of the trace (default 5)")
    ap.add_argument("--runs", type=int, default=3, help="best of N runs (default 3)")
    ap.add_argument("--length-scale", type=float, default=0.05)
    ap.add_argument("--max-length", type=int, default=256)
    ap.add_argument("--rate-scale", type=float, action="append", help="default: 0.1, 1 and 4")
    ap.add_argument("--strategy", action="append", help="default: all")
    ap.add_argument("--slices", type=int, default=100, help="short runs for the last column")
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
    print(
        "| strategy | rate scale | offered req/s | requests | events/request | mean batch "
        "| req/s (wall) | req/s (CPU) | req/s (best short run) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for rate in args.rate_scale or [0.1, 1.0, 4.0]:
        trace = repeated(map_trace(base, rate_scale=rate), args.repeat)
        for s in strategies:
            cfg = BatchingConfig(strategy=s)
            walls, cpus = [], []
            for _ in range(args.runs):
                w0, c0 = time.perf_counter(), time.process_time()
                run = simulate(trace, cost, cfg, max_length=args.max_length)
                walls.append(time.perf_counter() - w0)
                cpus.append(time.process_time() - c0)
            head = map_trace(trace, limit=3000)
            short = []
            for _ in range(args.slices):
                w0 = time.perf_counter()
                simulate(head, cost, cfg, max_length=args.max_length)
                short.append(time.perf_counter() - w0)
            n = len(trace)
            print(
                f"| {s.value} | {rate:g} | {n / trace.duration:.2f} | {n} | {run.events / n:.2f} "
                f"| {run.mean_batch_size or 0:.1f} | {n / min(walls):,.0f} "
                f"| {n / min(cpus):,.0f} | {len(head) / min(short):,.0f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
