"""Token agreement of lenbatch's batched greedy decoding with fp32 `transformers.generate()`.

    bench/run.py bf16-agreement -- --model smollm2 --prompts 24 --max-new 32 \\
        --dtype bfloat16 [--quantize int4 [--switch-rows 1024]] [--lean off] [--alone] \\
        [--out bench/results/llm_bf16_agreement.md] [--table bench/results/llm_agreement.md]

The reference is `model.generate()` in float32 on each prompt alone (greedy). lenbatch runs
the same prompts batched through a `GenerationEngine` (continuous batching, the preallocated
KV cache) with the model in `--dtype`. Reported: sequences identical to the reference, the
share of generated positions that hold the reference's token, and the mean length of the common
prefix (greedy decoding diverges for good after its first different token). With
`--dtype float32` the figure must be 100 % (the equality the tests assert on tiny models).

`--alone` decodes each prompt by itself through the runner instead (no batching): every prefill
is a whole unpadded prompt, the shape whose attention runs on AMX tiles in bf16 where the CPU
has them (`LENBATCH_AMX=off` for torch's attention), so that path's agreement is measured.

`--quantize int8|int4` runs the lean path's weight-only kernels; `--switch-rows N` makes them run
up to N rows per product (default: the switch point measured on this processor, so a batched
decode may run dense), which measures the quantized kernels themselves. `--table FILE` appends
one row to a markdown table (created with its header and the processor key when absent).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import sys
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from lenbatch.config import BatchingConfig
from lenbatch.generate import GenerationEngine, SamplingParams
from lenbatch.runners.causal import CausalLMRunner, resolve_causal_model


def _prompts(n: int) -> list[str]:
    ref = resources.files("lenbatch") / "data" / "text" / "gsm8k_test.jsonl"
    lines = ref.read_text(encoding="utf-8").splitlines()[:n]
    return [json.loads(line)["question"] for line in lines]


def _reference(runner: Any, ids: list[int], max_new: int) -> list[int]:
    x = torch.tensor([ids])
    with torch.no_grad():
        out = runner.model.generate(
            x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=max_new,
            do_sample=False,
            pad_token_id=runner.info.pad_token_id,
        )
    return [int(t) for t in out[0, len(ids) :]]


async def _engine_tokens(runner: Any, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    engine = GenerationEngine(runner, BatchingConfig(max_batch=8, max_wait_ms=5))
    params = SamplingParams(max_tokens=max_new, temperature=0)
    await engine.start()
    try:
        seqs = [engine.submit(p, params) for p in prompts]

        async def one(s: Any) -> list[int]:
            return [t async for d in engine.stream(s) for t in d.token_ids]

        return list(await asyncio.gather(*(one(s) for s in seqs)))
    finally:
        await engine.stop()


def _cached_reference(
    path: Path | None, runner: Any, prompts: list[list[int]], max_new: int
) -> list[list[int]]:
    """The float32 reference tokens, read from `path` when it holds them for these very prompts
    and `max_new` (several options compared against one reference compute it once)."""
    if path is not None and path.exists():
        saved = json.loads(path.read_text(encoding="utf-8"))
        if saved["prompts"] == prompts and saved["max_new"] == max_new:
            return [list(x) for x in saved["expected"]]
    expected = [_reference(runner, ids, max_new) for ids in prompts]
    if path is not None:
        data = {"prompts": prompts, "max_new": max_new, "expected": expected}
        path.write_text(json.dumps(data), encoding="utf-8")
    return expected


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _append_row(
    args: argparse.Namespace,
    runner: Any,
    prompts: int,
    same: int,
    agree: int,
    positions: int,
    prefix: list[int],
) -> None:
    """One row of the agreement table; the header (processor, command) when the file is new."""
    from lenbatch.runners.hardware import processor_key

    if not args.table.exists():
        args.table.write_text(
            "# Greedy agreement with float32 `generate()` per precision and quantization\n\n"
            f"Processor: `{processor_key()}`, torch {torch.__version__}. Reference: float32 "
            "`model.generate()` on each prompt alone; lenbatch batched (continuous, max_batch 8). "
            f"{prompts} GSM8K prompts through the chat template, up to {args.max_new} new "
            "tokens. Command per row: `bench/llm_bf16_agreement.py --model MODEL --prompts N "
            "--max-new M --dtype D [--quantize Q --switch-rows S] [--lean off] --table FILE`. "
            "An option below 90 % of positions agreeing is not a default.\n\n"
            "| model | dtype | forward | linears | identical | positions agree | "
            "mean common prefix |\n|---|---|---|---|---:|---:|---:|\n",
            encoding="utf-8",
        )
    lean = getattr(runner, "lean", None)
    linears = lean.plan.describe() if lean is not None else "transformers"
    forward = "lean" if lean is not None else "transformers"
    with args.table.open("a", encoding="utf-8") as f:
        f.write(
            f"| {args.model} | {runner.precision.name} | {forward} | {linears} | "
            f"{same}/{prompts} | {100 * agree / positions:.1f} % | "
            f"{sum(prefix) / len(prefix):.1f} |\n"
        )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--prompts", type=int, default=24)
    p.add_argument("--max-new", type=int, default=32)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--quantize", default="none", choices=("auto", "none", "int8", "int4"))
    p.add_argument("--switch-rows", type=int, help="quantized kernels up to this many rows")
    p.add_argument("--lean", default="auto", choices=("auto", "off"))
    p.add_argument("--alone", action="store_true", help="each prompt alone, not batched")
    p.add_argument("--out", type=Path)
    p.add_argument("--table", type=Path, help="append one row to this markdown table")
    p.add_argument("--reference-cache", type=Path, help="reuse the fp32 reference (JSON file)")
    args = p.parse_args()
    ref = resolve_causal_model(args.model)
    assert ref is not None
    load = {"gguf_file": ref.gguf_file, "name": ref.name}
    fp32 = CausalLMRunner(ref.folder, **load, dtype="float32")
    # Through the chat template: the instruct model answers at length (raw questions often
    # get an end-of-sequence token first, which would make agreement trivial).
    prompts = [fp32.chat_prompt([{"role": "user", "content": q}]) for q in _prompts(args.prompts)]
    expected = _cached_reference(args.reference_cache, fp32, prompts, args.max_new)
    del fp32
    options: dict[str, Any] = {"quantization": args.quantize}
    if args.switch_rows is not None:
        options["quant_switch_rows"] = args.switch_rows
    if args.lean == "off":
        options["lean"] = False
    runner = CausalLMRunner(ref.folder, **load, dtype=args.dtype, **options)
    if args.alone:
        got = [runner.greedy_alone(p, args.max_new) for p in prompts]
    else:
        got = asyncio.run(_engine_tokens(runner, prompts, args.max_new))
    how = "each prompt alone" if args.alone else "batched"
    same = sum(g == e for g, e in zip(got, expected, strict=True))
    positions = sum(max(len(g), len(e)) for g, e in zip(got, expected, strict=True))
    agree = sum(
        sum(x == y for x, y in zip(g, e, strict=False)) for g, e in zip(got, expected, strict=True)
    )
    prefix = [_common_prefix(g, e) for g, e in zip(got, expected, strict=True)]
    summary = (
        f"{args.model} in {runner.precision.name} ({how}, lenbatch) vs float32 generate() "
        f"alone, greedy, {len(prompts)} GSM8K prompts x up to {args.max_new} new tokens: "
        f"{same}/{len(prompts)} sequences identical; {agree}/{positions} generated positions "
        f"agree ({100 * agree / positions:.1f} %); mean common prefix "
        f"{sum(prefix) / len(prefix):.1f} tokens"
    )
    print(summary)
    if args.table:
        _append_row(args, runner, len(prompts), same, agree, positions, prefix)
    if args.out:
        args.out.write_text(
            "# bf16 token agreement with float32 `generate()`\n\n"
            f"Command: `.venv/bin/python bench/llm_bf16_agreement.py --model {args.model} "
            f"--prompts {args.prompts} --max-new {args.max_new} --dtype {args.dtype} "
            f"--out {args.out}`\n\n"
            f"Machine: {platform.processor() or platform.machine()}, "
            f"torch {torch.__version__}, {torch.get_num_threads()} threads.\n\n"
            f"Result: {summary}.\n\nCommon prefix per prompt: {prefix}\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
