"""The benchmark report: Markdown tables and PNG plots from replayed runs.

Input is a list of `RunRecord`s (one per server and rate), each with the shared summary (see
`plan/summary.py`), optionally the per-request columns of the run (for the CDF and time plots) and
optionally the simulator's predicted summary for the same run. Output is `report.md` and
`*.png` in one folder. Nothing here measures anything: it only lays out what it is given, so
it is tested on fixed data.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from lenbatch.plan.summary import OUTCOME_OK
from lenbatch.replay.driver import ReplayResult

__all__ = [
    "SLO_P95_MS",
    "RunRecord",
    "fmt",
    "headline_rows",
    "ratio",
    "render_markdown",
    "write_plots",
    "write_report",
]

SLO_P95_MS = 1000.0  # the headline's latency bound
MAX_ERROR_RATE = 0.01  # a rate "meets" the bound only with at most this share of failures


@dataclass
class RunRecord:
    """One replay of the benchmark traffic against one server at one rate."""

    name: str  # strategy (`fifo`, `bucketed`, ...) or peer (`naive`, `ray`)
    kind: str  # "strategy" or "peer"
    rate: float  # arrival-rate multiplier of this run (1.0 without a sweep)
    summary: dict[str, Any]
    result: ReplayResult | None = None
    predicted: dict[str, Any] | None = None

    @property
    def label(self) -> str:
        """Name, with the rate when it is not 1."""
        return self.name if self.rate == 1.0 else f"{self.name} @x{self.rate:g}"


def fmt(value: Any, digits: int = 1) -> str:
    """A table cell: numbers rounded, missing values as a dash."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


def ratio(a: Any, b: Any) -> float | None:
    """a / b, or None when either is missing or b is zero."""
    if a is None or b is None or b == 0:
        return None
    return float(a) / float(b)


def _x(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}×"


def _pct(value: Any) -> str:
    return "–" if value is None else f"{100 * float(value):.1f} %"


def _diff(pred: Any, live: Any) -> str:
    r = ratio(pred, live)
    return "–" if r is None else f"{100 * (r - 1):+.0f} %"


def _reference(records: Sequence[RunRecord], name: str, rate: float) -> RunRecord | None:
    return next((r for r in records if r.name == name and r.rate == rate), None)


def _main_table(records: Sequence[RunRecord], peer: str | None) -> list[str]:
    head = (
        "| server | requests | errors | P50 ms | P95 ms | P99 ms | req/s | real tok/s | "
        "error rate | padding waste | mean batch | peak MB | tok/s vs fifo | P95 vs fifo | "
        f"tok/s vs {peer or 'peer'} | P95 vs {peer or 'peer'} |"
    )
    lines = [head, "|" + "---|" * 16]
    for r in records:
        s = r.summary
        fifo = _reference(records, "fifo", r.rate)
        ref = _reference(records, peer, r.rate) if peer else None
        fs = fifo.summary if fifo else {}
        ps = ref.summary if ref else {}
        lines.append(
            f"| {r.label} | {s['requests']} | {s['errors'] + s['rejected']} | {fmt(s['p50_ms'])} "
            f"| {fmt(s['p95_ms'])} | {fmt(s['p99_ms'])} | {fmt(s['throughput_rps'], 2)} "
            f"| {fmt(s['real_tokens_per_s'], 0)} | {_pct(s['error_rate'])} "
            f"| {_pct(s['padding_waste'])} | {fmt(s['mean_batch_size'], 1)} "
            f"| {fmt(s['peak_memory_mb'], 0)} "
            f"| {_x(ratio(s['real_tokens_per_s'], fs.get('real_tokens_per_s')))} "
            f"| {_x(ratio(s['p95_ms'], fs.get('p95_ms')))} "
            f"| {_x(ratio(s['real_tokens_per_s'], ps.get('real_tokens_per_s')))} "
            f"| {_x(ratio(s['p95_ms'], ps.get('p95_ms')))} |"
        )
    return lines


