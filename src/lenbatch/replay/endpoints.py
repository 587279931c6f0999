"""What the replay driver sends and how it reads the answer, one small class per API.

An `Endpoint` turns (input, output length) into a request body once, before the run, and reads
one response during the run into a `CallResult`. Two ship: `EmbeddingsEndpoint`
(`POST /v1/embeddings`, OpenAI shape) and `CompletionsEndpoint` (`POST /v1/completions` with
`stream: true`, OpenAI server-sent events), which also times the first token and the gaps
between tokens. Reading is kept cheap: the driver shares the CPUs with the server it measures.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp

from lenbatch.plan.summary import OUTCOME_ERROR, OUTCOME_OK, OUTCOME_REJECTED

__all__ = [
    "ENDPOINTS",
    "CallResult",
    "CompletionsEndpoint",
    "EmbeddingsEndpoint",
    "Endpoint",
    "make_endpoint",
    "outcome_of_status",
]

# Statuses that mean "refused at admission": overloaded, too large, unavailable.
_REJECT_STATUSES = frozenset({413, 429, 503})


def outcome_of_status(status: int) -> int:
    """OUTCOME_OK for 2xx, OUTCOME_REJECTED for 413/429/503, else OUTCOME_ERROR."""
    if 200 <= status < 300:
        return OUTCOME_OK
    if status in _REJECT_STATUSES:
        return OUTCOME_REJECTED
    return OUTCOME_ERROR


def error_text(status: int, content: bytes) -> str:
    """A short error description: the status and the server's error message (OpenAI shape),
    which servers keep free of request content."""
    msg = ""
    try:
        data = json.loads(content)
        err = data.get("error", data) if isinstance(data, dict) else data
        msg = str(err.get("message", err) if isinstance(err, dict) else err)
    except (ValueError, AttributeError):
        msg = content[:120].decode("utf-8", errors="replace")
    return f"HTTP {status}: {msg[:200]}"


@dataclass(slots=True)
class CallResult:
    """One request's answer as the driver saw it. Times are `time.perf_counter()` seconds."""

    status: int  # HTTP status; 0 when no response came (connection error, timeout)
    outcome: int  # summary.OUTCOME_*
    done: float
    error: str | None = None
    first_token: float | None = None  # completions: when the first token arrived
    output_tokens: int = 0
    token_gaps: list[float] = field(default_factory=list)  # completions: gaps between chunks


class Endpoint(Protocol):
    """Builds request bodies and reads responses for one API."""

    name: str
    path: str
    streams: bool  # True if the endpoint reports first-token and inter-token times

    def body(self, payload: str | list[int], output_tokens: int | None) -> bytes:
        """The JSON body for one request."""
        ...

    async def call(self, session: aiohttp.ClientSession, base: str, body: bytes) -> CallResult:
        """Send one request to the server at `base` and read its answer (exceptions propagate
        to the driver)."""
        ...


_HEADERS = {"content-type": "application/json"}


class EmbeddingsEndpoint:
    """`POST /v1/embeddings` with one input per call. A 2xx answer counts as done without
    decoding the vectors (decoding 384 floats per answer would cost the driver CPU)."""

    name = "embeddings"
    path = "/v1/embeddings"
    streams = False

    def __init__(self, model: str | None = None) -> None:
        self.model = model

    def body(self, payload: str | list[int], output_tokens: int | None = None) -> bytes:
        """`{"input": ..., "model": ...}`."""
        data: dict[str, Any] = {"input": payload}
        if self.model is not None:
            data["model"] = self.model
        return json.dumps(data, separators=(",", ":")).encode()

    async def call(self, session: aiohttp.ClientSession, base: str, body: bytes) -> CallResult:
        """Post and wait for the whole answer."""
        async with session.post(base + self.path, data=body, headers=_HEADERS) as resp:
            content = await resp.read()
        done = time.perf_counter()
        outcome = outcome_of_status(resp.status)
        err = None if outcome == OUTCOME_OK else error_text(resp.status, content)
        return CallResult(resp.status, outcome, done, err)


class CompletionsEndpoint:
    """`POST /v1/completions` with `stream: true`: prompt of the input length, `max_tokens`
    the trace's output length. Records time to first token, the gaps between streamed chunks
    and the output token count (from `usage` when the server sends it, else one per chunk)."""

    name = "completions"
    path = "/v1/completions"
    streams = True

    def __init__(
        self, model: str | None = None, default_max_tokens: int = 16, ignore_eos: bool = True
    ) -> None:
        self.model = model
        self.default_max_tokens = default_max_tokens
        self.ignore_eos = ignore_eos

    def body(self, payload: str | list[int], output_tokens: int | None) -> bytes:
        """Streaming completion request; greedy so runs are repeatable. `ignore_eos` (as in
        vLLM and lenbatch) makes the server generate exactly the trace's output length; it
        comes with `min_tokens` = `max_tokens`, which does the same on servers without
        `ignore_eos` (llama-cpp-python's)."""
        data: dict[str, Any] = {
            "prompt": payload,
            "max_tokens": int(output_tokens or self.default_max_tokens),
            "stream": True,
            "stream_options": {"include_usage": True},
            "temperature": 0.0,
        }
        if self.ignore_eos:
            data["ignore_eos"] = True
            data["min_tokens"] = data["max_tokens"]
        if self.model is not None:
            data["model"] = self.model
        return json.dumps(data, separators=(",", ":")).encode()

    async def call(self, session: aiohttp.ClientSession, base: str, body: bytes) -> CallResult:
        """Read the event stream to `[DONE]` (or its end)."""
        first: float | None = None
        last: float | None = None
        gaps: list[float] = []
        chunks = 0
        usage_tokens: int | None = None
        async with session.post(base + self.path, data=body, headers=_HEADERS) as resp:
            if resp.status != 200:
                content = await resp.read()
                done = time.perf_counter()
                status = resp.status
                return CallResult(
                    status, outcome_of_status(status), done, error_text(status, content)
                )
            async for raw in resp.content:
                line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
                if not line.startswith("data:"):
                    continue  # blank separators, comments, `event:` lines
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                event = json.loads(data)
                if "error" in event:
                    return CallResult(
                        200, OUTCOME_ERROR, now, f"stream error: {str(event['error'])[:200]}"
                    )
                usage = event.get("usage")
                if usage and usage.get("completion_tokens") is not None:
                    usage_tokens = int(usage["completion_tokens"])
                choices = event.get("choices") or []
                if not any(c.get("text") for c in choices):
                    continue  # a usage-only or empty chunk is not a token
                chunks += 1
                if first is None:
                    first = now
                elif last is not None:
                    gaps.append(now - last)
                last = now
        done = time.perf_counter()
        tokens = usage_tokens if usage_tokens is not None else chunks
        if first is None and tokens > 0:
            return CallResult(200, OUTCOME_ERROR, done, "stream ended without any text chunk")
        return CallResult(200, OUTCOME_OK, done, None, first, tokens, gaps)


ENDPOINTS = ("embeddings", "completions")


def make_endpoint(name: str, model: str | None = None, ignore_eos: bool = True) -> Endpoint:
    """The endpoint called `name` (`embeddings` or `completions`)."""
    if name == "embeddings":
        return EmbeddingsEndpoint(model)
    if name == "completions":
        return CompletionsEndpoint(model, ignore_eos=ignore_eos)
    raise ValueError(f"unknown endpoint {name!r}; choose one of: {', '.join(ENDPOINTS)}")
