#!/usr/bin/env python3
"""How well `adaptive` predicts a burst's queue drain, replayed from a server's own batch log.

    bench/run.py bursts-drain
    python bench/bursts_drain.py --profile P.json LOG [LOG ...] [--runs RUN.json ...]

Each LOG is the batch lines of `lenbatch serve --log-level debug` (`batch lane=… size=…
width=… real=… exec_ms=…`: lengths and timings only) from a `bursts` scenario run. The batches
are fed, in order, to the online cost model (`core.costfit.OnlineCostModel`, seeded with the
profile the server started on) and to the queue drift (the measured / predicted moving
average admission scales the queued work by, `AdaptiveState.queue_drift`). A burst is a run
of full batches; two batches into it (when admission decides on the burst's calls), the
predicted time of the burst's remaining batches, queue drift x fit, is divided by the time
they took. Above 1 admission over-estimates the queue and refuses calls the server then had
time for; below 1 it admits calls that end late (and are shed at the head of the queue).

Variants: the queue drift from all batches or from full ones only (at least `--full-rows`),
the profile weighing 4 or 32 batches in the fit, and the fit alone (no drift). The replay
leaves out the request-side CPU slowdown the live server divides batch times by (the log has
no CPU readings), so its figures are the model's, not the server's, decisions.

`--runs` also tabulates per 5-second window (one burst each) the calls answered within 1 s,
refused or shed, and answered late, from `lenbatch bench` run records (runs/*.json).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from lenbatch.core.adaptive_learning import _DRIFT_MAX, _QUEUE_DRIFT_ALPHA
from lenbatch.core.costfit import CostCoefficients, OnlineCostModel

BATCH = re.compile(r"size=(\d+) width=(\d+) real=(\d+) packed=\w+ exec_ms=([\d.]+)")


def read_batches(path: Path) -> list[tuple[int, int, float]]:
    """(rows, longest length, seconds) of every batch line, in order."""
    out = []
    for line in path.read_text().splitlines():
        m = BATCH.search(line)
        if m:
            out.append((int(m[1]), int(m[2]), float(m[4]) / 1000))
    return out


def find_bursts(batches: list[tuple[int, int, float]], full: int) -> list[tuple[int, int]]:
    """(first, end) indices of runs of at least five batches that start with a full one and
    go on while batches hold at least half a full batch."""
    bursts, i = [], 0
    while i < len(batches):
        if batches[i][0] >= full:
            j = i
            while j < len(batches) and (batches[j][0] >= full // 2 or j - i < 3):
                j += 1
            if j - i >= 5:
                bursts.append((i, j))
            i = j
        else:
            i += 1
    return bursts


def replay(
    batches: list[tuple[int, int, float]],
    prior: CostCoefficients,
    weight: float,
    drift_from: int | None,
    full: int,
) -> list[float]:
    """Predicted / taken time of each burst's remaining batches, two batches into it.
    `drift_from`: the fewest rows a batch needs to move the queue drift (None: no drift)."""
    model = OnlineCostModel(prior, 256, prior_weight=weight)
    log_drift = 0.0
    bursts = find_bursts(batches, full)
    decide = {first + 2: end for first, end in bursts}
    ratios = []
    for i, (rows, length, seconds) in enumerate(batches):
        co = model.coefficients
        if i in decide:
            rest = batches[i : decide[i]]
            predicted = math.exp(log_drift) * sum(co.seconds(b, n) for b, n, _ in rest)
            ratios.append(predicted / sum(s for *_, s in rest))
        if drift_from is not None and rows >= drift_from:
            ratio = min(_DRIFT_MAX, max(1 / _DRIFT_MAX, seconds / co.seconds(rows, length)))
            log_drift += _QUEUE_DRIFT_ALPHA * (math.log(ratio) - log_drift)
        model.observe(rows, length, seconds)
    return ratios


def per_window(run: Path, slo_s: float = 1.0, window_s: float = 5.0) -> list[str]:
    """`in-time/refused/late` per `window_s` of a `lenbatch bench` run record."""
    result = json.loads(run.read_text())["result"]
    cells = []
    start = 0.0
    sched = result["scheduled"]
    while start < max(sched):
        idx = [i for i, t in enumerate(sched) if start <= t < start + window_s]
        ok = [i for i in idx if result["status"][i] == 200]
        late = sum(1 for i in ok if result["done"][i] - sched[i] > slo_s)
        cells.append(f"{len(ok) - late}/{len(idx) - len(ok)}/{late}")
        start += window_s
    return cells


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("logs", nargs="+", type=Path, help="batch lines of serve --log-level debug")
    ap.add_argument("--profile", type=Path, required=True, help="the profile the server used")
    ap.add_argument("--full-rows", type=int, default=16, help="rows of a full batch's half")
    ap.add_argument("--runs", nargs="*", type=Path, default=[], help="bench run records")
    args = ap.parse_args()
    prior = CostCoefficients.from_profile(json.loads(args.profile.read_text()))
    full = 2 * args.full_rows
    variants = [
        ("drift from all batches, profile x4 (before)", 4.0, 1),
        ("drift from full batches, profile x4", 4.0, args.full_rows),
        ("drift from full batches, profile x32 (now)", 32.0, args.full_rows),
        ("fit alone, profile x4", 4.0, None),
        ("fit alone, profile x32", 32.0, None),
    ]
    print("Predicted / taken time of a burst's queue, two batches into it (1 = exact):\n")
    print("| log | variant | first burst | median over bursts | range | bursts |")
    print("|---|---|---|---|---|---|")
    for log in args.logs:
        batches = read_batches(log)
        for name, weight, drift_from in variants:
            r = replay(batches, prior, weight, drift_from, full)
            if not r:
                print(f"| {log.name} | {name} | – | – | – | 0 |")
                continue
            print(
                f"| {log.name} | {name} | {r[0]:.2f} | {statistics.median(r):.2f} | "
                f"{min(r):.2f}-{max(r):.2f} | {len(r)} |"
            )
    if args.runs:
        print("\nCalls per 5 s window (one burst each): in time / refused or shed / late:\n")
        for run in args.runs:
            print(f"- {run.parent.parent.name}/{run.name}: " + " · ".join(per_window(run)))


if __name__ == "__main__":
    main()