def headline_rows(
    records: Sequence[RunRecord], oracle: dict[str, dict[str, float]] | None = None
) -> list[dict[str, Any]]:
    """One row per server over all its rates: the highest rate whose P95 is within
    `SLO_P95_MS` (with at most `MAX_ERROR_RATE` failed) and its real tokens/s, P95 at the
    lightest rate, the most real tokens/s at any rate (saturation, when the sweep goes past
    it), peak RSS over the runs, and the oracle's real tokens/s with the ratio to it."""
    rows = []
    for name in dict.fromkeys(r.name for r in records):
        runs = sorted((r for r in records if r.name == name), key=lambda r: r.rate)
        ok = [
            r
            for r in runs
            if r.summary.get("p95_ms") is not None
            and r.summary["p95_ms"] <= SLO_P95_MS
            and (r.summary.get("error_rate") or 0.0) <= MAX_ERROR_RATE
        ]
        best = ok[-1] if ok else None
        top = max(runs, key=lambda r: r.summary.get("real_tokens_per_s") or 0.0)
        peaks = [r.summary.get("peak_memory_mb") for r in runs]
        orc = (oracle or {}).get(name)
        sustained = top.summary.get("real_tokens_per_s")
        rows.append(
            {
                "name": name,
                "kind": runs[0].kind,
                "slo_rate": best.rate if best else None,
                "slo_offered_rps": best.summary.get("offered_rps") if best else None,
                "slo_real_tokens_per_s": best.summary.get("real_tokens_per_s") if best else None,
                "light_rate": runs[0].rate,
                "light_p95_ms": runs[0].summary.get("p95_ms"),
                "saturation_rate": top.rate,
                "saturation_real_tokens_per_s": sustained,
                "saturation_error_rate": top.summary.get("error_rate"),
                "peak_memory_mb": max((x for x in peaks if x is not None), default=None),
                "oracle_real_tokens_per_s": orc.get("real_tokens_per_s") if orc else None,
                "of_oracle": ratio(sustained, orc.get("real_tokens_per_s")) if orc else None,
            }
        )
    return rows


def _headline_table(records: Sequence[RunRecord], meta: dict[str, Any]) -> list[str]:
    oracle = meta.get("oracle")
    lines = [
        f"| server | highest rate with P95 ≤ {SLO_P95_MS / 1000:g} s | its real tok/s | "
        "light-load P95 ms | real tok/s at saturation | peak RSS MB | oracle real tok/s | "
        "of oracle |",
        "|" + "---|" * 8,
    ]
    rows = headline_rows(records, oracle)
    for h in rows:
        slo = "none in this sweep"
        if h["slo_rate"] is not None:
            slo = f"x{h['slo_rate']:g}"
            if h["slo_offered_rps"] is not None:
                slo += f" ({h['slo_offered_rps']:.1f} req/s)"
        sat = fmt(h["saturation_real_tokens_per_s"], 0)
        if h["saturation_real_tokens_per_s"] is not None:
            sat += f" (x{h['saturation_rate']:g}"
            if h["saturation_error_rate"]:
                sat += f", {_pct(h['saturation_error_rate'])} failed"
            sat += ")"
        lines.append(
            f"| {h['name']} | {slo} | {fmt(h['slo_real_tokens_per_s'], 0)} "
            f"| {fmt(h['light_p95_ms'])} (x{h['light_rate']:g}) | {sat} "
            f"| {fmt(h['peak_memory_mb'], 0)} | {fmt(h['oracle_real_tokens_per_s'], 0)} "
            f"| {_pct(h['of_oracle'])} |"
        )
    lines += [
        "",
        f"Highest rate: the largest multiplier of the sweep at which P95 ≤ {SLO_P95_MS:g} ms "
        f"with at most {_pct(MAX_ERROR_RATE)} of requests failed (req/s offered in brackets). "
        "Saturation: the most real (unpadded) tokens/s the server answered at any rate of the "
        "sweep, the rate in brackets; it is the server's capacity only if the sweep went past "
        "it. Peak RSS: the largest over its runs.",
    ]
    if meta.get("oracle_note"):
        lines += ["", str(meta["oracle_note"])]
    over = [h["name"] for h in rows if h["kind"] == "strategy" and (h["of_oracle"] or 0) > 1]
    if over:
        lines += [
            "",
            f"**The cost model is slower than this machine**: {', '.join(over)} served more "
            "than the oracle it bounds, so the oracle column understates what this CPU can "
            "do. Profile the model here (`lenbatch profile`) and re-run for a meaningful ratio.",
        ]
    elif not oracle:
        lines += ["", "No cost model given (`--cost FILE`): no oracle column."]
    return lines


