"""Simulated scenarios: `adaptive` against fifo, bucketed (defaults), the best fixed bucketed
config a grid search finds for each scenario, and a naive one-request-per-call server.

Simulated time does not depend on the CPU the script runs on: the cost model does (it was
profiled on the machine named in its file). Writes a Markdown report.

    bench/run.py adaptive-sim -- --cost bench/results/cost_minilm_cpu.json \
        --rate 30 --duration 120 --slo-ms 1000 --out bench/results/adaptive_sim.md
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from lenbatch.config import AdaptiveConfig, BatchingConfig, Strategy
from lenbatch.plan.costmodel import CostModel
from lenbatch.plan.fitting import fit_boundaries
from lenbatch.plan.sim import SimRun, simulate
from lenbatch.plan.summary import OUTCOME_OK
from lenbatch.plan.trace import Trace, map_trace
from lenbatch.replay.bodies import TextBuilder, load_tokenizer
from lenbatch.replay.scenarios import build_scenario, pools_from_builder

MAX_LENGTH = 256
WAITS_MS = (0.0, 5.0, 10.0, 25.0, 50.0, 100.0)
BATCHES = (8, 16, 32)


@dataclass
class Row:
    """One strategy's simulated run on one scenario."""

    name: str
    run: SimRun
    seconds: float  # wall time of the simulation


def goodput(run: SimRun, slo: float, duration: float) -> tuple[float, float]:
    """Requests/s answered OK within `slo`, and the share of all requests that were."""
    ok = (run.outcomes == OUTCOME_OK) & (run.latencies <= slo)
    return float(ok.sum()) / duration, float(ok.mean()) if len(ok) else math.nan


def p(run: SimRun, q: float, sel: Any = None) -> float | None:
    """Percentile (ms) of OK latencies, optionally of a selection of requests."""
    ok = run.outcomes == OUTCOME_OK
    if sel is not None:
        ok = ok & sel
    lat = run.latencies[ok]
    return float(np.percentile(lat, q, method="inverted_cdf") * 1000) if len(lat) else None


def batch_hist(run: SimRun) -> str:
    """Batch sizes of OK requests' batches, bucketed 1, 2-3, 4-7, 8-15, 16+ (share of batches)."""
    # one size per batch: members share their batch's start + exec, count them
    ok = ~np.isnan(run.execs)
    keys = np.round(run.waits[ok] + run.arrivals[ok], 9) * 1e3 + run.lanes[ok]
    _, sizes = np.unique(keys, return_counts=True)
    edges = [(1, 1), (2, 3), (4, 7), (8, 15), (16, 10**9)]
    shares = [np.mean((sizes >= lo) & (sizes <= hi)) for lo, hi in edges]
    return " / ".join(f"{100 * s:.0f}" for s in shares)


def phases(name: str, trace: Trace, duration: float) -> list[tuple[str, Any]]:
    """Named request selections per phase of a scenario (for P99 per phase)."""
    t = np.asarray(trace.arrivals)
    if name == "swing":
        third = duration / 3
        return [
            ("low 1", t < third),
            ("high", (t >= third) & (t < 2 * third)),
            ("low 2", t >= 2 * third),
        ]
    if name == "onoff":
        on = (t % 5.0) < 1.5
        return [("on", on), ("off", ~on)]
    if name == "drift":
        return [("short half", t < duration / 2), ("long half", t >= duration / 2)]
    return []


def fixed_grid(trace: Trace, cost: CostModel, rate: float) -> list[tuple[str, BatchingConfig]]:
    """The bucketed configs the offline search tries: default and fitted boundaries x one
    max wait x one max batch for all buckets."""
    lengths = np.minimum(trace.input_lengths, MAX_LENGTH)
    fitted = fit_boundaries(lengths, "optimal", "auto", MAX_LENGTH, rate=rate, cost=cost)
    bounds: list[tuple[str, tuple[int, ...] | None]] = [("default", None)]
    if fitted.boundaries:
        bounds.append((f"optimal {list(fitted.boundaries)}", tuple(fitted.boundaries)))
    out = []
    for (bname, b), w, mb in itertools.product(bounds, WAITS_MS, BATCHES):
        cfg = BatchingConfig(strategy=Strategy.BUCKETED, boundaries=b, max_wait_ms=w, max_batch=mb)
        out.append((f"{bname}, wait {w:g} ms, batch {mb}", cfg))
    return out


