"""A Hugging Face encoder (`AutoModel`) with sentence-transformers pooling.

Reads the model folder's sentence-transformers files when present: `modules.json` (is there a
Normalize module?), the pooling folder's `config.json` (mean / cls / max / last-token) and
`sentence_bert_config.json` (`max_seq_length`). Without them it falls back to mean pooling
without normalisation and the tokenizer's limit, and says so in the log.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from lenbatch.core.collate import Collated
from lenbatch.runners.base import ModelInfo, RunnerMemory
from lenbatch.runners.hardware import Precision, check_quantization, resolve_precision
from lenbatch.runners.memory import current_rss, peak_rss
from lenbatch.runners.tokenizer import TextTokenizer

__all__ = ["EncoderRunner", "encoder_precision", "read_pooling", "read_prompts"]

log = logging.getLogger("lenbatch.runner")

# sentence-transformers pooling config key -> our pooling mode, in its order of precedence
_POOLING_KEYS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_lasttoken": "lasttoken",
}


def read_pooling(folder: Path) -> tuple[str, bool, int | None]:
    """(pooling mode, normalize?, max_seq_length) from a sentence-transformers folder."""
    mode, normalize, max_len = "mean", False, None
    modules_file = folder / "modules.json"
    if modules_file.exists():
        modules = json.loads(modules_file.read_text())
        for m in modules:
            kind = m.get("type", "")
            if kind.endswith("Normalize"):
                normalize = True
            if kind.endswith("Pooling"):
                cfg_file = folder / m.get("path", "") / "config.json"
                if cfg_file.exists():
                    pcfg = json.loads(cfg_file.read_text())
                    enabled = [v for k, v in _POOLING_KEYS.items() if pcfg.get(k)]
                    if len(enabled) > 1:
                        raise ValueError(f"{cfg_file}: several pooling modes {enabled} at once")
                    mode = enabled[0] if enabled else mode
    st_file = folder / "sentence_bert_config.json"
    if st_file.exists():
        max_len = json.loads(st_file.read_text()).get("max_seq_length")
    return mode, normalize, max_len


def read_prompts(folder: Path) -> tuple[dict[str, str], str | None]:
    """(prompts by name, default prompt name) from a sentence-transformers folder's
    config_sentence_transformers.json (none when it has no such file or no prompts)."""
    path = folder / "config_sentence_transformers.json"
    if not path.exists():
        return {}, None
    cfg = json.loads(path.read_text(encoding="utf-8"))
    prompts = {str(k): str(v) for k, v in (cfg.get("prompts") or {}).items()}
    default = cfg.get("default_prompt_name") or None
    return prompts, None if default is None else str(default)


def encoder_precision(dtype: str, device: str, quantization: str) -> Precision:
    """The float type of an encoder runner: `dtype`'s, or float32 around int8 products
    (`--quantize int8` with `--dtype` float32 or auto; bfloat16 beside int8 is refused)."""
    if quantization != "int8":
        return resolve_precision(dtype, device)
    if dtype not in ("float32", "auto"):
        raise ValueError(
            f"quantization int8 runs the encoder's products in int8 and the rest in float32: "
            f"serve it with --dtype float32 or auto, not {dtype}"
        )
    if torch.device(device).type != "cpu":
        raise ValueError(f"quantization int8 runs on CPU only, not on {device}")
    return Precision(torch.float32, "float32", "int8 products, float32 around them")


class EncoderRunner:
    """Runs an encoder on collated batches and pools each row into one vector."""

    pools = True  # pools hidden states into a vector (a scorer's head does its own pooling)
    # The engine runs every bucket's batch shapes once before it is ready (embed/warmup.py).
    needs_warm_up = True
    # `int8`: the encoder layers' matrix products in int8 (`runners.int8`), the rest float32.
    quantizations = ("none", "int8")

    def __init__(
        self,
        folder: str | Path,
        *,
        name: str | None = None,
        device: str = "cpu",
        max_length: int | None = None,
        torch_threads: int | None = None,
        dtype: str = "float32",
        default_prompt_name: str | None = None,
        quantization: str = "none",
    ) -> None:
        from transformers import AutoTokenizer

        self.folder = Path(folder)
        if torch_threads:
            torch.set_num_threads(torch_threads)
        self.device = torch.device(device)
        self.quantization = check_quantization(
            quantization, type(self).__name__, self.quantizations
        )
        self.precision = encoder_precision(dtype, device, quantization)
        self.tokenizer: Any = AutoTokenizer.from_pretrained(self.folder)
        self.model: Any = self._load_model().to(self.device, dtype=self._load_dtype()).eval()
        self.pooling, self.normalize, st_max = read_pooling(self.folder)
        if self.pools and not (self.folder / "modules.json").exists():
            log.warning(
                "no sentence-transformers config in %s: mean pooling, no normalize", self.folder
            )
        cfg = self.model.config
        limits = [
            st_max,
            getattr(cfg, "max_position_embeddings", None),
            self.tokenizer.model_max_length if self.tokenizer.model_max_length < 10**6 else None,
        ]
        model_limit = min(x for x in limits if x)
        if max_length is not None and max_length > model_limit:
            raise ValueError(f"max_length {max_length} exceeds the model's limit {model_limit}")
        limit = max_length or model_limit
        pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        prompts, folder_default = read_prompts(self.folder) if self.pools else ({}, None)
        default_prompt = default_prompt_name or folder_default
        if default_prompt is not None and default_prompt not in prompts:
            raise ValueError(
                f"default prompt name {default_prompt!r} is not one of this model's prompts "
                f"({', '.join(sorted(prompts)) or 'it has none'})"
            )
        self.info = ModelInfo(
            name=name or self.folder.name,
            max_length=int(limit),
            pad_token_id=int(pad_id),
            padding_side="left" if self.tokenizer.padding_side == "left" else "right",
            # BERT-like encoders are right-padded; positions default to 0..n-1 per row, which
            # is correct there. Left-padded absolute-position models need them explicitly.
            needs_position_ids=self.tokenizer.padding_side == "left",
            vocab_size=int(cfg.vocab_size),
            dim=self._output_width(cfg),
            normalized=self.normalize,
            prompts=prompts,
            default_prompt_name=default_prompt,
        )
        self.text = TextTokenizer(self.tokenizer, self.info.max_length, keep="head")
        # Several models in one process: called in the worker thread between two layers, where
        # the CPU budget may pause this call for another model's turn (`serving/budget.py`).
        self.between_layers: Callable[[], None] | None = None
        int8_bytes = 0
        for layers in self.model.modules():
            if isinstance(layers, torch.nn.ModuleList) and len(layers) > 1:
                for layer in layers:
                    layer.register_forward_pre_hook(self._before_layer)
                int8_bytes = self._quantize(layers)
                break  # the first stack of layers is the encoder's (a scorer's head stays)
        self._weights = int8_bytes + sum(
            p.numel() * p.element_size() for p in self.model.parameters()
        )
        self._rss_after_load = current_rss()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def _quantize(self, layers: torch.nn.ModuleList) -> int:
        """With `quantization` int8, put the int8 product in place of every linear layer of
        the encoder's `layers`; returns the bytes their weights now hold."""
        if self.quantization != "int8":
            return 0
        from lenbatch.runners.int8 import FLOAT32_PRODUCTS, quantize_linears

        return quantize_linears(layers, FLOAT32_PRODUCTS)

    def _before_layer(self, module: Any, args: Any) -> None:
        if self.between_layers is not None:
            self.between_layers()

    def _load_model(self) -> Any:
        """The encoder whose hidden states are pooled (subclasses load a head around it)."""
        from transformers import AutoModel

        return AutoModel.from_pretrained(self.folder)

    def _output_width(self, cfg: Any) -> int:
        """Width of one output row: the hidden size for a pooled vector."""
        return int(cfg.hidden_size)

    def decode(self, ids: list[int]) -> str:
        """Text of token ids, special tokens skipped."""
        return self.text.decode(ids)

    def _load_dtype(self) -> torch.dtype:
        """The float type the model's weights are loaded in (subclasses may keep float32)."""
        return self.precision.dtype

    def tokenize(self, texts: Sequence[str], truncate: bool) -> list[list[int]]:
        """Token ids with special tokens; truncated to the limit (its first tokens kept) only
        when asked. One batch-encode call for all `texts` (`TextTokenizer`, head side)."""
        return self.text.tokenize(texts, truncate)

    @torch.inference_mode()
    def embed(self, batch: Collated) -> npt.NDArray[np.float32]:
        """Forward pass, pooling over real tokens only, optional L2 normalisation."""
        ids = torch.from_numpy(batch.input_ids).to(self.device)
        mask = torch.from_numpy(batch.attention_mask).to(self.device)
        kwargs: dict[str, Any] = {"input_ids": ids, "attention_mask": mask}
        if batch.position_ids is not None:
            kwargs["position_ids"] = torch.from_numpy(batch.position_ids).to(self.device)
        if batch.token_type_ids is not None:
            kwargs["token_type_ids"] = torch.from_numpy(batch.token_type_ids).to(self.device)
        try:
            hidden = self.model(**kwargs).last_hidden_state
        except torch.cuda.OutOfMemoryError:
            # The engine splits the batch and retries: hand the cached blocks back first.
            torch.cuda.empty_cache()
            raise
        pooled = self._pool(hidden.float(), mask)
        if self.normalize:
            pooled = torch.nn.functional.normalize(pooled, p=2, dim=1)
        out: npt.NDArray[np.float32] = pooled.float().cpu().numpy()
        return out

    def _pool(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        m = mask.unsqueeze(-1).to(hidden.dtype)
        if self.pooling == "mean":
            return (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)
        if self.pooling == "max":
            return hidden.masked_fill(m == 0, torch.finfo(hidden.dtype).min).max(1).values
        if self.pooling == "cls":
            first = mask.argmax(1)  # first real token, whatever the padding side
            return hidden[torch.arange(hidden.shape[0]), first]
        # last token: the last real one on either padding side
        last = mask.shape[1] - 1 - mask.flip(1).argmax(1)
        return hidden[torch.arange(hidden.shape[0]), last]

    def memory(self) -> RunnerMemory:
        """Weights (parameter bytes) apart from peak activations."""
        if self.device.type == "cuda":
            peak = int(torch.cuda.max_memory_allocated(self.device)) - self._weights
            return RunnerMemory(self._weights, max(peak, 0), str(self.device))
        return RunnerMemory(self._weights, max(peak_rss() - self._rss_after_load, 0), "cpu")