def _peer_section(meta: dict[str, Any]) -> list[str]:
    setup = meta.get("peer_setup") or {}
    if not setup:
        return []
    out = ["## Peers from other projects", ""]
    for name, info in setup.items():
        versions = ", ".join(f"{k} {v}" for k, v in (info.get("versions") or {}).items())
        install = "–"
        if info.get("install_s") is not None:
            install = f"{info['install_s']:g} s, {fmt(info.get('disk_mb'), 0)} MB on disk"
        out += [
            f"**{name}**: {versions or 'versions unknown'} (Python {info.get('python') or '?'})",
            "",
            f"- installed with: `pip install {' '.join(info.get('requirements') or [])}`"
            + (
                f", then removed {', '.join(info['uninstalled'])}"
                if info.get("uninstalled")
                else ""
            ),
            f"- install: {install}",
            f"- command: `{' '.join(info.get('command') or [])}`",
            "- environment: " + ", ".join(f"`{k}={v}`" for k, v in (info.get("env") or {}).items()),
        ]
        out += [f"- {note}" for note in info.get("notes") or []]
        out.append("")
    return out


def _prediction_table(records: Sequence[RunRecord]) -> list[str]:
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
            f"| {_diff(p.get('p50_ms'), s['p50_ms'])} "
            f"| {fmt(p.get('p95_ms'))} / {fmt(s['p95_ms'])} "
            f"| {_diff(p.get('p95_ms'), s['p95_ms'])} "
            f"| {fmt(p.get('throughput_rps'), 2)} / {fmt(s['throughput_rps'], 2)} "
            f"| {_diff(p.get('throughput_rps'), s['throughput_rps'])} "
            f"| {_pct(p.get('padding_waste'))} / {_pct(s['padding_waste'])} |"
        )
    return lines


def _driver_table(records: Sequence[RunRecord]) -> list[str]:
    lines = [
        "| server | driver CPU s | CPU share | send late p50 ms | p99 ms | max ms | not sent |",
        "|" + "---|" * 7,
    ]
    for r in records:
        d = r.summary.get("driver", {})
        share = d.get("cpu_share")
        lines.append(
            f"| {r.label} | {fmt(d.get('cpu_s'), 2)} | {_pct(share)} "
            f"| {fmt(d.get('send_lateness_p50_ms'), 2)} | {fmt(d.get('send_lateness_p99_ms'), 2)} "
            f"| {fmt(d.get('send_lateness_max_ms'), 2)} | {fmt(d.get('not_sent'))} |"
        )
    return lines


def _bucket_tables(records: Sequence[RunRecord]) -> list[str]:
    out: list[str] = []
    for r in records:
        rows = r.summary.get("per_bucket") or []
        if not rows:
            continue
        out += [
            f"**{r.label}**",
            "",
            "| bucket | requests | P50 ms | P95 ms | padding waste | mean batch | "
            "queue wait p50 ms (server) | exec ms per batch |",
            "|" + "---|" * 8,
        ]
        for b in rows:
            out.append(
                f"| {b['bucket']} | {b['requests']} | {fmt(b.get('p50_ms'))} "
                f"| {fmt(b.get('p95_ms'))} | {_pct(b.get('padding_waste'))} "
                f"| {fmt(b.get('mean_batch_size'))} | {fmt(b.get('server_queue_wait_p50_ms'))} "
                f"| {fmt(b.get('mean_exec_ms'))} |"
            )
        out.append("")
    return out


