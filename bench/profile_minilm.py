"""Profile all-MiniLM-L6-v2 on this machine and write a Markdown result plus the cost model.

    bench/run.py profile-minilm -- --conditions "quiet machine"

Runs `lenbatch.plan.profile` over batch sizes x padded lengths (warm-up, median of repeats, sampled
RSS per point), fits the cost model, and writes `bench/results/profile_minilm_<device>.md`
(command, machine, load average before and after, the table, the fit) and the cost model JSON
next to it, which `lenbatch fit --cost` and `lenbatch simulate` read.
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from lenbatch.plan.profile import bucket_max_batches, format_table, profile_and_fit
from lenbatch.runners import load_runner

RESULTS = Path(__file__).parent / "results"


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main() -> int:
    """Profile, fit, write the Markdown result and the cost model."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch-sizes", type=_ints, default=_ints("1,2,4,8,16,32"))
    p.add_argument("--lengths", type=_ints, default=_ints("16,32,64,128,256"))
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--torch-threads", type=int, default=None)
    p.add_argument("--budget-mb", type=float, default=1024.0, help="example memory budget")
    p.add_argument(
        "--boundaries",
        type=_ints,
        default=_ints("22,56,71,134,209,256"),
        help="bucket uppers for the max-batch example (default: `fit --method optimal` on "
        "the dev trace at the MiniLM mapping, plus the overlong lane at 256)",
    )
    p.add_argument("--conditions", required=True, help="what else ran on the machine")
    p.add_argument("--out", type=Path, default=None, help="Markdown file to write")
    args = p.parse_args()

    import torch

    runner = load_runner("minilm", device=args.device, torch_threads=args.torch_threads)
    load_before = os.getloadavg()
    started = time.perf_counter()
    cost = profile_and_fit(
        runner,
        args.batch_sizes,
        args.lengths,
        repeats=args.repeats,
        warmup=args.warmup,
        device=args.device,
        progress=lambda pt: print(
            f"B={pt.batch:<3} L={pt.padded_len:<4} {1e3 * pt.latency_s:9.2f} ms", file=sys.stderr
        ),
    )
    elapsed = time.perf_counter() - started
    load_after = os.getloadavg()
    dev = args.device.split(":")[0]
    out = args.out or RESULTS / f"profile_minilm_{dev}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    cost_path = out.with_name(f"cost_minilm_{dev}.json")
    cost.save(cost_path)
    budget = args.budget_mb * 2**20
    batches = bucket_max_batches(cost, args.boundaries, budget)
    overhead = cost.const / cost.per_token if cost.per_token > 0 else float("nan")
    command = "python " + " ".join(shlex.quote(a) for a in sys.argv)
    md = [
        f"# Profile: {runner.info.name} on {args.device}",
        "",
        f"**Conditions: {args.conditions}.** Load average (1/5/15 min) before "
        f"{load_before[0]:.2f}/{load_before[1]:.2f}/{load_before[2]:.2f}, after "
        f"{load_after[0]:.2f}/{load_after[1]:.2f}/{load_after[2]:.2f}.",
        "",
        f"- Command: `{command}`",
        f"- Machine: {_cpu_name()}, {os.cpu_count()} logical CPUs, {platform.system()} "
        f"{platform.release()}; Python {platform.python_version()}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} torch threads",
        f"- Grid: batch sizes {args.batch_sizes} x padded lengths {args.lengths}; "
        f"{args.warmup} warm-up + {args.repeats} timed runs per point (median kept, min-max "
        f"shown), then one run under the memory probe; {elapsed:.0f} s in all",
        f"- Memory: {cost.memory_method}; weights {cost.weights_bytes / 2**20:.1f} MB apart",
        f"- Cost model written to `{cost_path.name}` (read by `lenbatch fit --cost` and "
        "`lenbatch simulate`)",
        "",
        "```",
        format_table(cost),
        "```",
        "",
        f"Per-batch overhead in token-equivalents (`const / per_token`, what `lenbatch fit "
        f"--cost` uses): {overhead:.0f}.",
        "",
        f"Max batch per bucket under a {args.budget_mb:g} MB budget (weights included), "
        "padded to each bucket's upper bound:",
        "",
        "| padded to | max batch |",
        "|---:|---:|",
        *(f"| {u} | {n} |" for u, n in zip(args.boundaries, batches, strict=True)),
        "",
    ]
    out.write_text("\n".join(md), encoding="utf-8")
    print(f"wrote {out} and {cost_path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
