"""The benchmark report: `report.md` and its PNG plots from replayed runs.

Input is a list of `RunRecord`s (one per server and rate), each with the shared summary (see
`plan/summary.py`), optionally the per-request columns of the run (for the CDF and time plots) and
optionally the simulator's predicted summary for the same run. The tables are in
`replay.tables` and `replay.predictions`, the plots in `replay.plots`; this module lays them out
in one document. Nothing here measures anything, so it is tested on fixed data.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lenbatch.replay.plots import write_plots
from lenbatch.replay.predictions import prediction_table
from lenbatch.replay.records import RunRecord
from lenbatch.replay.tables import (
    bucket_tables,
    driver_table,
    headline_table,
    peer_section,
    results_table,
    streaming_table,
)

__all__ = ["render_markdown", "write_report"]


def render_markdown(
    records: Sequence[RunRecord], meta: dict[str, Any], plots: Sequence[str] = ()
) -> str:
    """The report text. `meta` keys used: title, command, machine, trace_notes, settings,
    conditions, prediction_note."""
    peers = [r.name for r in records if r.kind == "peer"]
    peer = "naive" if "naive" in peers else (peers[0] if peers else None)
    md = [f"# {meta.get('title', 'lenbatch replay benchmark')}", ""]
    if meta.get("conditions"):
        md += [f"> {meta['conditions']}", ""]
    md += ["Command:", "", "```", str(meta.get("command", "")), "```", ""]
    if meta.get("machine"):
        md += [f"Machine: {meta['machine']}", ""]
    if meta.get("software"):
        md += [f"Software: {meta['software']}", ""]
    for note in meta.get("trace_notes", []):
        md.append(f"- {note}")
    for key, value in (meta.get("settings") or {}).items():
        md.append(f"- {key}: {value}")
    md += ["", "## Headline", ""]
    md += headline_table(records, meta)
    md += [""]
    stream = streaming_table(records)
    if stream:
        md += [
            "Completions, per rate (a fixed load): time to first token, inter-token latency "
            "and output tokens/s.",
            "",
            *stream,
            "",
        ]
    md += ["## Results", ""]
    md += results_table(records, peer)
    md += [
        "",
        "Latency is measured by the client from send to complete answer. Padding waste "
        "(token-weighted, this run only) and mean batch size come from the server's `/stats`; "
        "peers do not report them. Peak MB is the peak RSS of the server's whole process tree, "
        "sampled by the benchmark. Ratios: this row divided by the reference row at the same rate.",
        "",
    ]
    pred = prediction_table(records)
    md += ["## Simulator prediction vs live", ""]
    md += pred or [str(meta.get("prediction_note", "No predictions were given for this run."))]
    md += [""]
    md += peer_section(meta)
    md += ["## Load driver", "", *driver_table(records), ""]
    md += [
        "The driver runs on the same CPUs as the server; its CPU share and how late it sent "
        "(against the trace's schedule) say how far the figures above can be trusted.",
        "",
    ]
    md += ["## Per bucket", "", *bucket_tables(records)]
    if plots:
        md += ["## Plots", ""]
        md += [f"![{p}]({p})" for p in plots]
        md += [""]
    return "\n".join(md)


def write_report(out_dir: str | Path, records: Sequence[RunRecord], meta: dict[str, Any]) -> Path:
    """Write `report.md` and its plots into `out_dir`; returns the report's path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    plots = write_plots(records, out)
    path = out / "report.md"
    path.write_text(render_markdown(records, meta, plots) + "\n", encoding="utf-8")
    return path
