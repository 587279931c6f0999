"""`lenbatch profile`: time a model over batch sizes x padded lengths; write its cost model."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from lenbatch.cli.common import (
    add_boundaries_option,
    add_precision_options,
    add_quantize_option,
    int_list,
)

DEFAULT_BATCH_SIZES = "1,2,4,8,16,32"
DEFAULT_LENGTHS = "16,32,64,128,256"


def register(sub: Any) -> None:
    """Add the `profile` subcommand."""
    p = sub.add_parser(
        "profile",
        help="measure latency and memory over batch x length; write a cost model (JSON)",
        description="Run the model on a grid of batch sizes x padded lengths (warm-up, median "
        "of repeats), record peak activation memory per point (CUDA allocator on GPU, sampled "
        "RSS on CPU; weights apart), fit latency = const + per_row*B + per_token*B*L + "
        "per_token_sq*B*L^2 and a memory model by non-negative least squares, and write "
        "them as JSON for `lenbatch simulate` and `lenbatch fit --cost`. The JSON records the "
        "processor it was measured on (CPU model, family, threads; or the GPU), the dtype and "
        "the execution: commands reading it warn when it came from another processor.",
    )
    p.add_argument(
        "--model",
        default="minilm",
        help="'minilm' (bundled all-MiniLM-L6-v2, the default) or a local HF model folder",
    )
    p.add_argument("--out", required=True, metavar="COST.json", help="where to write the model")
    p.add_argument("--device", default="cpu", help="torch device (default cpu)")
    p.add_argument("--torch-threads", type=int, help="torch intra-op threads on CPU")
    # As `serve` runs the model. The grid's rows are all of the point's length, so packed and
    # padded batches hold the same tokens.
    add_precision_options(p, default="auto")
    add_quantize_option(p)
    p.add_argument(
        "--batch-sizes",
        type=int_list,
        default=int_list(DEFAULT_BATCH_SIZES),
        metavar="B1,B2,...",
        help=f"batch sizes (default {DEFAULT_BATCH_SIZES})",
    )
    p.add_argument(
        "--lengths",
        type=int_list,
        default=None,
        metavar="L1,L2,...",
        help=f"padded lengths (default {DEFAULT_LENGTHS}, up to the model's limit)",
    )
    p.add_argument("--repeats", type=int, default=5, help="timed runs per point (default 5)")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs per point (default 1)")
    p.add_argument(
        "--memory-budget-mb",
        type=float,
        metavar="M",
        help="derive each bucket's max batch under this memory budget (weights included)",
    )
    add_boundaries_option(
        p, "bucket upper bounds for --memory-budget-mb (default: the profiled lengths)"
    )
    p.add_argument("--json", action="store_true", help="print the cost model JSON at the end")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Load the model, profile it, fit, print the table and write the cost model."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from lenbatch.plan.profile import bucket_max_batches, format_table, profile_and_fit
    from lenbatch.runners import load_runner

    runner = load_runner(
        args.model,
        device=args.device,
        torch_threads=args.torch_threads,
        dtype=args.dtype,
        execution=args.execution,
        quantization=args.quantize or "auto",
    )
    limit = runner.info.max_length
    lengths = args.lengths or [n for n in int_list(DEFAULT_LENGTHS) if n <= limit]
    print(
        f"profiling {runner.info.name} on {args.device}: batch sizes {args.batch_sizes} x "
        f"lengths {lengths}, {args.warmup} warm-up + {args.repeats} timed runs per point",
        file=sys.stderr,
    )
    cost = profile_and_fit(
        runner,
        args.batch_sizes,
        lengths,
        repeats=args.repeats,
        warmup=args.warmup,
        device=args.device,
        progress=lambda p: print(
            f"  B={p.batch:<4} L={p.padded_len:<5} {1e3 * p.latency_s:9.2f} ms",
            file=sys.stderr,
        ),
    )
    cost.save(args.out)
    print(format_table(cost))
    if args.memory_budget_mb is not None:
        uppers = args.boundaries or lengths
        budget = args.memory_budget_mb * 2**20
        batches = bucket_max_batches(cost, uppers, budget)
        print(f"\nmax batch per bucket under {args.memory_budget_mb:g} MB (weights included):")
        for upper, n in zip(uppers, batches, strict=True):
            print(f"  padded to {upper:>6} tokens: {n}")
        print(f"\n[batching]\nboundaries = {list(uppers)}\nbucket_max_batch = {batches}")
        if min(batches) == 0:
            print("note: a bucket with 0 cannot run even one request within the budget")
    print(f"\ncost model ({cost.processor}, {cost.dtype}, {cost.execution}) written to {args.out}")
    if args.json:
        print(json.dumps(cost.to_json(), indent=2))
    return 0
