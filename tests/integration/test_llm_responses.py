"""OpenAI's Responses API (`/v1/responses`) through real HTTP on loopback, read by the `openai`
client (`responses.create`, `responses.stream`, `retrieve`, `delete`) on the tiny random Llama.

The references are someone else's: transformers' `generate()` on the prompt its own
`apply_chat_template` renders for the conversation the response stands for (instructions,
input items, a previous response's turns), the `openai` client's event accumulator (which
checks that items and parts keep their identity across the stream), and `jsonschema`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from lenbatch.config import BatchingConfig, GenerationConfig, Settings
from lenbatch.generate import GenerationEngine
from lenbatch.generate.api import create_llm_app
from lenbatch.generate.prefixcache import BLOCK_TOKENS
from tests.integration.conftest import LiveServer
from tests.integration.test_llm_tools import PARAMS, TOOLS, WEATHER, tools_llm
from tests.llm_reference import reference_greedy

pytestmark = pytest.mark.slow

__all__ = ["tools_llm"]  # a fixture, used below

INSTRUCTIONS = "Answer in one short sentence."
QUESTION = "A robe takes 2 bolts of blue fiber and half that much white fiber. How many bolts?"
ANSWER = {
    "type": "object",
    "properties": {"answer": {"enum": ["two", "three", "four"]}},
    "required": ["answer"],
    "additionalProperties": False,
}
FLAT_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]


@pytest.fixture(scope="module")
def served(llama_runner: Any) -> Iterator[tuple[str, Any]]:
    """(base URL, runner) of the tiny Llama behind uvicorn."""
    engine = GenerationEngine(
        llama_runner,
        BatchingConfig(boundaries=(32, 64, 128), max_batch=4, max_wait_ms=2),
        generation=GenerationConfig(),
    )
    app = create_llm_app(engine, Settings.model_validate({"model": {"name": "tiny-llama"}}))
    with LiveServer(None, app=app) as server:
        yield server.url, llama_runner


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _expected(runner: Any, messages: list[dict[str, Any]], n: int) -> tuple[list[int], str]:
    """The prompt transformers renders for `messages`, and generate()'s greedy text."""
    prompt = runner.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    return list(prompt), str(runner.decode(reference_greedy(runner, list(prompt), n)))


def test_a_response_is_the_chat_turn_generate_makes(served: tuple[str, Any]) -> None:
    url, runner = served
    prompt, text = _expected(
        runner,
        [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}],
        12,
    )
    client = _client(url)
    r = client.responses.create(
        model="tiny-llama", instructions=INSTRUCTIONS, input=QUESTION, max_output_tokens=12,
        temperature=0,
    )  # fmt: skip
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.output_text == text
    (item,) = r.output
    assert item.type == "message" and item.role == "assistant"
    assert r.usage is not None and r.usage.input_tokens == len(prompt)
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    ended = len(runner.tokenize([text])[0]) < r.usage.output_tokens  # EOS counted, not shown
    if ended:
        assert r.status == "completed" and r.incomplete_details is None
    else:
        assert r.status == "incomplete" and r.incomplete_details is not None
        assert r.incomplete_details.reason == "max_output_tokens"
    # the same input as items with text parts
    parts = client.responses.create(
        model="tiny-llama", instructions=INSTRUCTIONS, max_output_tokens=12, temperature=0,
        input=[{"role": "user", "content": [{"type": "input_text", "text": QUESTION}]}],
    )  # fmt: skip
    assert parts.output_text == text
    assert client.responses.retrieve(r.id).output_text == text


def test_streamed_events_build_the_same_response(served: tuple[str, Any]) -> None:
    url, _ = served
    client = _client(url)
    kw: dict[str, Any] = {
        "model": "tiny-llama", "input": QUESTION, "max_output_tokens": 10, "temperature": 0,
    }  # fmt: skip
    whole = client.responses.create(**kw)
    with client.responses.stream(**kw) as stream:
        events = list(stream)
    kinds = [e.type for e in events]
    final = events[-1].response  # the client's own accumulation of the items and parts
    assert final.output[0].content[0].text == whole.output_text
    assert final.status == whole.status
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed" if whole.status == "completed" else "response.incomplete",
    ]
    assert kinds.count("response.output_text.delta") >= 2
    # on the wire: each event named, numbered from 0 in order
    body = dict(kw, stream=True)
    lines = httpx.post(url + "/v1/responses", json=body, timeout=60).text.splitlines()
    names = [line[7:] for line in lines if line.startswith("event: ")]
    data = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
    assert names == [d["type"] for d in data] == kinds
    assert [d["sequence_number"] for d in data] == list(range(len(data)))


def test_previous_response_id_continues_the_conversation(served: tuple[str, Any]) -> None:
    """The second call sees the first's input and output before its own (as transformers
    renders that conversation), and the tokens they share come from the prefix cache."""
    url, runner = served
    client = _client(url)
    first = client.responses.create(
        model="tiny-llama", input=QUESTION, max_output_tokens=8, temperature=0
    )
    follow = "And how many of them are blue?"
    second = client.responses.create(
        model="tiny-llama", input=follow, previous_response_id=first.id, max_output_tokens=8,
        temperature=0,
    )  # fmt: skip
    conversation = [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": follow},
    ]
    prompt, text = _expected(runner, conversation, 8)
    assert second.output_text == text
    assert second.previous_response_id == first.id
    assert second.usage is not None and second.usage.input_tokens == len(prompt)
    cached = second.usage.input_tokens_details.cached_tokens
    assert cached >= BLOCK_TOKENS and cached % BLOCK_TOKENS == 0
    assert cached < second.usage.input_tokens
    # instructions do not carry over (as OpenAI's): with new ones, they alone lead
    third = client.responses.create(
        model="tiny-llama", input=follow, previous_response_id=first.id, max_output_tokens=8,
        temperature=0, instructions=INSTRUCTIONS,
    )  # fmt: skip
    prompt, text = _expected(
        runner, [{"role": "system", "content": INSTRUCTIONS}, *conversation], 8
    )
    assert third.output_text == text
    assert third.usage is not None and third.usage.input_tokens == len(prompt)


