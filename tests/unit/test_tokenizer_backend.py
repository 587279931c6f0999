"""`TextTokenizer` calls a fast tokenizer's Rust backend directly (`encode` for one text,
`encode_batch` for several): its ids must be transformers' own, cut or whole, on real text,
for an encoder's (MiniLM, head side) and a causal LM's (SmolLM2, tail side) tokenizer."""

from __future__ import annotations

import json
from importlib import resources

import pytest
from transformers import AutoTokenizer

from lenbatch.runners.tokenizer import TextTokenizer


def _texts() -> list[str]:
    path = resources.files("lenbatch.data") / "text" / "gsm8k_test.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()[:120]]
    texts = [r["question"] for r in rows] + [r["answer"] for r in rows[:40]]
    # beyond every limit, empty, whitespace, accents and emoji, a special token's spelling
    texts += [" ".join(texts[:60]), "", "   ", "Café naïve — 東京 🚀", "[CLS] [SEP] <|im_end|>"]
    return texts


def _reference(tok: object, texts: list[str], max_length: int | None) -> list[list[int]]:
    enc = tok(  # type: ignore[operator]
        texts,
        add_special_tokens=True,
        truncation=max_length is not None,
        max_length=max_length,
        return_attention_mask=False,
        return_token_type_ids=False,
    )
    return [list(x) for x in enc["input_ids"]]


@pytest.fixture(scope="module")
def minilm() -> object:
    from lenbatch.runners.loading import resolve_model

    folder, _ = resolve_model("minilm")
    return AutoTokenizer.from_pretrained(folder)


def test_encoder_backend_equals_transformers(minilm: object) -> None:
    text = TextTokenizer(minilm, 128, keep="head")
    assert text._whole is not None, "a fast tokenizer must take the direct path"
    texts = _texts()
    assert text.tokenize(texts) == _reference(minilm, texts, None)
    cut = text.tokenize(texts, truncate=True)
    assert cut == _reference(minilm, texts, 128)
    assert max(len(ids) for ids in cut) == 128  # the long text was cut, to the limit
    # one text per call (most requests): the backend's single-text path, the same ids
    assert [text.tokenize([t])[0] for t in texts] == _reference(minilm, texts, None)
    assert [text.tokenize([t], truncate=True)[0] for t in texts] == cut


def test_the_backend_copies_leave_the_tokenizer_as_it_was(minilm: object) -> None:
    backend = minilm.backend_tokenizer  # type: ignore[attr-defined]
    before = (backend.truncation, backend.padding)
    text = TextTokenizer(minilm, 64)
    text.tokenize(_texts(), truncate=True)
    assert (backend.truncation, backend.padding) == before


def test_causal_backend_equals_transformers() -> None:
    from lenbatch.runners.causal import resolve_causal_model

    ref = resolve_causal_model("smollm2")
    assert ref is not None
    extra = {"gguf_file": ref.gguf_file} if ref.gguf_file else {}
    tok = AutoTokenizer.from_pretrained(ref.folder, **extra)
    text = TextTokenizer(tok, 100, keep="tail")
    assert text._whole is not None
    texts = _texts()
    whole = _reference(tok, texts, None)
    assert text.tokenize(texts) == whole
    # tail side: the last max_length - 1 tokens of the whole encoding
    assert text.tokenize(texts, truncate=True) == [ids[-99:] for ids in whole]
    assert [text.tokenize([t])[0] for t in texts] == whole
    assert [text.tokenize([t], truncate=True)[0] for t in texts] == [ids[-99:] for ids in whole]
