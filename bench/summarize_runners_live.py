"""Tabulate `bench/runners_live.sh`'s reports: one row per target, side by side.

    .venv/bin/python bench/summarize_runners_live.py bench/results/runners-live

Per target: P95 at light load (x1.5), each load point's P95 and real tokens/s, the real
tokens/s at the highest offered rate whose P95 stays within 1 s, the most real tokens/s seen
(saturation, where a point fell behind), peak RSS of the server's process tree, the server's
peak activation memory (RSS above weights, from its /stats) and its event-loop CPU per request
at light load (the main thread's CPU time over the run, from /proc, divided by the requests).
Then one row per saturation run (x28, far past what fp32 sustains).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def _runs(folder: Path) -> list[dict[str, Any]]:
    runs = [json.loads(p.read_text()) for p in sorted((folder / "runs").glob("*.json"))]
    return sorted(runs, key=lambda r: float(r["rate"]))


def _folders(path: Path) -> list[Path]:
    return [p for p in path.iterdir() if p.is_dir()] if path.exists() else []


def _rate_label(folder: Path, run: dict[str, Any]) -> str:
    """The offered rate as a multiple of the trace's (rate-scale x sweep fraction)."""
    report = (folder / "report.md").read_text()
    scale = float(report.split("--rate-scale ", 1)[1].split()[0])
    return f"x{scale * float(run['rate']):.3g}"


def main() -> int:
    """Print the Markdown table of every target found under the given folder."""
    root = Path(sys.argv[1] if len(sys.argv) > 1 else "bench/results/runners-live")
    names = sorted({p.name for part in ("light", "load") for p in _folders(root / part)})
    rows = []
    for name in names:
        light = root / "light" / name
        load = root / "load" / name
        light_p95 = loop_ms = "–"
        if light.exists():
            (lr,) = _runs(light)[:1]
            s = lr["summary"]
            light_p95 = f"{s['p95_ms']:.0f}"
            cpu = s.get("server_cpu")
            if cpu:
                loop_ms = f"{1e3 * cpu['loop_s'] / s['requests']:.2f}"
        points, ok_tok, best_tok, rss, act = [], 0.0, 0.0, 0.0, 0.0
        if load.exists():
            for r in _runs(load):
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
        rows.append(
            f"| {name} | {light_p95} | {'; '.join(points) or '–'} | "
            f"{ok_tok:,.0f} | {best_tok:,.0f} | {rss:,.0f} | {act:,.0f} | {loop_ms} |"
        )
    print(
        "| target | light-load P95 ms (x1.5) | load points: P95 / real tok/s | real tok/s at "
        "P95 <= 1 s | most real tok/s | peak RSS MB | peak activations MB | loop CPU ms/req "
        "(light) |"
    )
    print("|---|---:|---|---:|---:|---:|---:|---:|")
    print("\n".join(rows))
    sat = _folders(root / "saturation")
    if sat:
        print(
            "\n| saturation (x28) | requests | P50 ms | P95 ms | real tok/s | mean batch | "
            "peak RSS MB | peak activations MB |"
        )
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        for folder in sorted(sat):
            for r in _runs(folder):
                s = r["summary"]
                mem = (s.get("server") or {}).get("memory") or {}
                print(
                    f"| {folder.name} | {s['requests']} | {s['p50_ms']:,.0f} | "
                    f"{s['p95_ms']:,.0f} | {s['real_tokens_per_s']:,.0f} | "
                    f"{s['mean_batch_size']:.1f} | {s.get('peak_memory_mb') or 0:,.0f} | "
                    f"{mem.get('peak_activations_mb') or 0:,.0f} |"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