def run_scenario(
    name: str,
    trace: Trace,
    cost: CostModel,
    duration: float,
    slo: float,
    rate: float,
    log: Callable[[str], None],
) -> tuple[list[Row], str]:
    """Every contender on one scenario; returns the rows and the best fixed config's name."""
    ad = AdaptiveConfig(slo_ms=slo * 1000)

    def sim(cfg: BatchingConfig, **kw: Any) -> tuple[SimRun, float]:
        t0 = time.perf_counter()
        r = simulate(trace, cost, cfg, max_length=MAX_LENGTH, adaptive=ad, **kw)
        return r, time.perf_counter() - t0

    rows = []
    for label, cfg, kw in [
        ("naive (1 per call)", BatchingConfig(strategy=Strategy.FIFO, max_batch=1), {}),
        ("fifo", BatchingConfig(strategy=Strategy.FIFO), {}),
        ("bucketed (defaults)", BatchingConfig(), {}),
        ("adaptive", BatchingConfig(strategy=Strategy.ADAPTIVE), {}),
        (
            "adaptive, no profile",
            BatchingConfig(strategy=Strategy.ADAPTIVE),
            {"adaptive_prior": False},
        ),
    ]:
        r, secs = sim(cfg, **kw)
        rows.append(Row(label, r, secs))
    best: tuple[float, str, SimRun, float] | None = None
    for label, cfg in fixed_grid(trace, cost, rate):
        r, secs = sim(cfg)
        g = goodput(r, slo, duration)[0]
        if best is None or g > best[0]:
            best = (g, label, r, secs)
    assert best is not None
    rows.insert(3, Row("bucketed (best fixed)", best[2], best[3]))
    log(f"  {name}: best fixed bucketed = {best[1]}")
    return rows, best[1]


def table(name: str, rows: list[Row], trace: Trace, duration: float, slo: float) -> str:
    """One scenario's Markdown table."""
    ph = phases(name, trace, duration)
    head = [
        "strategy",
        "goodput req/s",
        "within SLO",
        "vs best fixed",
        "shed/rejected",
        "P95 ms",
        "P99 ms",
        *[f"P99 {n} ms" for n, _ in ph],
        "waste",
        "mean batch",
        "batch sizes 1/2-3/4-7/8-15/16+ %",
    ]
    ref = next(goodput(r.run, slo, duration)[0] for r in rows if r.name.endswith("best fixed)"))
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        g, share = goodput(r.run, slo, duration)
        rej = float(np.mean(r.run.outcomes != OUTCOME_OK))
        cells = [
            r.name,
            f"{g:.2f}",
            f"{100 * share:.1f} %",
            f"{g / ref:.2f}x" if ref else "-",
            f"{100 * rej:.1f} %",
            _ms(p(r.run, 95)),
            _ms(p(r.run, 99)),
            *[_ms(p(r.run, 99, sel)) for _, sel in ph],
            f"{100 * (r.run.padding_waste or 0):.1f} %",
            f"{r.run.mean_batch_size or 0:.2f}",
            batch_hist(r.run),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.0f}"


def attainment(
    trace: Trace, cost: CostModel, slo: float, scales: list[float]
) -> list[tuple[str, float | None]]:
    """Per strategy: the highest offered rate (req/s) with >= 99 % answered within the SLO."""
    ad = AdaptiveConfig(slo_ms=slo * 1000)
    out = []
    contenders = [
        ("fifo", BatchingConfig(strategy=Strategy.FIFO)),
        ("bucketed (defaults)", BatchingConfig()),
        ("adaptive", BatchingConfig(strategy=Strategy.ADAPTIVE)),
    ]
    dur = float(trace.arrivals[-1]) if trace.arrivals is not None and len(trace) else 1.0
    for label, cfg in contenders:
        best = None
        for s in scales:
            t = map_trace(trace, rate_scale=s)
            r = simulate(t, cost, cfg, max_length=MAX_LENGTH, adaptive=ad)
            if goodput(r, slo, dur / s)[1] >= 0.99:
                best = len(t) / (dur / s)
        out.append((label, best))
    return out


