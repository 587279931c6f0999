"""`lenbatch bench`: every strategy and the peers on the same traffic, one report."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path
from typing import Any

from lenbatch.cli.common import add_cost_option, float_list, name_list
from lenbatch.cli.traffic import add_traffic_options, describe, driver_options, traffic_from_args


def register(sub: Any) -> None:
    """Add the `bench` subcommand."""
    p = sub.add_parser(
        "bench",
        help="replay the same traffic against each strategy and peer, write a report",
        description="For each strategy, start `lenbatch serve --strategy S` on a free "
        "loopback port, replay the traffic, read /stats and stop it; the same for each peer "
        "(naive FastAPI server, Ray Serve with @serve.batch). Writes DIR/report.md, PNG plots "
        "and DIR/runs/*.json.",
    )
    add_traffic_options(p)
    p.add_argument(
        "--strategies",
        type=name_list,
        default=["static", "fifo", "sorted", "bucketed"],
        metavar="S1,S2",
        help="lenbatch strategies to run (default static,fifo,sorted,bucketed)",
    )
    p.add_argument(
        "--peer",
        type=name_list,
        default=[],
        metavar="P1,P2",
        help="peers to run as well: naive, ray (Ray Serve @serve.batch), ray-lenbatch and "
        "ray-lenbatch-p2c (lenbatch replicas on Ray Serve, length-aware / Ray's default "
        "routing; the ray peers need `pip install 'lenbatch[ray]'`), infinity, infinity-bf16 "
        "(the same in bfloat16), vllm, "
        "vllm-allcores (vLLM with its model threads on every core), vllm-bf16 (the same in "
        "bfloat16), llamacpp (completions); infinity, vllm and llamacpp are installed on "
        "first use into .venv-peers/NAME (minutes, ~1-4 GB each)",
    )
    p.add_argument("--report", required=True, metavar="DIR", help="output folder")
    p.add_argument(
        "--rate-sweep",
        type=float_list,
        default=[1.0],
        metavar="X1,X2",
        help="run each target at these multiples of the traffic's rate (default 1)",
    )
    s = p.add_argument_group("the servers under test")
    s.add_argument("--max-batch", type=int, default=32, help="batch cap for all servers (32)")
    s.add_argument(
        "--max-wait-ms", type=float, default=10.0, help="batch wait for all servers (10 ms)"
    )
    s.add_argument(
        "--keep-server",
        action="store_true",
        help="start each server once and replay every rate of the sweep against it, in the "
        "order given (default: a fresh server per run). Saves start-up time: vLLM takes about a "
        "minute to start",
    )
    s.add_argument(
        "--serve-args",
        default="",
        metavar="'ARGS'",
        help="extra flags for every `lenbatch serve`, e.g. '--boundaries 32,64,128'",
    )
    add_cost_option(
        p,
        "add the simulator's prediction of each strategy's run beside the live figures, from this ",
    )
    p.add_argument(
        "--no-lock",
        action="store_true",
        help="do not take /tmp/lenbatch-bench.lock (by default a benchmark waits while another "
        "holds it: two on the same cores measure nothing)",
    )
    p.add_argument("--title", default=None, help="report title")
    p.add_argument("--conditions", default=None, help="a note on the conditions, in the report")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Hold the bench lock (unless `--no-lock`), then run the benchmark."""
    from lenbatch.replay.cpulock import exclusive_cpu

    with exclusive_cpu(not args.no_lock):
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    """Build the traffic once, run every target, write the report."""
    from lenbatch.replay.bench import BenchConfig, lengths_summary, run_bench
    from lenbatch.replay.targets import targets_for

    serve_args = shlex.split(args.serve_args)
    threads = None
    if args.cost:
        from lenbatch.cli.common import pin_cost_spec

        # `auto` names one file for the whole run, and the report names that file; it is
        # looked up under the thread count and dtype the servers run with, not this process's.
        threads, dtype = served_threads_and_dtype(serve_args, args.model)
        args.cost = pin_cost_spec(args.cost, threads=threads, dtype=dtype)
    targets = targets_for(
        args.strategies,
        args.peer,
        model=args.model,
        max_batch=args.max_batch,
        max_wait_ms=args.max_wait_ms,
        serve_args=serve_args,
    )
    traffic = traffic_from_args(args)
    predictor = None
    prediction_note = (
        "No cost model given (`--cost FILE`), so no simulator predictions in this report."
    )
    if args.cost:
        from lenbatch.cli.predict import make_predictor

        predictor, prediction_note = make_predictor(args, traffic, serve_args, threads=threads)
    oracles, oracle_note = None, None
    if args.cost:
        oracles, oracle_note = oracle_figures(args, traffic, serve_args)
    settings = describe(args)
    settings.update(
        {
            "strategies": ",".join(args.strategies),
            "peers": ",".join(args.peer) or "none",
            "max batch / max wait": f"{args.max_batch} / {args.max_wait_ms:g} ms (all servers)",
            "extra serve flags": args.serve_args or "none",
            "servers": "started once per target for the whole sweep"
            if args.keep_server
            else "a fresh server for every run",
            "traffic": lengths_summary(traffic.plan.lengths),
        }
    )
    meta = {
        "title": args.title or "lenbatch replay benchmark",
        "command": "lenbatch " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
        "trace_notes": list(traffic.plan.notes),
        "settings": settings,
        "conditions": args.conditions,
        "prediction_note": prediction_note,
        "oracle": oracles,
        "oracle_note": oracle_note,
    }
    cfg = BenchConfig(
        plan=traffic.plan,
        endpoint=traffic.endpoint,
        targets=targets,
        report_dir=Path(args.report),
        rates=args.rate_sweep,
        boundaries=_bucketed_boundaries(serve_args, traffic.max_length, args.model),
        max_length=traffic.max_length,
        warmup=traffic.warmup,
        predictor=predictor,
        meta=meta,
        model=args.model,
        max_batch=args.max_batch,
        keep_server=args.keep_server,
        rate_plans=traffic.rate_plans(len(args.rate_sweep), args.seed),
        **driver_options(args),
    )
    path = run_bench(cfg, log=lambda m: print(m, file=sys.stderr))
    if args.cost and args.strategies:
        _append_calibration(path, args.cost)
    print(path)
    return 0