def _streaming_table(records: Sequence[RunRecord]) -> list[str]:
    rows = [r for r in records if r.summary.get("ttft_p50_ms") is not None]
    if not rows:
        return []
    lines = [
        "| server | TTFT P50 ms | TTFT P95 ms | ITL P50 ms | ITL P95 ms | output tok/s |",
        "|" + "---|" * 6,
    ]
    for r in rows:
        s = r.summary
        lines.append(
            f"| {r.label} | {fmt(s['ttft_p50_ms'])} | {fmt(s['ttft_p95_ms'])} "
            f"| {fmt(s['itl_p50_ms'])} | {fmt(s['itl_p95_ms'])} "
            f"| {fmt(s['output_tokens_per_s'], 1)} |"
        )
    return lines


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
    md += _headline_table(records, meta)
    md += [""]
    stream = _streaming_table(records)
    if stream:
        md += [
            "Completions, per rate (a fixed load): time to first token, inter-token latency "
            "and output tokens/s.",
            "",
            *stream,
            "",
        ]
    md += ["## Results", ""]
    md += _main_table(records, peer)
    md += [
        "",
        "Latency is measured by the client from send to complete answer. Padding waste "
        "(token-weighted, this run only) and mean batch size come from the server's `/stats`; "
        "peers do not report them. Peak MB is the peak RSS of the server's whole process tree, "
        "sampled by the benchmark. Ratios: this row divided by the reference row at the same rate.",
        "",
    ]
    pred = _prediction_table(records)
    md += ["## Simulator prediction vs live", ""]
    md += pred or [str(meta.get("prediction_note", "No predictions were given for this run."))]
    md += [""]
    md += _peer_section(meta)
    md += ["## Load driver", "", *_driver_table(records), ""]
    md += [
        "The driver runs on the same CPUs as the server; its CPU share and how late it sent "
        "(against the trace's schedule) say how far the figures above can be trusted.",
        "",
    ]
    md += ["## Per bucket", "", *_bucket_tables(records)]
    if plots:
        md += ["## Plots", ""]
        md += [f"![{p}]({p})" for p in plots]
        md += [""]
    return "\n".join(md)


def _ok_latencies_ms(r: RunRecord) -> np.ndarray[Any, Any]:
    assert r.result is not None
    lat = r.result.latencies
    return np.sort(1000 * lat[~np.isnan(lat)])


