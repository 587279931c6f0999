"""What both peers share: load the model folder and embed with sentence-transformers' pooling.

Kept deliberately plain: what a user would write from the model card. Not used by lenbatch's
own server (which has its own runner); only the pooling rules are read from the same files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from lenbatch.runners import resolve_model
from lenbatch.runners.encoder import read_pooling

__all__ = ["PlainEncoder", "texts_of"]


class PlainEncoder:
    """AutoTokenizer + AutoModel + the folder's pooling; pads each call to its longest input."""

    def __init__(self, model: str, threads: int | None = None) -> None:
        from transformers import AutoModel, AutoTokenizer

        if threads:
            torch.set_num_threads(threads)
        folder, self.name = resolve_model(model)
        self.tokenizer: Any = AutoTokenizer.from_pretrained(Path(folder))
        self.model: Any = AutoModel.from_pretrained(Path(folder)).eval()
        self.pooling, self.normalize, max_len = read_pooling(Path(folder))
        self.max_length = int(max_len or self.tokenizer.model_max_length)

    @torch.inference_mode()
    def embed(self, inputs: list[str] | list[list[int]]) -> list[list[float]]:
        """Vectors for a list of texts (or token-id lists), padded to the longest, truncated to
        the model's limit as sentence-transformers does."""
        if inputs and isinstance(inputs[0], str):
            enc = self.tokenizer(
                inputs,
                padding=True,
                truncation=True,
                max_length=self.max_length,
                return_tensors="pt",
            )
        else:
            ids = [list(x)[: self.max_length] for x in inputs]
            enc = self.tokenizer.pad({"input_ids": ids}, return_tensors="pt")
        mask = enc["attention_mask"]
        hidden = self.model(input_ids=enc["input_ids"], attention_mask=mask).last_hidden_state
        m = mask.unsqueeze(-1).to(hidden.dtype)
        if self.pooling == "cls":
            pooled = hidden[:, 0]
        else:  # mean (all-MiniLM-L6-v2)
            pooled = (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)
        if self.normalize:
            pooled = torch.nn.functional.normalize(pooled, p=2, dim=1)
        out: list[list[float]] = pooled.tolist()
        return out


def texts_of(raw: Any) -> list[str] | list[list[int]]:
    """The request's `input` as a list: one text, texts, one token array or token arrays."""
    if isinstance(raw, str):
        return [raw]
    if isinstance(raw, list) and raw and isinstance(raw[0], int):
        return [raw]
    if isinstance(raw, list) and raw:
        return raw
    raise ValueError("input must be a non-empty string, list of strings or token ids")


def response(vectors: list[list[float]], name: str, tokens: int) -> dict[str, Any]:
    """The OpenAI embeddings response body."""
    return {
        "object": "list",
        "data": [
            {"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(vectors)
        ],
        "model": name,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
