"""The scoring engine: a cross-encoder's (query, document) pairs or a classifier's texts through
the same lanes, scheduler and ledger as embeddings.

A pair's length is its token count as a pair (query, document and the special tokens between),
so each pair is bucketed by its own length and batched with pairs of other requests, exactly as
an embedding input is. The runner (`runners.scorer`) answers raw logits per row; the routes
(`embed/score_api.py`) turn them into scores, probabilities and labels.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Unpack, cast

from lenbatch.core.errors import BadInput, InputTooLong
from lenbatch.embed.engine import Engine
from lenbatch.embed.inputs import check_texts, tokenize_checked
from lenbatch.runners.base import ScoringRunner
from lenbatch.serving.messages import CallOptions, PairInputs, Predicted

__all__ = ["ScoringEngine"]

# Special tokens a pair adds to its query's own count (BERT: [CLS] q [SEP] d [SEP] -> one more
# [SEP]); the document needs at least one token more.
_PAIR_EXTRA = 2


class ScoringEngine(Engine):
    """`Engine` in front of a `ScoringRunner`: `predict_with_usage` admits texts or pairs and
    answers each one's raw logits (`ScoringService`). Takes `Engine`'s arguments."""

    def __init__(self, runner: ScoringRunner, *args: Any, **kwargs: Any) -> None:
        super().__init__(runner, *args, **kwargs)
        self.scorer = runner

    @property
    def labels(self) -> Sequence[str]:
        """The head's label names in logit order (`id2label`)."""
        return self.scorer.labels

    @property
    def activation(self) -> str:
        """What sentence-transformers' `CrossEncoder` applies to the logits by default."""
        return self.scorer.activation

    @property
    def problem_type(self) -> str | None:
        """transformers' `problem_type` of the head (multi-label: sigmoid per label)."""
        return self.scorer.problem_type

    async def predict_with_usage(
        self, inputs: PairInputs, **options: Unpack[CallOptions]
    ) -> Predicted:
        """The logits of each text or (query, document) pair, in order, and the tokens they
        took. Texts and pairs are tokenized in a worker thread; a pair over the limit is cut
        from the document's side when truncating, and a query that alone leaves no room for a
        document is refused 413."""
        priority = options.get("priority", 0)
        self.check_running()
        self.check_priority(priority)
        truncate = self.inputs.truncating(options.get("truncate"))
        seqs, segments = await self.inputs.in_thread(self._tokenize, list(inputs), truncate)
        logits = await self.submit_ids(
            seqs, segments, priority, options.get("timeout"), options.get("arrival")
        )
        return Predicted(logits, sum(len(x) for x in seqs))

    def _tokenize(
        self, inputs: list[str | tuple[str, str]], truncate: bool
    ) -> tuple[list[list[int]], list[list[int]] | None]:
        if not inputs:
            raise BadInput("no inputs given")
        if all(isinstance(x, str) for x in inputs):
            texts = cast("list[str]", inputs)
            return tokenize_checked(self.runner.tokenize, texts, truncate), None
        if not all(isinstance(x, tuple) and len(x) == 2 for x in inputs):
            raise BadInput("inputs mix texts and (query, document) pairs: send one kind per call")
        pairs = cast("list[tuple[str, str]]", inputs)
        check_texts([q for q, _ in pairs])
        check_texts([d for _, d in pairs])
        try:
            out = self.scorer.tokenize_pairs(pairs, truncate)
        except Exception as exc:
            if truncate:
                self._check_queries(pairs)
            raise BadInput(
                f"the tokenizer could not process the input ({type(exc).__name__})"
            ) from None
        return out.ids, out.token_type_ids

    def _check_queries(self, pairs: list[tuple[str, str]]) -> None:
        """Raise 413 for the first pair whose query alone leaves no room for its document
        (truncation cuts only the document)."""
        limit = self.info.max_length
        seen: dict[str, int] = {}
        for i, (q, _) in enumerate(pairs):
            if q not in seen:
                seen[q] = len(self.runner.tokenize([q], False)[0])
            n = seen[q] + _PAIR_EXTRA
            if n > limit:
                raise InputTooLong(
                    f"input {i}: the query alone takes {n - 1} tokens with the pair's special "
                    f"tokens; the limit is {limit} tokens and truncation cuts only the document",
                    code="query_too_long",
                )
