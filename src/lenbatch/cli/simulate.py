"""`lenbatch simulate`: predict what a batching config does to a trace, before deploying it."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from lenbatch.cli.common import float_list
from lenbatch.cli.simreport import (
    SimContext,
    add_sim_options,
    f,
    pct,
    per_bucket,
    side_by_side,
    table,
)
from lenbatch.config import Strategy
from lenbatch.plan.sweep import SweepPoint, SweepResult, plot_sweep, sweep

__all__ = ["parse_strategies", "register", "run"]


def register(sub: Any) -> None:
    """Add the `simulate` subcommand."""
    p = sub.add_parser(
        "simulate",
        help="predict latency, throughput and waste of a batching config on a trace",
        description="Replay a trace through the server's own admission, queues and scheduler "
        "under a virtual clock, with batch times from a cost model (`lenbatch profile`). "
        "Batching settings merge like `lenbatch serve`: defaults, --config FILE, "
        "LENBATCH_<SECTION>__<FIELD> environment variables, then these flags. The model's "
        "length limit is --max-length (default: the config's model.max_length, else 256 = "
        "MiniLM); longer inputs are rejected unless --truncate.",
    )
    add_sim_options(p)
    p.add_argument(
        "--strategy",
        metavar="NAME[,NAME...]",
        help="strategies to compare side by side: "
        + ", ".join(s.value for s in Strategy)
        + ", or 'all' (default: the config's; with --sweep: all)",
    )
    g = p.add_argument_group("rate sweep")
    g.add_argument(
        "--sweep",
        action="store_true",
        help="run the trace at increasing rates; report per strategy the highest "
        "throughput whose P95 stays within --slo-p95-ms",
    )
    g.add_argument(
        "--rates",
        type=float_list,
        metavar="X1,X2,...",
        help="rate scales to try (multiples of the mapped trace's rate; default: offered "
        "load from 5%% to 110%% of the oracle's throughput)",
    )
    g.add_argument("--slo-p95-ms", type=float, metavar="MS", help="P95 latency SLO (--sweep)")
    g.add_argument("--plot", metavar="FILE.png", help="plot P95 vs offered load (--sweep)")
    p.set_defaults(run=run)


def parse_strategies(text: str | None, default: list[Strategy]) -> list[Strategy]:
    """`fifo,bucketed` or `all` as a list of strategies (`default` when not given)."""
    if text is None:
        return default
    if text.strip().lower() == "all":
        return list(Strategy)
    out = [Strategy.parse(name) for name in text.split(",") if name.strip()]
    if not out:
        raise ValueError("--strategy names no strategy")
    return out


def run(args: argparse.Namespace) -> int:
    """Simulate (or sweep) and print a report."""
    if args.sweep and args.slo_p95_ms is None:
        raise ValueError("--sweep needs --slo-p95-ms (the P95 latency target in ms)")
    if not args.sweep and (args.rates or args.plot):
        raise ValueError("--rates and --plot only apply with --sweep")
    ctx = SimContext.from_args(args)
    default = list(Strategy) if args.sweep else [ctx.settings.batching.strategy]
    strategies = parse_strategies(args.strategy, default)
    if args.sweep:
        return _run_sweep(args, ctx, strategies)
    runs = [
        ctx.simulate(ctx.settings.batching.model_copy(update={"strategy": s})) for s in strategies
    ]
    if args.json:
        if len(runs) == 1:
            print(json.dumps(runs[0].summary(), indent=2))
        else:
            print(json.dumps([{"strategy": r.strategy.value, **r.summary()} for r in runs]))
        return 0
    print(ctx.header())
    print()
    print(side_by_side(runs))
    for r in runs:
        print()
        print(per_bucket(r))
    return 0


def _run_sweep(args: argparse.Namespace, ctx: SimContext, strategies: list[Strategy]) -> int:
    def progress(strategy: str, p: SweepPoint) -> None:
        if not args.json:
            mark = "ok" if p.sustainable else p.reason
            print(
                f"  {strategy:9s} x{p.rate_scale:<8.3g} {p.offered_rps:8.1f} req/s  {mark}",
                file=sys.stderr,
            )

    result = sweep(
        ctx.trace,
        ctx.cost,
        ctx.settings.batching,
        ctx.settings.admission,
        strategies=strategies,
        slo_p95_ms=args.slo_p95_ms,
        rates=args.rates,
        max_length=ctx.max_length,
        truncate=ctx.truncate,
        progress=progress,
        seed=ctx.seed,
    )
    if args.plot:
        plot_sweep(result, args.plot)
    if args.json:
        print(json.dumps(result.to_json()))
        return 0
    print(ctx.header())
    print()
    print(_capacity_table(result))
    for s in result.strategies:
        print()
        print(f"{s.strategy}: offered req/s, served req/s, P95 ms, completed, verdict")
        for p in s.points:
            done = p.summary["completed"] / max(1, p.summary["requests"])
            verdict = "sustainable" if p.sustainable else p.reason
            print(
                f"  {p.offered_rps:9.2f}  {p.throughput_rps:9.2f}  "
                f"{f(p.summary['p95_ms']):>9}  {done:7.1%}  {verdict}"
            )
    if args.plot:
        print(f"\nplot written to {args.plot}")
    return 0


def _capacity_table(result: SweepResult) -> str:
    o = result.oracle
    lines = [
        f"capacity at P95 <= {result.slo_p95_ms:g} ms (highest sustainable throughput); "
        f"oracle: {o.throughput_rps:.1f} req/s, {o.real_tokens_per_s:,.0f} real tokens/s, "
        f"mean batch {o.mean_batch_size:.1f}, waste {o.padding_waste:.1%}",
    ]
    rows: list[tuple[str, list[str]]] = [
        ("strategy", [s.strategy for s in result.strategies]),
        ("capacity req/s", []),
        ("real tokens/s", []),
        ("fraction of oracle", []),
        ("P95 ms at capacity", []),
        ("mean batch size", []),
        ("padding waste", []),
        ("next rate fails on", []),
    ]
    for s in result.strategies:
        cap = s.capacity
        sm = cap.summary if cap is not None else {}
        above = [p for p in s.points if cap is not None and p.rate_scale > cap.rate_scale]
        fail = next((p.reason for p in above if not p.sustainable), "-")
        if cap is None:
            fail = s.points[0].reason if s.points else "-"
        rows[1][1].append(f(cap.throughput_rps if cap else None, ".2f"))
        rows[2][1].append(f(sm.get("real_tokens_per_s"), ",.0f"))
        frac = cap.throughput_rps / o.throughput_rps if cap and o.throughput_rps else None
        rows[3][1].append(pct(frac))
        rows[4][1].append(f(sm.get("p95_ms")))
        rows[5][1].append(f(sm.get("mean_batch_size")))
        rows[6][1].append(pct(sm.get("padding_waste")))
        rows[7][1].append(fail)
    return "\n".join(lines) + "\n" + table(rows)
