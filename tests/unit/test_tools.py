"""Tool calls' plan and their streamed shape (`generate.tools`, `generate.api._ToolStream`)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from lenbatch.core.errors import BadInput
from lenbatch.generate.api import _ToolStream
from lenbatch.generate.tools import ToolCalls, plan_tools
from lenbatch.serving.messages import Delta

F = {"get_time": {"type": "object", "properties": {"zone": {"type": "string"}}}, "ping": None}


def test_named_function_follows_its_parameters() -> None:
    tools, schema = plan_tools(F, None, "get_time", None)
    assert tools == ToolCalls("named", "get_time")
    assert schema == F["get_time"]
    # A function without parameters takes an empty object.
    assert plan_tools(F, None, "ping", None)[1] == {"type": "object", "properties": {}}


def test_required_is_an_array_of_the_tools_calls() -> None:
    tools, schema = plan_tools(F, "required", None, None)
    assert tools == ToolCalls("required")
    assert schema is not None and schema["type"] == "array" and schema["minItems"] == 1
    names = [item["properties"]["name"]["enum"] for item in schema["items"]["anyOf"]]
    assert names == [["get_time"], ["ping"]]
    assert "maxItems" not in schema
    assert plan_tools(F, "required", None, False)[1]["maxItems"] == 1  # type: ignore[index]


@pytest.mark.parametrize(
    ("functions", "choice", "named", "needle"),
    [
        (F, None, "nope", "not among the tools"),
        ({}, "required", None, "needs tools"),
    ],
)
def test_refusals(
    functions: dict[str, Any], choice: str | None, named: str | None, needle: str
) -> None:
    with pytest.raises(BadInput, match=needle):
        plan_tools(functions, choice, named, None)


@pytest.mark.parametrize("choice", ["auto", None])
def test_auto_takes_the_servers_parser_or_is_refused(choice: str | None) -> None:
    """`auto` (and no tool_choice with tools) is free text for a parser: without one, a 400
    naming the flag and what to send instead."""
    tools, schema = plan_tools(F, choice, None, None)
    assert tools == ToolCalls("auto") and schema is None
    assert tools.with_parser("hermes") == ToolCalls("auto", parser="hermes")
    with pytest.raises(BadInput, match=r"needs a parser .* --tool-call-parser"):
        tools.with_parser(None)
    named = ToolCalls("named", "ping")
    assert named.with_parser(None) is named


def test_free_text_where_no_call_is_asked() -> None:
    assert plan_tools(F, "none", None, None) == (None, None)
    assert plan_tools({}, None, None, None) == (None, None)
    assert plan_tools({}, "auto", None, None) == (None, None)


def test_calls_of_a_complete_text() -> None:
    named = ToolCalls("named", "get_time").calls('{"zone": "UTC"}')
    assert [c["function"] for c in named] == [{"name": "get_time", "arguments": '{"zone": "UTC"}'}]
    assert named[0]["id"].startswith("call_") and named[0]["type"] == "function"
    text = (
        '[{"name": "get_time", "parameters": {"zone": "CET"}}, {"name": "ping", "parameters": {}}]'
    )
    calls = ToolCalls("required").calls(text)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_time", {"zone": "CET"}),
        ("ping", {}),
    ]
    assert len({c["id"] for c in calls}) == 2


def test_named_stream_sends_argument_fragments_with_id_and_name_first() -> None:
    s = _ToolStream(ToolCalls("named", "get_time"))
    first = s.delta(Delta((1,), '{"zone"'))["tool_calls"][0]
    assert first["index"] == 0 and first["id"].startswith("call_")
    assert first["type"] == "function"
    assert first["function"] == {"name": "get_time", "arguments": '{"zone"'}
    second = s.delta(Delta((2,), ': "UTC"}', "stop"))["tool_calls"][0]
    assert second == {"index": 0, "function": {"arguments": ': "UTC"}'}}
    assert s.finish_reason == "stop"


def test_required_stream_sends_calls_whole_at_the_end_or_the_text_when_cut() -> None:
    s = _ToolStream(ToolCalls("required"))
    assert s.delta(Delta((1,), '[{"name": "ping", ')) == {}
    last = s.delta(Delta((2,), '"parameters": {}}]', "stop"))["tool_calls"]
    assert [(c["index"], c["function"]["name"]) for c in last] == [(0, "ping")]
    assert s.finish_reason == "tool_calls"
    cut = _ToolStream(ToolCalls("required"))
    cut.delta(Delta((1,), '[{"name": '))
    assert cut.delta(Delta((2,), '"pi', "length")) == {"content": '[{"name": "pi'}
