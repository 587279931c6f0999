"""What an embeddings call's inputs must be, checked once for every front door.

The single server's engine and the Ray ingress (`lenbatch.scaleout`) both turn a call's
inputs (texts, or token-id arrays) into token ids through these functions, so a bad input
gets the same 400 from either. Errors name the input's index, never its content.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import cast

from lenbatch.core.errors import BadInput

__all__ = ["Inputs", "check_texts", "token_ids", "tokenize_checked"]

Inputs = Sequence[str] | Sequence[Sequence[int]]

Tokenize = Callable[[Sequence[str], bool], list[list[int]]]


def check_texts(texts: Sequence[str]) -> None:
    """Refuse an empty text or one that is not valid Unicode (a lone surrogate escape)."""
    for i, t in enumerate(texts):
        if not t:
            raise BadInput(f"input {i} is an empty string")
        if not t.isascii():
            try:
                t.encode("utf-8")
            except UnicodeEncodeError:
                raise BadInput(
                    f"input {i} is not valid Unicode (it holds a lone surrogate escape)"
                ) from None


def tokenize_checked(tokenize: Tokenize, texts: Sequence[str], truncate: bool) -> list[list[int]]:
    """`tokenize(texts, truncate)` after `check_texts`; a tokenizer failure becomes a 400
    that reports the exception's type only (its message could quote the text)."""
    check_texts(texts)
    try:
        return tokenize(texts, truncate)
    except Exception as exc:
        raise BadInput(
            f"the tokenizer could not process the input ({type(exc).__name__})"
        ) from None


def token_ids(
    inputs: Inputs, tokenize: Callable[[Sequence[str]], list[list[int]]], vocab_size: int
) -> list[list[int]]:
    """Texts tokenized with `tokenize`, token arrays checked against the vocabulary; one kind
    per call, and no input may come out empty."""
    if not inputs:
        raise BadInput("no inputs given")
    if isinstance(inputs[0], str):
        texts = cast("Sequence[str]", inputs)
        if not all(isinstance(t, str) for t in texts):
            raise BadInput("inputs mix texts and token arrays: send one kind per call")
        ids = tokenize(texts)
        for i, x in enumerate(ids):
            if not x:
                raise BadInput(f"input {i} is empty (0 tokens)")
        return ids
    out = []
    for i, seq in enumerate(cast("Sequence[Sequence[int]]", inputs)):
        if isinstance(seq, str):
            raise BadInput("inputs mix texts and token arrays: send one kind per call")
        if len(seq) == 0:
            raise BadInput(f"input {i} is an empty token array")
        if min(seq) < 0 or max(seq) >= vocab_size:
            raise BadInput(f"input {i} has token ids outside [0, {vocab_size})")
        out.append(list(seq))
    return out
