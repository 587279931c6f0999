"""OpenAI's completion protocol as lenbatch speaks it: request bodies, usage, stream chunks.

Request models accept OpenAI's fields (unknown ones are ignored, as OpenAI-compatible servers
do) plus `ignore_eos` (as in vLLM); options this server cannot honour are named by
`unsupported()` so the route can answer 400 instead of silently ignoring them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError

from lenbatch.core.errors import BadInput
from lenbatch.generate.tools import ToolCalls, plan_tools
from lenbatch.serving.messages import (
    MAX_LOGPROBS,
    MAX_REPETITION_PENALTY,
    MIN_REPETITION_PENALTY,
    OutputConstraint,
    SamplingParams,
    TokenLogprob,
)
from lenbatch.serving.services import GenerationHandle

__all__ = [
    "MAX_CHOICES",
    "MAX_STOP",
    "MAX_STOP_TOKEN_IDS",
    "MAX_TOOLS",
    "SEED_MAX",
    "SEED_MIN",
    "ChatMessage",
    "ChatRequest",
    "CommonOptions",
    "CompletionRequest",
    "JsonSchemaFormat",
    "NamedToolChoice",
    "ResponseFormat",
    "StreamOptions",
    "StructuredOutputs",
    "Tool",
    "ToolFunction",
    "chat_logprobs",
    "completion_logprobs",
    "envelope",
    "obj_line",
    "usage",
]

MAX_STOP = 4
MAX_STOP_TOKEN_IDS = 64
MAX_TOOLS = 128  # as OpenAI's limit
MAX_CHOICES = 16  # `n`: each choice a row of its own (the prefix cache shares the prompt's blocks)
# Seeds are 64-bit signed integers, as in vLLM (torch.Generator takes no wider value).
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1


class StreamOptions(BaseModel):
    """OpenAI's `stream_options`."""

    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    """OpenAI's `response_format.json_schema`: a named schema (`strict` is accepted; the
    schema is always followed)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str = "response"
    description: str | None = None
    # `schema` is OpenAI's name; pydantic's BaseModel has a method of that name.
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`: free text, any JSON object, or JSON that follows a schema."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs`: exactly one constraint on the text."""

    model_config = ConfigDict(extra="ignore")

    json_: dict[str, Any] | str | None = Field(
        None, alias="json", description="A JSON schema the text follows."
    )
    regex: str | None = Field(None, description="A regular expression the whole text matches.")
    choice: list[str] | None = Field(None, description="The text is one of these strings.")
    grammar: str | None = Field(None, description="A Lark grammar the text follows.")
    json_object: bool | None = Field(None, description="The text is a JSON object.")
    disable_any_whitespace: bool = Field(
        False, description="JSON without whitespace between its tokens."
    )

    def constraint(self) -> OutputConstraint | None:
        """The one constraint given, compiled; `BadInput` for none or several."""
        from lenbatch.generate.structured import grammar_of

        given = {
            "json": self.json_,
            "regex": self.regex,
            "choice": self.choice,
            "grammar": self.grammar,
            "json_object": self.json_object or None,
        }
        kinds = [k for k, v in given.items() if v is not None]
        if len(kinds) != 1:
            raise BadInput(
                "structured_outputs takes exactly one of json, regex, choice, grammar or "
                f"json_object; got {len(kinds)}"
            )
        return grammar_of(kinds[0], given[kinds[0]], compact=self.disable_any_whitespace)


