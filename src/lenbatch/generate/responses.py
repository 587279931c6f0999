"""OpenAI's Responses API over the chat path: `POST /v1/responses`, `GET` and `DELETE
/v1/responses/{id}`.

A response's `input` (a string, or items: messages with text parts, `function_call` and
`function_call_output`) and its `instructions` become a chat request (`ChatRequest`: the same
checks, chat template, sampling, structured outputs and tool plans as `/v1/chat/completions`);
`text.format` is the chat's `response_format`, and `tools` (function tools, given flat as the
Responses API does) and `tool_choice` are the chat's. The text comes back as `output` items: an
assistant `message` with one `output_text` part, or `function_call` items. Streamed, it comes as
the API's typed events (`response.created`, `response.output_text.delta`, ...,
`response.completed`), each with its `sequence_number`.

Responses sent with `store` (the default) are kept in the server's memory, the most recent
`MAX_STORED`, so that `previous_response_id` can continue a conversation (its input and output
come before the new input; its `instructions` do not carry over, as OpenAI's) and `GET` can
read one back. They are never written to disk or logged. A conversation continued this way
starts with the same tokens as the call before it, which the prefix cache
(`generate.prefixcache`) then does not prefill again: `usage.input_tokens_details.cached_tokens`
says how many.
"""

from __future__ import annotations

import itertools
import json
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from lenbatch.core.errors import BadInput, LenbatchError, ResponseNotFound
from lenbatch.generate.calls import (
    PriorityHeader,
    RequestTimeout,
    collect_texts,
    first_delta,
    merged_deltas,
)
from lenbatch.generate.protocol import MAX_TOOLS, ChatRequest, CommonOptions
from lenbatch.generate.tools import ToolCalls, call_id
from lenbatch.serving.http import unless_disconnected
from lenbatch.serving.http_errors import error_response
from lenbatch.serving.messages import Delta
from lenbatch.serving.services import GenerationHandle, GenerationService

__all__ = ["MAX_STORED", "ResponsesRequest", "add_response_routes"]

MAX_STORED = 1024  # responses kept for previous_response_id and GET (the most recent)

_TEXT_PARTS = ("input_text", "output_text", "text")


class TextOptions(BaseModel):
    """The Responses API's `text`: the format of the output text."""

    model_config = ConfigDict(extra="ignore")

    format: dict[str, Any] | None = None


class ResponsesRequest(BaseModel):
    """Body of `POST /v1/responses` (OpenAI's fields; unknown ones are ignored)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    input: str | list[dict[str, Any]] = Field(
        description="A user message's text, or items: messages (text parts), function_call "
        "and function_call_output."
    )
    instructions: str | None = Field(None, description="A system message before the input.")
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    stream: bool = False
    text: TextOptions | None = None
    tools: list[dict[str, Any]] | None = Field(
        None, max_length=MAX_TOOLS, description="Function tools (type, name, parameters)."
    )
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    previous_response_id: str | None = None
    store: bool = Field(True, description="Keep the response (in memory) for GET and follow-ups.")
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["disabled", "auto"] | None = None
    background: bool | None = None
    top_logprobs: int | None = None
    structured_outputs: dict[str, Any] | None = Field(
        None, description="vLLM's, as in chat completions: a JSON schema, regex, choice or grammar."
    )

    def unsupported(self) -> str | None:
        """The first option set to something this server cannot honour, named."""
        if self.background:
            return "background is not supported: send the request and wait for its answer"
        if self.truncation == "auto":
            return "truncation auto is not supported: an input over the context is refused"
        if self.top_logprobs:
            return "top_logprobs is not supported on /v1/responses (chat completions has it)"
        return None

    def format(self) -> dict[str, Any] | None:
        """`text.format` as given (None: plain text)."""
        return self.text.format if self.text is not None else None

    def chat(self, conversation: list[dict[str, Any]]) -> ChatRequest:
        """The chat request that runs this response after `conversation` (chat messages: the
        stored turns, then this input). Raises `BadInput` naming what is wrong."""
        messages = list(conversation)
        if self.instructions is not None:
            messages.insert(0, {"role": "system", "content": self.instructions})
        if not messages:
            raise BadInput("input: give a text or at least one item")
        body: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "max_completion_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "stream": self.stream,
            "parallel_tool_calls": self.parallel_tool_calls,
            "user": self.user,
        }
        if self.structured_outputs is not None:
            body["structured_outputs"] = self.structured_outputs
        fmt = self.format()
        if fmt is not None:
            body["response_format"] = _response_format(fmt)
        if self.tools is not None:
            body["tools"] = [_chat_tool(t) for t in self.tools]
        if isinstance(self.tool_choice, dict):
            if self.tool_choice.get("type") != "function" or "name" not in self.tool_choice:
                raise BadInput("tool_choice: give none, auto, required or a function by name")
            body["tool_choice"] = {
                "type": "function",
                "function": {"name": self.tool_choice["name"]},
            }
        elif self.tool_choice is not None:
            body["tool_choice"] = self.tool_choice
        try:
            return ChatRequest.model_validate(body)
        except ValidationError as exc:
            err = exc.errors()[0]
            where = ".".join(str(p) for p in err["loc"])
            raise BadInput(f"{where}: {err['msg']}") from None


def _response_format(fmt: dict[str, Any]) -> dict[str, Any]:
    """`text.format` as chat's `response_format`."""
    kind = fmt.get("type")
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise BadInput("text.format of type json_schema needs a schema (an object)")
        named = {k: fmt[k] for k in ("name", "description", "schema", "strict") if k in fmt}
        return {"type": "json_schema", "json_schema": named}
    raise BadInput("text.format.type: give text, json_object or json_schema")


