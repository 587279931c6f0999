#!/usr/bin/env python3
"""Does the runner's resident memory keep growing as batch shapes vary? A short in-process loop.

    python bench/memory_growth.py --batches 400                  # as the server runs it
    MALLOC_ARENA_MAX=2 python bench/memory_growth.py --batches 400
    python bench/memory_growth.py --batches 400 --trim           # malloc_trim after each batch

Loads the runner as `lenbatch serve` would (the config's model, dtype, execution, threads) and
runs `--batches` batches of random shapes (rows 1..max_batch, lengths drawn like the dev trace's
at the MiniLM mapping: mostly short, a long tail to the limit) on `max_concurrent_batches`
threads, as the server does; prints RSS every `--every` batches, and at the end its growth over
the second half of the run. What the knobs test: glibc's per-thread malloc arenas
(`MALLOC_ARENA_MAX`), freed memory glibc keeps instead of returning (`--trim`: `malloc_trim(0)`),
oneDNN's per-shape kernel cache (`ONEDNN_PRIMITIVE_CACHE_CAPACITY`).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np

DEV_CONFIG = "configs/minilm-azure-conv.toml"


def rss_mb() -> float:
    """This process's resident set, MB (/proc/self/statm)."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def main() -> int:
    """Run the loop and print RSS as it goes."""
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--config", default=DEV_CONFIG)
    p.add_argument("--batches", type=int, default=400)
    p.add_argument("--every", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trim", action="store_true", help="malloc_trim(0) after each batch")
    args = p.parse_args()

    import torch

    from lenbatch.config.settings import load_settings
    from lenbatch.core.collate import collate, pack
    from lenbatch.runners import load_runner

    settings = load_settings(args.config)
    m, b = settings.model, settings.batching
    threads = m.torch_threads or torch.get_num_threads()
    runner = load_runner(m.name, execution=m.execution, dtype=m.dtype, torch_threads=threads)
    limit = runner.info.max_length
    rng = np.random.default_rng(args.seed)
    libc = ctypes.CDLL("libc.so.6") if args.trim else None
    packed = hasattr(runner, "embed_packed")

    def one(k: int) -> None:
        r = np.random.default_rng(args.seed * 100_003 + k)
        rows = int(r.integers(1, b.max_batch + 1))
        lengths = np.minimum(r.lognormal(3.6, 0.8, rows).astype(int) + 2, limit)
        if rows * int(lengths.max()) > b.max_batch_tokens:
            rows = max(1, b.max_batch_tokens // int(lengths.max()))
            lengths = lengths[:rows]
        seqs = [[101] + [1000 + (i % 500) for i in range(n - 2)] + [102] for n in lengths]
        if packed:
            runner.embed_packed(pack(seqs))  # type: ignore[attr-defined]
        else:
            runner.embed(collate(seqs, runner.info.pad_token_id))
        if libc is not None:
            libc.malloc_trim(0)

    print(f"start: {rss_mb():.0f} MB (model loaded)", flush=True)
    samples: list[tuple[int, float]] = []
    t0 = time.perf_counter()
    with ThreadPoolExecutor(b.max_concurrent_batches) as pool:
        for start in range(0, args.batches, args.every):
            list(pool.map(one, range(start, min(start + args.every, args.batches))))
            samples.append((min(start + args.every, args.batches), rss_mb()))
            print(f"{samples[-1][0]:5d} batches: {samples[-1][1]:7.0f} MB", flush=True)
    del rng
    half = samples[len(samples) // 2 - 1][1] if len(samples) > 1 else samples[0][1]
    end = samples[-1][1]
    knobs = {k: os.environ[k] for k in ("MALLOC_ARENA_MAX", "ONEDNN_PRIMITIVE_CACHE_CAPACITY")
             if k in os.environ}  # fmt: skip
    print(
        f"end: {end:.0f} MB after {args.batches} batches in {time.perf_counter() - t0:.0f} s; "
        f"growth over the second half {100 * (end - half) / half:+.1f} %; "
        f"trim={args.trim} {knobs}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
