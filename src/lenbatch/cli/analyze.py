"""`lenbatch analyze TRACE`: length percentiles, arrival rate and burstiness of a trace."""

from __future__ import annotations

import argparse
import json
from typing import Any

from lenbatch.cli.common import add_trace_options, trace_from_args


def register(sub: Any) -> None:
    """Add the `analyze` subcommand."""
    p = sub.add_parser(
        "analyze",
        help="length percentiles, arrival rate and burstiness of a trace or length log",
        description="Summarise a trace (or a `serve --length-log` file): count, min, mean, "
        "nearest-rank p50/p75/p90/p95/p99 and max of input (and output) lengths; mean and "
        "peak arrival rate per second; burstiness (variance/mean of per-second counts). "
        "The mapping applied to the trace is reported with the results.",
    )
    add_trace_options(p)
    p.add_argument("--plot", metavar="FILE.png", help="write a length histogram with markers")
    p.add_argument("--log-x", action="store_true", help="log-scale length axis in --plot")
    p.add_argument("--json", action="store_true", help="print a JSON summary instead of text")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Load, map, summarise and print; optionally plot."""
    from lenbatch.plan.analysis import analyze, format_summary, plot_histogram

    trace = trace_from_args(args)
    summary = analyze(trace, args.max_length)
    plot = None
    if args.plot:
        plot = plot_histogram(trace, args.plot, log_x=args.log_x)
    if args.json:
        out = summary.to_json()
        out["plot"] = None if plot is None else str(plot)
        print(json.dumps(out, indent=2))
    else:
        print(format_summary(summary))
        if plot is not None:
            print(f"\nhistogram written to {plot}")
    return 0