def _chat_tool(tool: dict[str, Any]) -> dict[str, Any]:
    """A Responses API function tool (flat) as a chat tool (its function nested)."""
    if tool.get("type") != "function":
        raise BadInput(f"tools: only function tools are supported, not {tool.get('type')!r}")
    fields = ("name", "description", "parameters", "strict")
    return {"type": "function", "function": {k: tool[k] for k in fields if k in tool}}


def _text_of(content: Any, where: str) -> str:
    """A message item's text: a string, or its text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadInput(f"{where}.content: give a text or a list of text parts")
    parts = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS:
            raise BadInput(f"{where}.content[{k}]: parts of type {kind!r} are not supported (text)")
        parts.append(str(part.get("text", "")))
    return "".join(parts)


def _field(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise BadInput(f"{where}.{key}: a string is required")
    return value


def input_messages(given: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The input as chat messages: a text is one user message; `function_call` items become
    an assistant turn's `tool_calls` (consecutive calls one turn), `function_call_output`
    items tool messages. Reasoning items are left out (this server makes none)."""
    if isinstance(given, str):
        return [{"role": "user", "content": given}]
    out: list[dict[str, Any]] = []
    for i, item in enumerate(given):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise BadInput(f"{where}.role: give user, system, developer or assistant")
            out.append({"role": role, "content": _text_of(item.get("content"), where)})
        elif kind == "function_call":
            fn = {
                "name": _field(item, "name", where),
                "arguments": _field(item, "arguments", where),
            }
            call = {"id": _field(item, "call_id", where), "type": "function", "function": fn}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
                last["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else json.dumps(output)
            out.append(
                {"role": "tool", "tool_call_id": _field(item, "call_id", where), "content": text}
            )
        elif kind != "reasoning":
            raise BadInput(f"{where}.type: items of type {kind!r} are not supported")
    return out


def _output_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output items as the chat messages a follow-up call sees."""
    items: list[dict[str, Any]] = []
    for item in output:
        if item["type"] == "message":
            items.append({"role": "assistant", "content": item["content"][0]["text"]})
        else:
            items.append({k: item[k] for k in ("type", "call_id", "name", "arguments")})
    return input_messages(items)


@dataclass
class _Stored:
    messages: list[dict[str, Any]]  # the conversation through this response's output
    body: dict[str, Any]  # the response object


class ResponseStore:
    """The most recent `MAX_STORED` responses sent with `store` (event loop only)."""

    def __init__(self, limit: int = MAX_STORED) -> None:
        self.limit = limit
        self._kept: OrderedDict[str, _Stored] = OrderedDict()

    def put(self, rid: str, messages: list[dict[str, Any]], body: dict[str, Any]) -> None:
        """Keep a finished response and the conversation through it."""
        self._kept[rid] = _Stored(messages, body)
        while len(self._kept) > self.limit:
            self._kept.popitem(last=False)

    def get(self, rid: str) -> _Stored:
        """A kept response; `ResponseNotFound` if none has that id."""
        kept = self._kept.get(rid)
        if kept is None:
            raise ResponseNotFound(
                f"no stored response has that id (this server keeps the {self.limit} most "
                "recent sent with store: true, in memory)"
            )
        return kept

    def delete(self, rid: str) -> None:
        """Forget a kept response."""
        self.get(rid)
        del self._kept[rid]


@dataclass
class _Call:
    """One response being made: its request, chat plan and the fixed part of its object."""

    body: ResponsesRequest
    seq: GenerationHandle
    tools: ToolCalls | None
    conversation: list[dict[str, Any]]
    shell: dict[str, Any]

    def items(self, text: str, reason: str | None) -> list[dict[str, Any]]:
        """The output items of a finished text: tool calls where it made complete ones, else
        one assistant message."""
        if self.tools is not None and reason == "stop":
            content, calls = self.tools.message(text)
            if calls:  # under auto, the text beside the calls first, as a message
                said = [_message_item(_item_id("msg"), content, "completed")] if content else []
                return [*said, *(_function_item(c) for c in calls)]
        return [_message_item(_item_id("msg"), text, _status(reason))]

    def finished(self, output: list[dict[str, Any]], reason: str | None) -> dict[str, Any]:
        """The response object once its text has ended."""
        obj = dict(self.shell, output=output, usage=_usage(self.seq))
        if reason == "length":
            obj.update(status="incomplete", incomplete_details={"reason": "max_output_tokens"})
        else:
            obj["status"] = "completed"
        obj["completed_at"] = int(time.time())
        obj["lenbatch"] = {"timings": self.seq.timings_ms()}
        return obj


def _status(reason: str | None) -> str:
    """An output item's status once its text has ended for `reason`."""
    return "incomplete" if reason == "length" else "completed"


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {
        "id": item_id,
        "type": "message",
        "status": status,
        "role": "assistant",
        "content": [part] if status != "in_progress" else [],
    }


def _function_item(call: dict[str, Any], status: str = "completed") -> dict[str, Any]:
    fn = call["function"]
    return {
        "id": _item_id("fc"),
        "type": "function_call",
        "status": status,
        "call_id": call["id"],
        "name": fn["name"],
        "arguments": fn["arguments"],
    }


def _usage(seq: GenerationHandle) -> dict[str, Any]:
    prompt, output = seq.prompt_tokens, seq.completion_tokens
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": seq.cached_tokens},
        "output_tokens": output,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + output,
    }


