"""The `adaptive-goodput` and `adaptive-sustained` recipes' work: capacity first, then every
strategy at fractions and multiples of it, live beside the simulator, with adaptive's decision
log (issue 24). `adaptive-sustained` replays a five times longer window at 2-4x capacity only,
so that its overload lasts 15-30 s instead of the 2-4 s of `adaptive-goodput`'s 3x.

1. **Capacity**: `bucketed` (as `make serve` configures it, 1 s SLO) replayed far past
   saturation on the dev trace window (`--length-scale 0.1 --max-length 256`); capacity is its
   completions per second (`throughput_rps`: completed / first arrival to last answer).
   Before it, the cost model of this processor as `make serve` runs it is found, or measured
   and cached by the self-calibration `serve` runs at first start (a `bucketed` server reads
   no cost model, so it would not).
2. **Rates**: the same window replayed at `0.2, 0.5, 0.8, 1.5, 3` x capacity (mean rates), each
   strategy on one server kept across the rates, `--repeats` times, with the simulator's
   prediction of each run (`--cost`: the self-calibrated model of this processor).
3. **Bursts**: the `bursts` scenario at a mean rate of `--bursts-load` x capacity, each repeat.
4. **Table** (`summary.md`): per rate and strategy, goodput (answers within 1 s per second of
   offered traffic; mean and range over repeats), the real tokens of those answers per second
   (adaptive's also over the capacity run's tokens/s: a server that refuses long calls first
   answers more requests than its capacity in requests, not more tokens), shed %, P95, the
   simulator's P95 and shed with the model measured at start-up and with the one `lenbatch
   bench` calibrated from the first repeat (`calibrated_cost.json`: the live server's
   overheads), adaptive's goodput over the best other target's and over capacity, and the
   decision log's worst burst (`/stats` `adaptive.decisions.worst_burst` of each adaptive
   server).

Nothing here is timed by itself: it runs `lenbatch bench` and reads what it wrote.
"""

from __future__ import annotations

import json
import shutil
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from steps import ROOT, lenbatch

__all__ = ["GoodputPlan", "goodput_table", "plan_from_args", "run_goodput", "write_table"]

TRACE = ("azure-conv", "--length-scale", "0.1", "--max-length", "256")
CONFIG = "configs/minilm-azure-conv.toml"
SLO_S = 1.0
# The capacity run is past saturation only when the server completes clearly less than it is
# offered; otherwise its completions/s are the offered rate, not the capacity (a faster CPU
# keeps up with a multiplier that saturated a slower one).
SATURATED = 0.9
CAPACITY_TRIES = 4


@dataclass(frozen=True)
class GoodputPlan:
    """What the recipe runs (from its flags)."""

    out: str
    start: str
    span: str
    loads: tuple[float, ...]
    strategies: str
    peers: str
    repeats: int
    overload: float  # the capacity run's rate multiplier of the trace
    bursts_load: float
    bursts_duration: str
    conditions: str

    def serve_args(self) -> str:
        """Every lenbatch server's flags: `make serve`'s."""
        return f"--config {CONFIG} --slo-ms {SLO_S * 1000:g} --cost auto"

    def bench(self, *args: str, report: str) -> Any:
        """A `lenbatch bench` command of this recipe."""
        return lenbatch("bench", *args, "--serve-args", self.serve_args(), "--no-progress",
                        "--conditions", self.conditions, "--report", report)  # fmt: skip

    def capacity_cmd(self) -> Any:
        """Step 1."""
        return self.bench(*TRACE, "--start", self.start, "--span", self.span,
                          "--rate-scale", f"{self.overload:g}", "--strategies", "bucketed",
                          report=f"{self.out}/capacity")  # fmt: skip

    def rates_cmd(self, sweep: str, cost: str, rep: int) -> Any:
        """Step 2, one repeat (`sweep`: trace-rate multipliers)."""
        peers = () if self.peers in ("", "none") else ("--peer", self.peers)
        return self.bench(*TRACE, "--start", self.start, "--span", self.span,
                          "--rate-sweep", sweep, "--keep-server",
                          "--strategies", self.strategies, *peers, "--cost", cost,
                          report=f"{self.out}/rates-{rep}")  # fmt: skip

    def bursts_cmd(self, rate: float, cost: str, rep: int) -> Any:
        """Step 3, one repeat."""
        return self.bench("--scenario", "bursts", "--rate", f"{rate:.2f}",
                          "--duration", self.bursts_duration, "--max-length", "256",
                          "--seed", str(rep), "--strategies", self.strategies, "--cost", cost,
                          report=f"{self.out}/bursts-{rep}")  # fmt: skip

    def describe(self) -> str:
        """What `--dry-run` prints: the commands, with what is only known after step 1."""
        lines = [
            self.capacity_cmd().describe(),
            "# capacity C = bucketed's throughput_rps above; r0 = the window's mean rate;",
            "# SWEEP = each load x C / r0; COST = this CPU's cost file (cached, committed, or "
            "self-calibrated before step 1)",
        ]
        for rep in range(1, self.repeats + 1):
            lines.append(self.rates_cmd("SWEEP", "COST", rep).describe())
            lines.append(self.bursts_cmd(0.0, "COST", rep).describe().replace("0.00", "RATE"))
        lines.append(f"# table: {self.out}/summary.md")
        return "\n".join(lines)


