"""Markdown tables from the files benchmark recipes write, for `bench/results/*.md`.

`bench/run.py` prints the table of a recipe after running it, and `bench/run.py table KIND
PATH...` makes it again from result files already on disk:

* `llm-decode`: `lenbatch replay` summaries of the `llm-decode-replay` recipe, with the
  server's `/stats` saved beside each (`<label>-x<rate>.json` and `.stats.json`);
* `ray-scaleout`: `lenbatch bench` run files of the `ray-scaleout` recipe, with each Ray
  replica's own batch figures and the router's ranges, spills and re-plans;
* `runners-live`: the `light/`, `load/` and `saturation/` reports of the `runners-live` recipe,
  one row per target;
* `adaptive-live`: the `adaptive-live` and `adaptive-overload` reports, goodput within the SLO
  with the simulator's prediction of each run's P95.

Nothing here runs a server or times anything; every function reads files and returns text.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "TABLES",
    "AdaptiveRun",
    "adaptive_live_table",
    "before_after_table",
    "llm_decode_table",
    "ray_scaleout_table",
    "runners_live_table",
]

TABLES = ("llm-decode", "ray-scaleout", "runners-live", "adaptive-live", "before-after")


def _cell(x: float | None, spec: str = ".1f", suffix: str = "") -> str:
    """`x` formatted, a dash when missing."""
    return "–" if x is None else f"{x:{spec}}{suffix}"


def _runs(folder: Path) -> list[dict[str, Any]]:
    """The run records (`runs/*.json`) of one `lenbatch bench --report` folder, by rate."""
    runs = [json.loads(p.read_text(encoding="utf-8")) for p in sorted(folder.glob("runs/*.json"))]
    return sorted(runs, key=lambda r: float(r["rate"]))


# --- before-after --------------------------------------------------------------------------


def before_after_table(root: Path, tolerance: float = 0.10) -> str:
    """The same `lenbatch bench` sweep run several times on two trees (`root/before-N`,
    `root/after-N`, run alternately): per strategy and rate, the median real tokens/s and P95
    of each side with every run's figure, and after/before. A ratio further than `tolerance`
    from 1 in the worse direction (fewer tokens/s, higher P95) is marked."""
    cells: dict[tuple[str, float], dict[str, list[dict[str, Any]]]] = {}
    for side in ("before", "after"):
        for folder in sorted(root.glob(f"{side}-*")):
            for run in _runs(folder):
                key = (str(run["name"]), float(run["rate"]))
                cells.setdefault(key, {}).setdefault(side, []).append(run["summary"])
    lines = [
        "| strategy | rate | real tok/s before: median (runs) | after | after / before "
        "| P95 ms before: median (runs) | after | after / before | errors % before / after |",
        "|---|---:|---|---|---:|---|---|---:|---|",
    ]
    for (name, rate), sides in sorted(cells.items()):
        before, after = sides.get("before", []), sides.get("after", [])
        if not before or not after:
            continue
        row = [f"`{name}`", f"x{rate:g}"]
        for field, spec, worse in (("real_tokens_per_s", ",.0f", -1), ("p95_ms", ",.0f", 1)):
            b = [float(x[field]) for x in before]
            a = [float(x[field]) for x in after]
            ratio = statistics.median(a) / statistics.median(b)
            mark = " **(worse)**" if (ratio - 1) * worse > tolerance else ""
            for values in (b, a):
                runs = ", ".join(f"{v:{spec}}" for v in values)
                row.append(f"{statistics.median(values):{spec}} ({runs})")
            row.append(f"{ratio:.2f}{mark}")
        errors = (
            ", ".join(f"{100 * float(x['error_rate']):.1f}" for x in v) for v in (before, after)
        )
        row.append(" / ".join(errors))
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


# --- llm-decode ---------------------------------------------------------------------------


def llm_decode_table(paths: Sequence[Path]) -> str:
    """One row per `lenbatch replay --json` summary: completions, TTFT, inter-token latency,
    output tokens/s, request P95, and the server's mean decode step and rows per step from the
    `/stats` saved beside it (`NAME.stats.json`; such files are skipped as inputs), if any."""
    lines = [
        "| run | done | TTFT P50 / P95 ms | ITL P50 / P95 ms | output tok/s | request P95 "
        "| decode step ms (server mean) | rows per decode step |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for path in paths:
        if path.name.endswith(".stats.json"):
            continue
        d = json.loads(path.read_text(encoding="utf-8"))
        stats_file = path.with_suffix(".stats.json")
        stats: dict[str, Any] = {}
        if stats_file.exists() and stats_file.stat().st_size:
            stats = json.loads(stats_file.read_text(encoding="utf-8"))
        steps = stats.get("steps") or {}
        decode = (steps.get("decode") or {}).get("mean_forward_ms")
        lines.append(
            f"| {path.stem} | {d['completed']}/{d['requests']} | "
            f"{_cell(d['ttft_p50_ms'], ',.0f')} / {_cell(d['ttft_p95_ms'], ',.0f')} | "
            f"{_cell(d['itl_p50_ms'], ',.0f')} / {_cell(d['itl_p95_ms'], ',.0f')} | "
            f"{_cell(d['output_tokens_per_s'], ',.1f')} | "
            f"{_cell(d['p95_ms'] / 1000, ',.2f')} s | {_cell(decode, ',.1f')} | "
            f"{_cell(stats.get('decode_mean_rows'), ',.1f')} |"
        )
    return "\n".join(lines)


# --- ray-scaleout -------------------------------------------------------------------------


def _bucket_sums(stats: Mapping[str, Any] | None) -> dict[str, int]:
    out = {"batches": 0, "requests": 0, "real": 0, "padded": 0}
    for b in (stats or {}).get("per_bucket", []):
        out["batches"] += b["batches"]
        out["requests"] += b["requests"]
        out["real"] += b["real_tokens"]
        out["padded"] += b["padded_tokens"]
    return out


def _replicas(before: Mapping[str, Any] | None, after: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Each replica's batches over the run (a replica new since `before` counts from zero)."""
    prev = {r["replica"]: r for r in (before or {}).get("per_replica", [])}
    rows = []
    for r in after.get("per_replica", []):
        a, b = _bucket_sums(r), _bucket_sums(prev.get(r["replica"]))
        d = {k: a[k] - b[k] for k in a}
        rows.append(
            {
                "replica": r["replica"],
                "group": r["group"],
                "requests": d["requests"],
                "batches": d["batches"],
                "mean_batch": d["requests"] / d["batches"] if d["batches"] else None,
                "waste": 1 - d["real"] / d["padded"] if d["padded"] else None,
            }
        )
    return rows