def add_response_routes(
    app: FastAPI,
    engine: GenerationService[Any],
    accept: Callable[[CommonOptions, Request], float],
    served: str,
) -> None:
    """Add `/v1/responses` (POST) and `/v1/responses/{id}` (GET, DELETE) to `app`."""
    store = ResponseStore()

    @app.post("/v1/responses")
    async def create_response(
        body: ResponsesRequest,
        request: Request,
        x_request_timeout: RequestTimeout = None,
        x_priority: PriorityHeader = None,
    ) -> Response:
        """OpenAI's Responses API: a chat turn (after `previous_response_id`'s, if given)
        whose output comes as items, streamed as typed events."""
        history: list[dict[str, Any]] = []
        if body.previous_response_id is not None:
            try:
                history = store.get(body.previous_response_id).messages
            except ResponseNotFound as err:
                raise BadInput(f"previous_response_id: {err}") from None
        conversation = [*history, *input_messages(body.input)]
        chat = body.chat(conversation)
        arrival = accept(chat, request)
        if (why := body.unsupported()) is not None:
            raise BadInput(why)
        tools, _ = chat.tool_plan()
        if tools is not None:
            tools = tools.with_parser(engine.generation.tool_call_parser)
        messages = [m.for_template() for m in chat.messages]
        prompt = await engine.chat_prompt(messages, chat.template_tools())
        params = chat.sampling(body.max_output_tokens or engine.context_left(len(prompt)))
        await engine.check_constraint(params)
        (seq,) = engine.submit_all(
            [prompt], [params], arrival=arrival, timeout=x_request_timeout, priority=x_priority or 0
        )
        call = _Call(body, seq, tools, conversation, _shell(body, "resp_" + seq.request_id, served))

        def keep(obj: dict[str, Any]) -> None:
            if body.store:
                store.put(obj["id"], [*conversation, *_output_messages(obj["output"])], obj)

        if body.stream:
            merged = merged_deltas(engine, [seq])
            try:
                first = await unless_disconnected(request, first_delta(merged))
            except LenbatchError as err:
                await merged.aclose()
                return error_response(err)
            if first is None:  # the client left: its sequence leaves the batch
                await merged.aclose()
                engine.cancel(seq)
                return Response(status_code=499)
            events = _events(call, first, merged, keep)
            return StreamingResponse(events, media_type="text/event-stream")
        done = await unless_disconnected(request, collect_texts(engine, [seq]))
        if done is None:
            engine.cancel(seq)
            return Response(status_code=499)
        texts, reasons, _ = done
        obj = call.finished(call.items(texts[0], reasons[0]), reasons[0])
        keep(obj)
        return Response(json.dumps(obj, separators=(",", ":")), media_type="application/json")

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str) -> dict[str, Any]:
        """A response kept with `store` (404 if none has that id)."""
        return store.get(response_id).body

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> dict[str, Any]:
        """Forget a kept response (404 if none has that id)."""
        store.delete(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}


