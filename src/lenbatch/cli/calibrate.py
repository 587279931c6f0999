"""`lenbatch calibrate REPORT_DIR --cost FILE`: measure what a live server adds to the cost
model (from one run of a `lenbatch bench` report), check the calibrated prediction against every
lenbatch run of that report, and write the calibrated cost model.

`lenbatch bench --cost` does the same at the end of its report when it ran more than one rate.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lenbatch.cli.common import load_cost_model
from lenbatch.plan.calibration import (
    ServingOverhead,
    calibrated,
    measure_overhead,
    spread_p10_p90,
    spread_source,
)
from lenbatch.plan.costmodel import CostModel

__all__ = ["Calibration", "calibrate_report", "register", "run"]


def register(sub: Any) -> None:
    """Add the `calibrate` subcommand."""
    p = sub.add_parser(
        "calibrate",
        help="measure a live server's overhead over the cost model from a bench report",
        description="Read a `lenbatch bench` report's runs/*.json; from one lenbatch run (by "
        "default `bucketed` at its lightest rate) measure how much longer the server's batches "
        "take than the cost model says for the same batch shapes (a scale and seconds per "
        "batch, fitted over that server's runs at every rate), the extra seconds per request "
        "(client median latency minus the server's own) and the CPU seconds each request costs "
        "outside the model (server event loop + load driver), which slow the model under "
        "load; simulate every lenbatch run with the given cost model and with these, and "
        "print predicted vs live. Run it from where the bench ran (the runs' --config paths "
        "are relative to it).",
    )
    p.add_argument("report", metavar="DIR", help="a `lenbatch bench --report` folder")
    p.add_argument("--cost", required=True, metavar="FILE", help="cost model JSON to calibrate")
    p.add_argument(
        "--from",
        dest="source",
        metavar="RUN",
        help="the run to measure, as its file name without .json, e.g. 'bucketed@x0.3' "
        "(default: bucketed at its lightest rate, else the lightest run)",
    )
    p.add_argument(
        "--server-only",
        action="store_true",
        help="leave the load driver's CPU out of the calibrated model (for predicting a "
        "server whose clients run on other machines; the table still includes it)",
    )
    p.add_argument("--out", metavar="FILE", help="write the calibrated cost model here")
    p.add_argument("--markdown", metavar="FILE", help="also write the table here")
    p.set_defaults(run=run)


@dataclass
class Calibration:
    """The measured overhead, the calibrated cost model and the predicted-vs-live table."""

    overhead: ServingOverhead
    cost: CostModel  # calibrated with everything measured (what the table used)
    markdown: str


def _load_runs(report_dir: Path) -> dict[str, dict[str, Any]]:
    runs = {}
    for path in sorted((report_dir / "runs").glob("*.json")):
        record = json.loads(path.read_text(encoding="utf-8"))
        if record.get("kind") == "strategy":
            runs[path.stem] = record
    if not runs:
        raise ValueError(f"{report_dir}/runs has no lenbatch strategy runs")
    return runs


def _served_threads(report_dir: Path, source: str | None) -> int | None:
    """The torch threads per batch of the server whose run is measured (`/stats` `workers`
    after the run), or None where the report or that figure is missing."""
    try:
        runs = _load_runs(report_dir)
    except (OSError, ValueError):
        return None
    record = runs.get(source or _default_source(runs))
    stats = (record or {}).get("result", {}).get("stats_after") or {}
    threads = (stats.get("workers") or {}).get("torch_threads")
    return int(threads) if isinstance(threads, int) and threads > 0 else None


def _default_source(runs: dict[str, dict[str, Any]]) -> str:
    bucketed = [k for k, r in runs.items() if r["name"] == "bucketed"]
    pool = bucketed or list(runs)
    return min(pool, key=lambda k: runs[k]["rate"])


def _predict(record: dict[str, Any], cost: CostModel) -> dict[str, Any]:
    """The simulator's summary for the traffic this run sent, with the server's settings."""
    from lenbatch.cli.predict import serve_settings
    from lenbatch.plan.sim import simulate
    from lenbatch.plan.trace import Trace
    from lenbatch.replay.bodies import model_max_length

    command = record["command"]
    settings = serve_settings(command[command.index("serve") + 1 :])
    limit = model_max_length(settings.model.name) or 512
    result = record["result"]
    trace = Trace(input_lengths=result["lengths"], arrivals=result["scheduled"], source="run")
    summary: dict[str, Any] = simulate(trace, cost, settings.batching, max_length=limit).summary()
    return summary


def _diff(pred: float | None, live: float | None) -> str:
    if pred is None or live is None or not live:
        return "–"
    return f"{100 * (pred - live) / live:+.0f} %"


def _given(cost: CostModel) -> str:
    if not cost.calibration:
        return "the model's compute alone"
    source = cost.calibration.split(":")[0]
    return (
        f"already calibrated: batches x{cost.batch_scale:.2f} "
        f"+{1000 * cost.batch_overhead_s:.1f} ms, "
        f"+{1000 * cost.request_overhead_s:.1f} ms per request, "
        f"{1000 * cost.cpu_per_request_s:.1f} ms CPU per request, from {source}"
    )


def _spread_text(overhead: ServingOverhead) -> str:
    """How much one batch's time varied around the fit, for the table's heading."""
    q = overhead.batch_spread
    if not q:
        return (
            f"no spread of batch times ({overhead.spread_requests} requests ran alone, "
            "30 needed, or the runs have no lengths): the simulator gives every batch its "
            "predicted time"
        )
    p10, p90 = spread_p10_p90(q)
    return (
        f"**a batch x{p10:.2f}-x{p90:.2f} its predicted time** (P10-P90 over "
        f"{spread_source(overhead)}; the simulator draws each batch's time from it)"
    )


def _num(value: float | None, digits: int = 1) -> str:
    return "–" if value is None else f"{value:,.{digits}f}"


def calibrate_report(
    report_dir: str | Path, cost: CostModel, source: str | None = None
) -> Calibration:
    """Measure the overhead in `source` (a run file's stem), re-simulate every lenbatch run of
    the report with the raw and the calibrated cost model, and tabulate against live."""
    runs = _load_runs(Path(report_dir))
    source = source or _default_source(runs)
    if source not in runs:
        raise ValueError(f"no lenbatch run {source!r} in {report_dir}; have {', '.join(runs)}")
    same_server = [r for r in runs.values() if r["name"] == runs[source]["name"]]
    overhead = measure_overhead(runs[source], cost, same_server, list(runs.values()))
    cal = calibrated(cost, overhead)
    cpu = overhead.cpu_per_request_s
    if cpu is None:
        cpu_text = "CPU per request not measured (this report predates it: run the bench again)"
    else:
        if overhead.cpu_runs > 1:
            how = (
                f"fitted over {overhead.cpu_runs} `{runs[source]['name']}` runs as idle CPU "
                f"({overhead.cpu_baseline_cores or 0:.3f} cores) x wall time + CPU per request "
                "x requests"
            )
        else:
            how = "this run's CPU time over its requests"
        cpu_text = (
            f"**{1000 * cpu:.1f} ms CPU per request** outside the model on "
            f"{overhead.cores} cores (server event loop {1000 * (overhead.loop_cpu_s or 0):.1f}"
            f" ms, load driver {1000 * (overhead.driver_cpu_s or 0):.1f} ms; {how}), which "
            "slows the model by cores / (cores - rate x CPU per request)"
        )
    lines = [
        f"Serving overhead measured on `{source}`: **batches x{overhead.batch_scale:.2f} the "
        f"model's time +{1000 * overhead.batch_s:.1f} ms** (the server's execution time per "
        "bucket against the cost model's for the same batch shapes, fitted over "
        f"{overhead.batches} batches of {overhead.batch_runs} `{runs[source]['name']}` "
        f"run(s)), **+{1000 * overhead.request_s:.1f} ms per request** "
        f"(client median latency minus the server's own, {overhead.requests} requests), "
        f"{cpu_text}, and {_spread_text(overhead)}. Each lenbatch run simulated with the given "
        f"cost model ({_given(cost)}) and with these overheads instead:",
        "",
        "| run | P50 ms given / calibrated / live | P50 diff given / cal. | "
        "P95 ms given / calibrated / live | P95 diff given / cal. | "
        "req/s calibrated / live | diff |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in sorted(runs, key=lambda k: (runs[k]["rate"], runs[k]["name"])):
        live = runs[name]["summary"]
        given, calib = _predict(runs[name], cost), _predict(runs[name], cal)
        mark = " (measured here)" if name == source else ""
        lines.append(
            f"| {name}{mark} | {_num(given['p50_ms'])} / {_num(calib['p50_ms'])} / "
            f"{_num(live['p50_ms'])} | {_diff(given['p50_ms'], live['p50_ms'])} / "
            f"{_diff(calib['p50_ms'], live['p50_ms'])} | {_num(given['p95_ms'])} / "
            f"{_num(calib['p95_ms'])} / {_num(live['p95_ms'])} | "
            f"{_diff(given['p95_ms'], live['p95_ms'])} / {_diff(calib['p95_ms'], live['p95_ms'])}"
            f" | {_num(calib['throughput_rps'], 2)} / {_num(live['throughput_rps'], 2)} | "
            f"{_diff(calib['throughput_rps'], live['throughput_rps'])} |"
        )
    return Calibration(overhead, cal, "\n".join(lines) + "\n")


def run(args: argparse.Namespace) -> int:
    """Print the calibration table; write the calibrated cost model if asked."""
    # The cost file is checked against the processor with the torch threads the bench's
    # servers ran (their /stats say), not this process's: `make serve` runs one batch per
    # core on one thread each, and its self-calibrated model was measured so.
    cost = load_cost_model(args.cost, threads=_served_threads(Path(args.report), args.source))
    cal = calibrate_report(args.report, cost, args.source)
    print(cal.markdown, end="")
    if args.markdown:
        Path(args.markdown).write_text(cal.markdown, encoding="utf-8")
    if args.out:
        out = calibrated(cost, cal.overhead, with_driver=not args.server_only)
        out.save(args.out)
        print(f"wrote {args.out} ({out.calibration})")
    return 0