def oracle_figures(
    args: argparse.Namespace, traffic: Any, serve_args: list[str]
) -> tuple[dict[str, dict[str, float]], str]:
    """The offline sorted-batch oracle (`plan.oracle`) on the bench's very requests, with the
    given cost model: for each strategy with the batching its server gets, and for the peers
    with a plain `lenbatch serve --max-batch N` (the same caps). Returns
    ({name: {real_tokens_per_s, throughput_rps, padding_waste}}, note)."""
    from lenbatch.cli.common import load_cost_model
    from lenbatch.cli.predict import batching_for
    from lenbatch.plan.oracle import oracle_for
    from lenbatch.replay.bodies import model_max_length

    cost = load_cost_model(args.cost, warn=False)
    limit = model_max_length(args.model) or 512
    out: dict[str, dict[str, float]] = {}
    names = [*args.strategies, *(["peers"] if args.peer else [])]
    for name in names:
        if name == "peers":
            batching = batching_for("fifo", args.max_batch, args.max_wait_ms, [])
        else:
            batching = batching_for(name, args.max_batch, args.max_wait_ms, serve_args)
        orc = oracle_for(traffic.plan.lengths, cost, batching, max_length=limit, truncate=True)
        figures = {
            "real_tokens_per_s": orc.real_tokens_per_s,
            "throughput_rps": orc.throughput_rps,
            "padding_waste": orc.padding_waste,
        }
        for target in args.peer if name == "peers" else [name]:
            out[target] = figures
    note = (
        f"Oracle: every request of this run known up front, sorted by length and cut into the "
        f"fastest batches under the server's caps, timed by the cost model "
        f"{Path(args.cost).name} ({cost.model or 'model not named'}); peers are held to the "
        f"oracle of `lenbatch serve --max-batch {args.max_batch}`. It is a bound for "
        "lenbatch's runner on this cost model; a peer with faster kernels can exceed it."
    )
    return out, note


def _append_calibration(report: Path, cost_path: str) -> None:
    """Add `lenbatch calibrate`'s table to the report and write DIR/calibrated_cost.json."""
    from lenbatch.cli.calibrate import calibrate_report
    from lenbatch.cli.common import load_cost_model

    try:
        cal = calibrate_report(report.parent, load_cost_model(cost_path, warn=False))
    except ValueError as exc:  # e.g. every run failed: the report stands without it
        print(f"bench: no calibration: {exc}", file=sys.stderr)
        return
    cal.cost.save(report.parent / "calibrated_cost.json")
    with report.open("a", encoding="utf-8") as f:
        f.write(
            "\n## Calibrated prediction\n\n"
            "What a live server adds to the cost model, measured on one light run (the CPU "
            "per request over that server's runs at every rate), then every run predicted "
            "again with it (`lenbatch calibrate`; the calibrated cost model is "
            "`calibrated_cost.json`, usable by `simulate`, `sweep` and `tune`).\n\n" + cal.markdown
        )


def served_threads_and_dtype(serve_args: list[str], model: str) -> tuple[int | None, str | None]:
    """The torch thread count (None: torch's default, the same as this process's) and the
    dtype name the bench's `lenbatch serve --model MODEL SERVE_ARGS` runs with, from the same
    settings merge `serve` does (`--config`, `LENBATCH_*` variables, flags, the automatic
    batch layout of an encoder served alone). (None, None)
    when the serve arguments do not parse: `serve` itself will say why."""
    from lenbatch.cli.main import build_parser
    from lenbatch.cli.serve import settings_from_args
    from lenbatch.runners.hardware import resolve_precision
    from lenbatch.serving.workers import usable_cores

    try:
        ns = build_parser().parse_args(["serve", "--model", model, *serve_args])
        m = settings_from_args(ns).with_cpu_layout(usable_cores()).model
        return m.torch_threads, resolve_precision(m.dtype, m.device).name
    except (SystemExit, ValueError):
        return None, None


def _bucketed_boundaries(
    serve_args: list[str], max_length: int | None, model: str
) -> tuple[int, ...] | None:
    """The buckets every run's per-bucket latencies are reported in: `--boundaries` from
    --serve-args if given, else the model's default (what `bucketed` serves with)."""
    if "--boundaries" in serve_args:
        i = serve_args.index("--boundaries")
        return tuple(int(x) for x in serve_args[i + 1].split(","))
    from lenbatch.core.buckets import default_boundaries
    from lenbatch.replay.bodies import model_max_length

    limit = model_max_length(model)
    if limit is None:
        return None
    return default_boundaries(limit if max_length is None else min(max_length, limit))
