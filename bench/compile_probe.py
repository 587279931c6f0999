"""Does `torch.compile` pay for a causal LM's steps on this CPU? Compile time against step time.

    .venv/bin/python bench/compile_probe.py --model smollm2 --dtype bfloat16 --rows 16 \\
        --prompt-len 160 --steps 24 --prefill-shape 4x128

Compiling the whole model forward with lenbatch's preallocated KV cache (a Python object whose
window bounds change every step) does not work with dynamo (guards on the cache's shapes fail
after a reallocation), so this probe compiles what has static shapes: every decoder layer's MLP
(most of a step's matmul time) with `dynamic=False`, i.e. one graph per input shape, which is
what bucket-padded prefill (`rows x bucket bound`) and a decode batch of a fixed size class
(`rows x 1`) give. It reports the one-off compile time per shape, the eager and compiled time
of a decode step and of one bucket-shaped prefill, and the largest logit difference.
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

from lenbatch.generate.kvcache import KVBatch
from lenbatch.runners.causal import CausalLMRunner, resolve_causal_model

TEXT = (
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips "
    "in May. How many clips did Natalia sell altogether in April and May? "
) * 30


def _decode_steps(runner: Any, rows: int, length: int, steps: int) -> tuple[list[float], Any]:
    ids = runner.tokenize([TEXT])[0][:length]
    batch = torch.tensor([ids] * rows)
    mask = torch.ones_like(batch)
    pos = torch.arange(length)[None].expand(rows, length)
    cache = runner.new_cache()
    logits = runner.forward(batch, mask, pos, cache)
    kv = KVBatch(cache, mask, torch.full((rows,), length), logits.argmax(-1))
    times, last = [], logits
    for _ in range(steps):
        a, m, p = kv.step_inputs()
        t0 = time.perf_counter()
        last = runner.forward(a, m, p, kv.cache)
        times.append(time.perf_counter() - t0)
        kv.advance(m, last.argmax(-1))
    return times, last


def _prefill(runner: Any, rows: int, cols: int, repeat: int) -> tuple[list[float], Any]:
    ids = torch.tensor([runner.tokenize([TEXT])[0][:cols]] * rows)
    mask = torch.ones_like(ids)
    pos = torch.arange(cols)[None].expand(rows, cols)
    times, out = [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = runner.forward(ids, mask, pos, runner.new_cache())
        times.append(time.perf_counter() - t0)
    return times, out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=160)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--prefill-shape", default="4x128", help="ROWSxCOLS of the bucket prefill")
    args = p.parse_args()
    ref = resolve_causal_model(args.model)
    assert ref is not None
    runner = CausalLMRunner(ref.folder, gguf_file=ref.gguf_file, name=ref.name, dtype=args.dtype)
    runner.warm_up()
    prow, pcol = (int(x) for x in args.prefill_shape.split("x"))
    _decode_steps(runner, args.rows, args.prompt_len, 4)
    eager_steps, eager_logits = _decode_steps(runner, args.rows, args.prompt_len, args.steps)
    eager_pre, eager_pre_logits = _prefill(runner, prow, pcol, 3)

    for layer in runner.model.model.layers:
        layer.mlp.forward = torch.compile(layer.mlp.forward, dynamic=False)
    t0 = time.perf_counter()
    _prefill(runner, prow, pcol, 1)  # compiles the prefill shape (and decode's on first step)
    compile_prefill_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    _decode_steps(runner, args.rows, args.prompt_len, 1)
    compile_decode_s = time.perf_counter() - t0
    comp_steps, comp_logits = _decode_steps(runner, args.rows, args.prompt_len, args.steps)
    comp_pre, comp_pre_logits = _prefill(runner, prow, pcol, 3)
    out = {
        "cpu": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "dtype": runner.precision.name,
        "decode_rows": args.rows,
        "prefill_shape": args.prefill_shape,
        "compile_s_prefill_shape": compile_prefill_s,
        "compile_s_decode_shape": compile_decode_s,
        "decode_step_ms_eager_p50": 1000 * statistics.median(eager_steps),
        "decode_step_ms_compiled_p50": 1000 * statistics.median(comp_steps),
        "prefill_ms_eager_min": 1000 * min(eager_pre),
        "prefill_ms_compiled_min": 1000 * min(comp_pre),
        "max_abs_logit_diff_decode": float((eager_logits - comp_logits).abs().max()),
        "max_abs_logit_diff_prefill": float((eager_pre_logits - comp_pre_logits).abs().max()),
        "same_argmax_decode": bool(torch.equal(eager_logits.argmax(-1), comp_logits.argmax(-1))),
    }
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
