"""`lenbatch replay`: send a trace or scenario to a live server open-loop and summarise it."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

from lenbatch.cli.common import add_boundaries_option
from lenbatch.cli.traffic import (
    add_traffic_options,
    describe,
    driver_options,
    traffic_from_args,
)


def register(sub: Any) -> None:
    """Add the `replay` subcommand."""
    p = sub.add_parser(
        "replay",
        help="replay a trace or scenario against a live server (open loop)",
        description="Send each request at its (scaled) trace timestamp, never waiting for "
        "earlier answers, with a body of the trace's token length built from real text. "
        "Prints the same summary keys as `simulate`, plus the server's own padding waste, "
        "batch size and memory from GET /stats, and the driver's CPU time and send lateness. "
        "Only loopback URLs are accepted.",
    )
    add_traffic_options(p)
    p.add_argument(
        "--url",
        required=True,
        help="server base URL on this machine, e.g. http://127.0.0.1:8000",
    )
    add_boundaries_option(p, "report latency per these buckets (default: the server's own)")
    p.add_argument("--json", metavar="FILE", help="write the summary as JSON ('-': stdout)")
    p.set_defaults(run=run)


def check_loopback(url: str) -> None:
    """Refuse anything but a loopback address: a load test never leaves this machine."""
    import httpx

    host = httpx.URL(url).host
    if not (host in ("localhost", "::1") or host.startswith("127.")):
        raise ValueError(f"--url must be a loopback address (127.0.0.1, localhost), got {host!r}")


def print_summary(s: dict[str, Any], file: Any = sys.stdout) -> None:
    """A short human-readable summary."""

    def f(v: Any, unit: str = "", digits: int = 1) -> str:
        return "–" if v is None else f"{v:,.{digits}f}{unit}"

    d = s.get("driver", {})
    waste = "–" if s["padding_waste"] is None else f"{100 * s['padding_waste']:.1f} %"
    lines = [
        f"requests {s['requests']}  completed {s['completed']}  errors {s['errors']}  "
        f"rejected {s['rejected']}  error rate {100 * s['error_rate']:.1f} %",
        f"latency p50 {f(s['p50_ms'], ' ms')}  p95 {f(s['p95_ms'], ' ms')}  "
        f"p99 {f(s['p99_ms'], ' ms')}",
        f"throughput {f(s['throughput_rps'], ' req/s', 2)}  "
        f"real tokens {f(s['real_tokens_per_s'], ' tok/s', 0)}  over {f(s['duration_s'], ' s')}",
        f"server: padding waste {waste}  "
        f"mean batch {f(s['mean_batch_size'])}  peak RSS {f(s['peak_memory_mb'], ' MB', 0)}",
        f"driver: {d.get('clients')} clients, CPU {f(d.get('cpu_s'), ' s', 2)} "
        f"({f(100 * (d.get('cpu_share') or 0), ' %')} of one core), send late p50 "
        f"{f(d.get('send_lateness_p50_ms'), ' ms', 2)} p99 "
        f"{f(d.get('send_lateness_p99_ms'), ' ms', 2)} max "
        f"{f(d.get('send_lateness_max_ms'), ' ms', 2)}",
    ]
    if s.get("ttft_p50_ms") is not None:
        lines.append(
            f"TTFT p50 {f(s['ttft_p50_ms'], ' ms')} p95 {f(s['ttft_p95_ms'], ' ms')}  "
            f"ITL p50 {f(s['itl_p50_ms'], ' ms')} p95 {f(s['itl_p95_ms'], ' ms')}  "
            f"output {f(s['output_tokens_per_s'], ' tok/s')}"
        )
    if s.get("error_kinds"):
        lines.append(f"errors by kind: {s['error_kinds']}")
    print("\n".join(lines), file=file)


def run(args: argparse.Namespace) -> int:
    """Build the bodies, replay, print (and optionally save) the summary."""
    from lenbatch.replay.driver import replay, summarize_replay

    check_loopback(args.url)
    traffic = traffic_from_args(args)
    for note in traffic.plan.notes:
        print(f"replay: {note}", file=sys.stderr)
    result = asyncio.run(replay(args.url, traffic.plan, traffic.endpoint, **driver_options(args)))
    summary = summarize_replay(result, boundaries=args.boundaries, max_length=args.max_length)
    summary["notes"] = list(traffic.plan.notes)
    summary["settings"] = describe(args)
    print_summary(summary, sys.stderr if args.json == "-" else sys.stdout)
    if args.json:
        text = json.dumps(summary, indent=2)
        if args.json == "-":
            print(text)
        else:
            with open(args.json, "w", encoding="utf-8") as fh:
                fh.write(text + "\n")
    return 0
