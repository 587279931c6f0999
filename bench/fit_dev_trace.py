"""Boundaries each fitting method gives on the dev trace at the MiniLM mapping, side by side.

    .venv/bin/python bench/fit_dev_trace.py [--cost bench/results/cost_minilm_cpu.json]

Maps the bundled Azure conversation trace onto MiniLM (`--length-scale 0.05 --max-length 256`,
overlong inputs clipped: see docs/traffic.md for why), then runs quantile, k-means and optimal
with `auto` K and with a fixed K, under a few traffic settings, and writes
`bench/results/fit_azure_minilm.md`. Deterministic: no timing is involved, only the model in
`lenbatch.plan.fitting`.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from lenbatch.plan.costmodel import CostModel
from lenbatch.plan.fitting import FitMethod, fit_boundaries
from lenbatch.plan.trace import load_trace, map_trace

RESULTS = Path(__file__).parent / "results"
SCALE, LIMIT = 0.05, 256


def main() -> int:
    """Fit with each method under each setting; write the Markdown table."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cost", type=Path, help="cost model for the batch overhead")
    p.add_argument("--fixed-k", type=int, default=5)
    p.add_argument("--out", type=Path, default=RESULTS / "fit_azure_minilm.md")
    args = p.parse_args()

    trace = map_trace(load_trace("azure-conv"), length_scale=SCALE, max_length=LIMIT)
    lengths = trace.input_lengths
    mean_rate = len(trace) / trace.duration
    cost = CostModel.load(args.cost) if args.cost else None
    settings = [
        ("full batches (heavy traffic)", None, 0.010),
        (f"trace rate x10 = {10 * mean_rate:.1f} req/s, max wait 10 ms", 10 * mean_rate, 0.010),
        (f"trace rate x10 = {10 * mean_rate:.1f} req/s, max wait 50 ms", 10 * mean_rate, 0.050),
        (f"trace rate = {mean_rate:.2f} req/s, max wait 10 ms", mean_rate, 0.010),
    ]
    command = "python " + " ".join(shlex.quote(a) for a in sys.argv)
    md = [
        "# Fitted boundaries on the dev trace at the MiniLM mapping",
        "",
        f"- Command: `{command}`",
        f"- Trace: bundled `azure-conv`, {len(trace)} requests, mapping: " + "; ".join(trace.notes),
        f"- Model limit {LIMIT} tokens; max batch 32 per bucket, overlong lane max batch 8 / "
        "max wait 50 ms; optimal may give up to 5% of traffic (the longest) to the overlong lane",
        "- Batch overhead: "
        + (
            f"from `{args.cost}` ({cost.const / cost.per_token:.0f} token-equivalents)"
            if cost is not None and cost.per_token > 0
            else "128 token-equivalents (the default)"
        ),
        "- `cost` = expected padded tokens + batch overhead per request (token-equivalents); "
        "`waste` = expected token-weighted padding waste. Deterministic (no timing).",
        "",
    ]
    for title, rate, wait in settings:
        md += [f"## {title}", "", "| method | K | boundaries | waste | cost/request |"]
        md.append("|---|---:|---|---:|---:|")
        for buckets in ("auto", args.fixed_k):
            for method in FitMethod:
                r = fit_boundaries(
                    lengths, method, buckets, LIMIT, rate=rate, max_wait_s=wait, cost=cost
                )
                k = f"{len(r.boundaries)} ({buckets})"
                md.append(
                    f"| {method.value} | {k} | {list(r.boundaries)} | "
                    f"{100 * r.expected_padding_waste:.1f}% | {r.objective:.1f} |"
                )
        md.append("")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(md), encoding="utf-8")
    print(args.out.read_text(encoding="utf-8"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
