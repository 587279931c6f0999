"""Tool calls read out of a model's own text under `tool_choice: "auto"`
(`generate.toolparsers`): the formats vLLM's `hermes` and `pythonic` parsers read, whole and
streamed."""

from __future__ import annotations

import json

import pytest

from lenbatch.generate.toolparsers import AutoToolStream, parse_tool_calls

WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "celsius": true}}\n</tool_call>'  # noqa: E501
TIME = '<tool_call>{"name": "get_time", "parameters": {"zone": "UTC"}}</tool_call>'


def _args(calls: list[tuple[str, str]]) -> list[tuple[str, object]]:
    return [(name, json.loads(args)) for name, args in calls]


def test_hermes_blocks_are_calls_and_the_rest_is_content() -> None:
    content, calls = parse_tool_calls("hermes", WEATHER)
    assert content is None
    assert _args(calls) == [("get_weather", {"city": "Paris", "celsius": True})]
    content, calls = parse_tool_calls("hermes", f"Let me check.\n{WEATHER}\n{TIME}")
    assert content == "Let me check."
    assert _args(calls) == [
        ("get_weather", {"city": "Paris", "celsius": True}),
        ("get_time", {"zone": "UTC"}),  # `parameters`, as some templates name them
    ]
    quoted = '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>'
    assert _args(parse_tool_calls("hermes", quoted)[1]) == [("f", {"a": 1})]


@pytest.mark.parametrize(
    "text",
    [
        "The weather is fine.",
        "<tool_call>{not json}</tool_call>",
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        '<tool_call>{"name": "f", "arguments": {}}',  # never closed (cut short)
    ],
)
def test_a_text_without_a_well_formed_hermes_call_is_content(text: str) -> None:
    assert parse_tool_calls("hermes", text) == (text, [])


def test_pythonic_lists_of_calls_with_literal_arguments() -> None:
    text = '[get_weather(city="Paris", celsius=True), get_time(zone="UTC")]'
    content, calls = parse_tool_calls("pythonic", f"  {text}\n")
    assert content is None
    assert _args(calls) == [
        ("get_weather", {"city": "Paris", "celsius": True}),
        ("get_time", {"zone": "UTC"}),
    ]
    assert _args(parse_tool_calls("pythonic", "[ping()]")[1]) == [("ping", {})]


@pytest.mark.parametrize(
    "text",
    [
        "Paris is sunny.",
        "[1, 2, 3]",
        "[f(x)]",  # a positional argument
        "[f(a=open('x'))]",  # not a literal: never evaluated
        "[f(a=1)",
        "[]",
    ],
)
def test_a_text_that_is_not_a_list_of_literal_calls_is_content(text: str) -> None:
    assert parse_tool_calls("pythonic", text) == (text, [])


def _stream(parser: str, pieces: list[str], complete: bool = True) -> tuple[str, list[str], list]:
    s = AutoToolStream(parser)
    sent = [s.push(p) for p in pieces]
    rest, calls = s.finish(complete)
    return "".join(sent) + rest, sent, calls


def test_streamed_hermes_content_goes_out_and_a_call_waits_for_the_end() -> None:
    text = f"Checking now. {WEATHER}"
    pieces = [text[i : i + 3] for i in range(0, len(text), 3)]
    content, sent, calls = _stream("hermes", pieces)
    assert content.strip() == "Checking now."
    assert _args(calls) == [("get_weather", {"city": "Paris", "celsius": True})]
    assert "".join(sent).startswith("Checking now")
    # nothing of the marker went out as content, even split across pieces
    assert "<" not in "".join(sent)


def test_streamed_text_that_only_looked_like_a_call_is_all_content() -> None:
    content, sent, calls = _stream("hermes", ["a <tool", "_cal", "l> broken"])
    assert (content, calls) == ("a <tool_call> broken", [])
    assert sent[0] == "a "  # "<tool" waited: it could have begun a call
    content, _, calls = _stream("hermes", ["<tool_call>", '{"name": "f", "arguments": {}}'], False)
    assert calls == [] and content == '<tool_call>{"name": "f", "arguments": {}}'  # cut short


def test_streamed_pythonic_waits_for_a_leading_bracket() -> None:
    content, sent, calls = _stream("pythonic", ["[ping(", ")]"])
    assert sent == ["", ""] and content == "" and _args(calls) == [("ping", {})]
    content, sent, calls = _stream("pythonic", ["Hello", " there"])
    assert sent == ["Hello", " there"] and calls == []
