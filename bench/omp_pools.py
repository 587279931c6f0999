"""Small parallel torch ops on the thread that started OpenMP's first pool, and on a second one.

    bench/omp_pools.py [--threads 2] [--repeats 20] [--out bench/results/omp_pools.md]

libgomp keeps one pool of worker threads per thread that starts a parallel region; when the
threads it manages outnumber the CPUs, it stops spinning between regions ("throttled"), so every
region waits for a sleeping thread to wake. This times 200 bf16 linears (64 x 576 by 1536 x 576)
with a SiLU product, the size of a small model's decode-step ops, in three layouts, each in a
fresh process so their pools do not mix:

* `main`: the main thread runs them (one pool);
* `second thread only`: a worker thread runs them, the main thread never ran a parallel op
  (one pool: what `serving.torchthread` arranges);
* `main, then a second thread`: the main thread ran them first (its pool exists), then a
  worker thread runs them (two pools: a model loaded on the main thread and run on an engine's
  worker, as the server did before).

Medians of `--repeats` runs of the 200 ops; the processor key heads the table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

LAYOUTS = {
    "main": "main",
    "second thread only": "thread",
    "main, then a second thread": "main-then-thread",
}


def _child(layout: str, threads: int, repeats: int) -> float:
    """Run in a fresh process: the median seconds of 200 small ops in `layout`."""
    from concurrent.futures import ThreadPoolExecutor

    import torch

    torch.set_num_threads(threads)
    x = torch.randn(64, 576, dtype=torch.bfloat16)
    w = torch.randn(1536, 576, dtype=torch.bfloat16)

    def ops() -> float:
        t = time.perf_counter()
        for _ in range(200):
            y = torch.nn.functional.linear(x, w)
            torch.nn.functional.silu(y) * y
        return time.perf_counter() - t

    if layout in ("main", "main-then-thread"):
        for _ in range(3):
            ops()
    if layout == "main":
        return statistics.median(ops() for _ in range(repeats))
    with ThreadPoolExecutor(1) as ex:
        runs = [ex.submit(ops).result() for _ in range(repeats + 3)][3:]
    return statistics.median(runs)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--rounds", type=int, default=2, help="layouts alternated this many times")
    p.add_argument("--out", type=Path)
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(_child(args.child, args.threads, args.repeats)))
        return 0
    from lenbatch.runners.hardware import processor_key

    times: dict[str, list[float]] = {name: [] for name in LAYOUTS}
    for _ in range(args.rounds):
        for name, layout in LAYOUTS.items():
            cmd = [sys.executable, __file__, "--child", layout, "--threads", str(args.threads)]
            cmd += ["--repeats", str(args.repeats)]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            times[name].append(json.loads(out.strip().splitlines()[-1]))
    base = statistics.median(times["main"])
    lines = [
        f"Processor: `{processor_key()}`; {args.threads} torch threads.",
        "",
        f"Command: `{' '.join(['bench/omp_pools.py', *sys.argv[1:]])}`",
        "",
        f"200 bf16 linears (64 x 576 by 1536 x 576) + SiLU product, ms: median of {args.repeats}",
        f"runs per process, one value per process ({args.rounds} processes per layout, "
        "alternated).",
        "",
        "| layout | ms per 200 ops | over `main` |",
        "|---|---|---:|",
    ]
    for name, xs in times.items():
        ms = ", ".join(f"{1000 * v:.1f}" for v in xs)
        lines.append(f"| {name} | {ms} | {statistics.median(xs) / base:.2f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