def _shell(body: ResponsesRequest, rid: str, served: str) -> dict[str, Any]:
    """The response object's fields that its text does not change."""
    if isinstance(body.tool_choice, dict):
        choice: Any = body.tool_choice
    else:
        choice = body.tool_choice or ("auto" if body.tools else "none")
    return {
        "id": rid,
        "object": "response",
        "created_at": int(time.time()),
        "status": "in_progress",
        "error": None,
        "incomplete_details": None,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "model": served,
        "output": [],
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": body.previous_response_id,
        "store": body.store,
        "temperature": body.temperature,
        "text": {"format": body.format() or {"type": "text"}},
        "tool_choice": choice,
        "tools": body.tools or [],
        "top_p": body.top_p,
        "truncation": "disabled",
        "usage": None,
        "user": body.user,
        "metadata": body.metadata or {},
    }


async def _events(
    call: _Call,
    first: tuple[tuple[int, Delta], ...],
    rest: AsyncIterator[tuple[int, Delta]],
    keep: Callable[[dict[str, Any]], None],
) -> AsyncIterator[str]:
    """The response as the Responses API's server-sent events. A named tool's arguments
    stream as they come; under `required` the calls come whole at the end (the text cannot be
    split into calls before); other text streams as `output_text` deltas. An error after the
    first token ends the stream with an `error` event."""
    numbers = itertools.count()

    def event(kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": next(numbers), **fields}
        return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"

    async def deltas() -> AsyncIterator[Delta]:
        for _, d in first:
            yield d
        async for _, d in rest:
            yield d

    tools = call.tools
    yield event("response.created", response=call.shell)
    yield event("response.in_progress", response=call.shell)
    text, reason = "", None
    try:
        if tools is not None and tools.mode == "named":
            fc = _function_item(
                {"id": call_id(), "function": {"name": tools.name, "arguments": ""}},
                "in_progress",
            )
            yield event("response.output_item.added", output_index=0, item=fc)
            async for d in deltas():
                text, reason = text + d.text, d.finish_reason or reason
                if d.text:
                    yield event(
                        "response.function_call_arguments.delta",
                        item_id=fc["id"], output_index=0, delta=d.text,
                    )  # fmt: skip
            # a call cut short by max_output_tokens ends as far as it went, incomplete
            fc.update(arguments=text, status=_status(reason))
            if reason == "stop":
                yield event(
                    "response.function_call_arguments.done",
                    item_id=fc["id"], output_index=0, name=fc["name"], arguments=text,
                )  # fmt: skip
            yield event("response.output_item.done", output_index=0, item=fc)
            output = [fc]
        elif tools is not None:
            async for d in deltas():
                text, reason = text + d.text, d.finish_reason or reason
            output = call.items(text, reason)
            for i, item in enumerate(output):
                for e in _whole_item_events(event, i, item):
                    yield e
        else:
            msg = _message_item(_item_id("msg"), "", "in_progress")
            where = {"item_id": msg["id"], "output_index": 0, "content_index": 0}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            yield event("response.output_item.added", output_index=0, item=msg)
            yield event("response.content_part.added", **where, part=part)
            async for d in deltas():
                text, reason = text + d.text, d.finish_reason or reason
                if d.text:
                    yield event("response.output_text.delta", **where, delta=d.text, logprobs=[])
            done = _message_item(msg["id"], text, _status(reason))
            yield event("response.output_text.done", **where, text=text, logprobs=[])
            yield event("response.content_part.done", **where, part=done["content"][0])
            yield event("response.output_item.done", output_index=0, item=done)
            output = [done]
    except LenbatchError as err:
        yield event("error", code=err.code, message=str(err), param=None)
        return
    obj = call.finished(output, reason)
    keep(obj)
    kind = "response.incomplete" if obj["status"] == "incomplete" else "response.completed"
    yield event(kind, response=obj)


def _whole_item_events(event: Callable[..., str], index: int, item: dict[str, Any]) -> list[str]:
    """The events of an output item sent whole (added, its content, done)."""
    if item["type"] == "function_call":
        added = dict(item, arguments="", status="in_progress")
        where = {"item_id": item["id"], "output_index": index}
        return [
            event("response.output_item.added", output_index=index, item=added),
            event("response.function_call_arguments.delta", **where, delta=item["arguments"]),
            event(
                "response.function_call_arguments.done",
                **where,
                name=item["name"],
                arguments=item["arguments"],
            ),
            event("response.output_item.done", output_index=index, item=item),
        ]
    part = item["content"][0]
    where = {"item_id": item["id"], "output_index": index, "content_index": 0}
    empty = dict(part, text="")
    return [
        event(
            "response.output_item.added",
            output_index=index,
            item=dict(item, content=[], status="in_progress"),
        ),
        event("response.content_part.added", **where, part=empty),
        event("response.output_text.delta", **where, delta=part["text"], logprobs=[]),
        event("response.output_text.done", **where, text=part["text"], logprobs=[]),
        event("response.content_part.done", **where, part=part),
        event("response.output_item.done", output_index=index, item=item),
    ]
