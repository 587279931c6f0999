"""Tiny random causal LMs built from a config, for tests and benchmarks (no model hub).

`build_tiny_model(folder, arch)` writes a randomly initialised Llama or GPT-2 and a small
byte-level BPE tokenizer (trained in about a second on the bundled GSM8K questions) into
`folder`, in the ordinary Hugging Face layout, so the real loading path (`CausalLMRunner`) runs
on it. The weights are random: the text is gibberish, but every batching, padding, position and
cache rule is exercised exactly as with a real model.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any, Literal

__all__ = ["CHAT_TEMPLATE", "build_tiny_model", "build_tiny_tokenizer"]

# A minimal ChatML-style template, as small chat models ship.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

Arch = Literal["llama", "gpt2"]


def _corpus(limit: int = 2000) -> list[str]:
    ref = resources.files("lenbatch") / "data" / "text" / "gsm8k_test.jsonl"
    lines = ref.read_text(encoding="utf-8").splitlines()[:limit]
    return [json.loads(line)["question"] for line in lines]


def build_tiny_tokenizer(folder: str | Path, vocab_size: int = 512) -> int:
    """Train a byte-level BPE tokenizer and save it (HF fast-tokenizer files) into `folder`.

    Returns the vocabulary size. Special tokens: `<s>` (BOS, id 0), `</s>` (EOS, id 1),
    `<pad>` (2), `<|im_start|>`, `<|im_end|>`.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        padding_side="left",
        model_max_length=1 << 30,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(folder))
    return int(tok.get_vocab_size())


def build_tiny_model(
    folder: str | Path,
    arch: Arch = "llama",
    *,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    max_positions: int = 512,
    seed: int = 0,
    vocab_size: int = 512,
    init_range: float = 0.2,
) -> Path:
    """Write a random tiny `arch` model and its tokenizer into `folder`; returns `folder`.

    `init_range` is the weights' standard deviation: larger than the usual 0.02 so that the
    random model's next token depends strongly on content and position (a model that repeats
    one token could not reveal a wrong position id or mask).
    """
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    vocab = build_tiny_tokenizer(out, vocab_size)
    torch.manual_seed(seed)
    common: dict[str, Any] = {
        "vocab_size": vocab,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 2,
        "initializer_range": init_range,
    }
    if arch == "llama":
        lcfg = LlamaConfig(
            hidden_size=hidden,
            intermediate_size=hidden * 2,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=max(1, heads // 2),
            max_position_embeddings=max_positions,
            tie_word_embeddings=False,
            **common,
        )
        model: torch.nn.Module = LlamaForCausalLM(lcfg)
    elif arch == "gpt2":
        gcfg = GPT2Config(
            n_embd=hidden, n_layer=layers, n_head=heads, n_positions=max_positions, **common
        )
        model = GPT2LMHeadModel(gcfg)
    else:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose llama or gpt2")
    model.generation_config.eos_token_id = 1  # type: ignore[union-attr]
    model.generation_config.pad_token_id = 2  # type: ignore[union-attr]
    model.save_pretrained(str(out))  # type: ignore[operator]
    return out
