"""The tables of the benchmark report, each from the runs' `RunRecord`s: the headline (highest
rate within the latency bound, saturation, oracle), the results at each rate with ratios to
`fifo` and a peer, streaming (TTFT, inter-token latency), the load driver's own figures, the
per-bucket rows, and how peers from other projects were installed. Markdown lines out; nothing
here measures anything."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lenbatch.replay.records import (
    MAX_ERROR_RATE,
    SLO_P95_MS,
    RunRecord,
    fmt,
    pct,
    ratio,
    times,
)

__all__ = [
    "bucket_tables",
    "driver_table",
    "headline_rows",
    "headline_table",
    "peer_section",
    "results_table",
    "streaming_table",
]


def _reference(records: Sequence[RunRecord], name: str, rate: float) -> RunRecord | None:
    return next((r for r in records if r.name == name and r.rate == rate), None)


def results_table(records: Sequence[RunRecord], peer: str | None) -> list[str]:
    """One row per run: latency, throughput, errors, waste, batch size and memory, with ratios
    to `fifo` and to `peer` at the same rate."""
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
            f"| {fmt(s['real_tokens_per_s'], 0)} | {pct(s['error_rate'])} "
            f"| {pct(s['padding_waste'])} | {fmt(s['mean_batch_size'], 1)} "
            f"| {fmt(s['peak_memory_mb'], 0)} "
            f"| {times(ratio(s['real_tokens_per_s'], fs.get('real_tokens_per_s')))} "
            f"| {times(ratio(s['p95_ms'], fs.get('p95_ms')))} "
            f"| {times(ratio(s['real_tokens_per_s'], ps.get('real_tokens_per_s')))} "
            f"| {times(ratio(s['p95_ms'], ps.get('p95_ms')))} |"
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


def headline_table(records: Sequence[RunRecord], meta: dict[str, Any]) -> list[str]:
    """The headline: `headline_rows` as a table, with what its columns mean and, when
    `meta` has an oracle, whether the cost model under it is slower than this machine."""
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
                sat += f", {pct(h['saturation_error_rate'])} failed"
            sat += ")"
        lines.append(
            f"| {h['name']} | {slo} | {fmt(h['slo_real_tokens_per_s'], 0)} "
            f"| {fmt(h['light_p95_ms'])} (x{h['light_rate']:g}) | {sat} "
            f"| {fmt(h['peak_memory_mb'], 0)} | {fmt(h['oracle_real_tokens_per_s'], 0)} "
            f"| {pct(h['of_oracle'])} |"
        )
    lines += [
        "",
        f"Highest rate: the largest multiplier of the sweep at which P95 ≤ {SLO_P95_MS:g} ms "
        f"with at most {pct(MAX_ERROR_RATE)} of requests failed (req/s offered in brackets). "
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


def peer_section(meta: dict[str, Any]) -> list[str]:
    """How each peer from another project was installed and launched (`meta['peer_setup']`);
    nothing without such peers."""
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


def driver_table(records: Sequence[RunRecord]) -> list[str]:
    """The load driver's CPU time and send lateness per run: how far the figures can be trusted."""
    lines = [
        "| server | driver CPU s | CPU share | send late p50 ms | p99 ms | max ms | not sent |",
        "|" + "---|" * 7,
    ]
    for r in records:
        d = r.summary.get("driver", {})
        share = d.get("cpu_share")
        lines.append(
            f"| {r.label} | {fmt(d.get('cpu_s'), 2)} | {pct(share)} "
            f"| {fmt(d.get('send_lateness_p50_ms'), 2)} | {fmt(d.get('send_lateness_p99_ms'), 2)} "
            f"| {fmt(d.get('send_lateness_max_ms'), 2)} | {fmt(d.get('not_sent'))} |"
        )
    return lines


def bucket_tables(records: Sequence[RunRecord]) -> list[str]:
    """One table per run that has per-bucket rows: latency, waste, batch size, queue wait, exec."""
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
                f"| {fmt(b.get('p95_ms'))} | {pct(b.get('padding_waste'))} "
                f"| {fmt(b.get('mean_batch_size'))} | {fmt(b.get('server_queue_wait_p50_ms'))} "
                f"| {fmt(b.get('mean_exec_ms'))} |"
            )
        out.append("")
    return out


def streaming_table(records: Sequence[RunRecord]) -> list[str]:
    """TTFT, inter-token latency and output tokens/s of streamed completions; nothing otherwise."""
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
