"""Token agreement of lenbatch's batched greedy decoding with fp32 `transformers.generate()`.

    bench/run.py bf16-agreement -- --model smollm2 --prompts 24 --max-new 32 \\
        --dtype bfloat16 [--out bench/results/llm_bf16_agreement.md]

The reference is `model.generate()` in float32 on each prompt alone (greedy). lenbatch runs
the same prompts batched through a `GenerationEngine` (continuous batching, the preallocated
KV cache) with the model in `--dtype`. Reported: sequences identical to the reference, the
share of generated positions that hold the reference's token, and the mean length of the common
prefix (greedy decoding diverges for good after its first different token). With
`--dtype float32` the figure must be 100 % (the equality the tests assert on tiny models).
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


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--prompts", type=int, default=24)
    p.add_argument("--max-new", type=int, default=32)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    ref = resolve_causal_model(args.model)
    assert ref is not None
    load = {"gguf_file": ref.gguf_file, "name": ref.name}
    fp32 = CausalLMRunner(ref.folder, **load, dtype="float32")
    # Through the chat template: the instruct model answers at length (raw questions often
    # get an end-of-sequence token first, which would make agreement trivial).
    prompts = [fp32.chat_prompt([{"role": "user", "content": q}]) for q in _prompts(args.prompts)]
    expected = [_reference(fp32, ids, args.max_new) for ids in prompts]
    del fp32
    runner = CausalLMRunner(ref.folder, **load, dtype=args.dtype)
    got = asyncio.run(_engine_tokens(runner, prompts, args.max_new))
    same = sum(g == e for g, e in zip(got, expected, strict=True))
    positions = sum(max(len(g), len(e)) for g, e in zip(got, expected, strict=True))
    agree = sum(
        sum(x == y for x, y in zip(g, e, strict=False)) for g, e in zip(got, expected, strict=True)
    )
    prefix = [_common_prefix(g, e) for g, e in zip(got, expected, strict=True)]
    summary = (
        f"{args.model} in {runner.precision.name} (batched, lenbatch) vs float32 generate() "
        f"alone, greedy, {len(prompts)} GSM8K prompts x up to {args.max_new} new tokens: "
        f"{same}/{len(prompts)} sequences identical; {agree}/{positions} generated positions "
        f"agree ({100 * agree / positions:.1f} %); mean common prefix "
        f"{sum(prefix) / len(prefix):.1f} tokens"
    )
    print(summary)
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
