"""Request bodies of an exact token length, checked with the model's own tokenizer."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from lenbatch.replay.bodies import TextBuilder, corpus_units, load_tokenizer

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer("minilm")


@pytest.fixture(scope="module")
def builder(tokenizer: Any) -> TextBuilder:
    return TextBuilder(tokenizer)


def test_texts_have_the_requested_token_length(tokenizer: Any, builder: TextBuilder) -> None:
    """Each text tokenizes (special tokens included) to exactly its target length."""
    targets = [3, 4, 7, 16, 33, 64, 100, 128, 200, 255, 256, 512, 1000]
    bodies = builder.texts(targets, seed=1)
    counts = [len(tokenizer(t)["input_ids"]) for t in bodies.inputs]
    assert counts == targets
    assert bodies.lengths.tolist() == targets
    assert bodies.exact == len(targets)


def test_texts_are_real_text_from_the_corpus(builder: TextBuilder) -> None:
    """A body is a contiguous span of the bundled text, not generated words."""
    corpus = "\n\n".join(t for s in ("gsm8k", "inaugural") for _, t in corpus_units(s))
    for text in builder.texts([20, 80, 150], seed=3).inputs:
        assert isinstance(text, str)
        assert text in corpus


def test_same_seed_same_bodies(builder: TextBuilder) -> None:
    """Bodies are reproducible by seed and differ across seeds."""
    a = builder.texts([50, 60, 70], seed=7).inputs
    assert builder.texts([50, 60, 70], seed=7).inputs == a
    assert builder.texts([50, 60, 70], seed=8).inputs != a


def test_token_ids_have_exact_length_and_special_tokens(
    tokenizer: Any, builder: TextBuilder
) -> None:
    """Token payloads carry [CLS] ... [SEP] around real text's ids, at the exact length."""
    targets = [3, 10, 256]
    bodies = builder.token_ids(targets, seed=0)
    assert [len(x) for x in bodies.inputs] == targets
    for ids in bodies.inputs:
        assert isinstance(ids, list)
        assert ids[0] == tokenizer.cls_token_id and ids[-1] == tokenizer.sep_token_id


def test_too_short_targets_are_reported(builder: TextBuilder) -> None:
    """A target below [CLS] + 1 token + [SEP] cannot be met; the real length says so."""
    bodies = builder.texts([1, 2, 5])
    assert bodies.lengths.tolist() == [3, 3, 5]
    assert bodies.exact == 1 and bodies.mismatched == 2


def test_unit_lengths_are_the_corpus_lengths(tokenizer: Any, builder: TextBuilder) -> None:
    """Length pools are the tokenizer's counts of each real unit of text."""
    units = corpus_units("gsm8k")[:20]
    expect = [len(tokenizer(t)["input_ids"]) for _, t in units]
    assert builder.unit_lengths("gsm8k")[:20].tolist() == expect
    speeches = builder.unit_lengths("inaugural-speech")
    assert len(speeches) == len({g for g, _ in corpus_units("inaugural")})
    assert np.median(speeches) > 1000