def write_plots(records: Sequence[RunRecord], out_dir: Path) -> list[str]:
    """Latency CDF, throughput over time, padding waste per bucket, queue wait vs execution
    and, with several rates, P95 against throughput. Returns the file names written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written: list[str] = []
    # The most loaded point: where the strategies differ (at light load they all look alike).
    base = [r for r in records if r.rate == max(x.rate for x in records)] if records else []
    with_cols = [r for r in base if r.result is not None]

    def save(fig: Any, name: str) -> None:
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=100)
        plt.close(fig)
        written.append(name)

    if with_cols:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for r in with_cols:
            ms = _ok_latencies_ms(r)
            assert r.result is not None
            total = len(r.result.outcomes)  # failed requests never complete: the curve
            if ms.size:  # tops out at the fraction answered
                ax.step(ms, np.arange(1, ms.size + 1) / total, where="post", label=r.label)
        ax.set(xscale="log", xlabel="latency (ms, log)", ylabel="fraction of all requests")
        ax.set_title("Latency CDF (failed requests never reach the top)")
        ax.grid(alpha=0.3)
        ax.legend()
        save(fig, "latency_cdf.png")

        fig, ax = plt.subplots(figsize=(7, 4.5))
        for r in with_cols:
            assert r.result is not None
            t, rate = _sliding_rate(r.result.done[r.result.outcomes == OUTCOME_OK])
            ax.plot(t, rate, label=r.label)
        first = with_cols[0].result
        assert first is not None
        t, rate = _sliding_rate(first.scheduled)
        ax.plot(t, rate, "k--", lw=1, label="offered")
        ax.set(xlabel="time (s)", ylabel=f"requests per second ({_WINDOW_S:g} s window)")
        ax.set_title("Throughput over time (completed vs offered)")
        ax.grid(alpha=0.3)
        ax.legend()
        save(fig, "throughput.png")

    wasted = [r for r in base if any(b.get("padding_waste") is not None for b in _rows(r))]
    if wasted:
        fig, ax = plt.subplots(figsize=(8, 4.5))
        labels: list[str] = []
        for r in wasted:
            for b in _rows(r):
                if b["bucket"] not in labels:
                    labels.append(b["bucket"])
        width = 0.8 / len(wasted)
        for k, r in enumerate(wasted):
            vals = {b["bucket"]: b.get("padding_waste") for b in _rows(r)}
            xs = [i + k * width for i, lab in enumerate(labels) if vals.get(lab) is not None]
            ys = [100 * float(vals[lab]) for lab in labels if vals.get(lab) is not None]  # type: ignore[arg-type]
            ax.bar(xs, ys, width=width, label=r.label)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(labels))], labels, rotation=30)
        ax.set(ylabel="padding waste (%)", title="Padding waste per bucket (server lanes)")
        ax.legend()
        save(fig, "waste_per_bucket.png")

    timed = [r for r in base if (r.summary.get("server") or {}).get("mean_exec_ms") is not None]
    if timed:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        pos = np.arange(len(timed), dtype=np.float64)
        waits = [r.summary.get("queue_wait_p50_ms") or 0.0 for r in timed]
        waits95 = [r.summary.get("queue_wait_p95_ms") or 0.0 for r in timed]
        execs = [r.summary["server"]["mean_exec_ms"] for r in timed]
        ax.bar(pos - 0.27, waits, 0.27, label="queue wait P50")
        ax.bar(pos, waits95, 0.27, label="queue wait P95")
        ax.bar(pos + 0.27, execs, 0.27, label="execution per batch (mean)")
        ax.set_xticks(pos, [r.label for r in timed])
        ax.set(ylabel="ms", title="Queue wait vs execution (server side)")
        ax.legend()
        save(fig, "queue_vs_exec.png")

    if len({r.rate for r in records}) > 1:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for name in dict.fromkeys(r.name for r in records):
            pts = sorted((r.rate, r.summary) for r in records if r.name == name)
            ax.plot(
                [s["real_tokens_per_s"] for _, s in pts],
                [s["p95_ms"] or np.nan for _, s in pts],
                marker="o",
                label=name,
            )
        ax.set(xlabel="real tokens/s served", ylabel="P95 latency (ms)", yscale="log")
        ax.set_title("Rate sweep: P95 vs throughput")
        ax.grid(alpha=0.3)
        ax.legend()
        save(fig, "rate_sweep.png")
    return written


_WINDOW_S = 5.0


def _sliding_rate(times: np.ndarray[Any, Any]) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """Events per second over a trailing window, on a 0.5 s grid (batches make 1 s bins spiky)."""
    if times.size == 0:
        return np.zeros(0), np.zeros(0)
    ts = np.sort(times)
    grid = np.arange(0.0, float(ts[-1]) + 0.5, 0.5)
    counts = np.searchsorted(ts, grid, side="right") - np.searchsorted(
        ts, grid - _WINDOW_S, side="right"
    )
    return grid, counts / _WINDOW_S


def _rows(r: RunRecord) -> list[dict[str, Any]]:
    """The server's own lanes (with their padding waste), as `bucket` rows."""
    lanes = (r.summary.get("server") or {}).get("lanes") or []
    return [{**lane, "bucket": lane["server_bucket"]} for lane in lanes]


def write_report(out_dir: str | Path, records: Sequence[RunRecord], meta: dict[str, Any]) -> Path:
    """Write `report.md` and its plots into `out_dir`; returns the report's path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    plots = write_plots(records, out)
    path = out / "report.md"
    path.write_text(render_markdown(records, meta, plots) + "\n", encoding="utf-8")
    return path
