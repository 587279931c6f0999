"""Soak: replay the dev trace against one `lenbatch serve` for a long time and watch its memory.

    bench/run.py soak -- --minutes 10 --rate-scale 2.3 --out bench/results/soak.md
    bench/run.py soak -- --minutes 10 --rate-scale 2.3 --allocator system   # glibc's malloc

Starts the server on `make serve`'s line (MiniLM, the tuned config, strategy adaptive, 1 s
SLO, `--cost auto`; `--allocator` passed through), replays the bundled Azure trace with
`lenbatch replay` (open loop, real text; lengths x`--length-scale`, default 0.1: long inputs,
mean ~100 tokens, clipped to 256), samples the server's resident set every few seconds from
/proc, and writes a Markdown result: RSS after warm-up, the second half's median (steady
state) and its growth, the end, the trend per hour, the allocator the server ran on, and the
replay's summary (every request answered, error kinds). At `--rate-scale 2.3` the trace sends
~12.7 requests/s (~7,600 in 10 minutes), the load of issue 23's memory check.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np

from lenbatch.replay.process import free_port

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--rate-scale", type=float, default=2.3)
    p.add_argument("--length-scale", type=float, default=0.1)
    p.add_argument("--allocator", choices=["auto", "tcmalloc", "system"], default="auto")
    p.add_argument("--sample-s", type=float, default=5.0)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    server = subprocess.Popen(
        [
            str(BIN / "lenbatch"),
            "serve",
            "--config",
            "configs/minilm-azure-conv.toml",
            "--port",
            str(port),
            "--strategy",
            "adaptive",
            "--slo-ms",
            "1000",
            "--cost",
            "auto",
            *(["--allocator", args.allocator] if args.allocator != "auto" else []),
            "--log-level",
            "warning",
        ],
        cwd=ROOT,
        env=env,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or server.poll() is not None:
                raise SystemExit("server did not start")
            time.sleep(0.5)
        samples: list[tuple[float, float]] = []
        stop = threading.Event()
        t0 = time.monotonic()

        def sample() -> None:
            while not stop.is_set():
                samples.append((time.monotonic() - t0, rss_mb(server.pid)))
                stop.wait(args.sample_s)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        summary_file = ROOT / "out" / "soak-summary.json"
        summary_file.parent.mkdir(exist_ok=True)
        replay = [
            str(BIN / "lenbatch"),
            "replay",
            "azure-conv",
            "--url",
            url,
            "--length-scale",
            str(args.length_scale),
            "--max-length",
            "256",
            "--rate-scale",
            str(args.rate_scale),
            "--duration",
            str(args.minutes * 60),
            "--no-progress",
            "--json",
            str(summary_file),
        ]
        subprocess.run(replay, cwd=ROOT, env=env, check=True)
        stop.set()
        sampler.join()
        stats = httpx.get(f"{url}/stats", timeout=10).json()
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)
    summary = json.loads(summary_file.read_text())
    t = np.array([s[0] for s in samples])
    mb = np.array([s[1] for s in samples])
    warm = t >= min(60.0, t[-1] / 5)  # skip the first minute: allocator and caches warm up
    slope_h = float(np.polyfit(t[warm], mb[warm], 1)[0] * 3600) if warm.sum() > 2 else 0.0
    first, last = float(mb[warm][0]), float(mb[-1])
    half = t >= t[-1] / 2
    half_growth = float(mb[half][-1] - mb[half][0]) if half.sum() > 1 else 0.0
    steady = float(np.median(mb[half]))
    from lenbatch.runners.hardware import processor_key

    memory = stats["memory"]
    lines = [
        "# Soak: memory of one server under a long replay",
        "",
        f"Command: `.venv/bin/python bench/soak.py --minutes {args.minutes:g} --rate-scale "
        f"{args.rate_scale:g} --length-scale {args.length_scale:g} --allocator {args.allocator}"
        + (f" --out {args.out}`" if args.out else "`"),
        "",
        f"Processor: `{processor_key()}` ({platform.machine()}, {os.cpu_count()} cores); "
        f"{time.strftime('%Y-%m-%d')}. Server: `make serve`'s line (`lenbatch serve --config "
        "configs/minilm-azure-conv.toml --strategy adaptive --slo-ms 1000 --cost auto`, "
        f"MiniLM), allocator `{args.allocator}`: it ran on **{memory.get('allocator')}**. "
        f"Traffic: the bundled Azure trace, lengths x{args.length_scale:g} clipped to 256, rate "
        f"x{args.rate_scale:g}, real text bodies, open loop.",
        "",
        "| figure | value |",
        "|---|---:|",
        f"| duration | {t[-1]:.0f} s |",
        f"| requests sent | {summary['requests']} |",
        f"| answered 200 | {summary['completed']} |",
        f"| errors / rejected | {summary['errors']} / {summary['rejected']} |",
        f"| P50 / P95 / P99 ms | {summary['p50_ms']:.0f} / {summary['p95_ms']:.0f} / "
        f"{summary['p99_ms']:.0f} |",
        f"| server RSS after warm-up (t={t[warm][0]:.0f} s) | {first:.1f} MB |",
        f"| server RSS at the end | {last:.1f} MB |",
        f"| growth, end minus warm-up | {last - first:+.1f} MB |",
        f"| steady state: median RSS over the second half | {steady:.1f} MB |",
        f"| growth over the second half (t={t[half][0]:.0f}-{t[-1]:.0f} s) | "
        f"{half_growth:+.1f} MB ({100 * half_growth / mb[half][0]:+.1f} %) |",
        f"| trend (least squares after warm-up) | {slope_h:+.1f} MB/hour |",
        f"| server peak RSS (its own /stats) | {memory.get('peak_rss_mb', 0):.1f} MB |",
        f"| batches / padding waste (server) | {stats['batches']} / "
        f"{100 * stats['padding_waste']:.1f} % |",
        "",
        "RSS samples (s, MB), one per minute:",
        "",
        "```",
        *(f"{a:6.0f} {b:8.1f}" for a, b in samples[:: max(1, int(60 / args.sample_s))]),
        "```",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text, encoding="utf-8")


if __name__ == "__main__":
    main()