def plan_from_args(args: Any) -> GoodputPlan:
    """The plan the `adaptive-goodput` recipe's flags describe."""
    return GoodputPlan(
        out=args.out,
        start=args.start,
        span=args.span,
        loads=tuple(float(x) for x in args.loads.split(",")),
        strategies=args.strategies,
        peers=args.peers,
        repeats=int(args.repeats),
        overload=float(args.overload),
        bursts_load=float(args.bursts_load),
        bursts_duration=args.bursts_duration,
        conditions=args.conditions,
    )


def _runs(folder: Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text(encoding="utf-8")) for p in sorted(folder.glob("runs/*.json"))]


def _window_rate(plan: GoodputPlan) -> float:
    """Mean requests per second of the trace window at x1."""
    from lenbatch.plan.trace import load_trace, map_trace

    start, end = float(plan.start), float(plan.start) + float(plan.span)
    t = map_trace(load_trace("azure-conv"), length_scale=0.1, max_length=256, start_s=start,
                  end_s=end)  # fmt: skip
    return len(t) / float(plan.span)


def _cost_file(plan: GoodputPlan) -> str:
    """The cost model measured on this processor as `make serve` runs it (the config's torch
    threads, the dtype `auto` picks, its execution): the cached self-calibration or a
    matching committed file; where there is none, measured now, in this process, by the
    bounded self-calibration `serve --strategy adaptive` runs at first start (cached for the
    servers that follow). A `bucketed` server never calibrates: it reads no cost model."""
    import shlex

    from lenbatch.cli.main import build_parser
    from lenbatch.cli.serve import settings_from_args
    from lenbatch.plan.costsource import choose_auto
    from lenbatch.plan.selfcal import auto_cost, runner_key
    from lenbatch.runners import load_runner

    ns = build_parser().parse_args(["serve", *shlex.split(plan.serve_args())])
    settings = settings_from_args(ns)
    m = settings.model
    runner = load_runner(m.name, device=m.device, max_length=m.max_length,
                         torch_threads=m.torch_threads, dtype=m.dtype,
                         execution=m.execution)  # fmt: skip
    found = auto_cost(runner, m.device, max_tokens=settings.batching.max_batch_tokens)
    assert found is not None  # calibrate=True: measured when nothing matched
    print(f"cost model: {found[1]}")
    key, execution = runner_key(runner, m.device)
    path, _ = choose_auto(key.processor, dtype=key.dtype, execution=execution)
    return str(path)


def next_overload(overload: float, offered_rps: float, completed_rps: float) -> float | None:
    """The capacity run's next rate multiplier (twice this one), or None when this one was past
    saturation (completed below `SATURATED` of offered)."""
    return None if completed_rps < SATURATED * offered_rps else 2.0 * overload


