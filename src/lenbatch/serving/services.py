"""The contracts the routes depend on: what a front-end promises, whatever runs behind it.

The HTTP shell (`lenbatch.serving.http`) and the routes of `embed/` and `generate/` are written
against these protocols, never against a concrete engine. The single-process engines implement
them, and so do the Ray ingress's front-ends (`lenbatch.scaleout`), with no casts; an engine in a
process apart from HTTP would implement them the same way, as a client of that process.

- `Service`: the lifecycle and the figures every front-end has (`/health`, `/stats`,
  `/metrics`, drain on SIGTERM).
- `EmbeddingService`: `POST /v1/embeddings`.
- `GenerationService`: `POST /v1/completions` and `/v1/chat/completions`; prompts are tokenized
  (chat templates included) off the event loop, by the service.
- `ScoringService`: what the encoder tasks' routes (rerank, score, classify) will call: raw
  logits per input or per (query, document) pair, each batched by its own length.

Every call either returns its answer or raises a `LenbatchError` saying what was wrong and what
the limit is; a caller that goes away cancels its work before it costs compute.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any, Protocol, TypeVar, Unpack, runtime_checkable

from lenbatch.config import GenerationConfig
from lenbatch.core.clock import Clock
from lenbatch.runners.base import ModelInfo
from lenbatch.serving.lifecycle import EngineState
from lenbatch.serving.messages import (
    CallOptions,
    Delta,
    Embedded,
    Inputs,
    PairInputs,
    Predicted,
    SamplingParams,
    SubmitOptions,
    TokenLogprob,
)

__all__ = [
    "Clocked",
    "EmbeddingService",
    "GenerationHandle",
    "GenerationService",
    "ScoringService",
    "Service",
    "params_per_prompt",
]

H = TypeVar("H", bound="GenerationHandle")


@runtime_checkable
class Service(Protocol):
    """What the HTTP shell reads of any front-end: lifecycle, readiness and figures."""

    @property
    def state(self) -> EngineState:
        """Where the front-end is in its lifecycle."""
        ...

    @property
    def failure(self) -> str | None:
        """Why the runner was declared crashed, if it was."""
        ...

    @property
    def ready(self) -> bool:
        """True while the front-end accepts work."""
        ...

    @property
    def unanswered(self) -> int:
        """Admitted requests not answered yet."""
        ...

    async def start(self) -> None:
        """Start serving on the running event loop."""
        ...

    async def drain(self, timeout: float | None = 30.0) -> None:
        """Refuse new requests; answer every admitted one within `timeout` seconds (what is
        left then is answered 503)."""
        ...

    async def stop(self, timeout: float | None = 30.0) -> None:
        """Drain, then stop."""
        ...

    def describe(self) -> str:
        """One line for the start-up log."""
        ...

    def stats(self) -> dict[str, Any]:
        """The JSON summary `GET /stats` answers with."""
        ...

    def prometheus(self) -> bytes:
        """The Prometheus exposition `GET /metrics` answers with."""
        ...


class Clocked(Protocol):
    """A front-end whose routes stamp each call's arrival with its clock, before tokenizing it
    (latency, TTFT and the SLO count from there)."""

    @property
    def clock(self) -> Clock:
        """The front-end's clock."""
        ...


@runtime_checkable
class EmbeddingService(Service, Clocked, Protocol):
    """A front-end that embeds texts or token arrays, each input batched by its length."""

    @property
    def info(self) -> ModelInfo:
        """The served model's facts (name, length limit, vector width)."""
        ...

    async def embed_with_usage(self, inputs: Inputs, **options: Unpack[CallOptions]) -> Embedded:
        """One vector per input, in order, and the tokens they took (`options`: truncation,
        timeout and priority, see `CallOptions`). With several inputs, an error's message
        starts with the failing input's index."""
        ...