class CommonOptions(BaseModel):
    """Options shared by completions and chat completions (OpenAI's names)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    n: int = Field(
        1,
        ge=1,
        le=MAX_CHOICES,
        description="Choices per prompt; with a `seed`, choice j samples with seed + j.",
    )
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(
        None,
        description="Seed for sampling: a 64-bit signed integer.",
        json_schema_extra={"minimum": SEED_MIN, "maximum": SEED_MAX},
    )
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    presence_penalty: float = Field(
        0.0, ge=-2, le=2, description="Subtracted from the logit of every token in the output."
    )
    frequency_penalty: float = Field(
        0.0,
        ge=-2,
        le=2,
        description="Times a token's count in the output, subtracted from its logit.",
    )
    repetition_penalty: float = Field(
        1.0,
        ge=MIN_REPETITION_PENALTY,
        le=MAX_REPETITION_PENALTY,
        description="As transformers and vLLM: the logit of a token in the prompt or the output "
        "is divided by it where positive, multiplied where negative (1: off).",
    )
    logit_bias: dict[str, float] | None = Field(
        None, description="Token id (as a string) -> bias from -100 to 100, added to its logit."
    )
    user: str | None = None
    stop_token_ids: list[int] | None = Field(
        None,
        max_length=MAX_STOP_TOKEN_IDS,
        description="Token ids that end the text as end-of-sequence does (as vLLM).",
    )
    include_stop_str_in_output: bool = Field(
        False, description="Keep the stop string that ended the text at its end (as vLLM)."
    )
    return_tokens_as_token_ids: bool = Field(
        False,
        description="Name the tokens of `logprobs` `token_id:N` instead of their text "
        "(as vLLM does).",
    )
    response_format: ResponseFormat | None = Field(
        None, description="OpenAI's: `json_object`, or `json_schema` with a schema to follow."
    )
    structured_outputs: StructuredOutputs | None = Field(
        None,
        description="vLLM's: the text follows a JSON schema, a regex, a choice or a grammar.",
    )

    @field_validator("seed", mode="before")
    @classmethod
    def _seed_in_range(cls, value: Any) -> Any:
        # Checked before pydantic's own int parsing so the message states the whole range;
        # a wider seed would overflow torch.Generator.manual_seed (a 500 before this check).
        is_int = isinstance(value, int) and not isinstance(value, bool)
        if is_int and not SEED_MIN <= value <= SEED_MAX:
            raise PydanticCustomError(
                "seed_range",
                "must be an integer in [{lo}, {hi}]",
                {"lo": SEED_MIN, "hi": SEED_MAX},
            )
        return value

    def unsupported(self) -> str | None:
        """The first option set to something this server cannot honour, named."""
        return None

    def choice_params(self, params: SamplingParams) -> list[SamplingParams]:
        """The sampling of each of a prompt's `n` choices: `params`, with a `seed`, seed + j
        for choice j (as vLLM), so seeded choices differ and each is reproducible."""
        if params.seed is None:
            return [params] * self.n
        return [dataclasses.replace(params, seed=_wrapped(params.seed + j)) for j in range(self.n)]

    def _biases(self) -> tuple[tuple[int, float], ...]:
        """`logit_bias` as (token id, bias) pairs; a key that is not a token id is a 400 (one
        outside the vocabulary is refused where the vocabulary is known, at submission)."""
        out = []
        for key, bias in (self.logit_bias or {}).items():
            try:
                token = int(key)
            except ValueError:
                raise BadInput(f"logit_bias keys must be token ids, got {key!r}") from None
            out.append((token, float(bias)))
        return tuple(out)

    def logprob_count(self) -> int | None:
        """Alternatives to report per generated token's log-probability; None: no
        log-probabilities (each endpoint's own fields say)."""
        return None

    def constraint(self) -> OutputConstraint | None:
        """The constraint `structured_outputs` or `response_format` puts on the text (not
        both), compiled; None for free text. Raises `BadInput` for a malformed one."""
        from lenbatch.generate.structured import grammar_of

        fmt = self.response_format
        if fmt is not None and fmt.type == "text":
            fmt = None
        if fmt is not None and self.structured_outputs is not None:
            raise BadInput("give response_format or structured_outputs, not both")
        if self.structured_outputs is not None:
            return self.structured_outputs.constraint()
        if fmt is None:
            return None
        if fmt.type == "json_object":
            return grammar_of("json_object", None)
        if fmt.json_schema is None or fmt.json_schema.json_schema is None:
            raise BadInput("response_format of type json_schema needs json_schema.schema")
        return grammar_of("json", fmt.json_schema.json_schema)

    def sampling(self, max_tokens: int) -> SamplingParams:
        """SamplingParams for this request (max_tokens already defaulted)."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stop) > MAX_STOP:
            raise BadInput(f"{len(stop)} stop sequences given; the limit is {MAX_STOP}")
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=self.temperature,
                top_p=self.top_p,
                seed=self.seed,
                stop=tuple(stop),
                ignore_eos=self.ignore_eos,
                min_tokens=self.min_tokens,
                logprobs=self.logprob_count(),
                repetition_penalty=self.repetition_penalty,
                frequency_penalty=self.frequency_penalty,
                presence_penalty=self.presence_penalty,
                logit_bias=self._biases(),
                stop_token_ids=tuple(self.stop_token_ids or ()),
                include_stop_str_in_output=self.include_stop_str_in_output,
                constraint=self.constraint(),
            )
        except ValueError as exc:
            raise BadInput(str(exc)) from None


class CompletionRequest(CommonOptions):
    """Body of `POST /v1/completions`."""

    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = Field(
        False,
        description="Begin each choice's text with its prompt (and, with `logprobs`, its "
        "tokens with the prompt's log-probabilities, the first null).",
    )
    best_of: int | None = None
    suffix: str | None = None
    logprobs: int | None = Field(
        None,
        ge=0,
        le=MAX_LOGPROBS,
        description="Return each generated token's log-probability with this many most "
        "likely alternatives (0: the token's own only).",
    )

    def logprob_count(self) -> int | None:
        """`logprobs` as given."""
        return self.logprobs

    def unsupported(self) -> str | None:
        """The first option set to something this server cannot honour, named."""
        if self.best_of not in (None, 1):
            return "best_of is not supported"
        if self.suffix:
            return "suffix is not supported"
        return super().unsupported()


class ToolFunction(BaseModel):
    """A function the model may call: its name, description and parameters' JSON schema."""

    model_config = ConfigDict(extra="ignore")

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    """OpenAI's chat `tools` item (functions only)."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["function"] = "function"
    function: ToolFunction


class NamedFunction(BaseModel):
    """The function a named `tool_choice` names."""

    name: str


class NamedToolChoice(BaseModel):
    """`tool_choice` naming one function: the text is that function's arguments."""

    type: Literal["function"] = "function"
    function: NamedFunction


class ChatMessage(BaseModel):
    """One chat message; `content` is text or a list of OpenAI text parts."""

    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    # An assistant turn's tool calls, and a tool turn's answer to one (for chat templates
    # that render them; others see the text only).
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    def for_template(self) -> dict[str, Any]:
        """The message as a chat template takes it: role and text, and its tool fields
        where given (a tool call's `arguments` parsed, as templates expect)."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            calls = []
            for call in self.tool_calls:
                fn = dict(call.get("function") or {})
                if isinstance(fn.get("arguments"), str):
                    with contextlib.suppress(ValueError):  # else left as the text it is
                        fn["arguments"] = json.loads(fn["arguments"])
                calls.append({**call, "function": fn})
            out["tool_calls"] = calls
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out

    def text(self) -> str:
        """The message's text (text parts joined)."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for p in self.content:
            if p.get("type") != "text":
                raise BadInput(f"message content part of type {p.get('type')!r} is not supported")
            parts.append(str(p.get("text", "")))
        return "".join(parts)


class ChatRequest(CommonOptions):
    """Body of `POST /v1/chat/completions`."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = Field(False, description="Return each output token's log-probability.")
    top_logprobs: int | None = Field(
        None,
        ge=0,
        le=MAX_LOGPROBS,
        description="With `logprobs`: this many most likely alternatives per output token.",
    )

    tools: list[Tool] | None = Field(
        None, max_length=MAX_TOOLS, description="Functions the model may call."
    )
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None,
        description="`required` (one or more calls of the tools) or a named function (its "
        "arguments); `auto`, the default with tools, needs a tool-call parser: refused.",
    )
    parallel_tool_calls: bool | None = Field(
        None, description="false: at most one call under `required`."
    )

    def unsupported(self) -> str | None:
        """The first option set to something this server cannot honour, named."""
        if self.top_logprobs is not None and not self.logprobs:
            return "top_logprobs needs logprobs: true"
        return super().unsupported()

    def tool_plan(self) -> tuple[ToolCalls | None, dict[str, Any] | None]:
        """How this call's text becomes tool calls, and the schema it follows (None, None:
        free text). Raises `BadInput` (see `generate.tools.plan_tools`)."""
        functions: dict[str, dict[str, Any] | None] = {}
        for tool in self.tools or []:
            name = tool.function.name
            if name in functions:
                raise BadInput(f"two tools are named {name!r}")
            functions[name] = tool.function.parameters
        choice = self.tool_choice
        named = choice.function.name if isinstance(choice, NamedToolChoice) else None
        text_choice = choice if isinstance(choice, str) else None
        if isinstance(choice, NamedToolChoice) and not self.tools:
            raise BadInput("tool_choice names a function but no tools were given")
        return plan_tools(functions, text_choice, named, self.parallel_tool_calls)

    def constraint(self) -> OutputConstraint | None:
        """The tools' schema where a call must be made, else the base class's; both at once
        is a 400."""
        from lenbatch.generate.structured import grammar_of

        _, schema = self.tool_plan()
        if schema is None:
            return super().constraint()
        if self.structured_outputs is not None or (
            self.response_format is not None and self.response_format.type != "text"
        ):
            raise BadInput("give tools with tool_choice or a response format, not both")
        return grammar_of("json", schema)

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as chat templates take them (None: no tools, or `tool_choice: none`)."""
        if not self.tools or self.tool_choice == "none":
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def logprob_count(self) -> int | None:
        """`top_logprobs` (0 when left out) where `logprobs` is true, else None."""
        return (self.top_logprobs or 0) if self.logprobs else None


