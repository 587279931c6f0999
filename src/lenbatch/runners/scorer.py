"""A sequence-classification head (`*ForSequenceClassification`): a cross-encoder reranker
with one label, a classifier with several.

The runner takes the same collated or packed batches as an embedding runner and returns one
row of raw logits per input, `[rows, num_labels]`: the engine, its lanes and its ledger do not
care whether a row is a vector or logits. What the logits mean is the route's business, from
what the runner reports: the label names (`id2label`), the `problem_type`, and the activation
sentence-transformers' `CrossEncoder` applies by default (`activation`).

`PackedScorerRunner` runs a BERT-family head padding-free: the encoder's token-wise layers on
the batch's real tokens (`runners.packed`), then the head's own pooler (the first token through
a dense layer and tanh) and classifier on one row per input.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from lenbatch.core.collate import Collated, Packed
from lenbatch.runners.encoder import EncoderRunner
from lenbatch.runners.packed import PackedEncoderRunner
from lenbatch.runners.tokenizer import Pairs

__all__ = ["PackedScorerRunner", "ScorerRunner", "default_activation", "supports_packed_head"]

log = logging.getLogger("lenbatch.runner")

# sentence-transformers' activation class names -> ours (`CrossEncoder` stores the class path)
_ACTIVATIONS = {"Sigmoid": "sigmoid", "Identity": "identity", "Tanh": "tanh", "Softmax": "softmax"}


def default_activation(config: dict[str, Any], num_labels: int) -> str:
    """The activation `CrossEncoder.predict` applies by default to a folder whose config.json
    holds `config`: the one it saved (`sentence_transformers.activation_fn`, or the older
    `sbert_ce_default_activation_function`), else sigmoid for one label and none for more."""
    st = config.get("sentence_transformers") or {}
    saved = st.get("activation_fn") or config.get("sbert_ce_default_activation_function")
    if saved:
        short = str(saved).rsplit(".", 1)[-1]
        if short in _ACTIVATIONS:
            return _ACTIVATIONS[short]
        log.warning("activation %s is not known here: using the default", saved)
    return "sigmoid" if num_labels == 1 else "identity"


def supports_packed_head(model: Any) -> tuple[bool, str]:
    """Whether a sequence-classification model's head can run after the packed encoder: a
    BERT head (pooler on the first token, then one linear classifier)."""
    name = type(model).__name__
    if name != "BertForSequenceClassification":
        return False, f"head {name} is not BertForSequenceClassification"
    if getattr(model.bert, "pooler", None) is None:
        return False, "the BERT head has no pooler"
    return True, "BERT sequence-classification head"


class ScorerRunner(EncoderRunner):
    """A `*ForSequenceClassification` model: raw logits per row (`embed`), pairs tokenized as
    pairs (`tokenize_pairs`). Takes `EncoderRunner`'s arguments."""

    pools = False

    def __init__(self, folder: str | Path, **kwargs: Any) -> None:
        self.head: Any = None
        super().__init__(folder, **kwargs)
        self.labels, self.problem_type, self.activation = _head_facts(self.head, self.folder)

    def _load_model(self) -> Any:
        from transformers import AutoModelForSequenceClassification

        self.head = AutoModelForSequenceClassification.from_pretrained(self.folder)
        return self.head

    def _output_width(self, cfg: Any) -> int:
        return int(cfg.num_labels)

    def tokenize_pairs(self, pairs: list[tuple[str, str]], truncate: bool) -> Pairs:
        """Ids and segment ids of (query, document) pairs; truncation cuts the document."""
        return self.text.tokenize_pairs(pairs, truncate)

    @torch.inference_mode()
    def embed(self, batch: Collated) -> npt.NDArray[np.float32]:
        """The head's raw logits per row, `[rows, num_labels]` (Hugging Face's forward)."""
        kwargs: dict[str, Any] = {
            "input_ids": torch.from_numpy(batch.input_ids).to(self.device),
            "attention_mask": torch.from_numpy(batch.attention_mask).to(self.device),
        }
        if batch.position_ids is not None:
            kwargs["position_ids"] = torch.from_numpy(batch.position_ids).to(self.device)
        if batch.token_type_ids is not None:
            kwargs["token_type_ids"] = torch.from_numpy(batch.token_type_ids).to(self.device)
        logits = self.head(**kwargs).logits
        out: npt.NDArray[np.float32] = logits.float().cpu().numpy()
        return out


class PackedScorerRunner(PackedEncoderRunner):
    """`ScorerRunner`'s head after the padding-free BERT encoder (`runners.packed`)."""

    pools = False

    def __init__(self, folder: str | Path, **kwargs: Any) -> None:
        self.head: Any = None
        super().__init__(folder, **kwargs)
        head: Any = self.head
        ok, why = supports_packed_head(head)
        if not ok:
            raise ValueError(f"packed execution is not available for {self.folder.name}: {why}")
        head.float()
        self._pooler = head.bert.pooler
        self._classifier = head.classifier
        self.labels, self.problem_type, self.activation = _head_facts(self.head, self.folder)

    def _load_model(self) -> Any:
        from transformers import AutoModelForSequenceClassification

        self.head = AutoModelForSequenceClassification.from_pretrained(self.folder)
        # The packed forward reads the encoder's layers; the head's pooler and classifier run
        # after it (`embed_packed`).
        return self.head.bert

    def _output_width(self, cfg: Any) -> int:
        return int(self.head.config.num_labels)

    def tokenize_pairs(self, pairs: list[tuple[str, str]], truncate: bool) -> Pairs:
        """Ids and segment ids of (query, document) pairs; truncation cuts the document."""
        return self.text.tokenize_pairs(pairs, truncate)

    @torch.inference_mode()
    def embed_packed(self, batch: Packed) -> npt.NDArray[np.float32]:
        """The head's raw logits per row of a packed batch, `[rows, num_labels]`."""
        x = self.hidden_packed(batch)
        first = x[torch.from_numpy(batch.offsets[:-1]).to(self.device)]
        # BertPooler reads the first token of `[rows, width, hidden]`: one-token rows suffice.
        logits = self._classifier(self._pooler(first.unsqueeze(1)))
        out: npt.NDArray[np.float32] = logits.float().cpu().numpy()
        return out


def _head_facts(head: Any, folder: Path) -> tuple[list[str], str | None, str]:
    """(label names in logit order, problem_type, CrossEncoder's default activation)."""
    cfg = head.config
    n = int(cfg.num_labels)
    id2label = getattr(cfg, "id2label", None) or {}
    labels = [str(id2label.get(i, f"LABEL_{i}")) for i in range(n)]
    raw = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    return labels, getattr(cfg, "problem_type", None), default_activation(raw, n)
