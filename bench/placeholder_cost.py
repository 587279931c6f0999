"""Quick MiniLM timings for a PLACEHOLDER cost model (until `lenbatch profile` exists).

Times a handful of batch shapes with the real runner (best of a few repeats after a warm-up:
under CPU contention the minimum is the least disturbed reading)
and fits latency = const + per_token*B*L + per_token_sq*B*L^2 by least squares with numpy.
This is deliberately small and rough; the lead replaces its output with `lenbatch profile`.

    .venv/bin/python bench/placeholder_cost.py --out bench/cost_minilm_cpu_placeholder.json
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from lenbatch.collate import collate
from lenbatch.costmodel import CostModel
from lenbatch.runners import load_runner

SHAPES = [(1, 16), (1, 128), (1, 256), (8, 32), (8, 128), (32, 16), (32, 64), (16, 256)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = ap.parse_args()
    runner = load_runner("minilm", torch_threads=args.threads)
    points = []
    for b, length in SHAPES:
        batch = collate([[101] + [2000] * (length - 2) + [102]] * b, 0)
        runner.embed(batch)  # warm-up
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            runner.embed(batch)
            times.append(time.perf_counter() - t0)
        med = min(times)
        points.append({"batch": b, "padded_len": length, "latency_s": med})
        print(f"B={b:3d} L={length:4d} {med * 1000:8.1f} ms", flush=True)
    bl = np.array([p["batch"] * p["padded_len"] for p in points], dtype=float)
    lsq = np.array([p["batch"] * p["padded_len"] ** 2 for p in points], dtype=float)
    y = np.array([p["latency_s"] for p in points])
    a = np.stack([np.ones_like(bl), bl, lsq], axis=1)
    # weight by 1/y so small batches count as much as large ones (relative error)
    coef, *_ = np.linalg.lstsq(a / y[:, None], np.ones_like(y), rcond=None)
    coef = np.maximum(coef, 0.0)
    pred = a @ coef
    err = float(np.sqrt(np.mean(((pred - y) / y) ** 2)))
    cm = CostModel(
        const=float(coef[0]),
        per_token=float(coef[1]),
        per_token_sq=float(coef[2]),
        weights_bytes=22_713_216 * 4.0,  # MiniLM-L6 parameters x fp32
        act_per_token=384 * 4 * 12.0,  # rough: ~12 hidden-size fp32 tensors live per token
        act_per_token_sq=12 * 4 * 2.0,  # rough: 12 heads of fp32 attention scores, x2 (softmax)
        model="all-MiniLM-L6-v2 (PLACEHOLDER: quick timings under CPU contention)",
        device="cpu",
        fit_error=err,
        points=points,
    )
    cm.save(args.out)
    print(f"fit: {coef}, relative RMS error {err:.1%}")


if __name__ == "__main__":
    main()
