"""Issue-2 benchmark: one mixed-length workload through static, fifo, sorted and bucketed,
in-process (engine + MiniLM, no HTTP), side by side in one run.

Workload: request lengths drawn from the dev trace (Azure LLM conversation trace) mapped onto
MiniLM (x0.05, clipped to 256 tokens: the mapping docs/traffic.md justifies), each request a
window of real text (public-domain State of the Union addresses) tokenized by MiniLM's own
tokenizer to exactly that length. Arrivals are open-loop Poisson at each given rate: every
strategy sees the same requests at the same moments.

    .venv/bin/python bench/bench_strategies.py --rates 8,30 --requests 400 \
        --out bench/results/strategies.md
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import time
import zipfile
from importlib import resources
from pathlib import Path

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from lenbatch.config import BatchingConfig, Strategy
from lenbatch.embed.engine import Engine
from lenbatch.plan.trace import load_trace, map_trace
from lenbatch.runners import EmbeddingRunner, load_runner
from lenbatch.serving.metrics import percentile


def corpus_ids(runner: EmbeddingRunner) -> list[int]:
    """MiniLM token ids of the bundled State of the Union corpus, no special tokens."""
    path = Path(str(resources.files("lenbatch") / "data" / "text" / "nltk_state_union.zip"))
    with zipfile.ZipFile(path) as z:
        names = sorted(n for n in z.namelist() if n.endswith(".txt"))[:12]
        text = "\n".join(z.read(n).decode("utf-8", errors="replace") for n in names)
    ids = runner.tokenize([text], truncate=False)[0]
    return ids[1:-1]


def workload(runner: EmbeddingRunner, n: int, seed: int) -> list[list[int]]:
    """`n` token sequences whose lengths follow the mapped dev trace."""
    trace = map_trace(load_trace("azure-conv"), length_scale=0.05, max_length=256)
    rng = np.random.default_rng(seed)
    lengths = rng.choice(trace.input_lengths, size=n)
    ids = corpus_ids(runner)
    cls, sep = runner.tokenize(["x"], False)[0][0], runner.tokenize(["x"], False)[0][-1]
    out = []
    for length in lengths:
        body = max(0, int(length) - 2)
        start = int(rng.integers(0, len(ids) - body))
        out.append([cls, *ids[start : start + body], sep])
    return out


async def run_one(
    runner: EmbeddingRunner,
    strategy: str,
    seqs: list[list[int]],
    gaps: np.ndarray,
    args: argparse.Namespace,
) -> dict[str, float]:
    """Replay the workload open-loop through one strategy; return its figures."""
    cfg = BatchingConfig(
        strategy=Strategy(strategy),
        max_batch=args.max_batch,
        max_wait_ms=args.max_wait_ms,
        max_batch_tokens=args.max_batch_tokens,
    )
    engine = Engine(runner, cfg)
    await engine.start()
    latencies: list[float] = []

    async def one(ids: list[int]) -> None:
        t0 = time.perf_counter()
        await engine.embed([ids])
        latencies.append(time.perf_counter() - t0)

    tasks = []
    start = time.perf_counter()
    due = start
    for ids, gap in zip(seqs, gaps, strict=True):
        due += gap
        delay = due - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(ids)))
    await asyncio.gather(*tasks)
    elapsed = time.perf_counter() - start
    stats = engine.metrics.stats()
    await engine.stop()
    return {
        "real_tok_s": stats["real_tokens"] / elapsed,
        "req_s": len(seqs) / elapsed,
        "waste": stats["padding_waste"],
        "batch": stats["mean_batch_size"],
        "p50_ms": 1000 * percentile(latencies, 50),
        "p95_ms": 1000 * percentile(latencies, 95),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rates", default="8,30", help="offered loads, requests/s")
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--strategies", default="static,fifo,sorted,bucketed")
    p.add_argument("--max-batch", type=int, default=32)
    p.add_argument("--max-wait-ms", type=float, default=10.0)
    p.add_argument("--max-batch-tokens", type=int, default=8192)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the Markdown table here")
    args = p.parse_args()
    runner = load_runner("minilm")
    seqs = workload(runner, args.requests, args.seed)
    lengths = np.array([len(s) for s in seqs])
    rng = np.random.default_rng(args.seed + 1)
    strategies = args.strategies.split(",")
    lines = [
        "# Strategies side by side (in-process, MiniLM)",
        "",
        f"Command: `.venv/bin/python bench/bench_strategies.py --rates {args.rates} "
        f"--requests {args.requests} --max-batch {args.max_batch} --max-wait-ms "
        f"{args.max_wait_ms:g} --seed {args.seed}`",
        "",
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"torch threads {__import__('torch').get_num_threads()}; date "
        f"{time.strftime('%Y-%m-%d')}.",
        f"Workload: {len(seqs)} requests, lengths from the Azure conv trace x0.05 clipped to "
        f"256 (p50 {int(np.median(lengths))}, p95 {int(np.percentile(lengths, 95))}, "
        f"mean {lengths.mean():.0f} tokens), real State-of-the-Union text; Poisson arrivals.",
        "Default bucketed boundaries (16,32,64,128 + overlong 129-256); max_batch "
        f"{args.max_batch}, max_wait {args.max_wait_ms:g} ms, token budget "
        f"{args.max_batch_tokens}.",
        "",
    ]
    # warm-up: first calls allocate
    asyncio.run(run_one(runner, "fifo", seqs[:20], np.zeros(20), args))
    for rate in [float(r) for r in args.rates.split(",")]:
        gaps = rng.exponential(1 / rate, size=len(seqs))
        rows = {s: asyncio.run(run_one(runner, s, seqs, gaps, args)) for s in strategies}
        base = rows.get("fifo")
        lines += [
            f"## Offered load {rate:g} req/s",
            "",
            "| strategy | real tok/s | vs fifo | req/s | padding waste | mean batch | P50 ms "
            "| P95 ms |",
            "|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for s, r in rows.items():
            ratio = f"{r['real_tok_s'] / base['real_tok_s']:.2f}x" if base else "-"
            lines.append(
                f"| {s} | {r['real_tok_s']:.0f} | {ratio} | {r['req_s']:.1f} | "
                f"{100 * r['waste']:.1f} % | {r['batch']:.1f} | {r['p50_ms']:.0f} | "
                f"{r['p95_ms']:.0f} |"
            )
        lines.append("")
        print("\n".join(lines[-(len(rows) + 4) :]), flush=True)
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
