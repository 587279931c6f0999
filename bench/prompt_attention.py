#!/usr/bin/env python3
"""A causal LM's whole-prompt attention: the AVX2 build's loop against torch's, float32.

    bench/run.py prompt-attention
    python bench/prompt_attention.py --lengths 32,64,128,256,400,1024 --rounds 7 --out FILE

SmolLM2-135M's shapes (9 query heads on 3 key/value heads of 64; `--heads`, `--kv-heads`,
`--dim` for others), one prompt of each length, random fused Q/K/V rows, on torch's threads
(2 here). Two arms, alternated round by round so a host that slows down hits both alike:

- `packed_attention(qkv, [0, n], heads, scale, True, kv_heads, causal=True)`, what the lean
  path runs where `LeanLlama.prompt_op` is set (an AVX2 build, float32);
- `F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)` on the same rows
  viewed as the lean path views them (`LENBATCH_PROMPT_ATTENTION=sdpa`), plus the copy back
  into rows that the lean path then makes.

Reported: per layer call, the median over rounds of each round's median of 7 calls, and the
ratio; a forward runs one call per layer (30 for SmolLM2). Needs lenbatch's C++ ops built as
an AVX2 build (a CPU without AVX-512).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from lenbatch.runners.decode_attention import decode_attention_op
from lenbatch.runners.hardware import processor_key


def median_call(fn: Callable[[], object], calls: int = 7) -> float:
    """The median seconds of `calls` calls of `fn` (`decode_attention.py` times with it too)."""
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="32,64,128,256,400,1024")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    op = decode_attention_op()
    if op is None or not op.causal_float32():
        raise SystemExit("needs lenbatch's C++ ops as an AVX2 build (a CPU without AVX-512)")
    nh, nkv, d = args.heads, args.kv_heads, args.dim
    scale = d**-0.5
    lines = [
        f"Processor: `{processor_key()}`; torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, Python {platform.python_version()}.",
        "",
        f"Command: `{' '.join(['bench/prompt_attention.py', *sys.argv[1:]])}`",
        "",
        f"One prompt's causal attention, {nh} query heads on {nkv} key/value heads of {d}, "
        f"float32: ms per layer call, median of {args.rounds} alternated rounds (each the "
        "median of 7 calls).",
        "",
        "| tokens | lenbatch AVX2 loop | torch SDPA | torch / loop |",
        "|---:|---:|---:|---:|",
    ]
    gen = torch.Generator().manual_seed(0)
    for n in (int(x) for x in args.lengths.split(",")):
        qkv = torch.randn(n, (nh + 2 * nkv) * d, generator=gen)
        starts = torch.tensor([0, n], dtype=torch.long)

        def loop(qkv: torch.Tensor = qkv, starts: torch.Tensor = starts) -> object:
            return op.packed_attention(qkv, starts, nh, scale, True, nkv, True)

        def sdpa(qkv: torch.Tensor = qkv, n: int = n) -> object:
            v4 = qkv.view(1, n, nh + 2 * nkv, d).transpose(1, 2)
            q, k, v = v4[:, :nh], v4[:, nh : nh + nkv], v4[:, nh + nkv :]
            out = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=scale, enable_gqa=True
            )
            return out.transpose(1, 2).reshape(n, nh * d)

        torch.testing.assert_close(loop(), sdpa(), atol=1e-4, rtol=1e-4)
        a: list[float] = []
        b: list[float] = []
        for _ in range(args.rounds):
            a.append(median_call(loop))
            b.append(median_call(sdpa))
        ta, tb = statistics.median(a), statistics.median(b)
        lines.append(f"| {n} | {1000 * ta:.3f} | {1000 * tb:.3f} | {tb / ta:.2f}x |")
        print(lines[-1], flush=True)
    write_table(lines, args.out)
    return 0


def write_table(lines: list[str], out: Path | None) -> None:
    """Print the table's `lines`, and write them to `out` when given."""
    text = "\n".join(lines) + "\n"
    print(text)
    if out:
        out.write_text(text, encoding="utf-8")


if __name__ == "__main__":
    raise SystemExit(main())
