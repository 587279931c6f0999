"""Which bfloat16 rounding costs greedy decoding its agreement with float32?

    bench/llm_rounding_sources.py --prompts 64 --max-new 32 VARIANT [VARIANT ...]

transformers' float32 `generate()` of SmolLM2 on GSM8K prompts (through the chat template, as
`llm_bf16_agreement.py` runs them), with bfloat16 roundings inserted one kind at a time, against
the plain float32 run. A VARIANT is a set of letters:

- `w`: the layers' linear weights and the embedding / output matrix rounded to bfloat16;
- `n`: the RMSNorm weights rounded;
- `i`: every linear's input rounded (what a bfloat16 product reads);
- `o`: every layer linear's output rounded (the output matrix's logits stay float32);
- `r`: the residual stream rounded after each decoder layer (once a layer; a bfloat16 forward
  rounds it twice);
- `base`: nothing (must agree 100 %).

Reported per variant: sequences identical, the share of generated positions that agree, as
`llm_bf16_agreement.py` counts them. Everything else runs in float32, so each variant isolates
what its roundings cost.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))

from lenbatch.runners.causal import CausalLMRunner, resolve_causal_model
from lenbatch.runners.hardware import processor_key
from llm_bf16_agreement import _cached_reference, _prompts, _reference


def _rounded(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).to(t.dtype)


def _apply(model: Any, original: dict[str, torch.Tensor], variant: str) -> list[Any]:
    """Restore the float32 weights, then insert `variant`'s roundings; returns the hooks."""
    letters = set() if variant == "base" else set(variant)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(original[name])
            matrix = "proj" in name or "lm_head" in name or "embed" in name
            if ("w" in letters and matrix) or ("n" in letters and "norm" in name):
                param.copy_(_rounded(original[name]))
    hooks = []

    def round_input(_mod: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return (_rounded(args[0]), *args[1:])

    def round_output(_mod: Any, _args: Any, out: Any) -> Any:
        if isinstance(out, tuple):
            return (_rounded(out[0]), *out[1:])
        return _rounded(out)

    for name, module in model.named_modules():
        if "r" in letters and type(module).__name__.endswith("DecoderLayer"):
            hooks.append(module.register_forward_hook(round_output))
        if isinstance(module, torch.nn.Linear):
            if "i" in letters:
                hooks.append(module.register_forward_pre_hook(round_input))
            if "o" in letters and "lm_head" not in name:
                hooks.append(module.register_forward_hook(round_output))
    return hooks


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("variants", nargs="+")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--max-new", type=int, default=32)
    p.add_argument("--reference-cache", type=Path, help="reuse the float32 reference (JSON)")
    args = p.parse_args()
    ref = resolve_causal_model("smollm2")
    assert ref is not None
    runner = CausalLMRunner(ref.folder, gguf_file=ref.gguf_file, name=ref.name, dtype="float32")
    prompts = [runner.chat_prompt([{"role": "user", "content": q}]) for q in _prompts(args.prompts)]
    expected = _cached_reference(args.reference_cache, runner, prompts, args.max_new)
    model = runner.model
    original = {n: t.detach().clone() for n, t in model.named_parameters()}
    print(f"{processor_key()}; {len(prompts)} prompts x up to {args.max_new} new tokens")
    for variant in args.variants:
        hooks = _apply(model, original, variant)
        run: Callable[[list[int]], list[int]] = lambda ids: _reference(runner, ids, args.max_new)  # noqa: E731
        got = [run(ids) for ids in prompts]
        for h in hooks:
            h.remove()
        same = sum(g == e for g, e in zip(got, expected, strict=True))
        positions = sum(max(len(g), len(e)) for g, e in zip(got, expected, strict=True))
        agree = sum(
            sum(x == y for x, y in zip(g, e, strict=False))
            for g, e in zip(got, expected, strict=True)
        )
        print(
            f"| {variant} | {same}/{len(prompts)} | {100 * agree / positions:.1f} % |", flush=True
        )
    _apply(model, original, "base")
    return 0


if __name__ == "__main__":
    sys.exit(main())
