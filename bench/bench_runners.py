"""MiniLM forward on this CPU: each dtype/backend over a batch x length grid, side by side.

    bench/run.py runners -- --options fp32,bf16-cast,bf16-autocast,compile-fp32
    bench/run.py runners -- --grid 1x16,32x32 --repeats 3      # a smoke test

Every option embeds the same random-token batches (right-padded, every row at full length, so
padded = real tokens) through the same pooling; the table gives the median milliseconds and
padded tokens/s per point, and each option's speed-up over eager fp32 at the same point.
Options:

* `fp32`: eager torch, float32 weights (the runner's `--dtype float32`);
* `bf16-cast`: weights cast to bfloat16 (the runner's `--dtype bfloat16`);
* `bf16-autocast`: float32 weights under `torch.autocast("cpu", torch.bfloat16)`;
* `compile-fp32`, `compile-bf16`: `torch.compile(dynamic=True)` of the fp32 / bf16-cast model
  (its compile time is reported apart and kept out of the timings);
* `packed-fp32`, `packed-bf16`: the padding-free runner (`runners/packed.py`);
* `packed-int8`, `int8`: the packed and the padded runner with `--quantize int8` (int8
  products, float32 around them: `runners/int8.py`).

`--ragged` makes rows of random lengths up to the point's length instead, and `--buckets` one
such batch per length bucket (rows spread over the bucket): then padded and packed runners
differ, and the table's tokens/s counts real tokens. `--memory` adds each point's peak
activation memory: the tensor storage torch ops create during the forward (weights apart),
counted exactly through a dispatch mode, so it is the same on any CPU.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np
import torch

from lenbatch.core.collate import Collated, collate
from lenbatch.runners.encoder import EncoderRunner
from lenbatch.runners.hardware import cpu_model, processor_key
from lenbatch.runners.loading import resolve_model

DEFAULT_GRID = "1x16,1x256,8x64,32x32,32x256"
OPTIONS = (
    "fp32",
    "bf16-cast",
    "bf16-autocast",
    "compile-fp32",
    "compile-bf16",
    "packed-fp32",
    "packed-bf16",
    "packed-int8",
    "int8",
)


def _grid(text: str) -> list[tuple[int, int]]:
    out = []
    for item in text.split(","):
        b, _, n = item.strip().partition("x")
        out.append((int(b), int(n)))
    return out


def _batch(
    rows: int, length: int, ragged: bool, rng: np.random.Generator, low: int | None = None
) -> Collated:
    """`rows` random-token rows of `length` tokens, or (ragged) of lengths in (low, length]."""
    low = max(1, length // 2) if low is None else low
    lengths = rng.integers(max(2, low + 1), length + 1, rows) if ragged else [length] * rows
    if ragged:
        lengths[0] = length  # the batch is padded to the point's length
    seqs = [[101, *rng.integers(1000, 30000, int(n) - 2).tolist(), 102] for n in lengths]
    return collate(seqs, 0, "right")


class _PeakTensorBytes:
    """Peak bytes of tensor storage created by torch ops while active (live at once).

    Counts every op's outputs (activations, attention scores, scatter grids) from allocation
    until its storage is freed; the weights, made before, are not counted. Exact where the RSS
    is noisy, and the same on any machine.
    """

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0
        self._seen: set[int] = set()

    def _freed(self, key: int, size: int) -> None:
        self._seen.discard(key)
        self.live -= size

    def track(self, out: Any) -> None:
        import weakref

        for t in out if isinstance(out, (tuple, list)) else (out,):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key, size = storage.data_ptr(), storage.nbytes()
            if key in self._seen or size == 0:
                continue
            self._seen.add(key)
            self.live += size
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._freed, key, size)


def _peak_activation_bytes(fn: Callable[[Collated], Any], batch: Collated) -> int:
    from torch.utils._python_dispatch import TorchDispatchMode

    meter = _PeakTensorBytes()

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            out = func(*args, **(kwargs or {}))
            meter.track(out)
            return out

    with Mode():
        fn(batch)
    return meter.peak


def _make(option: str, folder: Path) -> Callable[[Collated], Any]:
    """A callable that embeds a padded batch with `option` (packed options pack it first)."""
    if option.startswith("packed"):
        from lenbatch.runners.packed import PackedEncoderRunner

        dtype = "bfloat16" if option.endswith("bf16") else "float32"
        quantization = "int8" if option.endswith("int8") else "none"
        packed = PackedEncoderRunner(folder, dtype=dtype, quantization=quantization)
        return packed.embed
    dtype = "bfloat16" if option in ("bf16-cast", "compile-bf16") else "float32"
    runner = EncoderRunner(folder, dtype=dtype, quantization="int8" if option == "int8" else "none")
    if option.startswith("compile"):
        runner.model = torch.compile(runner.model, dynamic=True)
    if option == "bf16-autocast":
        plain = runner.embed

        def autocast(batch: Collated) -> Any:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return plain(batch)

        return autocast
    return runner.embed


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    import logging

    logging.disable(logging.INFO)
    try:
        yield
    finally:
        logging.disable(logging.NOTSET)


def main() -> int:
    """Time each option over the grid and print (or write) the Markdown table."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--options", default="fp32,bf16-cast,bf16-autocast,compile-fp32")
    p.add_argument("--grid", default=DEFAULT_GRID, help="batch x length points")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--torch-threads", type=int, default=None)
    p.add_argument("--ragged", action="store_true", help="rows of random lengths (buckets)")
    p.add_argument(
        "--buckets",
        help="bucket upper bounds (e.g. 35,74,112,167,226,256): one ragged batch per bucket, "
        "rows spread over (previous upper, upper], instead of --grid",
    )
    p.add_argument(
        "--bucket-tokens",
        type=int,
        default=2048,
        help="--buckets: rows per batch = this / the bucket's upper bound (default 2048)",
    )
    p.add_argument(
        "--memory",
        action="store_true",
        help="also report peak activation bytes per point (tensor storage torch ops create)",
    )
    p.add_argument("--out", type=Path, default=None, help="append the Markdown here")
    args = p.parse_args()
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    options = [o.strip() for o in args.options.split(",") if o.strip()]
    for o in options:
        if o not in OPTIONS:
            p.error(f"unknown option {o!r}; choose from {', '.join(OPTIONS)}")
    folder, _ = resolve_model("minilm")
    rng = np.random.default_rng(0)
    if args.buckets:
        # One point per bucket: a full batch of rows with lengths spread over the bucket.
        uppers = [int(x) for x in args.buckets.split(",")]
        lowers = [0, *uppers[:-1]]
        grid = [(max(1, args.bucket_tokens // u), u) for u in uppers]
        batches = [_batch(b, n, True, rng, low) for (b, n), low in zip(grid, lowers, strict=True)]
    else:
        grid = _grid(args.grid)
        batches = [_batch(b, n, args.ragged, rng) for b, n in grid]
    ms: dict[str, list[float]] = {}
    share: dict[str, float] = {}
    mem: dict[str, list[float]] = {}
    notes = []
    for option in options:
        with _quiet():
            fn = _make(option, folder)
        warm_start = time.perf_counter()
        for batch in batches:
            fn(batch)  # warm-up (and, for compile, compilation)
        warm = time.perf_counter() - warm_start
        if option.startswith("compile"):
            notes.append(f"{option}: first pass over the grid (compile) {warm:.1f} s")
        times = []
        cpu0, wall0 = time.process_time(), time.perf_counter()
        for (b, n), batch in zip(grid, batches, strict=True):
            runs = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                fn(batch)
                runs.append(time.perf_counter() - t0)
            times.append(1e3 * statistics.median(runs))
            print(f"{option:14s} {b}x{n}: {times[-1]:8.2f} ms", file=sys.stderr)
        ms[option] = times
        if args.memory:
            mem[option] = [_peak_activation_bytes(fn, batch) / 2**20 for batch in batches]
        # CPU this process got per wall second while timing: about the thread count on a
        # quiet machine, less when something else ran (then the figures are not clean).
        share[option] = (time.process_time() - cpu0) / (time.perf_counter() - wall0)
        del fn
    base = ms.get("fp32")
    tok = "real tok/s" if args.ragged else "tok/s"
    head = ["batch x length"]
    if args.buckets or args.ragged:
        head += ["real / padded tokens"]
    for o in options:
        head += [f"{o} ms", f"{o} {tok}"] + ([f"{o} vs fp32"] if base and o != "fp32" else [])
        head += [f"{o} peak act MB"] if mem else []
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for i, ((b, n), batch) in enumerate(zip(grid, batches, strict=True)):
        cells = [f"{b} x {n}"]
        if args.buckets or args.ragged:
            cells.append(f"{batch.real_tokens} / {batch.padded_tokens}")
        for o in options:
            t = ms[o][i]
            cells += [f"{t:.1f}", f"{batch.real_tokens / t:.1f}k"]
            if base and o != "fp32":
                cells.append(f"{base[i] / t:.2f}x")
            if mem:
                cells.append(f"{mem[o][i]:.1f}")
        lines.append("| " + " | ".join(cells) + " |")
    command = "python " + " ".join(shlex.quote(a) for a in sys.argv)
    md = [
        f"- Command: `{command}`",
        f"- Machine: {cpu_model()} ({processor_key()}), {os.cpu_count()} logical CPUs; "
        f"Python {platform.python_version()}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} torch threads; median of {args.repeats} after a warm-up"
        + ("; ragged rows (real tokens counted)" if args.ragged else ""),
        *(f"- {n}" for n in notes),
        "- CPU seconds this process got per wall second while timing (about the thread count "
        "when nothing else ran): " + ", ".join(f"{o} {v:.2f}" for o, v in share.items()),
        "",
        *lines,
        "",
    ]
    text = "\n".join(md)
    print(text)
    if args.out:
        with args.out.open("a", encoding="utf-8") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