def measure_capacity(
    plan: GoodputPlan, env: dict[str, str], r0: float
) -> tuple[float, list[dict[str, float]]]:
    """Step 1: `bucketed`'s completions/s at `plan.overload`, raised until the run is past
    saturation; (capacity, every try's multiplier, offered and completed req/s)."""
    out = ROOT / plan.out / "capacity"
    overload: float | None = plan.overload
    tries: list[dict[str, float]] = []
    while overload is not None and len(tries) < CAPACITY_TRIES:
        shutil.rmtree(out, ignore_errors=True)
        replace(plan, overload=overload).capacity_cmd().run(env)
        (cap_run,) = _runs(out)
        completed = float(cap_run["summary"]["throughput_rps"])
        tries.append({"overload": overload, "offered_rps": r0 * overload,
                      "completed_rps": completed})  # fmt: skip
        print(f"capacity run x{overload:g}: offered {r0 * overload:.1f} req/s, completed "
              f"{completed:.1f}")  # fmt: skip
        overload = next_overload(overload, r0 * overload, completed)
    if overload is not None:
        raise SystemExit(f"capacity: still keeping up after {len(tries)} runs (last x"
                         f"{tries[-1]['overload']:g}); start with a larger --overload")  # fmt: skip
    return tries[-1]["completed_rps"], tries


def run_goodput(plan: GoodputPlan, env: dict[str, str]) -> None:
    """Run the recipe's steps (see the module docstring) and write `summary.md`."""
    out = ROOT / plan.out
    cost = _cost_file(plan)
    r0 = _window_rate(plan)
    capacity, tries = measure_capacity(plan, env, r0)
    sweep = ",".join(f"{m * capacity / r0:.3f}" for m in plan.loads)
    n = r0 * float(plan.span)
    traffic_s = {f"{m:g}": n / (m * capacity) for m in plan.loads}
    meta = {"capacity_rps": capacity, "window_rps": r0, "loads": plan.loads, "sweep": sweep,
            "cost": cost, "start": plan.start, "span": plan.span, "capacity_runs": tries,
            "traffic_s": traffic_s}  # fmt: skip
    (out / "capacity.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    print(
        f"capacity {capacity:.1f} req/s (window {r0:.2f} req/s at x1): sweep x{sweep}; "
        "seconds of traffic per load: " + ", ".join(f"{k}x {v:.1f}" for k, v in traffic_s.items())
    )
    if traffic_s[f"{max(plan.loads):g}"] < 3 * SLO_S:
        print(
            f"warning: {max(plan.loads):g}x capacity lasts under {3 * SLO_S:g} s of traffic: "
            "the backlog stays within the SLO; a longer --span (the adaptive-sustained recipe) "
            "shows overload that lasts"
        )
    for rep in range(1, plan.repeats + 1):
        plan.rates_cmd(sweep, cost, rep).run(env)
        plan.bursts_cmd(plan.bursts_load * capacity, cost, rep).run(env)
    write_table(plan)


def write_table(
    plan: GoodputPlan, name: str = "summary.md", calibrated: str = "calibrated_cost.json"
) -> None:
    """Write (and print) the table of the runs in `plan.out` into its file `name`, the
    calibrated predictions with the cost model `calibrated` of the first repeat's folder."""
    out = ROOT / plan.out
    text = goodput_table(out, calibrated)
    (out / name).write_text(text + "\n", encoding="utf-8")
    print(text)


def _good(record: Mapping[str, Any]) -> tuple[float, float, int, float]:
    """Goodput (answers within the SLO per second of offered traffic), shed share, requests,
    and the real tokens of those answers per second of offered traffic."""
    from lenbatch.plan.summary import OUTCOME_OK
    from lenbatch.replay.results import ReplayResult

    res = ReplayResult.from_json(record["result"])
    s = record["summary"]
    n = int(s["requests"])
    offered = s.get("offered_rps") or n / max(s["duration_s"], 1e-9)
    wall = n / offered
    ok = (res.outcomes == OUTCOME_OK) & (res.latencies <= SLO_S)
    tokens = float(res.lengths[ok].sum()) / wall
    return float(ok.sum()) / wall, float(s["rejected"]) / max(n, 1), n, tokens


