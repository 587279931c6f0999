"""A left-padded prefill job's forward on the lean Llama path, its padding left out of the
products (the default) against run through them (`LENBATCH_PREFILL_PADDING=keep`).

    bench/llm_padded_prefill.py --model smollm2 --config lean-fp32-int4 \\
        --jobs 127,101,88,72 255,190 400,330 120,40 --repeats 9 [--decode-rows 36] [--out FILE]

Each job is prompts of the given token lengths (different slices of the bundled GSM8K text),
left-padded to the longest and prefilled in one forward into a fresh cache, as a prefill unit
of `generate.decode` runs a scheduler batch of one length bucket. The two runners (the same
configuration of `llm_decode_step.CONFIGS`, built with and without the variable) take turns
forward by forward. Reported: the medians in ms, the ratio, and the real tokens per second of
each. With `--decode-rows N`, each forward also carries a decode step of N running rows over
`--cols` cached columns (`forward_segments`), as a mixed unit of continuous batching does.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from lenbatch.generate.kvcache import KVBatch
from lenbatch.runners.base import Segment
from lenbatch.runners.causal import CausalLMRunner, resolve_causal_model
from lenbatch.runners.llama_attention import PADDING_ENV
from llm_decode_step import CONFIGS, build_runner, header, prompt_ids, running_batch, write


def _job(ids: list[int], lengths: list[int]) -> tuple[torch.Tensor, ...]:
    """Prompts of `lengths` tokens, left-padded to the longest: ids, mask, positions."""
    width = max(lengths)
    x = torch.full((len(lengths), width), 2, dtype=torch.long)
    mask = torch.zeros_like(x)
    for r, n in enumerate(lengths):
        x[r, width - n :] = torch.tensor(ids[r * 7 : r * 7 + n])
        mask[r, width - n :] = 1
    return x, mask, (mask.cumsum(1) - 1).clamp(min=0)


def _forward(runner: CausalLMRunner, job: tuple[torch.Tensor, ...], kv: KVBatch | None) -> float:
    """Seconds of one forward of `job` into a fresh cache (beside `kv`'s decode step)."""
    cache = runner.new_cache()
    segments = [Segment(*job, cache=cache)]
    if kv is not None:
        segments.insert(0, Segment(*kv.step_inputs(), cache=kv.cache))
    t0 = time.perf_counter()
    runner.forward_segments(segments)
    elapsed = time.perf_counter() - t0
    if kv is not None:
        kv.rollback()  # the window reads `--cols` columns again next time
    return elapsed


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--config", default="lean-fp32-int4", choices=sorted(CONFIGS))
    p.add_argument(
        "--jobs",
        nargs="+",
        default=["127,101,88,72", "255,190", "400,330", "120,40"],
        help="one job per argument: its prompts' token lengths, comma-separated",
    )
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--decode-rows", type=int, default=0, help="a decode step beside each job")
    p.add_argument("--cols", type=int, default=300, help="the decode rows' cached columns")
    p.add_argument("--out", type=Path, help="write the table (markdown) here")
    args = p.parse_args()
    ref = resolve_causal_model(args.model)
    if ref is None:
        raise SystemExit(f"{args.model} is not a causal LM")
    runners = {
        "padding left out": build_runner(ref, args.config),
        "padding run": build_runner(ref, args.config, {PADDING_ENV: "keep"}),
    }
    jobs = [[int(n) for n in j.split(",")] for j in args.jobs]
    ids = prompt_ids(runners["padding run"], max(args.cols, *(max(j) + 7 * len(j) for j in jobs)))
    kvs: dict[str, KVBatch | None] = {
        n: running_batch(r, ids[: args.cols], args.decode_rows) if args.decode_rows else None
        for n, r in runners.items()
    }
    beside = (
        f", beside a decode step of {args.decode_rows} rows x {args.cols} cached columns"
        if args.decode_rows
        else ""
    )
    lines = [
        *header("bench/llm_padded_prefill.py"),
        f"One left-padded prefill job's forward{beside}, `{args.config}`: ms, medians of "
        f"{args.repeats}, the two runners taking turns.",
        "",
        "| job (prompt tokens) | real / padded tokens | padding run | padding left out | "
        "speed-up | real tok/s, run / left out |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for lengths in jobs:
        job = _job(ids, lengths)
        times: dict[str, list[float]] = {n: [] for n in runners}
        for _ in range(2):  # warm-up: each new row count builds its kernels once
            for n, r in runners.items():
                _forward(r, job, kvs[n])
        for _ in range(args.repeats):
            for n, r in runners.items():
                times[n].append(_forward(r, job, kvs[n]))
        run, left = (statistics.median(times[n]) for n in ("padding run", "padding left out"))
        real, padded = sum(lengths), len(lengths) * max(lengths)
        lines.append(
            f"| {', '.join(map(str, lengths))} | {real} / {padded} | {1000 * run:.1f} | "
            f"{1000 * left:.1f} | {run / left:.2f}x | {real / run:,.0f} / {real / left:,.0f} |"
        )
        print(lines[-1], file=sys.stderr)
    return write(lines, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