def _wrapped(seed: int) -> int:
    """`seed` kept in the 64-bit signed range (seed + j past the top wraps to the bottom)."""
    return (seed - SEED_MIN) % 2**64 + SEED_MIN


def usage(seqs: Sequence[GenerationHandle], choices: int = 1) -> dict[str, Any]:
    """OpenAI usage counts of a call's sequences (every generated token counts), `choices`
    per prompt, in prompt order: a prompt's tokens count once, as OpenAI counts them; of
    those, `prompt_tokens_details.cached_tokens` came from the prefix cache."""
    prompt = sum(s.prompt_tokens for s in seqs[::choices])
    completion = sum(s.completion_tokens for s in seqs)
    cached = sum(s.cached_tokens for s in seqs[::choices])
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def envelope(
    rid: str, created: int, served: str, choices: list[Any], *, chat: bool, chunk: bool
) -> dict[str, Any]:
    """What a completion response (or, `chunk`, one streamed chunk of it) starts with: its id,
    OpenAI `object` kind, creation time, model and choices."""
    kind = "text_completion"
    if chat:
        kind = "chat.completion.chunk" if chunk else "chat.completion"
    return {"id": rid, "object": kind, "created": created, "model": served, "choices": choices}


def obj_line(obj: dict[str, Any]) -> str:
    """One server-sent event carrying `obj` as JSON."""
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def _name(token_id: int, text: str, as_ids: bool) -> str:
    """A token as a log-probability object names it: its text, or `token_id:N` (vLLM's
    `return_tokens_as_token_ids`)."""
    return f"token_id:{token_id}" if as_ids else text


