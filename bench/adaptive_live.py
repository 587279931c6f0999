"""Summarise `lenbatch bench` reports of the adaptive runs: goodput within an SLO, P95/P99, waste,
batch sizes, and the simulator's prediction of each run's P95 beside the live one.

    .venv/bin/python bench/adaptive_live.py --slo-ms 1000 \
        --cost bench/results/cost_minilm_cpu.json SCENARIO:RATE:DURATION:DIR [...]

DIR is a `lenbatch bench --report DIR` folder; every `runs/*.json` in it is one row. The
prediction re-builds the scenario (same seed) and simulates the run's strategy with the serve
settings of `bench/adaptive_live.sh` (read from the run name).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from lenbatch.config import AdaptiveConfig, BatchingConfig, Strategy
from lenbatch.plan.costmodel import CostModel
from lenbatch.plan.sim import simulate
from lenbatch.plan.summary import OUTCOME_OK
from lenbatch.plan.trace import map_trace
from lenbatch.replay.bodies import TextBuilder, load_tokenizer
from lenbatch.replay.results import ReplayResult
from lenbatch.replay.scenarios import build_scenario, pools_from_builder

# The serve settings each run name stands for (bench/adaptive_live.sh).
BEST_FIXED = {
    "onoff": {"max_wait_ms": 5.0, "max_batch": 16},
    "drift": {"max_wait_ms": 0.0, "max_batch": 8},
    "mixed": {"max_wait_ms": 0.0, "max_batch": 8},
}


def _batching(name: str, scenario: str) -> BatchingConfig | None:
    if name == "fifo":
        return BatchingConfig(strategy=Strategy.FIFO)
    if name == "bucketed":
        return BatchingConfig()
    if name == "adaptive":
        return BatchingConfig(strategy=Strategy.ADAPTIVE)
    if name == "naive":
        return BatchingConfig(strategy=Strategy.FIFO, max_batch=1)
    if name == "best fixed":
        return BatchingConfig(**BEST_FIXED[scenario])  # type: ignore[arg-type]
    return None


def _pct(x: Any, q: float) -> float | None:
    v = np.asarray(x, dtype=np.float64)
    v = v[~np.isnan(v)]
    return float(np.percentile(v, q, method="inverted_cdf") * 1000) if len(v) else None


def _f(x: float | None, fmt: str = ".0f") -> str:
    return "-" if x is None else format(x, fmt)


def main() -> int:
    """Print one Markdown table per scenario."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--slo-ms", type=float, default=1000.0)
    ap.add_argument("--cost", default="bench/results/cost_minilm_cpu.json")
    ap.add_argument("runs", nargs="+", metavar="SCENARIO:RATE:DURATION:DIR")
    args = ap.parse_args()
    slo = args.slo_ms / 1000
    cost = CostModel.load(args.cost)
    pools = pools_from_builder(TextBuilder(load_tokenizer("minilm")))
    out = []
    for spec in args.runs:
        scenario, rate, duration, folder = spec.split(":", 3)
        raw = build_scenario(scenario, pools, rate=float(rate), duration_s=float(duration))
        trace = map_trace(raw, max_length=256)
        out += [f"### {scenario} (live, {rate} req/s reference, {duration} s)", ""]
        head = (
            "| run | goodput req/s | within SLO | vs bucketed | not OK | P95 ms | P99 ms | "
            "predicted P95 ms | waste | mean batch |"
        )
        out += [head, "|---|---|---|---|---|---|---|---|---|---|"]
        rows = []
        for path in sorted(Path(folder, "runs").glob("*.json")):
            res = ReplayResult.from_json(json.loads(path.read_text(encoding="utf-8"))["result"])
            lat = res.latencies
            ok = (res.outcomes == OUTCOME_OK) & (lat <= slo)
            good = float(ok.sum()) / float(duration)
            stats = res.stats_after or {}
            name = "best fixed" if folder.rstrip("/").endswith("-best") else path.stem
            cfg = _batching(name, scenario)
            pred = None
            if cfg is not None:
                run = simulate(
                    trace, cost, cfg, max_length=256, adaptive=AdaptiveConfig(slo_ms=args.slo_ms)
                )
                sim_ok = run.outcomes == OUTCOME_OK
                pred = _pct(run.latencies[sim_ok], 95)
            rows.append(
                (
                    name,
                    good,
                    float(ok.mean()),
                    float(np.mean(res.outcomes != OUTCOME_OK)),
                    _pct(lat, 95),
                    _pct(lat, 99),
                    pred,
                    stats.get("padding_waste"),
                    stats.get("mean_batch_size"),
                )
            )
        ref = next((r[1] for r in rows if r[0] == "bucketed"), None)
        for name, good, share, bad, p95, p99, pred, waste, mb in rows:
            ratio = f"{good / ref:.2f}x" if ref else "-"
            out.append(
                f"| {name} | {good:.2f} | {100 * share:.1f} % | {ratio} | {100 * bad:.1f} % | "
                f"{_f(p95)} | {_f(p99)} | {_f(pred)} | "
                f"{'-' if waste is None else f'{100 * waste:.1f} %'} | "
                f"{'-' if mb is None else f'{mb:.2f}'} |"
            )
        out.append("")
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
