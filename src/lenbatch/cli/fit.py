"""`lenbatch fit TRACE`: bucket boundaries from a trace or length log, as a config snippet."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lenbatch.cli.common import (
    add_cost_option,
    add_trace_options,
    load_cost_model,
    trace_from_args,
)
from lenbatch.config import BatchingConfig
from lenbatch.plan.fitting import (
    AUTO_MAX_BUCKETS,
    DEFAULT_GAIN_THRESHOLD,
    DEFAULT_MAX_OVERLONG_SHARE,
    FitMethod,
    FitResult,
    fit_boundaries,
)
from lenbatch.plan.trace import Trace

__all__ = ["config_snippet", "register", "run"]

_DEFAULTS = BatchingConfig()


def _positive_or(word: str, convert: Callable[[str], float], what: str) -> Callable[[str], Any]:
    """An argparse type: `word` itself, or a positive number read by `convert`."""

    def parse(text: str) -> float | str:
        if text == word:
            return text
        try:
            value = convert(text)
        except ValueError:
            value = 0
        if not value > 0:
            raise argparse.ArgumentTypeError(
                f"expected a positive {what} or {word!r}, got {text!r}"
            )
        return value

    return parse


_buckets = _positive_or("auto", int, "integer")
_rate = _positive_or("full", float, "rate")


def register(sub: Any) -> None:
    """Add the `fit` subcommand."""
    p = sub.add_parser(
        "fit",
        help="fit bucket boundaries to a trace or length log; prints a config snippet",
        description="Fit bucket boundaries to the lengths of a trace (or a `serve "
        "--length-log` file). Every method is scored by one model: expected padded tokens "
        "per request plus a per-batch overhead, with each lane's batch size following its "
        "share of the arrival rate (see docs/traffic.md). Prints the reasoning and a "
        "[batching] section for `lenbatch serve --config`.",
    )
    add_trace_options(p)
    f = p.add_argument_group("fitting")
    f.add_argument(
        "--method",
        choices=[m.value for m in FitMethod],
        default=FitMethod.OPTIMAL.value,
        help="quantile: equal-mass cuts; kmeans: exact 1-D k-means; optimal: minimal "
        "expected padded tokens + batch overhead (default)",
    )
    f.add_argument(
        "--buckets",
        type=_buckets,
        default="auto",
        metavar="K|auto",
        help=f"buckets below the overlong lane, or auto: the K (1..{AUTO_MAX_BUCKETS}) after "
        "which one more bucket gains less than --gain-threshold (default auto)",
    )
    f.add_argument(
        "--gain-threshold",
        type=float,
        default=DEFAULT_GAIN_THRESHOLD,
        metavar="F",
        help=f"auto: smallest relative gain worth a bucket (default {DEFAULT_GAIN_THRESHOLD})",
    )
    f.add_argument(
        "--rate",
        type=_rate,
        metavar="R|full",
        help="arrival rate, req/s, for the batch-size model, or 'full': every batch full "
        "(heavy traffic). Default: the trace's mean rate after mapping; 'full' for a "
        "trace without timestamps",
    )
    f.add_argument(
        "--max-overlong-share",
        type=float,
        default=DEFAULT_MAX_OVERLONG_SHARE,
        metavar="F",
        help="optimal: most traffic (the longest requests) the overlong lane may take "
        f"(default {DEFAULT_MAX_OVERLONG_SHARE})",
    )
    lane_options: list[tuple[str, type, float, str, str]] = [
        ("--max-wait-ms", float, _DEFAULTS.max_wait_ms, "MS", "bucket max wait"),
        ("--max-batch", int, _DEFAULTS.max_batch, "N", "bucket max batch"),
        (
            "--overlong-max-wait-ms",
            float,
            _DEFAULTS.overlong_max_wait_ms,
            "MS",
            "overlong lane max wait",
        ),
        ("--overlong-max-batch", int, _DEFAULTS.overlong_max_batch, "N", "overlong lane max batch"),
    ]
    for flag, kind, default, metavar, what in lane_options:
        f.add_argument(
            flag, type=kind, default=default, metavar=metavar, help=f"{what} (default {default:g})"
        )
    f.add_argument(
        "--batch-overhead-tokens",
        type=float,
        metavar="H",
        help="per-batch overhead in token-equivalents (overrides --cost)",
    )
    add_cost_option(f, "cost model whose per-batch constant, in tokens, is the batch overhead; ")
    p.add_argument("--out", metavar="FILE.toml", help="also write the config snippet here")
    p.add_argument("--json", action="store_true", help="print a JSON result instead of text")
    p.set_defaults(run=run)


def config_snippet(
    result: FitResult, trace: Trace, rate: float | None, args: argparse.Namespace
) -> str:
    """A TOML `[batching]` section for `lenbatch serve --config`, with its provenance."""
    lanes = ", ".join(
        f"{'overlong ' if lane.overlong else ''}{lane.lower}-{lane.upper} {100 * lane.share:.1f}%"
        for lane in result.lanes
        if lane.lower <= lane.upper
    )
    mapping = "; ".join(trace.notes) or "none"
    at = "full batches" if rate is None else f"{rate:.4g} req/s"
    k = len(result.boundaries)
    return "\n".join(
        [
            f"# Fitted by `lenbatch fit` ({result.method.value}, {k} bucket"
            f"{'' if k == 1 else 's'}) for a model limit of {result.max_length} tokens.",
            f"# Trace: {trace.source} ({len(trace)} requests); mapping: {mapping}.",
            f"# Expected padding waste {100 * result.expected_padding_waste:.1f}% at {at}; "
            f"lanes: {lanes}.",
            "[batching]",
            'strategy = "bucketed"',
            f"boundaries = [{', '.join(str(b) for b in result.boundaries)}]",
            f"max_batch = {args.max_batch}",
            f"max_wait_ms = {args.max_wait_ms:g}",
            f"overlong_max_batch = {args.overlong_max_batch}",
            f"overlong_max_wait_ms = {args.overlong_max_wait_ms:g}",
            "",
        ]
    )


def run(args: argparse.Namespace) -> int:
    """Load and map the trace, fit, print reasoning and the snippet (or JSON)."""

    trace = trace_from_args(args)
    max_length = args.max_length
    notes: list[str] = []
    if max_length is None:
        max_length = int(trace.input_lengths.max())
        notes.append(
            f"no --max-length: fitting up to the longest input ({max_length} tokens); give "
            "your model's limit to leave the right overlong lane"
        )
    if args.rate is None and trace.arrivals is not None and trace.duration > 0:
        args.rate = len(trace) / trace.duration
        notes.append(f"rate: the trace's mean, {args.rate:.2f} req/s (set --rate to change)")
    elif args.rate is None:
        notes.append("rate: the trace has no timestamps, so full batches (set --rate)")
    rate = None if args.rate in (None, "full") else float(args.rate)
    cost = load_cost_model(args.cost) if args.cost else None
    result = fit_boundaries(
        trace.input_lengths,
        args.method,
        args.buckets,
        max_length,
        rate=rate,
        max_wait_s=args.max_wait_ms / 1000,
        max_batch=args.max_batch,
        batch_overhead_tokens=args.batch_overhead_tokens,
        cost=cost,
        overlong_max_batch=args.overlong_max_batch,
        overlong_max_wait_s=args.overlong_max_wait_ms / 1000,
        gain_threshold=args.gain_threshold,
        max_overlong_share=args.max_overlong_share,
    )
    snippet = config_snippet(result, trace, rate, args)
    if args.out:
        Path(args.out).write_text(snippet, encoding="utf-8")
    if args.json:
        out: dict[str, Any] = {
            "method": result.method.value,
            "boundaries": list(result.boundaries),
            "expected_padding_waste": result.expected_padding_waste,
            "shares": list(result.shares),
            "objective": result.objective,
            "max_length": result.max_length,
            "excluded": result.excluded,
            "rate": rate,
            "per_bucket": [
                {
                    "lower": lane.lower,
                    "upper": lane.upper,
                    "overlong": lane.overlong,
                    "share": lane.share,
                    "mean_batch": lane.mean_batch,
                    "padded_per_request": lane.padded_per_request,
                    "padding_waste": lane.padding_waste,
                }
                for lane in result.lanes
            ],
            "source": trace.source,
            "mapping": list(trace.notes),
            "reasoning": [*notes, *result.reasoning],
            "config": snippet,
        }
        print(json.dumps(out, indent=2))
        return 0
    print(f"trace: {trace.source} ({len(trace)} requests)")
    for note in trace.notes or ("none (raw lengths and times)",):
        print(f"mapping: {note}")
    for line in [*notes, *result.reasoning]:
        print(line)
    print()
    print(snippet, end="")
    if args.out:
        print(f"\nconfig written to {args.out}")
    return 0
