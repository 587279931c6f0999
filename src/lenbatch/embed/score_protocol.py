"""The encoder tasks' request bodies, in the anchors' shapes: rerank (Cohere v2 / Jina / vLLM,
and TEI's `texts` shape on `/rerank`), vLLM's `/v1/score` and `/classify`; and the activations
that turn a head's logits into scores and probabilities as the references do."""

from __future__ import annotations

from typing import Annotated

import numpy as np
import numpy.typing as npt
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

__all__ = [
    "ClassifyRequest",
    "Document",
    "RerankRequest",
    "ScoreRequest",
    "activate",
    "probabilities",
]

_Text = Annotated[StrictStr, Field(min_length=1)]


class Document(BaseModel):
    """A rerank document given as an object (Cohere, Jina): its `text`."""

    model_config = ConfigDict(extra="ignore")

    text: _Text


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = Field(None, description="Served model name (may be left out).")
    truncate: bool | None = Field(
        None,
        description="Cut a pair over the model limit from the document's side (never the "
        "query) instead of answering 413.",
    )
    priority: StrictInt | None = Field(None, description="Priority level (higher runs first).")


class RerankRequest(_Common):
    """`POST /v1/rerank` (Cohere v2, Jina, vLLM) and `POST /rerank` (those, or TEI's shape with
    `texts`; the body tells them apart)."""

    query: _Text
    documents: list[_Text | Document] | None = Field(
        None, description="Cohere/Jina: the documents, strings or {text} objects."
    )
    texts: list[_Text] | None = Field(None, description="TEI: the documents.")
    top_n: StrictInt | None = Field(
        None, description="Cohere/Jina: answer the best N (clamped to the number of documents)."
    )
    return_documents: bool = Field(True, description="Cohere/Jina: include each document.")
    raw_scores: bool = Field(False, description="Logits instead of the activated score.")
    return_text: bool = Field(False, description="TEI: include each text.")


class ScoreRequest(_Common):
    """`POST /v1/score` (vLLM): one `text_1` against every `text_2`, or lists pairwise."""

    text_1: _Text | Annotated[list[_Text], Field(min_length=1)]
    text_2: _Text | Annotated[list[_Text], Field(min_length=1)]
    raw_scores: bool = Field(False, description="Logits instead of the activated score.")


class ClassifyRequest(_Common):
    """`POST /classify` (vLLM): labels and probabilities of each input."""

    input: _Text | Annotated[list[_Text], Field(min_length=1)]


def activate(logits: npt.NDArray[np.float32], activation: str) -> npt.NDArray[np.float64]:
    """What sentence-transformers' `CrossEncoder.predict` applies (`runners.scorer`)."""
    x = logits.astype(np.float64)
    if activation == "sigmoid":
        out: npt.NDArray[np.float64] = 1.0 / (1.0 + np.exp(-x))
        return out
    if activation == "tanh":
        out = np.tanh(x)
        return out
    if activation == "softmax":
        e = np.exp(x - x.max(axis=-1, keepdims=True))
        out = e / e.sum(axis=-1, keepdims=True)
        return out
    return x


def probabilities(
    logits: npt.NDArray[np.float32], problem_type: str | None
) -> npt.NDArray[np.float64]:
    """Label probabilities as transformers' text-classification pipeline computes them: a
    sigmoid per label for one label or a multi-label head, else a softmax."""
    if logits.shape[-1] == 1 or problem_type == "multi_label_classification":
        return activate(logits, "sigmoid")
    return activate(logits, "softmax")