class GenerationHandle(Protocol):
    """What the routes read of one prompt being generated."""

    @property
    def request_id(self) -> str:
        """An anonymous id (the response's `id` is built from it)."""
        ...

    @property
    def prompt_tokens(self) -> int:
        """Tokens in the prompt."""
        ...

    @property
    def completion_tokens(self) -> int:
        """Tokens generated so far."""
        ...

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens whose keys and values a prefix cache gave (known once the prompt is
        prefilled, or for a relayed sequence once it has finished)."""
        ...

    def timings_ms(self) -> dict[str, Any]:
        """The TTFT breakdown, inter-token and end-to-end times, in milliseconds."""
        ...


@runtime_checkable
class GenerationService(Service, Clocked, Protocol[H]):
    """A front-end that generates text from prompts, each prompt's prefill batched by its
    length; `H` is its handle on one prompt in flight."""

    @property
    def info(self) -> ModelInfo:
        """The served model's facts (name, context length)."""
        ...

    @property
    def generation(self) -> GenerationConfig:
        """Generation settings (default and largest `max_tokens`)."""
        ...

    @property
    def has_chat_template(self) -> bool:
        """True if the tokenizer can format chat messages."""
        ...

    async def prompt_ids(
        self, raw: str | list[str] | list[int] | list[list[int]]
    ) -> list[list[int]]:
        """Token ids of a call's prompts: texts tokenized off the event loop (then dropped),
        token arrays as given. Raises `BadInput` for an empty prompt."""
        ...

    async def chat_prompt(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """Token ids of chat `messages` (and OpenAI `tools`, where the template renders
        them) through the model's chat template, off the event loop. Raises `BadInput` when
        the model has no chat template."""
        ...

    def context_left(self, prompt_len: int) -> int:
        """Most tokens a prompt of `prompt_len` tokens may generate (context and limit)."""
        ...

    async def prompt_text(self, ids: list[int]) -> str:
        """The text of a prompt's token ids (special tokens skipped), off the event loop."""
        ...

    async def check_constraint(self, params: SamplingParams) -> None:
        """Refuse (`BadInput`) `params`' structured-output constraint where the model cannot
        follow it or its token masks cost too much, off the event loop (the routes call it
        before `submit_all`; free text passes)."""
        ...

    async def prompt_logprobs(self, prompt: list[int], top: int) -> list[TokenLogprob]:
        """Each token of a (checked) `prompt` with its log-probability given the tokens
        before it and its `top` most likely alternatives (the first token: None, no
        alternatives), for `echo`. Raises `BadInput` where the front end cannot."""
        ...

    def submit_all(
        self,
        prompts: list[list[int]],
        params: SamplingParams | Sequence[SamplingParams],
        **options: Unpack[SubmitOptions],
    ) -> list[H]:
        """Admit every prompt of one call, or none (a refused prompt withdraws the others);
        raises the refusal (`BadInput`, `InputTooLong`, `Overloaded`, `Unavailable`).
        `params`: one for every prompt, or one per prompt (a call's `n` choices differ by
        seed). `options`: arrival, timeout and priority, see `SubmitOptions`."""
        ...

    def stream(self, handle: H) -> AsyncIterator[Delta]:
        """The deltas of one prompt as they are generated; the last has a finish reason.
        Raises the request's `LenbatchError` if it fails; leaving early cancels it."""
        ...

    def cancel(self, handle: H) -> None:
        """The caller is gone: stop generating for this prompt (idempotent)."""
        ...


@runtime_checkable
class ScoringService(Service, Clocked, Protocol):
    """A front-end that runs a sequence-classification head (a cross-encoder reranker, a
    classifier) on single texts or (query, document) pairs, each batched by its own token
    count. Routes turn the logits into scores (sigmoid for one label), probabilities (softmax,
    or sigmoid when multi-label) and labels."""

    @property
    def info(self) -> ModelInfo:
        """The served model's facts (name, length limit)."""
        ...

    @property
    def labels(self) -> Sequence[str]:
        """The head's label names in logit order (`id2label`)."""
        ...

    @property
    def activation(self) -> str:
        """sentence-transformers' `CrossEncoder` default activation for this head: sigmoid,
        identity, tanh or softmax (a score route applies it unless raw scores are asked)."""
        ...

    @property
    def problem_type(self) -> str | None:
        """transformers' `problem_type` (`multi_label_classification`: sigmoid per label)."""
        ...

    async def predict_with_usage(
        self, inputs: PairInputs, **options: Unpack[CallOptions]
    ) -> Predicted:
        """The logits of each input, in order, and the tokens they took. A pair that is too
        long is cut from the document's side when `truncate` is set, never the query's."""
        ...


def params_per_prompt(
    prompts: Sequence[object], params: SamplingParams | Sequence[SamplingParams]
) -> list[SamplingParams]:
    """`submit_all`'s `params` as one per prompt."""
    if isinstance(params, SamplingParams):
        return [params] * len(prompts)
    if len(params) != len(prompts):
        raise RuntimeError(f"bug: {len(params)} sampling params for {len(prompts)} prompts")
    return list(params)
