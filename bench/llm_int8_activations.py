"""What int8 arithmetic costs SmolLM2: teacher-forced agreement with float32 greedy decoding.

    bench/llm_int8_activations.py --prompts 64 --max-new 32 --reference-cache REF.json \\
        VARIANT [VARIANT ...]

The reference is float32 greedy decoding (`llm_bf16_agreement.py`'s: GSM8K prompts through the
chat template, `generate()` alone). Each variant runs transformers' float32 forward once over
prompt + reference tokens and counts the generated positions whose arg-max is the reference's
token (teacher-forced top-1: every position sees the reference's past, so one flip does not
derail the rest as it does in greedy decoding; greedy agreement is far lower). Variants:

- `base`: nothing changed (must be 100 %);
- `w8`, `w7`: the layers' linear weights rounded per output channel, symmetric, to 8 / 7 bits
  (7: what `runners/int8.py` uses on a CPU without VNNI);
- `a8`: every layer linear's input rounded per token (one scale a row), 8 bits;
- `a8-keepK`: the same with the K input channels of largest calibrated magnitude left exact
  (calibrated on 16 other prompts: LLM.int8()-style outlier columns);
- `a8-block`: inputs rounded per block of 32 of each token (llama.cpp's Q8 activations);
- `bf16`: for scale, the layer linears' weights and inputs rounded to bfloat16 instead (greedy:
  90.9 % of positions in `results/zen3-model1/bf16-rounding-sources.md`'s `w i`);
- `onednn[:KINDS]`: the real product, `runners.int8.quantize_linears` (7-bit weights per
  channel, 8-bit activations per token, oneDNN), on all layer linears or only those of
  `KINDS` (comma-free, `+`-joined: `qkv`, `o`, `gate_up`, `down`).

Everything else stays float32, so each variant isolates its rounding.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))

from lenbatch.runners.causal import CausalLMRunner, resolve_causal_model
from lenbatch.runners.hardware import processor_key
from lenbatch.runners.int8 import quantize_linears
from llm_bf16_agreement import _cached_reference, _prompts

_KINDS = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}


def _weights(w: torch.Tensor, levels: int) -> torch.Tensor:
    s = w.abs().amax(1, keepdim=True).clamp_min(1e-12) / levels
    return (w / s).round().clamp(-levels, levels) * s


def _rows(x: torch.Tensor, exact: torch.Tensor | None) -> torch.Tensor:
    kept = None
    if exact is not None:
        kept, x = x[..., exact].clone(), x.clone()
        x[..., exact] = 0
    s = x.abs().amax(-1, keepdim=True).clamp_min(1e-12) / 127
    y = (x / s).round() * s
    if kept is not None:
        y[..., exact] = kept
    return y


def _blocks(x: torch.Tensor) -> torch.Tensor:
    xb = x.reshape(*x.shape[:-1], x.shape[-1] // 32, 32)
    s = xb.abs().amax(-1, keepdim=True).clamp_min(1e-12) / 127
    return ((xb / s).round() * s).reshape(x.shape)


class _Rounded(torch.nn.Module):
    def __init__(self, lin: torch.nn.Linear, bits: int, acts: str, exact: torch.Tensor | None):
        super().__init__()
        w = lin.weight.data
        self.w = _weights(w, 2 ** (bits - 1) - 1) if bits else w
        if acts == "bf16":
            self.w = w.to(torch.bfloat16).float()
        self.acts, self.exact = acts, exact

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.acts == "bf16":
            x = x.to(torch.bfloat16).float()
        elif self.acts == "rows":
            x = _rows(x, self.exact)
        elif self.acts == "blocks":
            x = _blocks(x)
        return F.linear(x, self.w)


def _linears(model: Any) -> list[tuple[Any, str, str]]:
    """(parent module, child name, dotted name under model.model.layers) of each layer linear."""
    out = []
    for name, mod in model.model.layers.named_modules():
        for child, c in mod.named_children():
            if isinstance(c, torch.nn.Linear):
                out.append((mod, child, f"{name}.{child}"))
    return out


def _calibrate(model: Any, seqs: list[list[int]]) -> dict[str, torch.Tensor]:
    """Largest |input| per channel of each layer linear over `seqs`."""
    stats: dict[str, torch.Tensor] = {}
    hooks = []
    for mod, child, dotted in _linears(model):

        def hook(_m: Any, args: tuple[Any, ...], _out: Any, key: str = dotted) -> None:
            m = args[0].detach().abs().reshape(-1, args[0].shape[-1]).amax(0)
            stats[key] = torch.maximum(stats[key], m) if key in stats else m

        hooks.append(getattr(mod, child).register_forward_hook(hook))
    with torch.no_grad():
        for ids in seqs:
            model(torch.tensor([ids]))
    for h in hooks:
        h.remove()
    return stats


def _variant(base: Any, name: str, stats: dict[str, torch.Tensor]) -> Any:
    model = copy.deepcopy(base)
    if name == "base":
        return model
    if name.startswith("onednn"):
        kinds = name.split(":")[1].split("+") if ":" in name else list(_KINDS)
        wanted = {k for kind in kinds for k in _KINDS[kind]}
        keep = tuple(d for _m, c, d in _linears(model) if c not in wanted)
        quantize_linears(model.model.layers, keep=keep)
        return model
    bits = {"w8": 8, "w7": 7}.get(name, 0)
    acts = "blocks" if name == "a8-block" else "rows" if name.startswith("a8") else "none"
    if name == "bf16":
        acts = "bf16"
    k = int(name.removeprefix("a8-keep")) if name.startswith("a8-keep") else 0
    for mod, child, dotted in _linears(model):
        exact = stats[dotted].topk(k).indices if k else None
        setattr(mod, child, _Rounded(getattr(mod, child), bits, acts, exact))
    return model


def _agreement(model: Any, prompts: list[list[int]], expected: list[list[int]]) -> float:
    agree = total = 0
    with torch.no_grad():
        for p, e in zip(prompts, expected, strict=True):
            logits = model(torch.tensor([p + e[:-1]])).logits[0]
            pred = logits[len(p) - 1 :].argmax(-1).tolist()
            agree += sum(a == b for a, b in zip(pred, e, strict=True))
            total += len(e)
    return agree / total


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--max-new", type=int, default=32)
    p.add_argument("--reference-cache", type=Path, help="reuse the fp32 reference (JSON file)")
    p.add_argument("variants", nargs="+")
    args = p.parse_args()
    torch.set_num_threads(2)
    ref = resolve_causal_model("smollm2")
    assert ref is not None
    fp32 = CausalLMRunner(ref.folder, gguf_file=ref.gguf_file, name=ref.name, dtype="float32")
    n = args.prompts
    all_prompts = [fp32.chat_prompt([{"role": "user", "content": q}]) for q in _prompts(n + 16)]
    prompts, calib = all_prompts[:n], all_prompts[n:]
    expected = _cached_reference(args.reference_cache, fp32, prompts, args.max_new)
    base = fp32.model.eval()  # float32 as loaded
    stats = _calibrate(base, calib)
    print(f"Processor: `{processor_key()}`, torch {torch.__version__}, {n} prompts, "
          f"{sum(map(len, expected))} generated positions.\n")  # fmt: skip
    print("| variant | teacher-forced top-1 agreement |\n|---|---:|")
    for name in args.variants:
        share = _agreement(_variant(base, name, stats), prompts, expected)
        print(f"| {name} | {100 * share:.1f} % |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
