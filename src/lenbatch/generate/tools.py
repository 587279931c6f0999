"""Tool calls in chat: OpenAI's `tools` with `tool_choice` naming a function or `required`,
generated as JSON that follows the tools' schemas (structured outputs), and returned as
`tool_calls`.

What vLLM does without a model-specific tool parser, with its schemas: a named function's
text is its arguments (a JSON object following its `parameters`); `required` makes the text a
JSON array of one or more `{"name": ..., "parameters": {...}}` objects (no other keys, where
vLLM allows them), each following one of the tools (at most one with
`parallel_tool_calls: false`). The tools also
reach the chat template, for models whose template renders them. Under `tool_choice: "auto"`
(the default when tools are given) the model writes free text, calls or not, in its own
format, which a parser named at start-up reads (`serve --tool-call-parser`,
`generate.toolparsers`); without one, `auto` is refused with a 400 that says what to send
instead, as vLLM refuses it unless started with a parser. Finish reasons are OpenAI's:
`tool_calls` for `required` and for `auto` with calls, `stop` for a named function; a text cut
short by `max_tokens` comes back as content with `length` and no tool calls.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from lenbatch.core.errors import BadInput
from lenbatch.generate.toolparsers import PARSERS, parse_tool_calls

__all__ = ["ToolCalls", "call_id", "plan_tools", "tool_call", "tools_schema"]

_EMPTY_OBJECT: dict[str, Any] = {"type": "object", "properties": {}}


def call_id() -> str:
    """A new tool call's id (OpenAI's `call_` prefix)."""
    return "call_" + uuid.uuid4().hex[:24]


def tools_schema(functions: dict[str, dict[str, Any] | None], one: bool) -> dict[str, Any]:
    """The JSON schema of `required`, vLLM's with no keys but `name` and `parameters` in a
    call: an array of calls, each of one of `functions` (name -> parameters schema); at most
    one call where `one`."""
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": {
            "type": "object",
            "anyOf": [
                {
                    "properties": {
                        "name": {"type": "string", "enum": [name]},
                        "parameters": params or _EMPTY_OBJECT,
                    },
                    "required": ["name", "parameters"],
                    # vLLM leaves other keys open (then a model can wander off in one)
                    "additionalProperties": False,
                }
                for name, params in functions.items()
            ],
        },
    }
    if one:
        schema["maxItems"] = 1
    return schema


@dataclass(frozen=True)
class ToolCalls:
    """How a chat call's text becomes tool calls: `named` (one function, the text is its
    arguments), `required` (the text is a JSON array of calls) or `auto` (free text, read by
    `parser`: content, calls, or both)."""

    mode: str  # "named", "required" or "auto"
    name: str | None = None  # the named function
    parser: str | None = None  # auto: the model's tool-call format (`generate.toolparsers`)

    @property
    def finish_reason(self) -> str:
        """OpenAI's finish reason of a complete call: `tool_calls`, or `stop` when named."""
        return "stop" if self.mode == "named" else "tool_calls"

    def with_parser(self, parser: str | None) -> ToolCalls:
        """These tool calls with the server's parser for `auto`; `BadInput` where `auto` has
        none."""
        if self.mode != "auto":
            return self
        if parser is None:
            raise BadInput(
                "tool_choice 'auto' (the default with tools) needs a parser of this model's own "
                "tool-call format: start the server with --tool-call-parser "
                f"({' or '.join(PARSERS)}), or send tool_choice 'required', 'none', or name a "
                "function"
            )
        return ToolCalls("auto", parser=parser)

    def message(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """(content, OpenAI `tool_calls`) of a complete text (each call with a new id); raises
        `BadInput` where a `required` text is not the JSON its schema made it (a bug)."""
        if self.mode == "auto":
            assert self.parser is not None
            content, found = parse_tool_calls(self.parser, text)
            return content, [tool_call(name, args) for name, args in found]
        return None, self.calls(text)

    def calls(self, text: str) -> list[dict[str, Any]]:
        """The OpenAI `tool_calls` of a complete named or `required` text (each with a new
        id); raises `BadInput` where the text is not the JSON its schema made it (a bug)."""
        if self.mode == "named":
            assert self.name is not None
            return [tool_call(self.name, text)]
        try:
            items = json.loads(text)
        except ValueError as exc:
            raise BadInput(f"the model's tool calls are not JSON: {exc}") from None
        return [
            tool_call(str(item["name"]), json.dumps(item["parameters"], ensure_ascii=False))
            for item in items
        ]


def tool_call(name: str, arguments: str) -> dict[str, Any]:
    """An OpenAI `tool_calls` item (with a new id) calling `name` with `arguments` (JSON)."""
    return {
        "id": call_id(),
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def plan_tools(
    functions: dict[str, dict[str, Any] | None],
    choice: str | None,
    named: str | None,
    parallel: bool | None,
) -> tuple[ToolCalls | None, dict[str, Any] | None]:
    """(how the text becomes tool calls, the JSON schema it must follow), or (None, None)
    for free text: `functions` maps each tool's name to its parameters schema, `choice` is
    `tool_choice` as a string (None where it names a function: `named`). Raises `BadInput`."""
    if named is not None:
        if named not in functions:
            raise BadInput(f"tool_choice names function {named!r}, which is not among the tools")
        return ToolCalls("named", named), functions[named] or _EMPTY_OBJECT
    if choice == "none":
        return None, None
    if not functions:
        if choice == "required":
            raise BadInput("tool_choice 'required' needs tools")
        return None, None
    if choice == "required":
        return ToolCalls("required"), tools_schema(functions, one=parallel is False)
    return ToolCalls("auto"), None  # the route gives it the server's parser, or refuses it