def test_json_schema_format(served: tuple[str, Any]) -> None:
    """`text.format` json_schema: the text follows the schema and is the chat completion's
    under the same `response_format` (itself checked against generate() under llguidance)."""
    url, _ = served
    client = _client(url)
    fmt = {"type": "json_schema", "name": "answer", "schema": ANSWER, "strict": True}
    r = client.responses.create(
        model="tiny-llama", input=QUESTION, max_output_tokens=60, temperature=0,
        text={"format": fmt},  # type: ignore[typeddict-item]
    )  # fmt: skip
    jsonschema.validate(json.loads(r.output_text), ANSWER)
    assert r.status == "completed"
    with client.responses.stream(
        model="tiny-llama", input=QUESTION, max_output_tokens=60, temperature=0,
        text={"format": fmt},  # type: ignore[typeddict-item]
    ) as stream:  # fmt: skip
        assert stream.get_final_response().output_text == r.output_text
    as_chat = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}}
    chat = client.chat.completions.create(
        model="tiny-llama", messages=[{"role": "user", "content": QUESTION}], max_tokens=60,
        temperature=0, response_format=as_chat,  # type: ignore[arg-type]
    )  # fmt: skip
    assert chat.choices[0].message.content == r.output_text


def test_function_calls_and_their_outputs(tools_llm: Any) -> None:
    """Tools given flat: a named function's call, whole and streamed, equals the chat
    completion's; `required` returns calls of the tools; a call and its output sent back as
    items render as transformers renders the chat turns they stand for."""
    url, runner = tools_llm
    client = _client(url)
    ask = "What is the weather in Paris?"
    kw: dict[str, Any] = {
        "model": "tiny-tools", "input": ask, "tools": FLAT_TOOLS, "max_output_tokens": 200,
        "temperature": 0,
    }  # fmt: skip
    named = {"type": "function", "name": "get_weather"}
    r = client.responses.create(tool_choice=named, **kw)
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    chat = client.chat.completions.create(
        model="tiny-tools", messages=[{"role": "user", "content": ask}], tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=200,
        temperature=0,
    )  # fmt: skip
    assert chat.choices[0].message.tool_calls[0].function.arguments == call.arguments
    with client.responses.stream(tool_choice=named, **kw) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert final.output[0].arguments == call.arguments
    assert "response.function_call_arguments.delta" in kinds
    required = client.responses.create(tool_choice="required", **kw)
    assert required.output and all(c.type == "function_call" for c in required.output)
    for c in required.output:
        jsonschema.validate(json.loads(c.arguments), PARAMS[c.name])
    items: list[Any] = [
        {"role": "user", "content": ask},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Paris", "celsius": true}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "18 C, clear"},
    ]  # fmt: skip
    back = client.responses.create(
        model="tiny-tools", input=items, tools=FLAT_TOOLS, tool_choice="none",
        max_output_tokens=4, temperature=0,
    )  # fmt: skip
    rendered = [
        {"role": "user", "content": ask},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Paris", "celsius": True}}}
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, clear"},
    ]  # fmt: skip
    prompt = runner.tokenizer.apply_chat_template(
        rendered, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert back.usage is not None and back.usage.input_tokens == len(prompt)
    assert back.output[0].type == "message"


def test_stored_responses_are_read_and_deleted(served: tuple[str, Any]) -> None:
    url, _ = served
    client = _client(url)
    kw: dict[str, Any] = {"model": "tiny-llama", "input": "Hi", "max_output_tokens": 3}
    kept = client.responses.create(**kw)
    assert client.responses.retrieve(kept.id).id == kept.id
    client.responses.delete(kept.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(kept.id)
    unkept = client.responses.create(store=False, **kw)
    assert unkept.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unkept.id)
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        client.responses.create(previous_response_id=unkept.id, **kw)


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
         "'input_image' are not supported"),
        ({"input": "Hi", "tools": [{"type": "web_search"}]}, "only function tools"),
        ({"input": "Hi", "truncation": "auto"}, "truncation auto is not supported"),
        ({"input": "Hi", "background": True}, "background is not supported"),
        ({"input": [{"type": "function_call_output", "output": "1"}]}, "call_id"),
        ({"input": "Hi", "text": {"format": {"type": "xml"}}}, "text.format.type"),
        ({"input": "Hi", "tools": [{"type": "function", "name": "f"}]}, "tool_choice"),
        ({"input": []}, "at least one item"),
    ],
)  # fmt: skip
def test_bad_bodies_get_clear_400s(
    served: tuple[str, Any], body: dict[str, Any], says: str
) -> None:
    url, _ = served
    resp = httpx.post(url + "/v1/responses", json={"max_output_tokens": 3, **body}, timeout=60)
    assert resp.status_code == 400, resp.text
    assert says in resp.json()["error"]["message"]
