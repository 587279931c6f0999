"""Choosing the next token, and turning generated tokens into text with stop strings.

A request's decoding options are its `SamplingParams` (`lenbatch.serving.messages`).
`choose_tokens` picks one token per batch row: greedy rows take the argmax, sampled rows draw
from their own seeded `torch.Generator`, so a request samples the same tokens whether it runs
alone or in a batch. `penalize` applies a request's penalties and logit biases to its row
first; `step_logprobs` gives the log-probabilities a request asked for.
`TextTracker` detokenizes incrementally and finds stop strings, holding back text that might be
the start of one so a stream never shows text that a later stop would cut.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

import torch

from lenbatch.serving.messages import SamplingParams

__all__ = [
    "LOGPROB_FLOOR",
    "TextTracker",
    "choose_tokens",
    "make_generator",
    "mask_eos",
    "penalize",
    "step_logprobs",
]

# A log-probability of -inf (a token the model gives no mass) as JSON can carry it, as vLLM does.
LOGPROB_FLOOR = -9999.0

# Below this a temperature samples as it does in the limit (the top logit, ties shared).
_TINIEST_TEMPERATURE = 1e-30


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    """The request's own random generator (None for greedy requests)."""
    if params.greedy:
        return None
    gen = torch.Generator(device=device)
    if params.seed is not None:
        gen.manual_seed(params.seed)
    else:
        gen.seed()
    return gen


def choose_tokens(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> list[int]:
    """One next token per row of `logits` `[rows, vocab]`, each row by its own params."""
    if logits.shape[0] != len(params):
        raise RuntimeError(f"bug: {logits.shape[0]} logit rows for {len(params)} requests")
    # `max(...).indices` is argmax (the first of tied maxima) at 0.6x its time: 1.16 against
    # 1.84 ms for 27 rows of SmolLM2's 49,152 logits (Intel Xeon family 6 model 207, 2 threads),
    # paid on every decode step.
    greedy = logits.max(dim=-1).indices.tolist()
    out: list[int] = []
    for row, (p, gen) in enumerate(zip(params, generators, strict=True)):
        if p.greedy:
            out.append(int(greedy[row]))
            continue
        # Shifted so the largest logit is 0 before dividing: a tiny temperature (the schema
        # takes any positive one) then sends the others to -inf instead of making inf - inf
        # (NaN) out of the top ones; and one below float32's range (5e-324 became 0) divides
        # as the smallest that changes nothing: every gap float32 can hold is already -inf.
        x = logits[row].float()
        probs = torch.softmax((x - x.max()) / max(p.temperature, _TINIEST_TEMPERATURE), dim=-1)
        if p.top_p < 1.0:
            sorted_p, order = torch.sort(probs, descending=True)
            cum = torch.cumsum(sorted_p, dim=-1)
            # Keep a token while the mass before it is below top_p; the top token always stays
            # (set explicitly: a top_p below float32's smallest value would round to 0).
            keep = (cum - sorted_p) < p.top_p
            keep[0] = True
            sorted_p = torch.where(keep, sorted_p, torch.zeros_like(sorted_p))
            pick = torch.multinomial(sorted_p, 1, generator=gen)
            out.append(int(order[pick]))
        else:
            out.append(int(torch.multinomial(probs, 1, generator=gen)))
    return out


def step_logprobs(
    logits: torch.Tensor, chosen: Sequence[int], tops: Sequence[int]
) -> list[tuple[float, list[tuple[int, float]]]]:
    """Per row of `logits` `[rows, vocab]` (the model's raw logits, before temperature, top_p
    or end-of-sequence masking act on them): the log-probability of the row's `chosen` token
    and its `tops[row]` most likely (token id, log-probability), most likely first. Computed
    in float32; -inf becomes `LOGPROB_FLOOR`."""
    logp = torch.log_softmax(logits.float(), dim=-1).clamp_(min=LOGPROB_FLOOR)
    idx = torch.tensor(list(chosen), dtype=torch.long, device=logp.device)
    own = logp.gather(1, idx[:, None]).squeeze(1).tolist()
    k = max(tops, default=0)
    top_ids: list[list[int]] = [[] for _ in tops]
    top_lps: list[list[float]] = [[] for _ in tops]
    if k > 0:
        values, ids = logp.topk(k, dim=-1)
        top_ids, top_lps = ids.tolist(), values.tolist()
    return [
        (own[r], list(zip(top_ids[r][:n], top_lps[r][:n], strict=True))) for r, n in enumerate(tops)
    ]


def penalize(
    logits: torch.Tensor, row: int, params: SamplingParams, prompt: Sequence[int],
    generated: Sequence[int],
) -> None:  # fmt: skip
    """Apply `params`' penalties and logit biases to `logits[row]` in place, given the row's
    `prompt` and `generated` token ids (see `SamplingParams`): the repetition penalty over
    both (as transformers' `RepetitionPenaltyLogitsProcessor`), then OpenAI's frequency and
    presence penalties over the output, then the biases."""
    x = logits[row]
    dev = x.device
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted({*prompt, *generated}), dtype=torch.long, device=dev)
        vals = x[seen]
        p = params.repetition_penalty
        x[seen] = torch.where(vals > 0, vals / p, vals * p)
    if (params.frequency_penalty or params.presence_penalty) and generated:
        counted = Counter(generated)
        ids = torch.tensor(list(counted), dtype=torch.long, device=dev)
        counts = torch.tensor(list(counted.values()), dtype=x.dtype, device=dev)
        x[ids] -= counts * params.frequency_penalty + params.presence_penalty
    if params.logit_bias:
        ids = torch.tensor([t for t, _ in params.logit_bias], dtype=torch.long, device=dev)
        bias = torch.tensor([b for _, b in params.logit_bias], dtype=x.dtype, device=dev)
        x.index_add_(0, ids, bias)


