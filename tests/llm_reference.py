"""Reference outputs for generation tests: `transformers.generate()` on one prompt alone."""

from __future__ import annotations

from typing import Any

import torch

MAX_NEW = 20  # tokens generated per prompt in the equality tests

PROMPTS = [
    "Natalia sold clips to 48 of her friends in April",
    "Weng earns $12 an hour",
    "A robe takes 2 bolts of blue fiber and half that much white fiber. How many bolts?",
    "Hi",
    "Betty is saving money for a new wallet which costs $100. Betty has only half of the "
    "money she needs. Her parents decided to give her $15 for that purpose.",
    "James writes a 3-page letter to 2 different friends twice a week",
]


def reference_greedy(runner: Any, prompt: list[int], max_new_tokens: int, **kw: Any) -> list[int]:
    """Greedy tokens `model.generate()` produces for `prompt` alone (stops at EOS), with
    `generate`'s own options `kw` (an `eos_token_id`, logits processors)."""
    model = runner.model
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=runner.info.pad_token_id,
            **kw,
        )
    return [int(x) for x in out[0, len(prompt) :]]


def reference_tokens(runner: Any, prompt: list[int], n: int, **kw: Any) -> list[int]:
    """Exactly `n` greedy tokens `model.generate()` produces for `prompt` alone (no stop at
    end-of-sequence), with `generate`'s own options `kw` (penalties, biases, processors)."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = runner.model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=runner.info.pad_token_id,
            **kw,
        )
    return [int(x) for x in out[0, len(prompt) :]]
