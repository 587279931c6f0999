"""Tool calls in chat (OpenAI's `tools`, `tool_choice` naming a function or `required`),
through real HTTP on loopback with the `openai` client, on the tiny random Llama with a chat
template that renders tools and tool calls.

The references are someone else's: the `openai` client parses the calls, `jsonschema` checks
their arguments against the tools' parameters, and the greedy text behind them equals
transformers' `generate()` under llguidance's own mask of the schema vLLM documents for each
`tool_choice`; the prompt's token count equals transformers' `apply_chat_template` with the
tools.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import llguidance
import openai
import pytest
from transformers import AutoTokenizer

from lenbatch.config import Settings
from tests.integration.conftest import LiveServer
from tests.integration.test_llm_structured import _reference

pytestmark = pytest.mark.slow

# Renders the tools and an assistant's tool calls, as tool-calling models' templates do.
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{% for t in tools %}{{ t['function']['name'] }}: "
    "{{ t['function']['description'] }}\n{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m.get('tool_calls') %}"
    "{% for c in m['tool_calls'] %}<tool_call>{{ c['function']['name'] }} "
    "{{ c['function']['arguments'] | tojson }}</tool_call>{% endfor %}"
    "{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Oslo", "Lima"]},
        "celsius": {"type": "boolean"},
    },
    "required": ["city", "celsius"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER},
    },
    {
        "type": "function",
        "function": {"name": "get_time", "description": "Time now", "parameters": TIME},
    },
]
PARAMS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
MAX = 200  # JSON may carry whitespace anywhere (as in vLLM); a random model spends tokens on it


@contextmanager
def serve_with_tools_template(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory, **generation: Any
) -> Iterator[tuple[str, Any]]:
    """(base URL, runner) of a copy of the tiny Llama with `TOOLS_TEMPLATE` behind uvicorn,
    its engine's `GenerationConfig` given `generation`."""
    from lenbatch.config import BatchingConfig, GenerationConfig
    from lenbatch.generate import GenerationEngine
    from lenbatch.generate.api import create_llm_app
    from lenbatch.runners.causal import CausalLMRunner

    folder = tmp_path_factory.mktemp("tiny-tools") / "model"
    shutil.copytree(tiny_llama_dir, folder)
    tok = AutoTokenizer.from_pretrained(folder)
    tok.chat_template = TOOLS_TEMPLATE
    tok.save_pretrained(folder)
    runner = CausalLMRunner(folder, name="tiny-tools")
    engine = GenerationEngine(
        runner,
        BatchingConfig(boundaries=(32, 64, 128), max_batch=4, max_wait_ms=2),
        generation=GenerationConfig(**generation),
    )
    app = create_llm_app(engine, Settings.model_validate({"model": {"name": "tiny-tools"}}))
    with LiveServer(None, app=app) as server:
        yield server.url, runner


