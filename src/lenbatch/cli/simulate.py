"""`lenbatch simulate`: predict what a batching config does to a trace, before deploying it."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from lenbatch.cli.common import (
    add_batching_options,
    add_trace_options,
    batching_overrides,
    trace_from_args,
)
from lenbatch.config import Settings, Strategy, load_settings
from lenbatch.costmodel import CostModel
from lenbatch.oracle import oracle_for
from lenbatch.sim import SimRun, simulate
from lenbatch.sweep import SweepPoint, SweepResult, offered_rps, plot_sweep, sweep
from lenbatch.trace import Trace

__all__ = ["register", "run"]

MINILM_MAX_LENGTH = 256  # the bundled default model's limit


def _float_list(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated numbers like 0.5,1,2, got {text!r}"
        ) from None


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
    add_trace_options(p)
    p.add_argument("--cost", required=True, metavar="FILE", help="cost model JSON")
    p.add_argument("--config", metavar="FILE", help="config file (.toml, .yaml) as for serve")
    p.add_argument(
        "--strategy",
        metavar="NAME[,NAME...]",
        help="strategies to compare side by side: "
        + ", ".join(s.value for s in Strategy)
        + ", or 'all' (default: the config's; with --sweep: all)",
    )
    add_batching_options(p)
    p.add_argument(
        "--concurrency",
        type=int,
        metavar="N",
        help="batches the runner executes at once (batching.max_concurrent_batches)",
    )
    p.add_argument(
        "--truncate",
        action="store_true",
        default=None,
        help="truncate inputs over the model limit instead of rejecting them",
    )
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    g = p.add_argument_group("rate sweep")
    g.add_argument(
        "--sweep",
        action="store_true",
        help="run the trace at increasing rates; report per strategy the highest "
        "throughput whose P95 stays within --slo-p95-ms",
    )
    g.add_argument(
        "--rates",
        type=_float_list,
        metavar="X1,X2,...",
        help="rate scales to try (multiples of the mapped trace's rate; default: offered "
        "load from 5%% to 110%% of the oracle's throughput)",
    )
    g.add_argument("--slo-p95-ms", type=float, metavar="MS", help="P95 latency SLO (--sweep)")
    g.add_argument("--plot", metavar="FILE.png", help="plot P95 vs offered load (--sweep)")
    p.set_defaults(run=run)


def settings_from_args(args: argparse.Namespace) -> Settings:
    """Config file, environment and flags merged as `serve` merges them."""
    overrides: dict[str, Any] = {
        "model": {"max_length": args.max_length, "truncate": args.truncate},
        "batching": {
            **batching_overrides(args),
            "max_concurrent_batches": args.concurrency,
        },
    }
    return load_settings(args.config, os.environ, overrides)


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
    settings = settings_from_args(args)
    max_length = settings.model.max_length or MINILM_MAX_LENGTH
    truncate = settings.model.truncate
    cost = CostModel.load(args.cost)
    trace = trace_from_args(args)
    if len(trace) == 0:
        raise ValueError("the trace (after mapping) has no requests")
    default = list(Strategy) if args.sweep else [settings.batching.strategy]
    strategies = parse_strategies(args.strategy, default)
    ctx = _Context(trace, cost, settings, max_length, truncate, args.cost)
    if args.sweep:
        return _run_sweep(args, ctx, strategies)
    runs = [
        simulate(
            trace,
            cost,
            settings.batching.model_copy(update={"strategy": s}),
            settings.admission,
            max_length=max_length,
            truncate=truncate,
        )
        for s in strategies
    ]
    if args.json:
        if len(runs) == 1:
            print(json.dumps(runs[0].summary(), indent=2))
        else:
            print(json.dumps([{"strategy": r.strategy.value, **r.summary()} for r in runs]))
        return 0
    print(ctx.header())
    print()
    print(_side_by_side(runs))
    for r in runs:
        print()
        print(_per_bucket(r))
    return 0


class _Context:
    """What every report starts with: the trace, its mapping, the model limit, the cost."""

    def __init__(
        self,
        trace: Trace,
        cost: CostModel,
        settings: Settings,
        max_length: int,
        truncate: bool,
        cost_path: str,
    ) -> None:
        self.trace = trace
        self.cost = cost
        self.settings = settings
        self.max_length = max_length
        self.truncate = truncate
        self.cost_path = cost_path

    def header(self) -> str:
        t = self.trace
        b = self.settings.batching
        lines = [
            f"trace: {t.source or '?'}: {len(t)} requests over {t.duration:.1f} s "
            f"({offered_rps(t):.2f} req/s offered)",
            "mapping: " + ("; ".join(t.notes) if t.notes else "none"),
            f"model limit: {self.max_length} tokens; longer inputs are "
            + ("truncated" if self.truncate else "rejected (413)"),
            f"cost model: {self.cost_path} ({self.cost.model or 'unnamed'} on "
            f"{self.cost.device}; fit error {self.cost.fit_error:.1%})",
            f"batching: max_batch={b.max_batch} max_wait_ms={b.max_wait_ms:g} "
            f"max_batch_tokens={b.max_batch_tokens} concurrency={b.max_concurrent_batches} "
            f"prefetch={b.prefetch_batches}",
        ]
        if b.boundaries is None:
            from lenbatch.buckets import default_boundaries

            lines.append(
                f"boundaries: none given, so the engine's default "
                f"{list(default_boundaries(self.max_length))} (powers of two, not fitted "
                "to this traffic: run `lenbatch fit` or `lenbatch tune`)"
            )
        else:
            lines.append(f"boundaries: {list(b.boundaries)}")
        orc = oracle_for(
            t.input_lengths, self.cost, b, max_length=self.max_length, truncate=self.truncate
        )
        lines.append(
            f"oracle (all lengths known, sorted, no waiting): {orc.throughput_rps:.1f} req/s, "
            f"{orc.real_tokens_per_s:,.0f} real tokens/s; this trace offers "
            f"{offered_rps(t) / orc.throughput_rps:.0%} of it"
            if orc.throughput_rps > 0
            else "oracle: no admissible requests"
        )
        return "\n".join(lines)


def _f(x: float | None, fmt: str = ".1f") -> str:
    return "-" if x is None else format(x, fmt)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def _mean(values: Any) -> float | None:
    import numpy as np

    v = values[~np.isnan(values)]
    return float(v.mean()) if v.size else None


def _side_by_side(runs: list[SimRun]) -> str:
    sums = [r.summary() for r in runs]
    rows: list[tuple[str, list[str]]] = [
        ("strategy", [r.strategy.value for r in runs]),
        ("requests", [str(s["requests"]) for s in sums]),
        ("completed", [str(s["completed"]) for s in sums]),
        ("rejected", [str(s["rejected"]) for s in sums]),
        ("errors (expired)", [str(s["errors"]) for s in sums]),
        ("throughput req/s", [_f(s["throughput_rps"], ".2f") for s in sums]),
        ("real tokens/s", [_f(s["real_tokens_per_s"], ",.0f") for s in sums]),
        ("P50 ms", [_f(s["p50_ms"]) for s in sums]),
        ("P95 ms", [_f(s["p95_ms"]) for s in sums]),
        ("P99 ms", [_f(s["p99_ms"]) for s in sums]),
        ("queue wait mean ms", [_f(_ms(_mean(r.waits))) for r in runs]),
        ("queue wait P95 ms", [_f(s["queue_wait_p95_ms"]) for s in sums]),
        ("execution mean ms", [_f(_ms(_mean(r.execs))) for r in runs]),
        ("mean batch size", [_f(s["mean_batch_size"]) for s in sums]),
        ("padding waste", [_pct(s["padding_waste"]) for s in sums]),
        ("peak memory MB", [_f(s["peak_memory_mb"]) for s in sums]),
    ]
    reasons = [", ".join(f"{k} {v}" for k, v in sorted(r.rejections.items())) for r in runs]
    if any(reasons):
        rows.append(("rejected because", [x or "-" for x in reasons]))
    return _table(rows)


def _ms(x: float | None) -> float | None:
    return None if x is None else 1000 * x


def _table(rows: list[tuple[str, list[str]]]) -> str:
    w0 = max(len(name) for name, _ in rows)
    widths = [max(len(vals[i]) for _, vals in rows) for i in range(len(rows[0][1]))]
    return "\n".join(
        name.ljust(w0) + "  " + "  ".join(v.rjust(w) for v, w in zip(vals, widths, strict=True))
        for name, vals in rows
    )


def _per_bucket(run: SimRun) -> str:
    s = run.summary()
    head = [
        "bucket", "requests", "done", "rejected", "P50", "P95", "P99",
        "wait mean", "exec mean", "batches", "mean batch", "waste",
    ]  # fmt: skip
    body = [
        [
            b["bucket"],
            str(b["requests"]),
            str(b["completed"]),
            str(b["rejected"]),
            _f(b["p50_ms"]),
            _f(b["p95_ms"]),
            _f(b["p99_ms"]),
            _f(b["queue_wait_mean_ms"]),
            _f(b["exec_mean_ms"]),
            str(b["batches"]),
            _f(b["mean_batch_size"]),
            _pct(b["padding_waste"]),
        ]
        for b in s["per_bucket"]
    ]
    cols = list(zip(head, *body, strict=True))
    widths = [max(len(c) for c in col) for col in cols]
    lines = [f"{run.strategy.value}, per bucket (latencies in ms):"]
    for row in [head, *body]:
        lines.append("  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)))
    return "\n".join(lines)


def _run_sweep(args: argparse.Namespace, ctx: _Context, strategies: list[Strategy]) -> int:
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
                f"{_f(p.summary['p95_ms']):>9}  {done:7.1%}  {verdict}"
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
        rows[1][1].append(_f(cap.throughput_rps if cap else None, ".2f"))
        rows[2][1].append(_f(sm.get("real_tokens_per_s"), ",.0f"))
        frac = cap.throughput_rps / o.throughput_rps if cap and o.throughput_rps else None
        rows[3][1].append(_pct(frac))
        rows[4][1].append(_f(sm.get("p95_ms")))
        rows[5][1].append(_f(sm.get("mean_batch_size")))
        rows[6][1].append(_pct(sm.get("padding_waste")))
        rows[7][1].append(fail)
    return "\n".join(lines) + "\n" + _table(rows)
