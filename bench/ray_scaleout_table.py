"""Tables of the Ray scale-out benchmark from `lenbatch bench` run files (bench/ray_scaleout.sh).

Per target and rate: P95, real tokens/s, padding waste and mean batch size (this run only: the
server's counters after minus before), and for the Ray app each replica's own batch figures,
the length ranges, spills and re-plans; then each target's best real tokens/s among the rates
whose P95 stayed within the SLO.

    .venv/bin/python bench/ray_scaleout_table.py bench/results/ray-scaleout [--slo-ms 1000]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def _bucket_sums(stats: dict[str, Any] | None) -> dict[str, int]:
    out = {"batches": 0, "requests": 0, "real": 0, "padded": 0}
    for b in (stats or {}).get("per_bucket", []):
        out["batches"] += b["batches"]
        out["requests"] += b["requests"]
        out["real"] += b["real_tokens"]
        out["padded"] += b["padded_tokens"]
    return out


def _replicas(before: dict[str, Any] | None, after: dict[str, Any]) -> list[dict[str, Any]]:
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


def _fmt(x: float | None, spec: str = ".1f", suffix: str = "") -> str:
    return "–" if x is None else f"{x:{spec}}{suffix}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("reports", nargs="+", help="lenbatch bench report folders")
    p.add_argument("--slo-ms", type=float, default=1000.0)
    args = p.parse_args()
    runs = []
    for folder in args.reports:
        for f in sorted(Path(folder, "runs").glob("*.json")):
            runs.append(json.loads(f.read_text(encoding="utf-8")))
    runs.sort(key=lambda r: (r["rate"], r["name"]))
    print("| server | rate | req/s | P50 ms | P95 ms | real tok/s | errors | padding waste "
          "| mean batch | mean batch per replica | peak RSS MB |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    best: dict[str, tuple[float, float] | None] = {}
    routing_rows = []
    for r in runs:
        s = r["summary"]
        res = r["result"]
        after = res.get("stats_after") or {}
        per = _replicas(res.get("stats_before"), after) if "per_replica" in after else []
        per_txt = (
            " / ".join(f"g{x['group']}: {_fmt(x['mean_batch'], '.2f')}" for x in per)
            if per
            else _fmt(s.get("mean_batch_size"), ".2f")
        )
        print(
            f"| {r['name']} | x{r['rate'] * 1:g} | {s['throughput_rps']:.2f} | "
            f"{_fmt(s['p50_ms'])} | {_fmt(s['p95_ms'])} | {s['real_tokens_per_s']:.0f} | "
            f"{s['error_rate']:.1%} | {_fmt(s.get('padding_waste'), '.1%')} | "
            f"{_fmt(s.get('mean_batch_size'), '.2f')} | {per_txt} | "
            f"{_fmt(s.get('peak_memory_mb'), '.0f')} |"
        )
        ok = s["p95_ms"] is not None and s["p95_ms"] <= args.slo_ms and s["error_rate"] == 0
        cur = best.get(r["name"])
        if ok and (cur is None or s["real_tokens_per_s"] > cur[0]):
            best[r["name"]] = (s["real_tokens_per_s"], r["rate"])
        else:
            best.setdefault(r["name"], None)
        if "routing" in after:
            rt, before = after["routing"], (res.get("stats_before") or {}).get("routing", {})
            routing_rows.append((r["name"], r["rate"], rt, before, per))
    print(f"\n**Real tokens/s at P95 ≤ {args.slo_ms:g} ms** (best rate of the sweep, no errors)\n")
    print("| server | real tok/s | at rate |")
    print("|---|---|---|")
    for name, b in best.items():
        print(f"| {name} | {'none within the SLO' if b is None else f'{b[0]:.0f}'} | "
              f"{'–' if b is None else f'x{b[1]:g}'} |")  # fmt: skip
    if routing_rows:
        print("\n**Routing (Ray app, this run)**\n")
        print("| server | rate | length ranges at the end | re-plans | spills | retries "
              "| requests per replica (group) | padding waste per replica |")  # fmt: skip
        print("|---|---|---|---|---|---|---|---|")
        for name, rate, rt, before, per in routing_rows:
            ranges = ", ".join(
                f"g{x['group']} {x['min_len']}-{x['max_len'] or 'max'}" for x in rt["ranges"]
            )
            spills = rt["spills_total"] - before.get("spills_total", 0)
            replans = rt["rebalances"] - before.get("rebalances", 0)
            retries = rt["retries"] - before.get("retries", 0)
            reqs = " / ".join(f"{x['requests']} (g{x['group']})" for x in per)
            waste = " / ".join(f"g{x['group']}: {_fmt(x['waste'], '.1%')}" for x in per)
            print(f"| {name} | x{rate:g} | {ranges} | {replans} | {spills} | {retries} | "
                  f"{reqs} | {waste} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
