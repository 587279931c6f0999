"""Does `torch.compile` of the static shapes pay on this CPU? Compile time against step time.

    bench/run.py compile-probe -- --model smollm2 --dtype float32 --rows 16 \\
        --window 200 --width 256 [--prefill 4x128] [--freezing] [--threads N] [--json out.json]

The decode step is measured three ways on the same batch (`--rows` rows, a `--window`-column
cache): the eager path the server runs by default (`runner.forward` with the preallocated window
cache), the static shape run eager (`generate.shapes`'s layout: fixed `--width`-column buffers, a
tensor write column, a boolean 4-D mask; `ShapeGraphs(compile=False)`), and the same shape
compiled (`ShapeGraphs(compile=True)`: `torch.compile(dynamic=False, fullgraph=True)`). The first
compiled call is the shape's compile time. `--prefill RxC` does the same for one bucket-shaped
prefill. `--freezing` turns on Inductor's weight freezing (constant weights, prepacked for
oneDNN), the setting Inductor recommends for CPU inference.

Why the static layout at all: compiling `runner.forward` with the window cache recompiles every
step, because the window's bounds are Python integers that dynamo guards on (measured in an
earlier round); the static layout passes them as tensors and shapes only change with the class.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from typing import Any

import torch

from lenbatch.core.collate import collate
from lenbatch.generate.kvcache import KVBatch
from lenbatch.generate.shapes import FixedShapes, make_fixed_shapes
from lenbatch.runners.causal import CausalLMRunner, resolve_causal_model


def _timed(fn: Any, repeat: int) -> list[float]:
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def _static(runner: Any, compile: bool, width: int) -> FixedShapes:
    return make_fixed_shapes(runner, (width,), 64, width, compile=compile)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--window", type=int, default=200, help="cached columns per row")
    p.add_argument("--width", type=int, default=256, help="static decode buffer width")
    p.add_argument("--prefill", help="ROWSxCOLS of a bucket-shaped prefill to compare too")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    p.add_argument("--freezing", action="store_true", help="Inductor weight freezing")
    p.add_argument("--json", help="write the summary here")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.freezing:
        import torch._inductor.config as inductor_config

        inductor_config.freezing = True
    ref = resolve_causal_model(args.model)
    if ref is None:
        raise SystemExit(f"{args.model} is not a causal LM")
    runner = CausalLMRunner(ref.folder, gguf_file=ref.gguf_file, name=ref.name, dtype=args.dtype)
    runner.warm_up()
    rows, window = args.rows, args.window
    ids = torch.randint(1, min(1000, runner.info.vocab_size), (rows, window))
    mask = torch.ones_like(ids)
    pos = torch.arange(window)[None].expand(rows, window)

    def fresh() -> KVBatch:
        cache = runner.new_cache()
        logits = runner.forward(ids, mask, pos, cache)
        return KVBatch(cache, mask, torch.full((rows,), window), logits.argmax(-1))

    kv = fresh()

    def eager_step() -> None:
        a, m, q = kv.step_inputs()
        kv.advance(m, runner.forward(a, m, q, kv.cache).argmax(-1))

    out: dict[str, Any] = {
        "cpu": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "dtype": runner.precision.name,
        "rows": rows,
        "window": window,
        "width": args.width,
        "freezing": args.freezing,
    }
    out["decode_ms_eager_window_p50"] = 1000 * statistics.median(_timed(eager_step, args.steps))
    for compile in (False, True):
        static = _static(runner, compile, args.width)
        kv = fresh()

        def static_step() -> None:
            logits, m = static.decode(kv)  # noqa: B023 (kv and static of this pass)
            kv.advance(m, logits.argmax(-1))  # noqa: B023

        label = "compiled" if compile else "static_eager"
        if compile:
            t0 = time.perf_counter()
            static_step()
            out["compile_s_decode_shape"] = time.perf_counter() - t0
        out[f"decode_ms_{label}_p50"] = 1000 * statistics.median(_timed(static_step, args.steps))
        if args.prefill:
            prow, pcol = (int(x) for x in args.prefill.split("x"))
            batch = collate([ids[0, :pcol].tolist()] * prow, 0, "left", position_ids=True)
            if compile:
                t0 = time.perf_counter()
                static.prefill(batch)
                out["compile_s_prefill_shape"] = time.perf_counter() - t0
            times = _timed(lambda: static.prefill(batch), 3)  # noqa: B023
            out[f"prefill_ms_{label}_min"] = 1000 * min(times)
    if args.prefill:
        prow, pcol = (int(x) for x in args.prefill.split("x"))
        pids = ids[:prow, :pcol]
        times = _timed(
            lambda: runner.forward(
                pids, torch.ones_like(pids), pos[:prow, :pcol], runner.new_cache()
            ),
            3,
        )
        out["prefill_ms_eager_min"] = 1000 * min(times)
    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
