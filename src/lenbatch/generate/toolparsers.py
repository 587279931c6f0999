"""Tool calls a model writes by itself (`tool_choice: "auto"`), read out of its text in the
model's own format, as vLLM's tool-call parsers do (`serve --tool-call-parser`):

* `hermes`: calls as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (the
  format of Hermes, Qwen and SmolLM's templates), anywhere in the text; the text outside them
  is the message's content;
* `pythonic`: the whole text a Python list of calls, `[get_weather(city="Paris"), ...]`, with
  literal arguments (Llama 3.2's and others' format; read with `ast`, never evaluated).

A text with no well-formed call is content, whole (a block that is not JSON, or a list that is
not literal calls, stays text, as in vLLM). `AutoToolStream` splits a streamed text: content
goes out as it comes, except what could be the start of a call, which waits until it is
decided; calls go out whole once the text has ended.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

__all__ = ["PARSERS", "AutoToolStream", "parse_tool_calls"]

PARSERS = ("hermes", "pythonic")

_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)

Call = tuple[str, str]  # (function name, arguments as JSON text)


def parse_tool_calls(parser: str, text: str) -> tuple[str | None, list[Call]]:
    """(content, calls) of a whole text in `parser`'s format; content is None where the text
    is calls alone (OpenAI's shape)."""
    calls = _hermes(text) if parser == "hermes" else _pythonic(text)
    if calls is None:
        return text, []
    if parser == "hermes":
        rest = _HERMES.sub("", text).strip()
        return rest or None, calls
    return None, calls


def _hermes(text: str) -> list[Call] | None:
    blocks = _HERMES.findall(text)
    if not blocks:
        return None
    calls = []
    for block in blocks:
        try:
            obj = json.loads(block)
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):  # some models write the arguments as a JSON string
            try:
                args = json.loads(args)
            except ValueError:
                return None
        calls.append((obj["name"], json.dumps(args, ensure_ascii=False)))
    return calls


def _pythonic(text: str) -> list[Call] | None:
    body = text.strip()
    if not (body.startswith("[") and body.endswith("]")):
        return None
    try:
        tree = ast.parse(body, mode="eval").body
    except SyntaxError:
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return None
        args: dict[str, Any] = {}
        for kw in node.keywords:
            if kw.arg is None:
                return None
            try:
                args[kw.arg] = ast.literal_eval(kw.value)
            except ValueError:
                return None
        calls.append((node.func.id, json.dumps(args, ensure_ascii=False)))
    return calls


class AutoToolStream:
    """One streamed choice under `tool_choice: "auto"`: what of each new piece of text can go
    out as content now, and the calls at the end."""

    def __init__(self, parser: str) -> None:
        self.parser = parser
        self.text = ""
        self.sent = 0  # characters of `text` sent as content
        self.held = False  # a call may have begun: the rest waits for the end

    def push(self, piece: str) -> str:
        """Add `piece`; returns the content that can be sent now."""
        self.text += piece
        if self.held:
            return ""
        if self.parser == "pythonic":
            if self.text.strip() == "" or self.text.lstrip().startswith("["):
                self.held = True  # a list of calls, or text that begins like one
                return ""
            out, self.sent = self.text[self.sent :], len(self.text)
            return out
        start = self.text.find(_HERMES_OPEN, self.sent)
        if start >= 0:
            self.held = True
            out, self.sent = self.text[self.sent : start], start
            return out
        safe = len(self.text) - _partial_suffix(self.text, _HERMES_OPEN)
        out, self.sent = self.text[self.sent : safe], max(self.sent, safe)
        return out

    def finish(self, complete: bool = True) -> tuple[str, list[Call]]:
        """The content not sent yet and the calls, once the text has ended (`complete`:
        by itself; a text cut short is content, whole)."""
        rest = self.text[self.sent :]
        calls = parse_tool_calls(self.parser, self.text)[1] if complete else []
        if not calls:
            return rest, []
        if self.parser == "pythonic":
            return "", calls
        return _HERMES.sub("", rest).strip(), calls


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that begins `marker` (0: none)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
