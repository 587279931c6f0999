"""The narrow contracts between the engines and a model.

An embedding engine only needs to know a model's length limit and padding rules (`ModelInfo`),
how to turn text into token ids (`tokenize`), and how to run one collated batch (`embed`): the
`EmbeddingRunner`. Generation needs a causal LM's forward step over a KV cache: the
`CausalRunner`. Everything above this line is testable with the deterministic `FakeRunner` and
the tiny random models of `lenbatch.runners.tiny`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from lenbatch.core.collate import Collated, Packed
from lenbatch.runners.tokenizer import Pairs

if TYPE_CHECKING:  # torch only for annotations: the protocols import without it
    import torch

__all__ = [
    "CausalRunner",
    "EmbeddingRunner",
    "MixingRunner",
    "ModelInfo",
    "PackedEmbeddingRunner",
    "RunnerMemory",
    "ScoringRunner",
    "Segment",
]


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What the engine must know about a model to queue, pad and answer for it."""

    name: str  # reported as `model` in API responses
    max_length: int  # longest input in tokens, special tokens included
    pad_token_id: int
    padding_side: Literal["right", "left"]
    needs_position_ids: bool  # absolute positions + left padding: pass positions explicitly
    vocab_size: int
    dim: int = 0  # embedding width (0 if not an embedding model)
    kind: Literal["embedding", "generate"] = "embedding"
    normalized: bool = False  # vectors are L2-normalised (a `dimensions` cut re-normalises)
    # sentence-transformers prompts (name -> text put before an input), and the one applied
    # when a call names none (config_sentence_transformers.json, or `--default-prompt-name`)
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None


@dataclass(frozen=True, slots=True)
class Segment:
    """One part of a forward pass: `input_ids` `[rows, new]`, the padding `mask` over the
    cached and new columns, per-row `positions` of the new columns, and the segment's `cache`."""

    input_ids: torch.Tensor
    mask: torch.Tensor
    positions: torch.Tensor
    cache: Any


@dataclass(frozen=True, slots=True)
class RunnerMemory:
    """Memory a runner accounts for, in bytes: weights apart from activations."""

    weights: int
    peak_activations: int  # peak over the process lifetime beyond weights (CPU: RSS-based)
    device: str


@runtime_checkable
class EmbeddingRunner(Protocol):
    """A model that maps each row of a padded batch to one vector."""

    info: ModelInfo

    def tokenize(self, texts: Sequence[str], truncate: bool) -> list[list[int]]:
        """Token ids of each text, special tokens included; cut to `max_length` only if
        `truncate`, so callers can tell overlong inputs apart."""
        ...

    def embed(self, batch: Collated) -> npt.NDArray[np.float32]:
        """One float32 vector per row of `batch`, `[rows, dim]`; must not depend on padding."""
        ...

    def memory(self) -> RunnerMemory:
        """Weights and activation memory as measured now."""
        ...


@runtime_checkable
class PackedEmbeddingRunner(EmbeddingRunner, Protocol):
    """An embedding runner that also runs padding-free batches (`core.collate.Packed`): the
    engine packs its batches instead of padding them."""

    def embed_packed(self, batch: Packed) -> npt.NDArray[np.float32]:
        """One float32 vector per row of the packed batch, `[rows, dim]`."""
        ...


@runtime_checkable
class ScoringRunner(EmbeddingRunner, Protocol):
    """A sequence-classification head (`runners.scorer`): each row's "vector" is its raw
    logits, `[rows, num_labels]`; (query, document) pairs are tokenized as pairs."""

    labels: list[str]  # label names in logit order (`id2label`)
    problem_type: str | None  # transformers' `problem_type` (multi-label: sigmoid per label)
    activation: str  # CrossEncoder's default: sigmoid, identity, tanh or softmax

    def tokenize_pairs(self, pairs: list[tuple[str, str]], truncate: bool) -> Pairs:
        """Ids and segment ids of each pair; truncation cuts the document, never the query."""
        ...


class CausalRunner(Protocol):
    """What generation needs from a causal LM (`runners.causal`, `runners.tiny`)."""

    info: ModelInfo
    eos_token_ids: frozenset[int]
    device: torch.device

    def tokenize(self, texts: list[str], truncate: bool) -> list[list[int]]:
        """Token ids of each prompt."""
        ...

    def decode(self, ids: list[int]) -> str:
        """Text of generated ids (special tokens skipped)."""
        ...

    @property
    def has_chat_template(self) -> bool:
        """True if the tokenizer can format chat messages."""
        ...

    def chat_prompt(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """Token ids of chat messages (and OpenAI tools, where the template renders them)
        through the tokenizer's chat template."""
        ...

    def new_cache(self) -> Any:
        """An empty KV cache."""
        ...

    def forward(
        self, input_ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: Any
    ) -> torch.Tensor:
        """Logits of the last column, `[rows, vocab]`; appends the new columns to `cache`."""
        ...

    def memory(self) -> RunnerMemory:
        """Weights and activation memory."""
        ...


@runtime_checkable
class MixingRunner(CausalRunner, Protocol):
    """A causal LM whose one forward pass can carry several segments, each with its own cache
    (a decode step of the running batch and a prompt's prefill chunk), where `mixes` is True."""

    mixes: bool

    def forward_segments(self, segments: Sequence[Segment]) -> list[torch.Tensor]:
        """Each segment's last-column logits `[rows, vocab]`; every cache grows by its
        segment's new columns."""
        ...
