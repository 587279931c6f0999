"""Options shared by the commands that read a trace (analyze, fit, simulate, tune, replay)."""

from __future__ import annotations

import argparse

from lenbatch.trace import Trace, load_trace, map_trace

__all__ = ["add_trace_options", "trace_from_args"]


def add_trace_options(p: argparse.ArgumentParser, *, optional_trace: bool = False) -> None:
    """Add TRACE and the explicit mapping options (applied in this order: window, length
    scale, max length, rate scale, limit). `optional_trace` lets a command take its traffic
    from elsewhere (replay and bench: `--scenario`)."""
    p.add_argument(
        "trace",
        metavar="TRACE",
        nargs="?" if optional_trace else None,
        default=None,
        help="trace file, or a bundled trace: azure-conv, mooncake, sharegpt",
    )
    g = p.add_argument_group("trace mapping (reported with the results)")
    g.add_argument(
        "--format",
        dest="trace_format",
        default=None,
        help="trace format (default: detected from the file)",
    )
    g.add_argument(
        "--length-scale",
        type=float,
        default=1.0,
        metavar="X",
        help="multiply input lengths by X (map an LLM trace onto a small model)",
    )
    g.add_argument(
        "--max-length",
        type=int,
        default=None,
        metavar="N",
        help="model limit N: longer inputs are handled by --overflow",
    )
    g.add_argument(
        "--overflow",
        choices=["clip", "drop", "keep"],
        default="clip",
        help="inputs over --max-length: clip to N (they land in the overlong lane), "
        "drop them, or keep them (to test rejection) (default clip)",
    )
    g.add_argument(
        "--rate-scale",
        type=float,
        default=1.0,
        metavar="Y",
        help="multiply the arrival rate by Y (timestamps divided by Y)",
    )
    g.add_argument(
        "--limit",
        type=int,
        default=None,
        metavar="K",
        help="use only the first K requests (after the window)",
    )
    g.add_argument(
        "--start",
        type=float,
        default=None,
        metavar="S",
        help="window start, seconds from the trace's first request",
    )
    g.add_argument(
        "--end",
        type=float,
        default=None,
        metavar="S",
        help="window end, seconds from the trace's first request",
    )


def trace_from_args(args: argparse.Namespace) -> Trace:
    """Load and map the trace the options describe."""
    trace = load_trace(args.trace, args.trace_format)
    return map_trace(
        trace,
        length_scale=args.length_scale,
        max_length=args.max_length,
        overflow=args.overflow,
        rate_scale=args.rate_scale,
        limit=args.limit,
        start_s=args.start,
        end_s=args.end,
    )
