"""The HTTP layer for causal LMs: OpenAI-compatible completions over a `GenerationService`
(the single server's `GenerationEngine`, or the Ray ingress's front-end).

Endpoints: `POST /v1/completions`, `POST /v1/chat/completions` (when the tokenizer has a chat
template), both with `stream: true` as server-sent events; OpenAI's Responses API on the chat
path (`generate.responses`: `POST /v1/responses`, `GET`/`DELETE /v1/responses/{id}`);
`GET /v1/models`, `GET /health`, `GET /metrics` (Prometheus: prefill batches per bucket plus
the generation series), `GET /stats`.

Beyond OpenAI's fields, responses carry a `lenbatch` object with each choice's TTFT breakdown
(tokenize, queue, schedule, prefill, first_token), inter-token latency and end-to-end time;
requests may send `ignore_eos` (as vLLM) to generate exactly `max_tokens` tokens.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from lenbatch.config import Settings
from lenbatch.core.errors import BadInput, LenbatchError
from lenbatch.generate.calls import (
    PriorityHeader,
    RequestTimeout,
    collect_texts,
    first_delta,
    merged_deltas,
)
from lenbatch.generate.protocol import (
    ChatRequest,
    CommonOptions,
    CompletionRequest,
    chat_logprobs,
    completion_logprobs,
    envelope,
    obj_line,
    usage,
)
from lenbatch.generate.responses import add_response_routes
from lenbatch.generate.toolparsers import AutoToolStream
from lenbatch.generate.tools import ToolCalls, call_id, tool_call
from lenbatch.runners.tokenizer import TextTokenizer
from lenbatch.serving.http import check_model, engine_app, unless_disconnected
from lenbatch.serving.http_errors import error_response
from lenbatch.serving.messages import Delta, TokenLogprob
from lenbatch.serving.routes import add_task_refusals
from lenbatch.serving.server import received_at
from lenbatch.serving.services import GenerationHandle, GenerationService
from lenbatch.serving.tokenize_api import add_tokenize_routes

__all__ = ["create_llm_app"]

log = logging.getLogger("lenbatch.generate.api")


def create_llm_app(
    engine: GenerationService[Any],
    settings: Settings | None = None,
    tokenizer: TextTokenizer | None = None,
) -> FastAPI:
    """The FastAPI app serving `engine`; starts and drains it with the app's lifespan.
    `tokenizer` (the model's) adds `/tokenize` and `/detokenize`."""
    settings = settings or Settings()
    served = settings.server.served_model_name or engine.info.name
    accepted = {served, engine.info.name, settings.model.name}

    card = {"max_model_len": engine.info.max_length, "task": "generate"}
    app = engine_app(engine, settings, served, card)

    def accept(body: CommonOptions, request: Request) -> float:
        """The arrival time of a call this server can honour; raises its 400 or 404."""
        arrival = received_at(request.scope, engine.clock)
        check_model(body.model, accepted, served)
        if (why := body.unsupported()) is not None:
            raise BadInput(why)
        return arrival

    @app.post("/v1/completions")
    async def completions(
        body: CompletionRequest,
        request: Request,
        x_request_timeout: RequestTimeout = None,
        x_priority: PriorityHeader = None,
    ) -> Response:
        """OpenAI-compatible text completion; each prompt is batched by its own length."""
        arrival = accept(body, request)
        prompts = await engine.prompt_ids(body.prompt)
        longest = max(len(p) for p in prompts)
        default = min(engine.generation.default_max_tokens, engine.context_left(longest))
        params = body.choice_params(body.sampling(body.max_tokens or default))
        await engine.check_constraint(params[0])
        seqs = engine.submit_all(
            [p for p in prompts for _ in params],
            params * len(prompts),
            arrival=arrival,
            timeout=x_request_timeout,
            priority=x_priority or 0,
        )
        echoes = None
        if body.echo:
            try:
                echoed = await _echoes(engine, body.prompt, prompts, body.logprob_count())
            except BaseException:
                for s in seqs:
                    engine.cancel(s)
                raise
            echoes = [e for e in echoed for _ in params]  # one per choice
        return await _respond(request, engine, seqs, body, served, chat=False, echoes=echoes)

    @app.post("/v1/chat/completions")
    async def chat_completions(
        body: ChatRequest,
        request: Request,
        x_request_timeout: RequestTimeout = None,
        x_priority: PriorityHeader = None,
    ) -> Response:
        """OpenAI-compatible chat completion through the tokenizer's chat template."""
        arrival = accept(body, request)
        messages = [m.for_template() for m in body.messages]
        tools, _ = body.tool_plan()  # a bad tool_choice is refused before any tokenizing
        if tools is not None:
            tools = tools.with_parser(engine.generation.tool_call_parser)
        prompt = await engine.chat_prompt(messages, body.template_tools())
        requested = body.max_completion_tokens or body.max_tokens
        params = body.choice_params(body.sampling(requested or engine.context_left(len(prompt))))
        await engine.check_constraint(params[0])
        seqs = engine.submit_all(
            [prompt] * len(params),
            params,
            arrival=arrival,
            timeout=x_request_timeout,
            priority=x_priority or 0,
        )
        return await _respond(request, engine, seqs, body, served, chat=True, tools=tools)

    add_response_routes(app, engine, accept, served)
    if tokenizer is not None:
        add_tokenize_routes(app, tokenizer, engine.info.max_length, accepted, served)
    add_task_refusals(app, served, ["generate"])
    return app


Echo = tuple[str, list[TokenLogprob] | None]
"""An echoed prompt: its text, and its tokens' log-probabilities where asked."""


async def _echoes(
    engine: GenerationService[Any],
    raw: str | list[str] | list[int] | list[list[int]],
    prompts: list[list[int]],
    top: int | None,
) -> list[Echo]:
    """Each prompt as `echo` shows it: its text as given (a prompt given as token ids: their
    text), and its tokens' log-probabilities when `top` is not None."""
    one = isinstance(raw, str) or (bool(raw) and isinstance(raw[0], int))
    texts: list[Any] = [raw] if one else list(raw)
    out: list[Echo] = []
    for given, ids in zip(texts, prompts, strict=True):
        text = given if isinstance(given, str) else await engine.prompt_text(ids)
        out.append((text, None if top is None else await engine.prompt_logprobs(ids, top)))
    return out


async def _respond(
    request: Request,
    engine: GenerationService[Any],
    seqs: list[GenerationHandle],
    body: CommonOptions,
    served: str,
    *,
    chat: bool,
    echoes: list[Echo] | None = None,
    tools: ToolCalls | None = None,
) -> Response:
    rid = ("chatcmpl-" if chat else "cmpl-") + seqs[0].request_id
    created = int(time.time())
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        merged = merged_deltas(engine, seqs)
        # The status line waits for the first token: a request that ends before it (shed in
        # the queue by adaptive, or failed) then gets its own status and error body, as one
        # refused at the door does, rather than a 200 and an error event.
        try:
            first = await unless_disconnected(request, first_delta(merged))
        except LenbatchError as err:
            await merged.aclose()
            return error_response(err)
        if first is None:  # the client left: its sequences leave the batch
            await merged.aclose()
            for s in seqs:
                engine.cancel(s)
            return Response(status_code=499)
        events = _sse(seqs, first, merged, rid, created, served, chat, include_usage,
                      body.return_tokens_as_token_ids, body.n, echoes, tools)  # fmt: skip
        return StreamingResponse(events, media_type="text/event-stream")
    done = await unless_disconnected(request, collect_texts(engine, seqs))
    if done is None:  # the client left: its sequences leave the batch
        for s in seqs:
            engine.cancel(s)
        return Response(status_code=499)
    texts, reasons, logprobs = done
    asked, as_ids = body.logprob_count() is not None, body.return_tokens_as_token_ids
    choices: list[dict[str, Any]] = []
    for i, (text, reason) in enumerate(zip(texts, reasons, strict=True)):
        if chat:
            msg: dict[str, Any] = {"role": "assistant", "content": text}
            if tools is not None and reason == "stop":  # complete: its calls, not its text
                content, calls = tools.message(text)
                if calls:
                    msg = {"role": "assistant", "content": content, "tool_calls": calls}
                    reason = tools.finish_reason
            lp = chat_logprobs(logprobs[i], as_ids=as_ids) if asked else None
            choices.append({"index": i, "message": msg, "logprobs": lp, "finish_reason": reason})
        else:
            head, head_lp = echoes[i] if echoes is not None else ("", None)
            lp = completion_logprobs([*(head_lp or []), *logprobs[i]], as_ids=as_ids)
            choices.append(
                {"index": i, "text": head + text, "logprobs": lp if asked else None,
                 "finish_reason": reason}
            )  # fmt: skip
    payload = envelope(rid, created, served, choices, chat=chat, chunk=False)
    payload["usage"] = usage(seqs, body.n)
    payload["lenbatch"] = {"timings": [s.timings_ms() for s in seqs]}
    return Response(json.dumps(payload, separators=(",", ":")), media_type="application/json")


async def _sse(
    seqs: list[GenerationHandle],
    first: tuple[tuple[int, Delta], ...],
    rest: AsyncIterator[tuple[int, Delta]],
    rid: str,
    created: int,
    served: str,
    chat: bool,
    include_usage: bool,
    as_ids: bool = False,
    n: int = 1,
    echoes: list[Echo] | None = None,
    tools: ToolCalls | None = None,
) -> AsyncIterator[str]:
    """The response as server-sent events: the `first` delta, then the `rest`, `data: [DONE]`
    last. Errors after the first token arrive as an `error` event (the status line was
    already sent). With `tools`, a chat's text comes as tool calls (`_ToolStream`)."""

    def chunk(choices: list[Any]) -> dict[str, Any]:
        return envelope(rid, created, served, choices, chat=chat, chunk=True)

    async def deltas() -> AsyncIterator[tuple[int, Delta]]:
        for item in first:
            yield item
        async for item in rest:
            yield item

    try:
        if chat:
            for i in range(len(seqs)):
                role = {"index": i, "delta": {"role": "assistant", "content": ""}}
                yield obj_line(chunk([dict(role, finish_reason=None)]))
        offsets = [0] * len(seqs)  # characters of each choice's token texts so far
        for i, (head, head_lp) in enumerate(echoes or []):  # the prompts first, where echoed
            part = None if head_lp is None else completion_logprobs(head_lp, as_ids=as_ids)
            offsets[i] = sum(len(e.token) for e in head_lp or [])
            echo = {"index": i, "text": head, "logprobs": part, "finish_reason": None}
            yield obj_line(chunk([echo]))
        streams = [_ToolStream(tools) for _ in seqs] if tools is not None else None
        async for i, d in deltas():
            if chat:
                delta = {"content": d.text} if streams is None else streams[i].delta(d)
                choice: dict[str, Any] = {"index": i, "delta": delta}
                if d.logprobs is not None:
                    choice["logprobs"] = chat_logprobs(d.logprobs, as_ids=as_ids)
            else:
                lp = None
                if d.logprobs is not None:
                    lp = completion_logprobs(d.logprobs, offsets[i], as_ids=as_ids)
                    offsets[i] += sum(len(e.token) for e in d.logprobs)
                choice = {"index": i, "text": d.text, "logprobs": lp}
            choice["finish_reason"] = d.finish_reason
            if streams is not None and d.finish_reason == "stop":
                choice["finish_reason"] = streams[i].finish_reason
            obj = chunk([choice])
            if d.finish_reason is not None:
                obj["lenbatch"] = {"index": i, "timings": seqs[i].timings_ms()}
            yield obj_line(obj)
        if include_usage:
            obj = chunk([])
            obj["usage"] = usage(seqs, n)
            yield obj_line(obj)
    except LenbatchError as err:
        yield obj_line(json.loads(bytes(error_response(err).body).decode()))
    yield "data: [DONE]\n\n"


class _ToolStream:
    """One chat choice's text streamed as tool calls: a named function's arguments as they
    come (the first fragment with the call's id and name), `required`'s calls whole once
    the array is complete (before that it cannot be split into calls); a text cut short by
    `max_tokens` under `required` comes as content at its end. Under `auto` the content
    streams as it comes, but for what may begin a call, and the calls come whole at the end
    (`AutoToolStream`)."""

    def __init__(self, tools: ToolCalls) -> None:
        self.tools = tools
        self.text = ""
        self.started = False
        self.auto = AutoToolStream(tools.parser) if tools.parser is not None else None
        self.called = False  # auto: the text held calls

    @property
    def finish_reason(self) -> str:
        """The finish reason of a complete text."""
        if self.auto is not None:
            return "tool_calls" if self.called else "stop"
        return self.tools.finish_reason

    def delta(self, d: Delta) -> dict[str, Any]:
        """The chunk's `delta` for `d`."""
        self.text += d.text
        if self.auto is not None:
            return self._auto(d)
        if self.tools.mode == "named":
            fn: dict[str, Any] = {"arguments": d.text}
            call: dict[str, Any] = {"index": 0, "function": fn}
            if not self.started:
                self.started = True
                call.update(id=call_id(), type="function")
                fn["name"] = self.tools.name
            return {"tool_calls": [call]}
        if d.finish_reason is None:
            return {}
        if d.finish_reason != "stop":
            return {"content": self.text}
        calls = self.tools.calls(self.text)
        return {"tool_calls": [dict(c, index=k) for k, c in enumerate(calls)]}

    def _auto(self, d: Delta) -> dict[str, Any]:
        assert self.auto is not None
        out: dict[str, Any] = {}
        content = self.auto.push(d.text)
        if d.finish_reason is not None:
            rest, found = self.auto.finish(complete=d.finish_reason == "stop")
            content += rest
            if found:
                self.called = True
                out["tool_calls"] = [dict(tool_call(*c), index=k) for k, c in enumerate(found)]
        if content:
            out["content"] = content
        return out