def main() -> int:
    """Run the scenarios and write the report."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cost", default="bench/results/cost_minilm_cpu.json")
    ap.add_argument("--rate", type=float, default=30.0, help="reference rate (capacity), req/s")
    ap.add_argument("--duration", type=float, default=120.0)
    ap.add_argument("--slo-ms", type=float, default=1000.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--scenarios", default="mixed,swing,onoff,drift,bimodal,bursts", help="comma list"
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cost = CostModel.load(args.cost)
    slo = args.slo_ms / 1000
    pools = pools_from_builder(TextBuilder(load_tokenizer("minilm")))
    log = print if args.out else (lambda m: print(m, file=sys.stderr))
    parts = [
        "# adaptive vs fixed batching, simulated",
        "",
        f"Command: `.venv/bin/python bench/adaptive_sim.py {' '.join(sys.argv[1:])}`",
        "",
        f"Cost model `{args.cost}` ({cost.model}, {cost.device}; const "
        f"{cost.const * 1000:.1f} ms, {cost.per_token * 1e6:.0f} us per padded token). "
        f"SLO {args.slo_ms:g} ms arrival-to-answer; goodput = requests answered OK within "
        f"it per second of trace. Reference rate {args.rate:g} req/s, {args.duration:g} s per "
        f"scenario, seed {args.seed}, lengths from the bundled real text (MiniLM tokenizer), "
        f"clipped at {MAX_LENGTH}. `best fixed` = the bucketed config with the highest goodput "
        f"on that very scenario among {len(WAITS_MS) * len(BATCHES) * 2} (default and "
        f"`optimal`-fitted boundaries x max wait {list(WAITS_MS)} ms x max batch "
        f"{list(BATCHES)}): an offline search with hindsight. `adaptive` runs with its "
        f"defaults and the SLO, seeded from the cost file; `no profile`: from the generic "
        f"prior, learning the cost online. The naive server is fifo with max batch 1.",
        "",
    ]
    for name in [s.strip() for s in args.scenarios.split(",") if s.strip()]:
        raw = build_scenario(name, pools, rate=args.rate, duration_s=args.duration, seed=args.seed)
        trace = map_trace(raw, max_length=MAX_LENGTH)
        rows, _ = run_scenario(name, trace, cost, args.duration, slo, args.rate, log)
        parts += [f"## {name}", "", f"{raw.notes[0]}; {len(trace)} requests.", ""]
        parts += [table(name, rows, trace, args.duration, slo), ""]
        ad = next(r for r in rows if r.name == "adaptive").run.adaptive or {}
        merges = sum(m["n"] for m in ad.get("merges", []))
        parts += [
            f"adaptive: {merges} requests merged into longer lanes' batches, shed "
            f"{ad.get('shed')}, cost model after the run: a = "
            f"{ad.get('cost_model', {}).get('a_s', 0) * 1000:.1f} ms.",
            "",
        ]
        log(f"{name} done")
    base = map_trace(
        build_scenario("mixed", pools, rate=args.rate, duration_s=args.duration, seed=args.seed),
        max_length=MAX_LENGTH,
    )
    scales = [0.2, 0.4, 0.6, 0.8, 1.0, 1.2, 1.4, 1.7, 2.0]
    att = attainment(base, cost, slo, scales)
    parts += [
        "## SLO attainment vs offered load (mixed, Poisson)",
        "",
        f"Highest offered rate among x{scales} of {args.rate:g} req/s with >= 99 % of requests "
        "answered within the SLO:",
        "",
        "| strategy | req/s |",
        "|---|---|",
        *[f"| {n} | {'-' if v is None else f'{v:.1f}'} |" for n, v in att],
        "",
    ]
    text = "\n".join(parts)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as fh:
            fh.write(text + "\n")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
