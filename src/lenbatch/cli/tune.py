"""`lenbatch tune`: find the bucketed config that sustains the most load within a P95 SLO."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lenbatch.cli.common import float_list, int_list
from lenbatch.cli.simreport import SimContext, add_sim_options, f, pct, per_bucket, side_by_side
from lenbatch.plan.fitting import FitMethod
from lenbatch.plan.sweep import offered_rps
from lenbatch.plan.tune import (
    DEFAULT_BATCHES,
    DEFAULT_BUCKETS,
    DEFAULT_WAITS_MS,
    Candidate,
    TuneResult,
    settings_toml,
    tune,
)

__all__ = ["register", "run"]


def register(sub: Any) -> None:
    """Add the `tune` subcommand."""
    p = sub.add_parser(
        "tune",
        help="search boundaries, max wait and max batch per bucket for a P95 SLO",
        description="Search, by simulation, the bucketed config that sustains the most load "
        "with P95 latency within --slo-p95-ms while meeting it at the trace's own rate: "
        "boundaries from every fit method and bucket count, then one max wait for all "
        "buckets, then each lane's max wait and max batch. Settings not searched (token "
        "budget, concurrency, prefetch, admission) come from --config and the flags, as for "
        "`lenbatch simulate`. Prints the best config and its predicted figures; --out writes "
        "it as a config file for `lenbatch serve --config`.",
    )
    add_sim_options(p)
    p.add_argument("--slo-p95-ms", type=float, required=True, metavar="MS", help="P95 latency SLO")
    p.add_argument("--out", metavar="FILE.toml", help="write the best config here")
    g = p.add_argument_group("search space")
    g.add_argument(
        "--methods",
        default=",".join(m.value for m in FitMethod),
        metavar="M1,M2",
        help="fit methods for boundaries (default: all)",
    )
    grids: list[tuple[str, Any, Sequence[float], str, str]] = [
        ("--buckets", int_list, DEFAULT_BUCKETS, "K1,K2", "bucket counts to fit, besides auto"),
        ("--waits-ms", float_list, DEFAULT_WAITS_MS, "W1,W2",
         "max waits to try, ms (those over half the SLO are skipped)"),
        ("--batches", int_list, DEFAULT_BATCHES, "B1,B2", "max batch sizes to try per lane"),
    ]  # fmt: skip
    for flag, kind, default, metavar, what in grids:
        shown = ",".join(f"{x:g}" for x in default)
        g.add_argument(
            flag,
            type=kind,
            default=list(default),
            metavar=metavar,
            help=f"{what} (default {shown})",
        )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Tune, print the report (or JSON), and write the config file."""
    ctx = SimContext.from_args(args)
    methods = [FitMethod.parse(m) for m in args.methods.split(",") if m.strip()]
    t0 = time.monotonic()

    def progress(c: Candidate) -> None:
        if not args.json:
            cap = f"{c.capacity_rps:.2f} req/s" if c.capacity is not None else "-"
            print(f"  {time.monotonic() - t0:6.1f} s  {c.label:32s} {cap}", file=sys.stderr)

    res = tune(
        ctx.trace,
        ctx.cost,
        ctx.settings.batching,
        ctx.settings.admission,
        slo_p95_ms=args.slo_p95_ms,
        max_length=ctx.max_length,
        truncate=ctx.truncate,
        methods=methods,
        buckets=args.buckets,
        waits_ms=args.waits_ms,
        batches=args.batches,
        progress=progress,
        seed=ctx.seed,
    )
    text = _config_file(res, ctx)
    if args.out:
        Path(args.out).write_text(text, encoding="utf-8")
    best_run = ctx.simulate(res.best.batching)
    start_run = ctx.simulate(res.start.batching)
    if args.json:
        o = res.oracle.throughput_rps
        print(
            json.dumps(
                {
                    "met_slo": res.met_slo,
                    "slo_p95_ms": res.slo_p95_ms,
                    "batching": res.best.batching.model_dump(mode="json"),
                    "config": text,
                    "capacity_rps": res.best.capacity_rps if res.met_slo else None,
                    "start_capacity_rps": res.start.capacity_rps
                    if res.start.capacity is not None
                    else None,
                    "oracle_rps": o,
                    "fraction_of_oracle": res.best.capacity_rps / o if res.met_slo else None,
                    "at_trace_rate": best_run.summary(),
                    "start_at_trace_rate": start_run.summary(),
                    "configs_tried": len(res.tried),
                    "stages": res.stages,
                }
            )
        )
        return 0
    print(ctx.header())
    print()
    print(f"tuned bucketed for P95 <= {res.slo_p95_ms:g} ms, {len(res.tried)} configs tried:")
    print(f"  {_verdict(res.start, res)}")
    for line in res.stages:
        print(f"  {line}")
    print()
    if res.met_slo:
        print(f"best: {_verdict(res.best, res)}")
    else:
        print(
            f"no config met P95 <= {res.slo_p95_ms:g} ms at this trace's rate "
            f"({offered_rps(ctx.trace):.2f} req/s); the lowest P95 came from:"
        )
    print()
    print(text, end="")
    print()
    print(f"predicted at the trace's rate ({offered_rps(ctx.trace):.2f} req/s):")
    print(side_by_side([start_run, best_run], names=["start", "tuned"]))
    print()
    print(per_bucket(best_run, "tuned"))
    if args.out:
        print(f"\nconfig written to {args.out} (use: lenbatch serve --config {args.out})")
    return 0


def _verdict(c: Candidate, res: TuneResult) -> str:
    o = res.oracle.throughput_rps
    if c.capacity is None:
        p95 = None if c.at_target is None else c.at_target.summary["p95_ms"]
        return f"{c.label}: does not meet the SLO at the trace's rate (P95 {f(p95)} ms)"
    frac = pct(c.capacity_rps / o) if o else "-"
    return (
        f"{c.label}: sustains {c.capacity_rps:.2f} req/s within the SLO "
        f"({frac} of the oracle's {o:.2f} req/s)"
    )


def _config_file(res: TuneResult, ctx: SimContext) -> str:
    t = ctx.trace
    cap = f"{res.best.capacity_rps:.2f} req/s" if res.met_slo else "none (SLO not met)"
    head = [
        f"# Tuned by `lenbatch tune` for P95 <= {res.slo_p95_ms:g} ms on {t.source} "
        f"({len(t)} requests, {offered_rps(t):.2f} req/s)",
        f"# mapping: {'; '.join(t.notes) or 'none'}; model limit {ctx.max_length} tokens",
        f"# cost model: {ctx.cost_path}; predicted capacity within the SLO: {cap}",
    ]
    return "\n".join(head) + "\n" + settings_toml(res.best.batching, ctx.settings.admission)
