#!/usr/bin/env python3
"""A decode step's attention over the running batch's cache: lenbatch's op against torch's.

    bench/run.py decode-attention
    python bench/decode_attention.py --shapes 1x200,8x300,32x150,32x310,32x600,64x310 --out FILE
    python bench/decode_attention.py --other-build PATH/TO/lenbatch_decode_attention_X.so

SmolLM2-135M's shapes (9 query heads on 3 key/value heads of 64; `--heads`, `--kv-heads`,
`--dim` for others), `rows` running sequences over a window of `columns`, each row left-padded
by a different count (a running batch's rows hold prompts of different lengths), random
queries, keys and values. One "step" is one call per layer over 30 layers' own keys and values
(`--layers`), so the cache is read from memory as a decode step reads it, not from the CPU's
caches. Arms, alternated round by round so a host that slows down hits both alike:

- `decode_attention(q, keys, values, mask, scale)`, what the lean path runs for a decode step
  where the ops are built (each row over its real columns only);
- `F.scaled_dot_product_attention` with the boolean mask and grouped heads, what it runs
  without them;
- with `--other-build`, the same op from another build of the ops (the `.so` of another
  commit, e.g. before a change to the loop), for a before/after in one process.

Reported: ms per step (all layers), the median over rounds of each round's median of 5 steps;
the ratio to lenbatch's op; and the op's rate over the real keys and values it reads.
"""

from __future__ import annotations

import argparse
import importlib.util
import platform
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from lenbatch.runners.decode_attention import decode_attention_op
from lenbatch.runners.hardware import processor_key

sys.path.insert(0, str(Path(__file__).resolve().parent))

from prompt_attention import median_call, write_table


def _load_build(path: Path) -> Any:
    """Another build of lenbatch's ops, loaded from its `.so`."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"{path}: not a loadable module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="1x200,8x300,32x150,32x310,32x600,64x310")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--other-build", type=Path, help="another build's .so of lenbatch's ops")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    op = decode_attention_op()
    if op is None:
        raise SystemExit("needs lenbatch's C++ ops (a CPU with AVX-512, or AVX2 and FMA)")
    other = _load_build(args.other_build) if args.other_build else None
    nh, nkv, d = args.heads, args.kv_heads, args.dim
    scale = d**-0.5
    group = nh // nkv
    other_head = " | other build | other / op" if other is not None else ""
    lines = [
        f"Processor: `{processor_key()}`; torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, Python {platform.python_version()}.",
        "",
        f"Command: `{' '.join(['bench/decode_attention.py', *sys.argv[1:]])}`",
        "",
        f"One decode step's attention ({args.layers} layers, each its own cache), {nh} query "
        f"heads on {nkv} key/value heads of {d}, float32: ms per step, median of "
        f"{args.rounds} alternated rounds (each the median of 5 steps).",
        "",
        f"| rows x columns | lenbatch op | torch SDPA | SDPA / op{other_head} | op GB/s |",
        "|---|---:|---:|---:|" + ("---:|---:|" if other is not None else "") + "---:|",
    ]
    gen = torch.Generator().manual_seed(0)
    for shape in args.shapes.split(","):
        rows, width = (int(x) for x in shape.split("x"))
        mask = torch.ones(rows, width, dtype=torch.bool)
        for r in range(rows):  # left padding of varied length, up to a quarter of the window
            mask[r, : (r * 7) % max(1, width // 4)] = False
        layers = [
            (
                torch.randn(rows, nh, d, generator=gen),
                torch.randn(rows, nkv, width, d, generator=gen),
                torch.randn(rows, nkv, width, d, generator=gen),
            )
            for _ in range(args.layers)
        ]

        def with_op(m: Any, layers: list[Any] = layers, mask: torch.Tensor = mask) -> object:
            return [m.decode_attention(q, k, v, mask, scale) for q, k, v in layers]

        def sdpa(layers: list[Any] = layers, mask: torch.Tensor = mask, rows: int = rows) -> object:
            out = []
            for q, k, v in layers:
                a = F.scaled_dot_product_attention(
                    q.view(rows, nkv, group, d), k, v, attn_mask=mask[:, None, None, :],
                    scale=scale,
                )  # fmt: skip
                out.append(a.reshape(rows, nh, d))
            return out

        arms: dict[str, Callable[[], object]] = {"op": lambda: with_op(op), "sdpa": sdpa}
        if other is not None:
            arms["other"] = lambda: with_op(other)
        ref = sdpa()
        for name, fn in arms.items():
            if name != "sdpa":
                for got, want in zip(fn(), ref, strict=True):  # type: ignore[call-overload]
                    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        times: dict[str, list[float]] = {name: [] for name in arms}
        for _ in range(args.rounds):
            for name, fn in arms.items():
                times[name].append(median_call(fn, calls=5))
        t = {name: statistics.median(xs) for name, xs in times.items()}
        real = int(mask.sum()) * nkv * d * 4 * 2 * args.layers
        cells = [f"{1000 * t['op']:.2f}", f"{1000 * t['sdpa']:.2f}", f"{t['sdpa'] / t['op']:.2f}x"]
        if other is not None:
            cells += [f"{1000 * t['other']:.2f}", f"{t['other'] / t['op']:.2f}x"]
        lines.append(
            f"| {rows} x {width} | " + " | ".join(cells) + f" | {real / t['op'] / 1e9:.1f} |"
        )
        print(lines[-1], flush=True)
        del layers
    write_table(lines, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