def _sim(record: Mapping[str, Any], cost_path: Path | Any, meta: Mapping[str, Any]) -> Any:
    """The simulator's run of `record`'s strategy and rate with the cost model at
    `cost_path` (or a `CostModel`; the dev-trace window, `make serve`'s config), or None for
    a peer."""
    from lenbatch.config import AdaptiveConfig, Strategy, load_settings
    from lenbatch.plan.costmodel import CostModel
    from lenbatch.plan.sim import simulate
    from lenbatch.plan.trace import load_trace, map_trace

    if record.get("kind") != "strategy":
        return None
    settings = load_settings(str(ROOT / CONFIG), {}, {})
    batching = settings.batching.model_copy(update={"strategy": Strategy(record["name"])})
    start, span = float(meta["start"]), float(meta["span"])
    t = map_trace(load_trace("azure-conv"), length_scale=0.1, max_length=256, start_s=start,
                  end_s=start + span, rate_scale=float(record["rate"]))  # fmt: skip
    cost = cost_path if isinstance(cost_path, CostModel) else CostModel.load(cost_path)
    return simulate(t, cost, batching, settings.admission, max_length=256,
                    adaptive=AdaptiveConfig(slo_ms=SLO_S * 1000))  # fmt: skip


def _online_cost(record: Mapping[str, Any] | None) -> Any:
    """The adaptive server's own cost model after `record`'s run (`/stats`: its online fit of
    the whole server's batch cost and the CPU per request it measured), or None."""
    from lenbatch.plan.costsource import cost_from_stats
    from lenbatch.replay.results import ReplayResult

    if record is None:
        return None
    stats = ReplayResult.from_json(record["result"]).stats_after or {}
    try:
        return cost_from_stats(stats, "the adaptive server")
    except (ValueError, KeyError, TypeError):
        return None


# Issue 24, item 4: simulate's P95 within 20 % of live at mean rates up to 0.8 of capacity,
# and its shed share within 2 points of live at every rate, for these strategies.
CHECKED = ("adaptive", "bucketed")
P95_TOLERANCE = 0.20
P95_MAX_LOAD = 0.8
SHED_TOLERANCE_PTS = 2.0


