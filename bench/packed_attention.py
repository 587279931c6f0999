#!/usr/bin/env python3
"""The packed encoder's attention: lenbatch's C++ op (AVX-512 or AVX2; AMX tiles) against torch's.

    bench/run.py packed-attention
    python bench/packed_attention.py --rounds 3 --out bench/results/packed_attention.md
    python bench/packed_attention.py --dtype float32 [--quantize int8]   # an AVX2 CPU

MiniLM packed in bfloat16 (`--dtype`, `--quantize`: as `serve` takes them) on one torch
thread (one batch per thread, as `serve` runs two at once on two cores). For each of the
long-input buckets (<= 35, 75, 112, 167, 256 tokens) a batch of 32 rows of random lengths
within the bucket. Two measurements, each alternated
between the arms round by round so a host that slows down hits all alike:

- attention alone, per layer call: `packed_attention` on the packed Q/K/V rows against the
  padded grid, key mask and gather around `F.scaled_dot_product_attention` (the fallback);
- the whole packed forward (`embed_packed`) of each batch, with the op and with it forced off.

The op has two arms where the CPU has the AMX tile unit and the dtype is bfloat16: its AVX-512
loop (`LENBATCH_AMX=off`) and its tile path (the default there); elsewhere only the first (on
an AVX2 CPU, float32 only).

Reported: medians over the rounds (each round the median of 7 calls), and the ratio.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import torch

from lenbatch.core.collate import Packed, pack
from lenbatch.runners import decode_attention as da
from lenbatch.runners import load_runner
from lenbatch.runners.hardware import processor_key
from lenbatch.runners.packed import _Attention

BUCKETS = ((8, 35), (36, 74), (75, 112), (113, 167), (168, 256))


def _median_ms(fn: Callable[[], object], calls: int = 7) -> float:
    fn()
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times)


def _batches(rows: int, seed: int) -> list[Packed]:
    rng = np.random.default_rng(seed)
    out = []
    for lo, hi in BUCKETS:
        lengths = rng.integers(lo, hi + 1, rows)
        out.append(pack([list(rng.integers(1000, 20000, int(n))) for n in lengths]))
    return out


def measure(rounds: int, rows: int, dtype: str = "bfloat16", quantization: str = "none") -> str:
    """The two tables, as Markdown."""
    torch.set_num_threads(1)
    op = da.decode_attention_op()
    if op is None:
        raise SystemExit(f"the C++ op is not available here: {da.kernel_unavailable()}")
    options = {"dtype": dtype, "execution": "packed", "quantization": quantization}
    with_op = load_runner("minilm", **options)
    os.environ["LENBATCH_DECODE_ATTENTION"] = "sdpa"
    da._loaded.clear()
    without = load_runner("minilm", **options)
    del os.environ["LENBATCH_DECODE_ATTENTION"]
    assert with_op._kernel is not None and without._kernel is None  # type: ignore[attr-defined]
    batches = _batches(rows, 0)
    heads, dim = 12, 32
    mm = with_op._mm_dtype  # type: ignore[attr-defined]
    vectors = "AVX-512" if hasattr(op, "bf16_linear") else "AVX2"
    tiles = op.has_amx() and mm == torch.bfloat16
    arms = ["sdpa", "op"] + (["amx"] if tiles else [])
    names = {"sdpa": "torch (grid + SDPA)", "op": f"op, {vectors}", "amx": "op, AMX tiles"}
    att: dict[str, list[list[float]]] = {arm: [] for arm in arms}
    fwd: dict[str, list[list[float]]] = {arm: [] for arm in arms}
    cpu = torch.device("cpu")
    with torch.inference_mode():
        for r in range(rounds):
            for arm in arms if r % 2 == 0 else arms[::-1]:
                kernel = None if arm == "sdpa" else op
                runner = without if arm == "sdpa" else with_op
                runner._amx = arm == "amx"  # type: ignore[attr-defined]
                row_a, row_f = [], []
                for b in batches:
                    qkv = torch.randn(b.real_tokens, 3 * heads * dim).to(mm)
                    attend = _Attention(b, cpu, mm, b.real_tokens, kernel, arm == "amx")
                    row_a.append(_median_ms(lambda: attend(qkv, heads, dim)))  # noqa: B023
                    row_f.append(_median_ms(lambda: runner.embed_packed(b), calls=5))  # noqa: B023
                att[arm].append(row_a)
                fwd[arm].append(row_f)
    ratios = [(arms[i], arms[j]) for i in range(len(arms)) for j in range(i + 1, len(arms))]
    lines = []
    for title, res in (("Attention alone, one layer call", att), ("Whole packed forward", fwd)):
        med = {
            arm: [statistics.median(x[i] for x in res[arm]) for i in range(len(batches))]
            for arm in arms
        }
        lines += [
            f"**{title}** (ms, median over {rounds} rounds):",
            "",
            "| bucket | tokens | "
            + " | ".join(names[a] for a in arms)
            + " | "
            + " | ".join(f"{a} / {b}" for a, b in ratios)
            + " |",
            "|---|---:|" + "---:|" * (len(arms) + len(ratios)),
        ]
        rows_out = [
            (f"{lo}-{hi}", b.real_tokens, {a: med[a][i] for a in arms})
            for i, ((lo, hi), b) in enumerate(zip(BUCKETS, batches, strict=True))
        ]
        rows_out.append(
            ("all five", sum(b.real_tokens for b in batches), {a: sum(med[a]) for a in arms})
        )
        for label, tokens, ms in rows_out:
            lines.append(
                f"| {label} | {tokens:,} | "
                + " | ".join(f"{ms[a]:.2f}" for a in arms)
                + " | "
                + " | ".join(f"{ms[a] / ms[b]:.2f}x" for a, b in ratios)
                + " |"
            )
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    """Run both A/Bs and print (or write) the tables."""
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--rounds", type=int, default=4, help="alternated rounds per arm")
    p.add_argument("--rows", type=int, default=32, help="rows per batch")
    p.add_argument("--dtype", default="bfloat16", help="the runner's dtype (default bfloat16)")
    p.add_argument("--quantize", default="none", choices=("none", "int8"))
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    body = measure(args.rounds, args.rows, args.dtype, args.quantize)
    head = (
        f"Command: `{' '.join(['bench/packed_attention.py', *sys.argv[1:]])}`  \n"
        f"Processor: `{processor_key()}`; torch {torch.__version__}, 1 thread, "
        f"Python {platform.python_version()}; MiniLM packed, {args.dtype}"
        f"{', --quantize ' + args.quantize if args.quantize != 'none' else ''}, {args.rows} rows "
        "per batch of random lengths within each bucket.\n\n"
    )
    text = head + body
    print(text)
    if args.out:
        args.out.write_text(text + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