def mask_eos(logits: torch.Tensor, rows: Sequence[int], eos_ids: frozenset[int]) -> None:
    """Make end-of-sequence tokens unchoosable in `rows` of `logits` (in place)."""
    if not rows or not eos_ids:
        return
    idx = torch.tensor(sorted(eos_ids), dtype=torch.long, device=logits.device)
    for row in rows:
        logits[row, idx] = float("-inf")


class TextTracker:
    """Incremental detokenization of one sequence, with stop-string detection.

    `push(ids)` takes all generated ids so far and returns the new text that is safe to show.
    Text that may be the start of a stop string, or an incomplete UTF-8 character, is held back
    until it is decided. After a stop string is found, `stopped` is True and `text` ends before it
    (`keep_stop`: after it, as vLLM's `include_stop_str_in_output`).
    """

    __slots__ = ("_decode", "_keep", "_longest", "_stop", "emitted", "stopped", "text")

    def __init__(
        self, decode: Callable[[list[int]], str], stop: Sequence[str] = (), keep_stop: bool = False
    ) -> None:
        self._decode = decode
        self._keep = keep_stop
        self._stop = tuple(stop)
        self._longest = max((len(s) for s in self._stop), default=0)
        self.text = ""  # the decided text (ends before a stop string once stopped)
        self.emitted = 0  # characters of `text` already returned
        self.stopped = False

    def push(self, ids: list[int]) -> str:
        """New safe text after the generated ids became `ids`."""
        if self.stopped:
            return ""
        text = self._decode(ids)
        if self._stop:
            start = max(0, self.emitted - self._longest)
            hits = [(i, len(s)) for i, s in ((text.find(s, start), s) for s in self._stop)]
            hits = [(i, n) for i, n in hits if i >= 0]
            if hits:
                at, size = min(hits)
                self.text = text[: at + size if self._keep else at]
                self.stopped = True
                return self._take(len(self.text))
        self.text = text
        safe = len(text)
        while safe > self.emitted and text[safe - 1] == "\ufffd":
            safe -= 1  # an incomplete multi-byte character: wait for its next token
        safe -= self._held_for_stop(text[:safe])
        return self._take(max(safe, self.emitted))

    def flush(self) -> str:
        """Everything not yet returned (the sequence has ended)."""
        return self._take(len(self.text))

    def _take(self, end: int) -> str:
        piece = self.text[self.emitted : end]
        self.emitted = max(self.emitted, end)
        return piece

    def _held_for_stop(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        for n in range(min(self._longest - 1, len(text) - self.emitted), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self._stop):
                return n
        return 0
