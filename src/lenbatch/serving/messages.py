"""The plain data that crosses a service boundary: what a route hands a service and gets back.

Every front-end (the single-process engines, the Ray ingress, an engine in another process)
speaks in these types, so the routes are written once against `lenbatch.serving.services`.
Nothing here holds request text once it has been tokenized, and nothing here runs a model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypedDict

import numpy as np
import numpy.typing as npt

__all__ = [
    "MAX_LOGPROBS",
    "MAX_REPETITION_PENALTY",
    "MIN_REPETITION_PENALTY",
    "CallOptions",
    "Delta",
    "Embedded",
    "Inputs",
    "OutputConstraint",
    "PairInputs",
    "Predicted",
    "SamplingParams",
    "SubmitOptions",
    "TokenLogprob",
    "Vector",
]

MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 10.0
"""The `repetition_penalty`s taken (1 leaves the logits alone). Past a few it only makes every
earlier token unchoosable; a tiny one would divide logits into infinities (the fuzzer sent
5e-324), which sampling cannot take."""

MAX_LOGPROBS = 20
"""Most alternatives a request may ask log-probabilities of, per generated token (as vLLM's
default `max_logprobs`; OpenAI allows 5 for completions, 20 for chat)."""

Vector = npt.NDArray[np.float32]
"""One output row: an embedding, or a scorer's / classifier's logits."""

Inputs = Sequence[str] | Sequence[Sequence[int]]
"""An embeddings call's inputs: texts, or token-id arrays (the model's own ids, used as given)."""

PairInputs = Sequence[str | tuple[str, str]]
"""A scorer's or classifier's inputs: single texts, or (query, document) pairs tokenized as a
pair (with segment ids where the model uses them)."""


class CallOptions(TypedDict, total=False):
    """What an embeddings or scoring call may say besides its inputs (each may be left out).

    `truncate` cuts inputs over the model's limit (None: the server's default; otherwise an
    overlong input is refused 413); `timeout` is the seconds an input may wait before it runs
    (504 after; None: the server's default); `priority` its level (higher runs first; 0 when
    left out); `arrival` the engine clock's time the route took the call, before tokenizing
    it (None: when the engine admits it). Latency, the SLO's due time and the
    timeout count from it.
    """

    truncate: bool | None
    timeout: float | None
    priority: int
    arrival: float | None


class SubmitOptions(TypedDict, total=False):
    """What a generation call may say besides its prompts and sampling (each may be left out).

    `arrival` is the clock time the route received the call (before tokenizing), for the TTFT
    breakdown; `timeout` the seconds a prompt may wait before it runs (504 after); `priority`
    its level (higher runs first; 0 when left out).
    """

    arrival: float | None
    timeout: float | None
    priority: int


@dataclass(frozen=True, slots=True)
class Embedded:
    """The answer to one embeddings call: a vector per input, in order, and the tokens they
    took (after truncation: OpenAI's `usage.prompt_tokens`)."""

    vectors: list[Vector]
    prompt_tokens: int


@dataclass(frozen=True, slots=True)
class Predicted:
    """The answer to one scoring or classification call: the model's raw logits per input, in
    order (activation and labels are the route's: sigmoid or softmax, `id2label`), and the
    tokens they took."""

    logits: list[Vector]
    prompt_tokens: int


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A generated token's log-probability under the model's own distribution at that step
    (its logits before temperature, top_p or `min_tokens` act, as vLLM's default reports it),
    with the `top` most likely tokens of that step, most likely first. Each token comes as its
    id and its text (special tokens included); a log-probability of -inf is given as -9999.0,
    as JSON has no infinity."""

    token_id: int
    token: str
    logprob: float | None  # None: an echoed prompt's first token, which has no context
    top: tuple[tuple[int, str, float], ...] = ()  # (token id, its text, log-probability)


@dataclass(frozen=True, slots=True)
class Delta:
    """What a generated sequence produced in one engine step: new token ids, new text, and
    whether it ended (`finish_reason` is `stop` or `length`, else None); `logprobs`, one per
    new token, where the request asked for them (`SamplingParams.logprobs`)."""

    token_ids: tuple[int, ...]
    text: str
    finish_reason: str | None = None
    logprobs: tuple[TokenLogprob, ...] | None = None


@dataclass(frozen=True, slots=True)
class OutputConstraint:
    """What a generation's text must follow (`lenbatch.generate.structured`): its `kind`
    (`json`, `json_object`, `regex`, `choice` or `grammar`) and llguidance's serialized
    grammar of it. Plain text, so it travels to Ray replicas as it is."""

    kind: str
    grammar: str


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Decoding options of one generation request (OpenAI's names).

    `temperature == 0` means greedy. `top_p` keeps the smallest set of most likely tokens whose
    probability reaches `top_p`. `seed` makes sampling reproducible. `stop` strings end the text
    (not included in it). `ignore_eos` keeps generating past end-of-sequence tokens until
    `max_tokens` (benchmarks replaying a trace's output lengths need it). `min_tokens` keeps
    end-of-sequence tokens from being chosen until that many tokens exist (as in vLLM).
    `logprobs`: report each generated token's log-probability with that many most likely
    alternatives (0: the token's own only; None: none), at most `MAX_LOGPROBS`.

    Penalties and biases change the logits a token is chosen from (not its reported
    log-probability): `repetition_penalty` (as transformers and vLLM: a token already in the
    prompt or the output has its logit divided by it where positive, multiplied where
    negative), `frequency_penalty` and `presence_penalty` (OpenAI's: a token's logit less its
    count in the output so far times the first, less the second if it occurs at all), and
    `logit_bias` ((token id, bias) pairs added to the logits, OpenAI's -100 to 100).

    As in vLLM: `stop_token_ids` end the text as end-of-sequence does (left out of it; chosen
    no sooner than `min_tokens`, even with `ignore_eos`), and `include_stop_str_in_output`
    keeps the stop string that ended the text at its end.

    `constraint`: the text follows it (structured outputs); None: free text.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    constraint: OutputConstraint | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"min_tokens must be between 0 and max_tokens={self.max_tokens}, "
                f"got {self.min_tokens}"
            )
        if not 0 <= self.temperature <= 2:
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and not -(2**63) <= self.seed < 2**63:
            raise ValueError(
                f"seed must be an integer in [{-(2**63)}, {2**63 - 1}], got {self.seed}"
            )
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be between 0 and {MAX_LOGPROBS}, got {self.logprobs}")
        if not MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise ValueError(
                f"repetition_penalty must be in [{MIN_REPETITION_PENALTY}, "
                f"{MAX_REPETITION_PENALTY}], got {self.repetition_penalty}"
            )
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        for token, bias in self.logit_bias:
            if not -100 <= bias <= 100:
                raise ValueError(f"logit_bias of token {token} must be in [-100, 100], got {bias}")

    @property
    def penalized(self) -> bool:
        """True when a penalty or a bias changes the logits a token is chosen from."""
        return bool(
            self.repetition_penalty != 1.0
            or self.frequency_penalty
            or self.presence_penalty
            or self.logit_bias
        )

    @property
    def greedy(self) -> bool:
        """True when decoding takes the most likely token."""
        return self.temperature == 0
