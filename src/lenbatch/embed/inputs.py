"""What an embeddings call's inputs must be, checked once for every front door.

The single server's engine and the Ray ingress (`lenbatch.scaleout`) both turn a call's
inputs (texts, or token-id arrays) into token ids through an `InputReader`, so a bad input
gets the same 400 from either and the same ids come out. Texts are tokenized in worker threads,
not on the event loop: HF fast tokenizers release the GIL, so a huge input tokenizing in one
thread holds up neither the loop nor a small request tokenizing in the other. Only a short call
(a few texts, 2 KB in all) is tokenized on the loop: it costs less there than the thread hop.
Errors name the input's index, never its content.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar, cast

from lenbatch.core.errors import BadInput
from lenbatch.serving.messages import Inputs

__all__ = ["InputReader", "Inputs", "Tokenize", "check_texts", "token_ids", "tokenize_checked"]

T = TypeVar("T")

Tokenize = Callable[[Sequence[str], bool], list[list[int]]]
"""A tokenizer's `tokenize(texts, truncate)`: token ids per text, cut to the limit if asked."""

_THREADS = 2  # one long input tokenizing leaves a thread for everyone else
# A call this small is tokenized on the event loop (tens of microseconds, under what the thread
# hop costs); anything larger goes to the worker threads.
_INLINE_TEXTS = 4
_INLINE_CHARS = 2048


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


class InputReader:
    """A call's inputs to token ids, as every embeddings front door reads them: texts tokenized
    (in a worker thread), token arrays checked against the vocabulary, and every input cut to
    `max_length` tokens when the call truncates (`default_truncate` when it does not say)."""

    def __init__(
        self,
        tokenize: Tokenize,
        max_length: int,
        vocab_size: int,
        *,
        default_truncate: bool = False,
        threads: int = _THREADS,
    ) -> None:
        self.tokenize = tokenize
        self.max_length = max_length
        self.vocab_size = vocab_size
        self.default_truncate = default_truncate
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="lenbatch-tokenize")

    def truncating(self, truncate: bool | None) -> bool:
        """Whether a call that says `truncate` (None: nothing) has its inputs cut."""
        return self.default_truncate if truncate is None else truncate

    def token_ids(self, inputs: Inputs, truncate: bool | None = None) -> list[list[int]]:
        """Token ids of `inputs`, on the calling thread. Raises `BadInput` for an empty input,
        a text that is not valid Unicode or that the tokenizer cannot process, or a token id
        outside the vocabulary (naming the input's index, never its content)."""
        cut = self.truncating(truncate)
        ids = token_ids(
            inputs, lambda texts: tokenize_checked(self.tokenize, texts, cut), self.vocab_size
        )
        return [x[: self.max_length] for x in ids] if cut else ids

    async def read(self, inputs: Inputs, truncate: bool | None = None) -> list[list[int]]:
        """`token_ids`, with texts tokenized in a worker thread (one batch-encode call per
        call); token arrays need only a range check and are read on the loop."""
        if inputs and isinstance(inputs[0], str):
            texts = cast("Sequence[str]", inputs)
            if len(texts) <= _INLINE_TEXTS and sum(map(len, texts)) <= _INLINE_CHARS:
                # A short call tokenizes in tens of microseconds: less than the hop to a
                # worker thread and back costs the loop (a queue put, a thread wake-up, a
                # call_soon_threadsafe).
                return self.token_ids(inputs, truncate)
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._pool, self.token_ids, inputs, truncate)
        return self.token_ids(inputs, truncate)

    async def in_thread(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` in one of the tokenizing threads (other tokenizing work, such as a
        scorer's pairs, shares them)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, fn, *args)

    def close(self) -> None:
        """Stop the worker threads (an input still tokenizing finishes first)."""
        self._pool.shutdown(wait=False)
