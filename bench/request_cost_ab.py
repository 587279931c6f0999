#!/usr/bin/env python3
"""Paired A/B of the CPU one one-input request costs the server: this tree against another.

    bench/run.py request-cost-ab -- --against /tmp/old/src --blocks 16
    python bench/request_cost_ab.py --against /tmp/old/src --serve-args '--strategy adaptive'

`bench/request_cost.py` measures one server at a time, and this host's speed drifts 10-40 %
within the hour, more than the few per cent a change on the event loop moves: two runs of it
minutes apart cannot tell such a change from the drift. Here both servers run at once (the same
config and flags; one on the lenbatch this script imports, `bench/run.py --src` included, the
other on `--against`'s, each by PYTHONPATH), one idle while the
other is measured, and the client alternates between them in blocks of `--requests`
sequential one-line requests on one keep-alive connection each, the order swapped every block.
Each block reads the server's CPU per thread from `/proc/PID/task/*/schedstat` (nanoseconds),
so the two sides of a pair run minutes apart at most seconds. It reports, per request, the
event loop's CPU and all threads' CPU for each side, and the median of the per-pair ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent))

from request_cost import TEXT, loop_and_parser, sequential
from waterfall import DEV_CONFIG


def schedstat_ns(pid: int) -> dict[int, int]:
    """Nanoseconds on a CPU so far of every thread of process `pid`, by thread id."""
    out: dict[int, int] = {}
    for t in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{t}/schedstat", encoding="ascii") as f:
                out[int(t)] = int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            continue
    return out


def block(url: str, pid: int, body: bytes, n: int) -> tuple[float, float, int]:
    """`n` sequential requests; ms of event-loop CPU and of all threads' CPU per request, and
    how many were answered 200."""
    before = schedstat_ns(pid)
    _, ok = asyncio.run(sequential(url, body, n))
    after = schedstat_ns(pid)
    total = sum(v - before.get(t, 0) for t, v in after.items())
    loop = after.get(pid, 0) - before.get(pid, 0)
    return loop / n / 1e6, total / n / 1e6, ok


def main() -> int:
    """Run the paired blocks and print (and with --out write) the comparison."""
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--against", required=True, help="the other lenbatch's src folder")
    p.add_argument("--config", default=DEV_CONFIG)
    p.add_argument("--blocks", type=int, default=16, help="pairs of blocks")
    p.add_argument("--requests", type=int, default=300, help="requests per block")
    p.add_argument("--serve-args", default="", help="more `lenbatch serve` flags (both sides)")
    p.add_argument("--out", type=Path)
    args = p.parse_args()

    import lenbatch
    from lenbatch.replay.process import ServerProcess, free_port
    from lenbatch.replay.targets import LENBATCH_CLI, Target
    from lenbatch.runners.hardware import processor_key

    here = str(Path(lenbatch.__file__).resolve().parent.parent)  # the tree this runs (--src)
    sides = {"this tree": here, "against": str(Path(args.against).resolve())}
    more = shlex.split(args.serve_args)
    argv = (sys.executable, *LENBATCH_CLI, "serve", "--config", args.config,
            "--log-level", "warning", *more, "--port", "{port}")  # fmt: skip
    logs = Path(tempfile.mkdtemp(prefix="request-cost-ab-"))
    servers = {
        name: ServerProcess(
            Target(f"lenbatch serve ({name})", "strategy", argv, env=(("PYTHONPATH", src),)),
            free_port(),
            logs / f"{i}.log",
        )
        for i, (name, src) in enumerate(sides.items())
    }
    body = json.dumps({"input": TEXT}).encode()
    rows: dict[str, list[tuple[float, float]]] = {name: [] for name in servers}
    failed = 0
    try:
        for s in servers.values():
            s.wait_ready()
            asyncio.run(sequential(s.url, body, 100))  # warm
        stack = loop_and_parser(next(iter(servers.values())).proc.pid)
        names = list(servers)
        t0 = time.monotonic()
        for k in range(args.blocks):
            for name in names if k % 2 == 0 else names[::-1]:
                s = servers[name]
                loop_ms, all_ms, ok = block(s.url, s.proc.pid, body, args.requests)
                failed += args.requests - ok
                rows[name].append((loop_ms, all_ms))
            a, b = rows[names[0]][-1], rows[names[1]][-1]
            print(
                f"pair {k + 1}: loop {a[0]:.3f} / {b[0]:.3f} ms, all threads "
                f"{a[1]:.3f} / {b[1]:.3f} ms ({names[0]} / {names[1]})",
                flush=True,
            )
        minutes = (time.monotonic() - t0) / 60
    finally:
        for s in servers.values():
            s.stop()

    def line(i: int, what: str) -> str:
        a = [r[i] for r in rows["this tree"]]
        b = [r[i] for r in rows["against"]]
        ratios = sorted(x / y for x, y in zip(a, b, strict=True))
        q1, med, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
        wins = sum(x < y for x, y in zip(a, b, strict=True))
        return (
            f"| {what} | {statistics.median(a):.3f} | {statistics.median(b):.3f} | "
            f"**{med:.3f}** ({q1:.3f}-{q3:.3f}) | {wins} of {len(a)} |"
        )

    report = "\n".join(
        [
            f"Command: `python bench/request_cost_ab.py --against {args.against} --blocks "
            f"{args.blocks} --requests {args.requests}"
            + (f" --serve-args '{args.serve_args}'" if args.serve_args else "")
            + "`  ",
            f"Processor: `{processor_key()}`; server: {stack}  ",
            f"{args.blocks} pairs of blocks of {args.requests} sequential one-line requests "
            f"in {minutes:.1f} min, {failed} not answered 200",
            "",
            "| ms CPU per request (median of blocks) | this tree | against | ratio per pair, "
            "median (quartiles) | pairs this tree used less |",
            "|---|---:|---:|---:|---:|",
            line(0, "event loop (server main thread)"),
            line(1, "all server threads"),
            "",
        ]
    )
    print(report)
    if args.out:
        args.out.write_text(report)
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
