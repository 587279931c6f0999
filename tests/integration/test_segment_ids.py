"""Segment ids travel from tokenization to the runner: (query, document) pairs tokenized as
pairs give, padded or packed, what Hugging Face's own tokenizer and forward give for the pair."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModel, AutoTokenizer

from lenbatch.core.collate import collate, pack
from lenbatch.runners import EmbeddingRunner, load_runner, resolve_model
from lenbatch.runners.tokenizer import TextTokenizer

pytestmark = pytest.mark.model

PAIRS = [
    ("what is the capital of france?", "Paris is the capital and largest city of France."),
    ("how many legs does a spider have", "Spiders have eight legs and most have eight eyes."),
    ("bert", "BERT uses segment embeddings to tell the two texts of a pair apart."),
]


@pytest.fixture(scope="module")
def folder() -> str:
    return str(resolve_model("minilm")[0])


@pytest.fixture(scope="module")
def reference(folder: str) -> np.ndarray:
    """Hugging Face alone: its tokenizer on each pair, its model's forward with the pair's
    token_type_ids, mean pooling and L2 normalisation (MiniLM's sentence-transformers head)."""
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModel.from_pretrained(folder).eval()
    out = []
    with torch.inference_mode():
        for q, d in PAIRS:
            enc = tok(q, d, return_tensors="pt")
            assert enc["token_type_ids"].max() == 1  # the pair really has two segments
            hidden = model(**enc).last_hidden_state[0]
            out.append(torch.nn.functional.normalize(hidden.mean(0), dim=0).numpy())
    return np.stack(out)


def test_pairs_tokenize_as_the_models_tokenizer_does(folder: str) -> None:
    """Ids and segment ids of each pair equal Hugging Face's tokenizer on the pair."""
    tok = AutoTokenizer.from_pretrained(folder)
    pairs = TextTokenizer.load(folder, 256).tokenize_pairs(PAIRS)
    assert pairs.token_type_ids is not None
    for (q, d), ids, types in zip(PAIRS, pairs.ids, pairs.token_type_ids, strict=True):
        enc = tok(q, d)
        assert ids == enc["input_ids"] and types == enc["token_type_ids"]


def test_truncating_a_pair_keeps_the_query(folder: str) -> None:
    """A document over the limit is cut (exactly, after the cheap cut at a space); the query
    and its segment stay whole."""
    tok = AutoTokenizer.from_pretrained(folder)
    query, doc = "which city?", "Paris is lovely in spring. " * 400
    text = TextTokenizer.load(folder, 32)
    pairs = text.tokenize_pairs([(query, doc)], truncate=True)
    want = tok(query, doc, truncation="only_second", max_length=32)
    assert pairs.ids == [want["input_ids"]] and len(pairs.ids[0]) == 32
    assert pairs.token_type_ids == [want["token_type_ids"]]
    whole = text.tokenize_pairs([(query, doc)], truncate=False)
    assert len(whole.ids[0]) > 32  # without truncation the caller sees it is too long


@pytest.mark.parametrize("execution", ["padded", "packed"])
def test_runner_uses_the_segment_ids(
    execution: str, folder: str, reference: np.ndarray, minilm: EmbeddingRunner
) -> None:
    """The runner's vectors of the pairs, batched with padding or packed, equal the reference
    within 1e-5, and differ from the same tokens run as one segment (so dropping the segment
    ids would fail this test)."""
    runner = minilm if execution == "padded" else load_runner("minilm", execution="packed")
    pairs = TextTokenizer.load(folder, 256).tokenize_pairs(PAIRS)
    assert pairs.token_type_ids is not None
    if execution == "padded":
        vectors = runner.embed(collate(pairs.ids, 0, segments=pairs.token_type_ids))
        flat = runner.embed(collate(pairs.ids, 0))
    else:
        packed_runner = runner
        assert hasattr(packed_runner, "embed_packed")
        vectors = packed_runner.embed_packed(pack(pairs.ids, pairs.token_type_ids))
        flat = packed_runner.embed_packed(pack(pairs.ids))
    assert float(np.abs(vectors - reference).max()) <= 1e-5
    assert float(np.abs(flat - reference).max()) > 1e-3
