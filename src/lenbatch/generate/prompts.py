"""A call's prompts to checked token ids, off the event loop.

Prompt texts and chat templates are tokenized in worker threads (HF fast tokenizers release the
GIL), never in the async route, so a long prompt holds up neither the loop nor the streams it
serves. The checks a prompt must pass before admission (not empty, ids in the vocabulary,
`max_tokens` under the server's limit, prompt plus `max_tokens` within the context) are made
here too. The single server's generation engine and the Ray ingress (`lenbatch.scaleout`) both
use a `Prompts`, so a prompt gets the same ids and the same refusal from either; the ingress
builds it on a tokenizer alone (`lenbatch.runners.tokenizer.TextTokenizer`), never the weights.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

from lenbatch.config import GenerationConfig
from lenbatch.core.errors import BadInput, InputTooLong
from lenbatch.generate.structured import grammars_for
from lenbatch.runners.base import ModelInfo
from lenbatch.serving.messages import OutputConstraint, SamplingParams

__all__ = ["PromptCalls", "PromptTokenizer", "Prompts"]

_THREADS = 2  # one long prompt tokenizing leaves a thread for everyone else


class PromptTokenizer(Protocol):
    """What prompts need of a tokenizer (`TextTokenizer`, `CausalLMRunner`)."""

    @property
    def has_chat_template(self) -> bool:
        """True if the tokenizer can format chat messages."""
        ...

    def tokenize(self, texts: list[str], truncate: bool) -> list[list[int]]:
        """Token ids of each text, special tokens included."""
        ...

    def chat_prompt(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """Token ids of chat messages (and tools) through the chat template."""
        ...

    def decode(self, ids: list[int]) -> str:
        """Text of token ids, special tokens skipped."""
        ...


class Prompts:
    """Tokenizes and checks the prompts of one served causal LM."""

    def __init__(
        self,
        tokenizer: PromptTokenizer,
        info: ModelInfo,
        generation: GenerationConfig,
        *,
        threads: int = _THREADS,
    ) -> None:
        self.tokenizer = tokenizer
        self.info = info
        self.generation = generation
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="lenbatch-prompt")
        # llguidance's view of the vocabulary takes ~0.5 s to build for 49k tokens: built now,
        # beside start-up, rather than on the event loop by the first constrained request.
        if getattr(getattr(tokenizer, "tokenizer", None), "is_fast", False):
            self._pool.submit(grammars_for(tokenizer, info.vocab_size).tokenizer)

    @property
    def has_chat_template(self) -> bool:
        """True if the tokenizer can format chat messages."""
        return self.tokenizer.has_chat_template

    async def ids(self, raw: str | list[str] | list[int] | list[list[int]]) -> list[list[int]]:
        """Token ids of a call's prompts: texts tokenized in a worker thread (the caller drops
        the text afterwards), token arrays as given (`check` tests them against the
        vocabulary). Raises `BadInput` for an empty prompt."""
        if isinstance(raw, str):
            raw = [raw]
        if not raw:
            raise BadInput("prompt is empty: give a string, a list of strings or token ids")
        if isinstance(raw[0], int):
            raw = [raw]  # one token array
        if isinstance(raw[0], str):
            texts: list[str] = raw
            if any(not t for t in texts):
                raise BadInput("a prompt is an empty string")
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._pool, self.tokenizer.tokenize, texts, False)
        ids: list[list[int]] = raw
        return ids

    async def chat(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """Token ids of chat `messages` (and `tools`, where the template renders them)
        through the chat template, in a worker thread. Raises `BadInput` when the model has
        no chat template."""
        if not self.has_chat_template:
            raise BadInput(f"model {self.info.name} has no chat template; use /v1/completions")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, self.tokenizer.chat_prompt, messages, tools)

    async def text(self, ids: list[int]) -> str:
        """The text of token ids (special tokens skipped), in a worker thread."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, self.tokenizer.decode, ids)

    async def check_constraint(self, constraint: OutputConstraint) -> None:
        """Refuse (`BadInput`) a constraint this vocabulary cannot follow or whose token masks
        cost too much (`Grammars.check`), in a worker thread."""
        grammars = grammars_for(self.tokenizer, self.info.vocab_size)
        await asyncio.get_running_loop().run_in_executor(self._pool, grammars.check, constraint)

    def context_left(self, prompt_len: int) -> int:
        """Most tokens a prompt of `prompt_len` tokens may generate (context and limit)."""
        left = self.info.max_length - prompt_len
        cap = self.generation.max_tokens_limit
        return max(1, min(left, cap) if cap is not None else left)

    def check(self, prompt: list[int], params: SamplingParams) -> None:
        """Refuse a prompt the model cannot take, before any admission: empty, token ids out of
        the vocabulary (its own or `logit_bias`'s), `max_tokens` over this server's limit
        (`BadInput`), or prompt plus `max_tokens` over the context (`InputTooLong`)."""
        if not prompt:
            raise BadInput("the prompt is empty (0 tokens)")
        lo, hi = min(prompt), max(prompt)
        if lo < 0 or hi >= self.info.vocab_size:
            raise BadInput(f"prompt has token ids outside [0, {self.info.vocab_size})")
        vocab = self.info.vocab_size
        for token, _ in params.logit_bias:
            if not 0 <= token < vocab:
                raise BadInput(f"logit_bias names token {token}, outside [0, {vocab})")
        for token in params.stop_token_ids:
            if not 0 <= token < vocab:
                raise BadInput(f"stop_token_ids names token {token}, outside [0, {vocab})")
        limit = self.generation.max_tokens_limit
        if limit is not None and params.max_tokens > limit:
            raise BadInput(f"max_tokens={params.max_tokens} exceeds this server's limit {limit}")
        context = self.info.max_length
        if len(prompt) + params.max_tokens > context:
            raise InputTooLong(
                f"the prompt has {len(prompt)} tokens and max_tokens is {params.max_tokens}; "
                f"together they exceed the model's context of {context} tokens"
            )

    def close(self) -> None:
        """Stop the worker threads (a prompt still tokenizing finishes first)."""
        self._pool.shutdown(wait=False)


