"""`tool_choice: "auto"` with `serve --tool-call-parser hermes`: the model's free text is read
for `<tool_call>` blocks, through real HTTP with the `openai` client, on the tiny random Llama
with a template that renders tools.

A random model writes no calls by itself, so each call here also sends a regex
(`structured_outputs`) that makes it write one (or none): the text is then transformers'
`generate()` under llguidance's own mask of that regex, and the calls the server returns must
be the blocks of that text, read here with `json` (the format vLLM's hermes parser reads).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import llguidance
import openai
import pytest

from tests.integration.test_llm_structured import _reference
from tests.integration.test_llm_tools import ASK, TOOLS, WEATHER, serve_with_tools_template

pytestmark = pytest.mark.slow

MAX = 120
CALL = (
    r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "(Paris|Oslo|Lima)", '
    r'"celsius": (true|false)\}\}</tool_call>'
)
SAID = r"(Sure|Let me look)\. "


@pytest.fixture(scope="module")
def hermes_llm(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """(base URL, runner) of the tiny Llama with `TOOLS_TEMPLATE`, served with the hermes
    tool-call parser."""
    with serve_with_tools_template(
        tiny_llama_dir, tmp_path_factory, tool_call_parser="hermes"
    ) as served:
        yield served


def _text(runner: Any, pattern: str) -> str:
    """generate()'s greedy text under llguidance's mask of `pattern`, from the prompt the
    template makes with the tools."""
    prompt = runner.tokenizer.apply_chat_template(
        ASK, tools=TOOLS, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    grammar = llguidance.grammar_from("regex", pattern)
    return str(runner.decode(_reference(runner, list(prompt), grammar, MAX)))


def _chat(url: str, pattern: str, **kw: Any) -> Any:
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    return client.chat.completions.create(
        model="tiny-tools", messages=ASK, tools=TOOLS, max_tokens=MAX, temperature=0,  # type: ignore[arg-type]
        extra_body={"structured_outputs": {"regex": pattern}}, **kw,
    )  # fmt: skip


def _blocks(text: str) -> list[tuple[str, Any]]:
    found = re.findall(r"<tool_call>(.*?)</tool_call>", text, re.DOTALL)
    return [(json.loads(b)["name"], json.loads(b)["arguments"]) for b in found]


@pytest.mark.parametrize("choice", ["auto", None])
def test_a_call_in_the_text_comes_back_as_tool_calls(hermes_llm: Any, choice: str | None) -> None:
    url, runner = hermes_llm
    text = _text(runner, SAID + CALL)
    ((name, args),) = _blocks(text)
    kw = {"tool_choice": choice} if choice else {}
    out = _chat(url, SAID + CALL, **kw).choices[0]
    assert out.finish_reason == "tool_calls"
    assert out.message.content == text[: text.index("<tool_call>")].strip()
    (call,) = out.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == name
    assert json.loads(call.function.arguments) == args
    jsonschema.validate(args, WEATHER)


def test_streamed_content_goes_first_and_the_call_at_the_end(hermes_llm: Any) -> None:
    url, runner = hermes_llm
    text = _text(runner, SAID + CALL)
    chunks = list(_chat(url, SAID + CALL, tool_choice="auto", stream=True))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content.strip() == text[: text.index("<tool_call>")].strip()
    assert "<tool_call>" not in content
    calls = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == _blocks(text)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_a_text_without_a_call_is_content(hermes_llm: Any) -> None:
    url, runner = hermes_llm
    pattern = r"(It is|I think) (sunny|rainy) in Paris\."
    text = _text(runner, pattern)
    out = _chat(url, pattern, tool_choice="auto").choices[0]
    assert out.finish_reason == "stop"
    assert out.message.content == text and not out.message.tool_calls
    chunks = list(_chat(url, pattern, tool_choice="auto", stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_responses_api_returns_the_text_and_the_call_as_items(hermes_llm: Any) -> None:
    url, runner = hermes_llm
    text = _text(runner, SAID + CALL)
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    flat = [{"type": "function", **t["function"]} for t in TOOLS]
    r = client.responses.create(
        model="tiny-tools", input=ASK, tools=flat, max_output_tokens=MAX, temperature=0,  # type: ignore[arg-type]
        extra_body={"structured_outputs": {"regex": SAID + CALL}},
    )  # fmt: skip
    said, call = r.output
    assert said.type == "message"
    assert said.content[0].text == text[: text.index("<tool_call>")].strip()
    assert call.type == "function_call"
    assert [(call.name, json.loads(call.arguments))] == _blocks(text)
