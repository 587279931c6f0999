"""The report's comparison of the simulator's predicted summary with the live one, run by run."""

from __future__ import annotations

from collections.abc import Sequence

from lenbatch.replay.records import RunRecord, fmt, pct, relative_diff

__all__ = ["prediction_table"]


def prediction_table(records: Sequence[RunRecord]) -> list[str]:
    """Predicted against live P50, P95, req/s and waste for each run with a prediction."""
    rows = [r for r in records if r.predicted]
    if not rows:
        return []
    lines = [
        "| server | P50 ms pred / live | diff | P95 ms pred / live | diff | "
        "req/s pred / live | diff | waste pred / live |",
        "|" + "---|" * 8,
    ]
    for r in rows:
        p, s = r.predicted or {}, r.summary
        lines.append(
            f"| {r.label} | {fmt(p.get('p50_ms'))} / {fmt(s['p50_ms'])} "
            f"| {relative_diff(p.get('p50_ms'), s['p50_ms'])} "
            f"| {fmt(p.get('p95_ms'))} / {fmt(s['p95_ms'])} "
            f"| {relative_diff(p.get('p95_ms'), s['p95_ms'])} "
            f"| {fmt(p.get('throughput_rps'), 2)} / {fmt(s['throughput_rps'], 2)} "
            f"| {relative_diff(p.get('throughput_rps'), s['throughput_rps'])} "
            f"| {pct(p.get('padding_waste'))} / {pct(s['padding_waste'])} |"
        )
    return lines