def ray_scaleout_table(reports: Sequence[Path], slo_ms: float = 1000.0) -> str:
    """Per target and rate: P95, real tokens/s, padding waste and mean batch size (this run
    only: the server's counters after minus before), and for the Ray app each replica's own
    batch figures, the length ranges, spills and re-plans; then each target's best real
    tokens/s among the rates whose P95 stayed within `slo_ms` with no errors."""
    runs = [run for folder in reports for run in _runs(folder)]
    runs.sort(key=lambda r: (r["rate"], r["name"]))
    out = [
        "| server | rate | req/s | P50 ms | P95 ms | real tok/s | errors | padding waste "
        "| mean batch | mean batch per replica | peak RSS MB |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    best: dict[str, tuple[float, float] | None] = {}
    routing_rows = []
    for r in runs:
        s = r["summary"]
        res = r["result"]
        after = res.get("stats_after") or {}
        per = _replicas(res.get("stats_before"), after) if "per_replica" in after else []
        per_txt = (
            " / ".join(f"g{x['group']}: {_cell(x['mean_batch'], '.2f')}" for x in per)
            if per
            else _cell(s.get("mean_batch_size"), ".2f")
        )
        out.append(
            f"| {r['name']} | x{r['rate'] * 1:g} | {s['throughput_rps']:.2f} | "
            f"{_cell(s['p50_ms'])} | {_cell(s['p95_ms'])} | {s['real_tokens_per_s']:.0f} | "
            f"{s['error_rate']:.1%} | {_cell(s.get('padding_waste'), '.1%')} | "
            f"{_cell(s.get('mean_batch_size'), '.2f')} | {per_txt} | "
            f"{_cell(s.get('peak_memory_mb'), '.0f')} |"
        )
        ok = s["p95_ms"] is not None and s["p95_ms"] <= slo_ms and s["error_rate"] == 0
        cur = best.get(r["name"])
        if ok and (cur is None or s["real_tokens_per_s"] > cur[0]):
            best[r["name"]] = (s["real_tokens_per_s"], r["rate"])
        else:
            best.setdefault(r["name"], None)
        if "routing" in after:
            before = (res.get("stats_before") or {}).get("routing", {})
            routing_rows.append((r["name"], r["rate"], after["routing"], before, per))
    out += [
        "",
        f"**Real tokens/s at P95 ≤ {slo_ms:g} ms** (best rate of the sweep, no errors)",
        "",
        "| server | real tok/s | at rate |",
        "|---|---|---|",
    ]
    for name, b in best.items():
        out.append(
            f"| {name} | {'none within the SLO' if b is None else f'{b[0]:.0f}'} | "
            f"{'–' if b is None else f'x{b[1]:g}'} |"
        )
    if routing_rows:
        out += [
            "",
            "**Routing (Ray app, this run)**",
            "",
            "| server | rate | length ranges at the end | re-plans | spills | retries "
            "| requests per replica (group) | padding waste per replica |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for name, rate, rt, before, per in routing_rows:
            ranges = ", ".join(
                f"g{x['group']} {x['min_len']}-{x['max_len'] or 'max'}" for x in rt["ranges"]
            )
            spills = rt["spills_total"] - before.get("spills_total", 0)
            replans = rt["rebalances"] - before.get("rebalances", 0)
            retries = rt["retries"] - before.get("retries", 0)
            reqs = " / ".join(f"{x['requests']} (g{x['group']})" for x in per)
            waste = " / ".join(f"g{x['group']}: {_cell(x['waste'], '.1%')}" for x in per)
            out.append(
                f"| {name} | x{rate:g} | {ranges} | {replans} | {spills} | {retries} | "
                f"{reqs} | {waste} |"
            )
    return "\n".join(out)


# --- runners-live -------------------------------------------------------------------------


def _folders(path: Path) -> list[Path]:
    return sorted(p for p in path.iterdir() if p.is_dir()) if path.exists() else []


def _rate_label(folder: Path, run: Mapping[str, Any]) -> str:
    """The offered rate as a multiple of the trace's (rate-scale x sweep fraction), read from
    the command line the report quotes."""
    report = (folder / "report.md").read_text(encoding="utf-8")
    scale = float(report.split("--rate-scale ", 1)[1].split()[0])
    return f"x{scale * float(run['rate']):.3g}"


def runners_live_table(root: Path) -> str:
    """One row per target under `root` (`light/NAME`, `load/NAME`): P95 at light load, each
    load point's P95 and real tokens/s, the real tokens/s at the highest offered rate whose
    P95 stays within 1 s, the most real tokens/s seen, peak RSS of the server's process tree,
    the server's peak activation memory (from its /stats) and its event-loop CPU per request
    at light load. Then one row per saturation run (`saturation/NAME`)."""
    names = sorted({p.name for part in ("light", "load") for p in _folders(root / part)})
    out = [
        "| target | light-load P95 ms (x1.5) | load points: P95 / real tok/s | real tok/s at "
        "P95 <= 1 s | most real tok/s | peak RSS MB | peak activations MB | loop CPU ms/req "
        "(light) |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for name in names:
        light = root / "light" / name
        load = root / "load" / name
        light_p95 = loop_ms = "–"
        if light.exists():
            s = _runs(light)[0]["summary"]
            light_p95 = f"{s['p95_ms']:.0f}"
            cpu = s.get("server_cpu")
            if cpu:
                loop_ms = f"{1e3 * cpu['loop_s'] / s['requests']:.2f}"
        points, ok_tok, best_tok, rss, act = [], 0.0, 0.0, 0.0, 0.0
        for r in _runs(load) if load.exists() else []:
            s = r["summary"]
            errors = s["errors"] + s["rejected"]
            points.append(
                f"{_rate_label(load, r)}: {s['p95_ms']:,.0f} ms / {s['real_tokens_per_s']:,.0f}"
                + (f" ({errors} err)" if errors else "")
            )
            if s["p95_ms"] <= 1000 and not errors:
                ok_tok = max(ok_tok, s["real_tokens_per_s"])
            best_tok = max(best_tok, s["real_tokens_per_s"])
            rss = max(rss, s.get("peak_memory_mb") or 0.0)
            mem = (s.get("server") or {}).get("memory") or {}
            act = max(act, mem.get("peak_activations_mb") or 0.0)
        out.append(
            f"| {name} | {light_p95} | {'; '.join(points) or '–'} | "
            f"{ok_tok:,.0f} | {best_tok:,.0f} | {rss:,.0f} | {act:,.0f} | {loop_ms} |"
        )
    saturation = _folders(root / "saturation")
    if saturation:
        out += [
            "",
            "| saturation (x28) | requests | P50 ms | P95 ms | real tok/s | mean batch | "
            "peak RSS MB | peak activations MB |",
            "|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for folder in saturation:
            for r in _runs(folder):
                s = r["summary"]
                mem = (s.get("server") or {}).get("memory") or {}
                out.append(
                    f"| {folder.name} | {s['requests']} | {s['p50_ms']:,.0f} | "
                    f"{s['p95_ms']:,.0f} | {s['real_tokens_per_s']:,.0f} | "
                    f"{s['mean_batch_size']:.1f} | {s.get('peak_memory_mb') or 0:,.0f} | "
                    f"{mem.get('peak_activations_mb') or 0:,.0f} |"
                )
    return "\n".join(out)


# --- adaptive-live ------------------------------------------------------------------------


@dataclass(frozen=True)
class AdaptiveRun:
    """One `lenbatch bench --scenario` report of the adaptive recipes: its scenario, rate
    (req/s) and duration (s), the folder, and the batching flags the `-best` runs served with
    (max wait ms, max batch), if any."""

    scenario: str
    rate: float
    duration: float
    folder: Path
    best_fixed: tuple[float, int] | None = None

    def spec(self) -> str:
        """The run as `parse` reads it."""
        best = "" if self.best_fixed is None else f":{self.best_fixed[0]:g},{self.best_fixed[1]}"
        return f"{self.scenario}:{self.rate:g}:{self.duration:g}:{self.folder}{best}"

    @classmethod
    def parse(cls, spec: str) -> AdaptiveRun:
        """`SCENARIO:RATE:DURATION:DIR[:WAIT_MS,BATCH]`."""
        scenario, rate, duration, rest = spec.split(":", 3)
        folder, _, best = rest.partition(":")
        fixed = None
        if best:
            wait, batch = best.split(",")
            fixed = (float(wait), int(batch))
        return cls(scenario, float(rate), float(duration), Path(folder), fixed)


def _p_ms(x: Any, q: float) -> float | None:
    v = np.asarray(x, dtype=np.float64)
    v = v[~np.isnan(v)]
    return float(np.percentile(v, q, method="inverted_cdf") * 1000) if len(v) else None


def adaptive_live_table(runs: Sequence[AdaptiveRun], cost_path: Path, slo_ms: float) -> str:
    """One table per report: goodput (answered OK within `slo_ms`, per second of traffic),
    its ratio to `bucketed`, failures, P95/P99, the simulator's P95 for the same scenario and
    strategy (cost model `cost_path`), padding waste and mean batch size. A run's strategy is
    its file name; in a report with `best_fixed` settings every run is that fixed config."""
    from lenbatch.config import AdaptiveConfig, BatchingConfig, Strategy
    from lenbatch.plan.costmodel import CostModel
    from lenbatch.plan.sim import simulate
    from lenbatch.plan.summary import OUTCOME_OK
    from lenbatch.plan.trace import map_trace
    from lenbatch.replay.bodies import TextBuilder, load_tokenizer
    from lenbatch.replay.results import ReplayResult
    from lenbatch.replay.scenarios import build_scenario, pools_from_builder

    strategies = {
        "fifo": BatchingConfig(strategy=Strategy.FIFO),
        "bucketed": BatchingConfig(),
        "adaptive": BatchingConfig(strategy=Strategy.ADAPTIVE),
        "naive": BatchingConfig(strategy=Strategy.FIFO, max_batch=1),
    }
    slo = slo_ms / 1000
    cost = CostModel.load(cost_path)
    pools = pools_from_builder(TextBuilder(load_tokenizer("minilm")))
    out = []
    for run in runs:
        raw = build_scenario(run.scenario, pools, rate=run.rate, duration_s=run.duration)
        trace = map_trace(raw, max_length=256)
        out += [
            f"### {run.scenario} (live, {run.rate:g} req/s reference, {run.duration:g} s)",
            "",
            "| run | goodput req/s | within SLO | vs bucketed | not OK | P95 ms | P99 ms | "
            "predicted P95 ms | waste | mean batch |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        rows = []
        for path in sorted(run.folder.glob("runs/*.json")):
            record = json.loads(path.read_text(encoding="utf-8"))
            res = ReplayResult.from_json(record["result"])
            lat = res.latencies
            ok = (res.outcomes == OUTCOME_OK) & (lat <= slo)
            stats = res.stats_after or {}
            name, cfg = path.stem, strategies.get(path.stem)
            if run.best_fixed is not None:
                wait, batch = run.best_fixed
                name, cfg = "best fixed", BatchingConfig(max_wait_ms=wait, max_batch=batch)
            pred = None
            if cfg is not None:
                sim = simulate(
                    trace, cost, cfg, max_length=256, adaptive=AdaptiveConfig(slo_ms=slo_ms)
                )
                pred = _p_ms(sim.latencies[sim.outcomes == OUTCOME_OK], 95)
            rows.append(
                (
                    name,
                    float(ok.sum()) / run.duration,
                    float(ok.mean()),
                    float(np.mean(res.outcomes != OUTCOME_OK)),
                    _p_ms(lat, 95),
                    _p_ms(lat, 99),
                    pred,
                    stats.get("padding_waste"),
                    stats.get("mean_batch_size"),
                )
            )
        ref = next((r[1] for r in rows if r[0] == "bucketed"), None)
        for name, good, share, bad, p95, p99, pred, waste, mb in rows:
            vs = f"{good / ref:.2f}x" if ref else "–"
            out.append(
                f"| {name} | {good:.2f} | {100 * share:.1f} % | {vs} | {100 * bad:.1f} % | "
                f"{_cell(p95, '.0f')} | {_cell(p99, '.0f')} | {_cell(pred, '.0f')} | "
                f"{_cell(None if waste is None else 100 * waste, '.1f', ' %')} | "
                f"{_cell(mb, '.2f')} |"
            )
        out.append("")
    return "\n".join(out)
