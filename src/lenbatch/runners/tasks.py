"""What a model does (`ModelTask`), told from its name or its folder's config.json alone.

`task = "auto"` in a model's config resolves here, before any weights are read: a causal LM
(`*ForCausalLM`, `*LMHeadModel`, a .gguf file, `smollm2`) generates; a
`*ForSequenceClassification` head with one label scores (a cross-encoder's relevance), with
more labels classifies; any other model (`minilm`, a bare encoder) embeds.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lenbatch.config import ModelTask
from lenbatch.runners.causal import SMOLLM2_ALIASES
from lenbatch.runners.loading import resolve_model

__all__ = ["resolve_task", "task_from_config"]

# transformers' `PretrainedConfig.num_labels` when a config names neither it nor `id2label`
_DEFAULT_NUM_LABELS = 2


def task_from_config(config: Mapping[str, Any]) -> ModelTask:
    """The task of a model whose config.json holds `config` (never `auto`)."""
    archs = [str(a) for a in config.get("architectures") or ()]
    if any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs):
        return ModelTask.GENERATE
    if any(a.endswith("ForSequenceClassification") for a in archs):
        labels = config.get("id2label")
        n = len(labels) if labels else int(config.get("num_labels", _DEFAULT_NUM_LABELS))
        return ModelTask.SCORE if n == 1 else ModelTask.CLASSIFY
    return ModelTask.EMBED


def resolve_task(name: str, task: ModelTask | str = ModelTask.AUTO) -> ModelTask:
    """`task` itself unless it is `auto`; else the task of the model called `name` (a
    built-in name, a .gguf file or a local model folder), read from config.json only.
    Raises ValueError when `name` is none of those or its config.json cannot be read."""
    task = ModelTask(task)
    if task is not ModelTask.AUTO:
        return task
    if name.partition("?")[0].lower() == "fake":
        return ModelTask.EMBED  # the test stand-in (`runners.faulty`) is an embedding runner
    if name.lower() in SMOLLM2_ALIASES or Path(name).suffix == ".gguf":
        return ModelTask.GENERATE
    folder, _ = resolve_model(name)
    path = folder / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"model {name!r}: cannot read {path}: {exc}") from None
    if not isinstance(config, Mapping):
        raise ValueError(f"model {name!r}: {path} is not a JSON object")
    return task_from_config(config)
