"""Markdown table of `bench/llm_decode_replay.sh` runs (replay summaries and server /stats).

.venv/bin/python bench/llm_decode_table.py bench/results/llm-decode-replay/*-x0.3.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def _f(x: Any, digits: int = 0) -> str:
    return "–" if x is None else f"{x:,.{digits}f}"


def row(path: Path) -> str:
    """One table row for a replay summary (and the server stats beside it, if any)."""
    d = json.loads(path.read_text())
    stats_file = path.with_suffix(".stats.json")
    stats: dict[str, Any] = {}
    if stats_file.exists() and stats_file.stat().st_size:
        stats = json.loads(stats_file.read_text())
    steps = stats.get("steps") or {}
    decode = (steps.get("decode") or {}).get("mean_forward_ms")
    rows = stats.get("decode_mean_rows")
    return (
        f"| {path.stem} | {d['completed']}/{d['requests']} | "
        f"{_f(d['ttft_p50_ms'])} / {_f(d['ttft_p95_ms'])} | "
        f"{_f(d['itl_p50_ms'])} / {_f(d['itl_p95_ms'])} | {_f(d['output_tokens_per_s'], 1)} | "
        f"{_f(d['p95_ms'] / 1000, 2)} s | {_f(decode, 1)} | {_f(rows, 1)} |"
    )


def main() -> int:
    print(
        "| run | done | TTFT P50 / P95 ms | ITL P50 / P95 ms | output tok/s | request P95 "
        "| decode step ms (server mean) | rows per decode step |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for arg in sys.argv[1:]:
        print(row(Path(arg)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
