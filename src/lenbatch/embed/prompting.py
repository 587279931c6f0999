"""An embeddings call's prompt and `dimensions`, as sentence-transformers applies them.

- Prompts: the model's sentence-transformers `prompts` (config_sentence_transformers.json). A
  call names one with `prompt_name`, or with Cohere's `input_type` (mapped to a prompt of that
  name, or of the usual names for it); else the server's default prompt (the folder's
  `default_prompt_name`, or `--default-prompt-name`) applies. The prompt's text goes before each
  input's, as `SentenceTransformer.encode(prompt_name=...)` does, so its tokens count in the
  input's length (its bucket) and in `usage`.
- `dimensions` (Matryoshka): the first `d` components of each vector, re-normalised when the
  model normalises its vectors, as `encode(truncate_dim=d, normalize_embeddings=True)` gives.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from lenbatch.core.errors import BadInput
from lenbatch.runners.base import ModelInfo
from lenbatch.serving.messages import Vector

__all__ = ["INPUT_TYPE_PROMPTS", "cut_dimensions", "prompt_for", "prompted"]

# Cohere's input_type -> prompt names that mean it, in order of preference (the first that the
# model has is taken): its own name first (some models name their prompts after Cohere's).
INPUT_TYPE_PROMPTS: dict[str, tuple[str, ...]] = {
    "search_query": ("search_query", "query"),
    "search_document": ("search_document", "document", "passage", "corpus"),
    "classification": ("classification",),
    "clustering": ("clustering",),
}


def prompt_for(info: ModelInfo, prompt_name: str | None, input_type: str | None) -> str | None:
    """The prompt text a call gets (None: none). Raises `BadInput` for an unknown
    `prompt_name` (listing the model's), an `input_type` with no matching prompt, or both."""
    names = ", ".join(sorted(info.prompts)) or "none"
    if prompt_name is not None and input_type is not None:
        raise BadInput("give prompt_name or input_type, not both")
    if prompt_name is not None:
        if prompt_name not in info.prompts:
            raise BadInput(
                f"prompt_name is not one of this model's prompts; they are: {names}",
                code="unknown_prompt",
            )
        return info.prompts[prompt_name]
    if input_type is not None:
        candidates = INPUT_TYPE_PROMPTS.get(input_type, (input_type,))
        for name in candidates:
            if name in info.prompts:
                return info.prompts[name]
        known = ", ".join(INPUT_TYPE_PROMPTS)
        raise BadInput(
            f"input_type has no matching prompt in this model (input types: {known}; the "
            f"model's prompts: {names})",
            code="unknown_prompt",
        )
    if info.default_prompt_name is not None:
        return info.prompts[info.default_prompt_name]
    return None


def prompted(inputs: Sequence[str] | Sequence[Sequence[int]], prompt: str) -> list[str]:
    """Each text with `prompt` before it. Raises `BadInput` for token-id inputs (a prompt is
    text: put its ids in the arrays instead)."""
    if not all(isinstance(t, str) for t in inputs):
        raise BadInput(
            "a prompt (prompt_name, input_type or the server's default prompt) applies to "
            "texts, not token-id inputs: send text, or put the prompt's ids in the arrays"
        )
    return [prompt + str(t) for t in inputs]


def cut_dimensions(vectors: list[Vector], d: int, width: int, normalized: bool) -> list[Vector]:
    """The first `d` components of each vector, re-normalised if the model normalises. Raises
    `BadInput` when `d` is above the model's width."""
    if d > width:
        raise BadInput(
            f"dimensions={d} is above this model's width: its vectors have {width} dimensions",
            code="invalid_dimensions",
        )
    if d == width:
        return vectors
    out = np.stack(vectors)[:, :d]
    if normalized:
        out = out / np.clip(np.linalg.norm(out, axis=1, keepdims=True), 1e-12, None)
    return list(out.astype(np.float32))