def prediction_check(
    rows: Sequence[tuple[float, str, float | None, float, str, float | None, float | None]],
) -> list[str]:
    """The item 4 table: one row per (load, target, cost model) of `rows` = (load, target,
    live P95 ms, live shed share, model name, predicted P95 ms, predicted shed share), with
    the P95 error, the shed difference and whether both hold; then one line per model."""
    lines = [
        f"Prediction check (issue 24 item 4: P95 within {P95_TOLERANCE:.0%} at loads <= "
        f"{P95_MAX_LOAD:g}x capacity, shed within ±{SHED_TOLERANCE_PTS:g} points at every "
        "load; live figures are means over the repeats):",
        "",
        "| load | target | cost model | live P95 ms | predicted P95 ms | P95 error | live shed % "
        "| predicted shed % | shed Δ pts | holds |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    tally: dict[str, list[int]] = {}
    for load, name, p95, shed, model, pp95, pshed in rows:
        ok = True
        err = None
        if p95 is not None and pp95 is not None and p95 > 0:
            err = (pp95 - p95) / p95
        if load <= P95_MAX_LOAD:
            ok = err is not None and abs(err) <= P95_TOLERANCE + 1e-9
        delta = None if pshed is None else 100 * (pshed - shed)
        ok = ok and delta is not None and abs(delta) <= SHED_TOLERANCE_PTS + 1e-9
        count = tally.setdefault(model, [0, 0])
        count[0] += ok
        count[1] += 1
        err_cell = _fmt(None if err is None else 100 * err, "+.0f", " %")
        if load > P95_MAX_LOAD and err is not None:
            err_cell += " (not checked)"
        lines.append(
            f"| {load:g}x | {name} | {model} | {_fmt(p95)} | {_fmt(pp95)} | {err_cell} | "
            f"{100 * shed:.1f} | {_fmt(None if pshed is None else 100 * pshed, '.1f')} | "
            f"{_fmt(delta, '+.1f')} | {'yes' if ok else '**no**'} |"
        )
    lines.append("")
    for model, (good, total) in tally.items():
        verdict = "holds" if good == total else "does not hold"
        lines.append(f"- {model}: {good} of {total} rows hold; item 4 {verdict} with it")
    return lines


def repeat_errors(
    rows: Sequence[tuple[float, str, str, Sequence[float], float | None]],
) -> list[str]:
    """The P95 error of each repeat, for the rows (load, target, cost model, the repeats' live
    P95s in ms, the predicted P95) the check above judges on the repeats' mean: one repeat on
    a slower host (the runner-speed table) moves that mean for all of them."""
    if not rows:
        return []
    lines = [
        "",
        "P95 error of each repeat (the check uses their mean):",
        "",
        "| load | target | cost model | P95 error per repeat |",
        "|---|---|---|---|",
    ]
    for load, name, model, p95s, pp95 in rows:
        errs = " / ".join(
            _fmt(None if pp95 is None or p <= 0 else 100 * (pp95 - p) / p, "+.0f", " %")
            for p in p95s
        )
        lines.append(f"| {load:g}x | {name} | {model} | {errs} |")
    return lines


def _sim_cells(run: Any) -> tuple[float | None, float | None]:
    from lenbatch.plan.summary import OUTCOME_OK, OUTCOME_REJECTED

    if run is None:
        return None, None
    lat = run.latencies[run.outcomes == OUTCOME_OK]
    p95 = float(np.percentile(lat, 95) * 1000) if len(lat) else None
    return p95, float(np.mean(run.outcomes == OUTCOME_REJECTED))


def runner_speed(record: Mapping[str, Any], slots: int) -> tuple[int, float, float] | None:
    """How fast the server's model calls ran during `record`'s run, from its `/stats` before
    and after: the batches run, the model seconds per 1,000 real tokens, and the share of its
    `slots` runner slots kept busy (model time over the run's duration); None for a run
    without both snapshots (a peer). The host's speed can change between two runs minutes
    apart (a Zen 3 under KVM: 12 % within one repeat); this says when it did."""
    from lenbatch.replay.results import ReplayResult
    from lenbatch.serving.metrics import bucket_totals, bucket_work

    res = ReplayResult.from_json(record["result"])
    before, after = res.stats_before, res.stats_after
    if not before or not after or "per_bucket" not in after:
        return None
    work = bucket_work(bucket_totals(before), bucket_totals(after)).values()
    exec_s = sum(w.exec_s for w in work)
    batches = int(sum(w.batches for w in work))
    tokens = float(after.get("real_tokens", 0)) - float(before.get("real_tokens", 0))
    wall = float(record["summary"]["duration_s"])
    if tokens <= 0 or wall <= 0:
        return None
    return batches, exec_s / tokens * 1e6, exec_s / (wall * max(1, slots))


def speed_lines(out: Path, loads: Mapping[float, float], slots: int) -> list[str]:
    """The runner-speed table of the runs below capacity in `out`'s `rates-*` folders: per
    load, repeat and target, goodput beside how fast and how busy the model calls ran."""
    rows = []
    for folder in sorted(out.glob("rates-*")):
        for rec in sorted(_runs(folder), key=lambda r: (float(r["rate"]), r["name"])):
            rate = min(loads, key=lambda x: abs(x - float(rec["rate"])))
            speed = runner_speed(rec, slots)
            if loads[rate] >= 1 or speed is None:
                continue
            batches, ms_per_k, busy = speed
            good = _good(rec)[0]
            done = int(rec["summary"].get("completed", 0))
            rows.append((loads[rate], folder.name, rec["name"], good, batches,
                         done / max(1, batches), ms_per_k, busy))  # fmt: skip
    if not rows:
        return []
    lines = [
        f"Runner speed per run below capacity (the server's `/stats` before and after each run; "
        f"model time per 1,000 real tokens, and busy = model time over the run's duration x "
        f"{slots} slots). The targets of a repeat run one after another, a minute or more "
        "apart: a slower host shows here as more model time per token, which larger batches "
        "should lower, not raise.",
        "",
        "| load | repeat | target | goodput req/s | batches | rows per batch | model ms per 1k "
        "real tokens | runner busy |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for load, rep, name, good, batches, rows_per, ms_per_k, busy in sorted(rows):
        lines.append(f"| {load:g}x | {rep} | {name} | {good:.1f} | {batches} | {rows_per:.2f} | "
                     f"{ms_per_k:.0f} | {busy:.2f} |")  # fmt: skip
    return lines


def _worst_burst(record: Mapping[str, Any]) -> dict[str, Any] | None:
    """The decision log's worst burst in the server's `/stats` after the run (adaptive)."""
    from lenbatch.replay.results import ReplayResult

    stats = ReplayResult.from_json(record["result"]).stats_after or {}
    decisions = (stats.get("adaptive") or {}).get("decisions") or {}
    burst = decisions.get("worst_burst")
    return burst if isinstance(burst, dict) else None


def _capacity_lines(meta: Mapping[str, Any]) -> list[str]:
    """The capacity runs tried and how long each load's traffic lasts (where recorded)."""
    lines = []
    if meta.get("capacity_runs"):
        runs = "; ".join(f"x{t['overload']:g}: offered {t['offered_rps']:.1f}, completed "
                         f"{t['completed_rps']:.1f}" for t in meta["capacity_runs"])  # fmt: skip
        lines.append(f"Capacity runs (req/s; past saturation once completed < {SATURATED:g} "
                     f"of offered): {runs}.")  # fmt: skip
    if meta.get("traffic_s"):
        lines.append("Seconds of traffic per load: " + ", ".join(
            f"{k}x {v:.1f} s" for k, v in meta["traffic_s"].items()) + ".")  # fmt: skip
    return ["", *lines] if lines else []


def _slots() -> int:
    """The batches `make serve`'s config runs at once (its runner slots)."""
    from lenbatch.config import load_settings

    return int(load_settings(str(ROOT / CONFIG), {}, {}).batching.max_concurrent_batches)


def _fmt(x: float | None, spec: str = ".0f", suffix: str = "") -> str:
    return "–" if x is None else f"{x:{spec}}{suffix}"


def _spread(values: Sequence[float]) -> str:
    mean = statistics.fmean(values)
    if len(values) == 1:
        return f"{mean:.1f}"
    return f"{mean:.1f} ({min(values):.1f}–{max(values):.1f})"


def goodput_table(out: Path, calibrated_name: str = "calibrated_cost.json") -> str:
    """`summary.md` from the files `run_goodput` wrote under `out` (the calibrated model:
    `calibrated_name` in the first repeat's folder)."""
    meta = json.loads((out / "capacity.json").read_text(encoding="utf-8"))
    cap = float(meta["capacity_rps"])
    # the capacity run's real tokens/s: what "capacity" is in tokens (None for older folders)
    cap_runs = _runs(out / "capacity")
    cap_tok = float(cap_runs[-1]["summary"]["real_tokens_per_s"]) if cap_runs else None
    rates_dirs = sorted(out.glob("rates-*"))
    calibrated = rates_dirs[0] / calibrated_name if rates_dirs else None
    if calibrated is not None and not calibrated.exists():
        calibrated = None
    sweep = [float(x) for x in str(meta["sweep"]).split(",")]
    loads = dict(zip(sweep, meta["loads"], strict=True))
    cells: dict[tuple[float, str], list[tuple[float, float, int, float | None, float]]] = {}
    first: dict[tuple[float, str], dict[str, Any]] = {}
    worst: list[tuple[str, dict[str, Any]]] = []
    for folder in rates_dirs:
        last_burst = None  # the server is kept across rates: its log at the last rate
        for rec in sorted(_runs(folder), key=lambda r: float(r["rate"])):
            key = (min(sweep, key=lambda x: abs(x - float(rec["rate"]))), rec["name"])
            good, shed, n, tokens = _good(rec)
            cells.setdefault(key, []).append((good, shed, n, rec["summary"].get("p95_ms"), tokens))
            first.setdefault(key, rec)
            burst = _worst_burst(rec)
            if burst is not None:
                last_burst = (f"{folder.name}, {rec['name']} (all rates)", burst)
        if last_burst is not None:
            worst.append(last_burst)
    sim_meta = {"start": meta["start"], "span": meta["span"]}
    lines = [
        f"Capacity (bucketed's completions/s far past saturation): **{cap:.1f} req/s**"
        f"{f' ({cap_tok:,.0f} real tok/s)' if cap_tok else ''}; the "
        f"window offers {meta['window_rps']:.2f} req/s at x1. Goodput = answers within "
        f"{SLO_S:g} s per second of offered traffic, mean (range) over {len(rates_dirs)} "
        "repeats. Predicted: `simulate` with the cost model measured at start-up "
        f"({Path(meta['cost']).name}) / with `{calibrated_name}` of the first repeat.",
        *_capacity_lines(meta),
        "",
        "| load | target | goodput req/s | in time, real tok/s | shed % | P95 ms | predicted "
        "P95 ms | predicted shed % | adaptive / best other | adaptive / capacity | adaptive's "
        "tokens in time / capacity's tok/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    check: list[tuple[float, str, float | None, float, str, float | None, float | None]] = []
    per_repeat: list[tuple[float, str, str, list[float], float | None]] = []
    for rate in sweep:
        names = sorted({name for (r, name) in cells if r == rate})
        online = _online_cost(first.get((rate, "adaptive")))
        goods = {name: statistics.fmean(c[0] for c in cells[(rate, name)]) for name in names}
        best_other = max((g for name, g in goods.items() if name != "adaptive"), default=None)
        for name in names:
            runs = cells[(rate, name)]
            p95s = [c[3] for c in runs if c[3] is not None]
            models = [("start-up", Path(meta["cost"]))]
            if calibrated is not None:
                models.append(("calibrated", calibrated))
            preds = [_sim_cells(_sim(first[(rate, name)], path, sim_meta)) for _, path in models]
            if name in CHECKED:
                live_p95 = statistics.fmean(p95s) if p95s else None
                live_shed = statistics.fmean(c[1] for c in runs)
                for (model, _), (pp95_, pshed_) in zip(models, preds, strict=True):
                    check.append((loads[rate], name, live_p95, live_shed, model, pp95_, pshed_))
                    if len(p95s) > 1 and loads[rate] <= P95_MAX_LOAD:
                        per_repeat.append((loads[rate], name, model, p95s, pp95_))
                if online is not None:
                    pp95_, pshed_ = _sim_cells(_sim(first[(rate, name)], online, sim_meta))
                    check.append((loads[rate], name, live_p95, live_shed, "online (adaptive's "
                                  "/stats)", pp95_, pshed_))  # fmt: skip
            pp95 = " / ".join(_fmt(p[0]) for p in preds)
            pshed = " / ".join(_fmt(None if p[1] is None else 100 * p[1], ".1f") for p in preds)
            ratio = vs_cap = vs_cap_tok = ""
            tokens = statistics.fmean(c[4] for c in runs)
            if name == "adaptive":
                ratio = _fmt(goods[name] / best_other, ".2f", "x") if best_other else "–"
                vs_cap = _fmt(goods[name] / cap, ".2f")
                vs_cap_tok = _fmt(tokens / cap_tok, ".2f") if cap_tok else "–"
            lines.append(
                f"| {loads[rate]:g}x | {name} | {_spread([c[0] for c in runs])} | "
                f"{tokens:,.0f} | {_spread([100 * c[1] for c in runs])} | "
                f"{_fmt(statistics.fmean(p95s) if p95s else None)} | {pp95} | {pshed} | "
                f"{ratio} | {vs_cap} | {vs_cap_tok} |"
            )
    lines += ["", *prediction_check(check), *repeat_errors(per_repeat)]
    speed = speed_lines(out, loads, _slots())
    if speed:
        lines += ["", *speed]
    lines += ["", "Bursts scenario:", "", "| repeat | target | goodput req/s | shed % | P95 ms |",
              "|---|---|---|---|---|"]  # fmt: skip
    for folder in sorted(out.glob("bursts-*")):
        for rec in _runs(folder):
            good, shed, _, _ = _good(rec)
            lines.append(f"| {folder.name} | {rec['name']} | {good:.1f} | {100 * shed:.1f} | "
                         f"{_fmt(rec['summary'].get('p95_ms'))} |")  # fmt: skip
            burst = _worst_burst(rec)
            if burst is not None:
                worst.append((f"{folder.name}, {rec['name']}", burst))
    lines += ["", "Decision log, worst one-second burst of each adaptive server:", ""]
    for where, b in worst:
        lines.append(
            f"- {where}: {b['shed']} shed ({b['by_where']}); predicted late by "
            f"{b['median_late_by_ms']:.0f} ms (median, least {b['min_late_by_ms']:.0f}); "
            f"predicted start in {b['median_start_in_ms']:.0f} ms of a "
            f"{b['median_due_in_ms']:.0f} ms budget; running {b['median_running_ms']:.0f} ms + "
            f"queued {b['median_queued_ms']:.0f} ms ahead ({b['median_queue_ahead']} requests, "
            f"{b['max_queued']} queued at most); cost model a={b['cost_model']['a_s'] * 1000:.1f}"
            f" ms, b={b['cost_model']['b_s_per_token'] * 1e6:.1f} us/token after "
            f"{b['cost_model']['observed_batches']} batches"
        )
    if not worst:
        lines.append("- none: adaptive shed nothing")
    return "\n".join(lines)