@pytest.fixture(scope="module")
def tools_llm(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """(base URL, runner) of the tiny Llama with `TOOLS_TEMPLATE` behind uvicorn."""
    with serve_with_tools_template(
        tiny_llama_dir, tmp_path_factory, default_max_tokens=16
    ) as served:
        yield served


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _chat(url: str, **kw: Any) -> Any:
    return _client(url).chat.completions.create(
        model="tiny-tools",
        messages=kw.pop("messages", ASK),
        max_tokens=kw.pop("max_tokens", MAX),
        temperature=0,
        tools=TOOLS,  # type: ignore[arg-type]
        **kw,
    )


def _guided_text(runner: Any, schema: dict[str, Any], messages: list[dict[str, Any]]) -> str:
    """The greedy text transformers' generate() writes under llguidance's mask of `schema`,
    from the prompt the template makes with the tools."""
    prompt = runner.tokenizer.apply_chat_template(
        messages, tools=TOOLS, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        schema, defaults={"whitespace_flexible": True}
    )
    return str(runner.decode(_reference(runner, list(prompt), grammar, MAX)))


def test_named_function_returns_its_arguments(tools_llm: Any) -> None:
    url, runner = tools_llm
    out = _chat(url, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = out.choices[0]
    assert choice.finish_reason == "stop"  # OpenAI's, for a named function
    calls = choice.message.tool_calls
    assert calls is not None and len(calls) == 1
    call = calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    assert call.function.arguments == _guided_text(runner, WEATHER, ASK)
    # The prompt the template made with the tools (transformers' own rendering).
    prompt = runner.tokenizer.apply_chat_template(
        ASK, tools=TOOLS, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert out.usage is not None and out.usage.prompt_tokens == len(prompt)


def _required_schema(one: bool) -> dict[str, Any]:
    """vLLM's schema for `tool_choice: required` (an array of {name, parameters} objects),
    closed to other keys."""
    items = [
        {
            "properties": {"name": {"type": "string", "enum": [name]}, "parameters": params},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for name, params in PARAMS.items()
    ]
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": {"type": "object", "anyOf": items},
    }
    if one:
        schema["maxItems"] = 1
    return schema


@pytest.mark.parametrize("parallel", [True, False], ids=["parallel", "one-call"])
def test_required_returns_calls_of_the_tools(tools_llm: Any, parallel: bool) -> None:
    url, runner = tools_llm
    out = _chat(url, tool_choice="required", parallel_tool_calls=parallel)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls
    assert calls
    if not parallel:
        assert len(calls) == 1
    for call in calls:
        assert call.function.name in PARAMS
        jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])
    text = _guided_text(runner, _required_schema(one=not parallel), ASK)
    want = [(c["name"], c["parameters"]) for c in json.loads(text)]
    got = [(c.function.name, json.loads(c.function.arguments)) for c in calls]
    assert got == want


def test_streamed_calls_equal_whole(tools_llm: Any) -> None:
    url, _ = tools_llm
    for choice_arg in ({"type": "function", "function": {"name": "get_time"}}, "required"):
        whole = _chat(url, tool_choice=choice_arg).choices[0]
        assert whole.message.tool_calls
        stream = _chat(url, tool_choice=choice_arg, stream=True)
        parts: dict[int, dict[str, Any]] = {}
        finish = None
        for chunk in stream:
            if not chunk.choices:
                continue
            delta = chunk.choices[0].delta
            assert not delta.content  # calls, not text
            for tc in delta.tool_calls or []:
                part = parts.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
                if tc.id:
                    part["id"] = tc.id
                if tc.function and tc.function.name:
                    part["name"] = tc.function.name
                if tc.function and tc.function.arguments:
                    part["arguments"] += tc.function.arguments
            finish = chunk.choices[0].finish_reason or finish
        assert finish == whole.finish_reason
        got = [(p["name"], json.loads(p["arguments"])) for _, p in sorted(parts.items())]
        want = [
            (c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls
        ]
        assert got == want
        assert all(str(p["id"]).startswith("call_") for p in parts.values())


def test_history_with_calls_and_tool_answers_reaches_the_template(tools_llm: Any) -> None:
    url, runner = tools_llm
    history: list[dict[str, Any]] = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, clear"},
    ]
    out = _chat(url, messages=history, tool_choice="none", max_tokens=4)
    assert out.choices[0].message.tool_calls is None
    rendered = [dict(m) for m in history]
    rendered[1] = {**rendered[1], "content": ""}
    rendered[1]["tool_calls"] = [
        {**c, "function": {**c["function"], "arguments": {"city": "Paris"}}}
        for c in history[1]["tool_calls"]
    ]
    # tool_choice "none": the tools stay out of the template, as the route says.
    prompt = runner.tokenizer.apply_chat_template(
        rendered, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert "<tool_call>get_weather" in runner.tokenizer.decode(prompt)
    assert out.usage is not None and out.usage.prompt_tokens == len(prompt)


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"tools": TOOLS}, "needs a parser"),
        ({"tools": TOOLS, "tool_choice": "auto"}, "needs a parser"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "not among the tools",
        ),
        (
            {"tool_choice": {"type": "function", "function": {"name": "get_time"}}},
            "no tools were given",
        ),
        ({"tool_choice": "required"}, "needs tools"),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "not both",
        ),
        ({"tools": [TOOLS[0], TOOLS[0]], "tool_choice": "required"}, "two tools are named"),
        (
            {
                "tools": [
                    {"type": "function", "function": {"name": "x", "parameters": {"type": 7}}}
                ],
                "tool_choice": "required",
            },
            "invalid json constraint",
        ),
    ],
    ids=[
        "default-auto",
        "auto",
        "unknown-name",
        "named-without-tools",
        "required-without-tools",
        "with-response-format",
        "duplicate-names",
        "bad-parameters",
    ],
)
def test_bad_tool_requests_are_400s(tools_llm: Any, body: dict[str, Any], needle: str) -> None:
    url, _ = tools_llm
    r = httpx.post(
        url + "/v1/chat/completions",
        json={"model": "tiny-tools", "messages": ASK, "max_tokens": 4, **body},
        timeout=60,
    )
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]