def completion_logprobs(
    entries: Sequence[TokenLogprob], offset: int = 0, *, as_ids: bool = False
) -> dict[str, Any]:
    """OpenAI's legacy completion `logprobs` object for `entries`, the first starting at
    character `offset` of the completion's text: `tokens`, `token_logprobs`, `top_logprobs`
    (per token, the most likely alternatives and the chosen token itself, as OpenAI and vLLM
    give them: up to `logprobs` + 1 entries) and `text_offset` (by the tokens' texts).
    `as_ids`: tokens named `token_id:N`. An echoed prompt's first token, which has no
    log-probability, has null for both (as OpenAI gives it)."""
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e.token)
    tops: list[dict[str, float] | None] = []
    for e in entries:
        if e.logprob is None:
            tops.append(None)
            continue
        top = {_name(i, text, as_ids): lp for i, text, lp in e.top}
        top[_name(e.token_id, e.token, as_ids)] = e.logprob
        tops.append(top)
    return {
        "tokens": [_name(e.token_id, e.token, as_ids) for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def chat_logprobs(entries: Sequence[TokenLogprob], *, as_ids: bool = False) -> dict[str, Any]:
    """OpenAI's chat `logprobs` object for `entries`: `content`, one item per token with its
    text (`as_ids`: `token_id:N`), log-probability, UTF-8 bytes of its text and `top_logprobs`
    (the most likely alternatives, most likely first)."""

    def item(token_id: int, text: str, logprob: float | None) -> dict[str, Any]:
        name = _name(token_id, text, as_ids)
        return {"token": name, "logprob": logprob, "bytes": list(text.encode())}

    return {
        "content": [
            {
                **item(e.token_id, e.token, e.logprob),
                "top_logprobs": [item(i, text, lp) for i, text, lp in e.top],
            }
            for e in entries
        ]
    }