class PromptCalls:
    """The prompt calls of `GenerationService` (`prompt_ids`, `chat_prompt`,
    `has_chat_template`, `context_left`, `prompt_text`, `check_constraint`), answered by the
    front-end's `prompts`: what the single server's engine and the Ray ingress inherit
    alike."""

    prompts: Prompts

    @property
    def has_chat_template(self) -> bool:
        """True if the tokenizer can format chat messages."""
        return self.prompts.has_chat_template

    async def prompt_ids(
        self, raw: str | list[str] | list[int] | list[list[int]]
    ) -> list[list[int]]:
        """Token ids of a call's prompts: texts tokenized in a worker thread (then dropped),
        token arrays as given (checked against the vocabulary at submission)."""
        return await self.prompts.ids(raw)

    async def chat_prompt(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """Token ids of chat `messages` (and `tools`) through the tokenizer's chat template,
        in a worker thread. Raises `BadInput` when the model has no chat template."""
        return await self.prompts.chat(messages, tools)

    def context_left(self, prompt_len: int) -> int:
        """Most tokens a prompt of `prompt_len` tokens may generate (context and limit)."""
        return self.prompts.context_left(prompt_len)

    async def prompt_text(self, ids: list[int]) -> str:
        """The text of a prompt's token ids (special tokens skipped), off the event loop: what
        `echo` shows of a prompt given as token ids."""
        return await self.prompts.text(ids)

    async def check_constraint(self, params: SamplingParams) -> None:
        """Refuse (`BadInput`) `params`' constraint where the model cannot follow it or its
        masks cost too much, off the event loop; nothing to check for free text."""
        if params.constraint is not None:
            await self.prompts.check_constraint(params.constraint)
