"""Which model to serve and how to run it: one `[model]` table, or each entry of `[[models]]`."""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field

from lenbatch.config.fields import FROZEN

__all__ = ["ModelConfig", "ModelTask", "Quantization"]


class ModelTask(StrEnum):
    """What a served model does, which decides its routes and its runner."""

    AUTO = "auto"  # from the model folder's config.json (see `runners.tasks.resolve_task`)
    EMBED = "embed"  # /v1/embeddings
    GENERATE = "generate"  # /v1/completions and /v1/chat/completions (a causal LM)
    SCORE = "score"  # one relevance score per (query, document) pair (a cross-encoder)
    CLASSIFY = "classify"  # labels and their probabilities per input


class Quantization(StrEnum):
    """How a model's weights are stored, apart from the float type of its activations."""

    AUTO = "auto"  # the weights as the model ships them: a GGUF's 4- or 8-bit groups, else none
    NONE = "none"  # the weights in the model's float type (`dtype`)
    INT8 = "int8"  # 8-bit integers (causal LMs: weight-only; encoders: weights and activations)
    INT4 = "int4"  # 4-bit integer weights (causal LMs, weight-only; encoders refuse it)


class ModelConfig(BaseModel):
    """Which model to serve and how to run it: the `[model]` table, or one `[[models]]` entry."""

    model_config = FROZEN

    name: str = "minilm"
    """`minilm` (the bundled all-MiniLM-L6-v2), `smollm2` (the demo causal LM), a path to a
    local Hugging Face model folder, or a .gguf file."""
    served_name: str | None = None
    """The `model` name clients call it by and responses report (None: the built-in model's
    name, or the folder's or file's name). For a single model, `[server] served_model_name`
    sets it too."""
    task: ModelTask = ModelTask.AUTO
    """embed, generate, score, classify, or auto: from the folder's config.json (a causal LM
    generates; `*ForSequenceClassification` scores with one label, else classifies; any other
    model embeds)."""
    default_prompt_name: str | None = None
    """Embedding models: the sentence-transformers prompt (config_sentence_transformers.json
    `prompts`) put before inputs whose call names none (None: the folder's own
    `default_prompt_name`, if any). Serve refuses a name the model lacks."""
    truncate: bool = False
    """Default for requests that do not say: truncate inputs over the model limit (else: error)."""
    max_length: int | None = Field(None, ge=1)
    """Override the model's input limit in tokens (never above what the model supports)."""
    device: str = "cpu"
    """Torch device: cpu, cuda, cuda:1, ..."""
    torch_threads: int | None = Field(None, ge=1)
    """Intra-op threads for torch on CPU, per batch. Unset, an encoder served alone shares the
    usable cores among the batches that run at once (`batching.max_concurrent_batches`, itself
    one per core up to 8 when unset): one thread per batch on up to 8 cores. Several models in
    one process and causal LMs keep torch's default (one thread per core)."""
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "auto"
    """Float type of the model: float32, bfloat16, float16 (GPU only) or auto (bfloat16 where
    the hardware runs it natively, else float32). The start-up log says what was picked and why."""
    quantization: Quantization = Quantization.AUTO
    """Weight quantization, apart from `dtype`: auto, none, int8 or int4. `auto` computes with
    the weights as the model ships them: a causal LM on the lean Llama path in float32 whose
    layers are GGUF's Q4_1 blocks (and output matrix Q8_0, as the bundled SmolLM2) runs `int4`,
    a Q8_0 GGUF `int8`, exactly as stored (the start-up log says what it found); anything else,
    encoders included, runs `none`. A runner that does not implement the one asked for refuses
    to start. Causal LMs on the lean Llama path (SmolLM2)
    implement int8 and int4 (groups of 32), weight-only, up to the row count where they beat
    the dense kernel on this processor (measured at load): in float32, lenbatch's own loop with
    GGUF's Q8_0 / Q4_1 blocks (a Q4_1 GGUF then runs its shipped weights exactly); in bfloat16,
    torch's kernels (int8 per channel). Encoders implement int8: int8 weights per channel and
    activations per token through oneDNN's int8 product, float32 around it (`runners.int8`)."""
    cost_model: str | None = None
    """Path of the cost model (`lenbatch profile` JSON) this deployment was tuned with, `auto`
    (the one measured on this processor: the user's cache of self-calibrated models, then
    `$LENBATCH_COST_DIR`, default the source checkout's `bench/results/`; serve with strategy
    adaptive measures and caches one when none matches), `generic` (the online model's generic
    CPU prior: instant start) or a live adaptive server's URL (its online fit). Unset, strategy
    adaptive takes `auto`. Serve warns at start-up when a file was measured on another processor (or
    does not say)."""
    execution: Literal["auto", "padded", "packed"] = "auto"
    """How a batch runs: `packed` (padding-free: the token-wise layers run on the batch's real
    tokens only; BERT-family encoders), `padded` (to the batch's longest member), or `auto`
    (packed where the model supports it, else padded)."""

    max_batch_tokens: int | None = Field(None, ge=1)
    """This model's own `[batching] max_batch_tokens` (None: the shared one). With several
    models on one CPU an encoder call pauses between layers for another model's turn, so the
    cap is not needed for their latency; a generation step does not pause."""

    def default_served_name(self) -> str:
        """The served name when none is given, as far as the config can tell: the folder's or
        file's name (`.gguf` dropped). A built-in model reports its own name at run time."""
        return Path(self.name).expanduser().name.removesuffix(".gguf") or self.name
