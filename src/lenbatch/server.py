"""The HTTP layer: a thin FastAPI app over `Engine.embed`, and the uvicorn server that drains it.

Endpoints: `POST /v1/embeddings` (OpenAI-compatible), `GET /v1/models`, `GET /health`,
`GET /metrics` (Prometheus), `GET /stats` (JSON summary). Errors use OpenAI's shape,
`{"error": {"message", "type", "code", "param"}}`, are 4xx for anything the client sent wrong,
and never echo request content.

In front of the app, a plain ASGI guard checks the API key (every path but /health) and the body
size limit, by `Content-Length` and by counting a chunked body as it streams in. A client that
disconnects while its request waits has its inputs taken out of the queue.

`DrainingServer` is uvicorn's server with lenbatch's drain put in front of uvicorn's own
shutdown: on SIGTERM or Ctrl-C the engine first refuses new requests (503 with the reason) while
the listener stays open, answers everything already admitted (up to `drain_timeout_s`, then
503), and only then lets uvicorn close the listener, flush the responses and run the lifespan
shutdown. A second Ctrl-C forces an immediate exit.
"""

from __future__ import annotations

import asyncio
import base64
import hmac
import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any, Literal

import numpy as np
import uvicorn
from fastapi import FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from lenbatch.config import Settings
from lenbatch.engine import Engine
from lenbatch.errors import BadInput, LenbatchError

__all__ = ["DrainingServer", "EmbeddingRequest", "create_app", "serve"]

log = logging.getLogger("lenbatch.server")

_FLUSH_S = 5  # after the drain, how long uvicorn may take to write the last responses
_TIMEOUT_DOC = (
    "Seconds this call may wait before it runs; if it has not started by then its inputs are "
    "dropped and the answer is 504. Overrides the server's admission.request_timeout_s."
)

_Text = Annotated[StrictStr, Field(min_length=1)]
_TokenIds = Annotated[list[Annotated[StrictInt, Field(ge=0)]], Field(min_length=1)]
Input = Annotated[
    _Text
    | Annotated[list[_Text], Field(min_length=1)]
    | _TokenIds
    | Annotated[list[_TokenIds], Field(min_length=1)],
    Field(description="Text, list of texts, token ids, or list of token-id lists."),
]


class EmbeddingRequest(BaseModel):
    """Body of `POST /v1/embeddings`, as in OpenAI's API, plus TEI's `truncate`."""

    model_config = ConfigDict(extra="ignore")

    input: Input
    model: str | None = Field(None, description="Model name; must match the served model.")
    encoding_format: Literal["float", "base64"] = Field(
        "float", description="`float` lists or `base64` little-endian float32."
    )
    dimensions: int | None = Field(None, ge=1, description="Must equal the model's width if given.")
    user: str | None = Field(None, description="Ignored; accepted for compatibility.")
    truncate: bool | None = Field(
        None, description="Cut inputs over the model limit instead of rejecting them."
    )


def _error(
    status: int, message: str, kind: str, code: str, retry_after: float | None = None
) -> JSONResponse:
    headers = {}
    if retry_after is not None:
        headers["Retry-After"] = str(max(1, int(np.ceil(retry_after))))
    body = {"error": {"message": message, "type": kind, "code": code, "param": None}}
    return JSONResponse(body, status_code=status, headers=headers)


def error_response(err: LenbatchError) -> JSONResponse:
    """The HTTP response for a lenbatch error."""
    return _error(err.status, err.message, err.kind, err.code, err.retry_after)


async def _until_disconnect(request: Request) -> None:
    # After FastAPI has read the body, the next ASGI message is the disconnect (uvicorn sends
    # it when the client goes away, or once the response is complete).
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class _BodyTooLarge(StarletteHTTPException):
    """Raised from `receive` when a streamed body passes the limit; answered 413."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body exceeds the limit of {limit} bytes")


class _Guard:
    """API key and body size limit, as plain ASGI middleware.

    Plain ASGI rather than `@app.middleware`: Starlette's BaseHTTPMiddleware re-wraps `receive`,
    which the disconnect watcher relies on. A body announced over the limit is refused before
    it is read; a chunked one is counted as it arrives and refused once it passes the limit.
    """

    def __init__(self, app: ASGIApp, api_key: str | None, max_body: int) -> None:
        self.app = app
        self.key = None if api_key is None else f"Bearer {api_key}".encode()
        self.max_body = max_body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        if self.key is not None and scope["path"] != "/health":
            given = headers.get("authorization", "").encode("latin-1")
            if not hmac.compare_digest(given, self.key):
                response = _error(
                    401,
                    "missing or wrong API key (send Authorization: Bearer <key>)",
                    "invalid_request_error",
                    "invalid_api_key",
                )
                response.headers["WWW-Authenticate"] = "Bearer"
                await response(scope, receive, send)
                return
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body:
            response = _error(
                413,
                f"request body of {length} bytes exceeds the limit of {self.max_body} bytes",
                "invalid_request_error",
                "body_too_large",
            )
            await response(scope, receive, send)
            return
        received = 0

        async def limited() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body:
                    raise _BodyTooLarge(self.max_body)
            return message

        await self.app(scope, limited, send)


def _describe_validation(exc: RequestValidationError) -> str:
    # Pydantic's default detail echoes the offending value: describe the place, not the data.
    parts: list[str] = []
    for e in exc.errors():
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        if e.get("type") == "json_invalid":
            msg = "the body is not valid JSON"
        elif loc and loc[0] == "input":
            msg = (
                "input: must be a non-empty string, a list of strings, a list of token "
                "ids (integers), or a list of token-id lists"
            )
        elif e.get("type") == "missing":
            msg = f"{'.'.join(loc)}: required"
        else:
            msg = f"{'.'.join(loc) or 'body'}: {e.get('msg', 'invalid')}"
        if msg not in parts:
            parts.append(msg)
    return "invalid request: " + "; ".join(parts[:5])


def create_app(engine: Engine, settings: Settings | None = None) -> FastAPI:
    """The FastAPI app serving `engine`; starts and drains the engine with the app's lifespan."""
    settings = settings or Settings()
    served = settings.server.served_model_name or engine.info.name
    accepted_names = {served, engine.info.name, settings.model.name}

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await engine.start()
        log.info(
            "engine started: strategy=%s lanes=%s",
            engine.cfg.strategy.value,
            ",".join(engine.lane_labels),
        )
        yield
        await engine.stop(timeout=settings.server.drain_timeout_s)
        log.info("engine stopped")

    app = FastAPI(title="lenbatch", version="0.1.0", lifespan=lifespan)

    if settings.server.cors_origins:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(settings.server.cors_origins),
            allow_methods=["*"],
            allow_headers=["*"],
        )
    app.add_middleware(
        _Guard, api_key=settings.server.api_key, max_body=settings.server.max_body_bytes
    )

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _error(
            400 if request.url.path.startswith("/v1/") else 422,
            _describe_validation(exc),
            "invalid_request_error",
            "invalid_input",
        )

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if isinstance(exc, _BodyTooLarge):
            return _error(413, str(exc.detail), "invalid_request_error", "body_too_large")
        detail = str(exc.detail)
        if exc.status_code == 400 and "parsing the body" in detail:
            detail = "the body could not be parsed: send UTF-8 encoded JSON"
        return _error(exc.status_code, detail, "invalid_request_error", "http_error")

    @app.exception_handler(LenbatchError)
    async def on_lenbatch_error(request: Request, exc: LenbatchError) -> JSONResponse:
        return error_response(exc)

    @app.get("/health")
    async def health() -> JSONResponse:
        """200 while accepting work; 503 with the state (and the reason if the runner
        failed) while draining, failed or stopped."""
        if engine.ready:
            return JSONResponse({"status": "ok"})
        body: dict[str, Any] = {"status": engine.state.value}
        if engine.failure is not None:
            body["reason"] = engine.failure
        return JSONResponse(body, status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        """Prometheus exposition."""
        mem = engine.runner.memory()
        engine.metrics.set_memory(mem.weights, mem.peak_activations, mem.device)
        return Response(
            engine.metrics.prometheus(), media_type="text/plain; version=0.0.4; charset=utf-8"
        )

    @app.get("/stats")
    async def stats() -> JSONResponse:
        """JSON summary: waste, latency percentiles, per-bucket figures, batch caps, state."""
        mem = engine.runner.memory()
        engine.metrics.set_memory(mem.weights, mem.peak_activations, mem.device)
        out = engine.metrics.stats()
        out["model"] = served
        out["state"] = engine.state.value
        out["boundaries"] = list(engine.cfg.boundaries)
        out["default_boundaries"] = engine.uses_default_boundaries
        out["queue_depths"] = engine.queues.depths()
        out["unanswered"] = engine.unanswered
        out["batch_caps"] = engine.caps.describe(engine.clock.now(), engine.lane_labels)
        return JSONResponse(out)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        """The one served model, OpenAI style."""
        return JSONResponse(
            {
                "object": "list",
                "data": [{"id": served, "object": "model", "owned_by": "lenbatch", "created": 0}],
            }
        )

    @app.post("/v1/embeddings")
    async def embeddings(
        body: EmbeddingRequest,
        request: Request,
        x_request_timeout: Annotated[
            float | None, Header(gt=0, allow_inf_nan=False, description=_TIMEOUT_DOC)
        ] = None,
    ) -> Response:
        """OpenAI-compatible embeddings; each input is batched by its own length."""
        if body.model is not None and body.model not in accepted_names:
            return _error(
                404,
                f"the requested model is not served here; use {served!r}",
                "invalid_request_error",
                "model_not_found",
            )
        if body.dimensions is not None and body.dimensions != engine.info.dim:
            raise BadInput(
                f"dimensions={body.dimensions} is not supported: this model's "
                f"vectors have {engine.info.dim} dimensions"
            )
        ids = _token_ids(body.input, engine, body.truncate, settings.server.max_inputs_per_request)
        work = asyncio.ensure_future(
            engine.embed(ids, truncate=body.truncate, timeout=x_request_timeout)
        )
        gone = asyncio.ensure_future(_until_disconnect(request))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            work.cancel()
            gone.cancel()
            raise
        gone.cancel()
        if not work.done():
            work.cancel()  # the client left: its requests leave the queue
            await asyncio.wait({work})  # let the cancellation run before answering
        if work.cancelled():
            log.info("client disconnected: %d inputs withdrawn", len(ids))
            return Response(status_code=499)
        vectors = work.result()
        usage = sum(len(x) for x in ids)
        data = [
            {"object": "embedding", "index": i, "embedding": _encode(v, body.encoding_format)}
            for i, v in enumerate(vectors)
        ]
        payload = {
            "object": "list",
            "data": data,
            "model": served,
            "usage": {"prompt_tokens": usage, "total_tokens": usage},
        }
        return Response(json.dumps(payload, separators=(",", ":")), media_type="application/json")

    return app


def _encode(vec: np.ndarray[Any, Any], fmt: str) -> Any:
    if fmt == "base64":
        return base64.b64encode(vec.astype("<f4").tobytes()).decode("ascii")
    return vec.tolist()


def _token_ids(
    raw: str | list[str] | list[int] | list[list[int]],
    engine: Engine,
    truncate: bool | None,
    max_inputs: int,
) -> list[list[int]]:
    """Validate `input` and turn it into token-id lists (tokenizing text, then dropping it)."""
    if isinstance(raw, str):
        raw = [raw]
    if not raw:
        raise BadInput("input is empty: give a string, a list of strings or token ids")
    if isinstance(raw[0], int):
        raw = [raw]  # one token array
    if len(raw) > max_inputs:
        raise BadInput(f"{len(raw)} inputs in one call; the limit is {max_inputs}")
    if isinstance(raw[0], str):
        texts: list[str] = raw
        for i, t in enumerate(texts):
            if not t:
                raise BadInput(f"input {i} is an empty string")
            if not t.isascii():
                try:
                    t.encode("utf-8")
                except UnicodeEncodeError:
                    raise BadInput(
                        f"input {i} is not valid Unicode (it holds a lone surrogate escape)"
                    ) from None
        try:
            ids = engine.tokenize(texts, truncate)
        except Exception as exc:  # the message could quote the text: report the type only
            raise BadInput(
                f"the tokenizer could not process the input ({type(exc).__name__})"
            ) from None
        return ids
    ids = raw
    vocab = engine.info.vocab_size
    for i, seq in enumerate(ids):
        if not seq:
            raise BadInput(f"input {i} is an empty token array")
        if min(seq) < 0 or max(seq) >= vocab:
            raise BadInput(f"input {i} has token ids outside [0, {vocab})")
    return ids


class DrainingServer(uvicorn.Server):
    """uvicorn's server, draining the engine before uvicorn's own shutdown begins.

    uvicorn's shutdown closes the listener, then waits for open responses, then runs the
    lifespan shutdown. A shutdown request (signal or `should_exit`) is held here instead until
    `engine.drain()` has answered every admitted request; meanwhile the listener stays open and
    new requests get 503 `shutting_down`, which load balancers treat as "go elsewhere".
    """

    def __init__(self, config: uvicorn.Config, engine: Engine, drain_timeout_s: float) -> None:
        super().__init__(config)
        self.engine = engine
        self.drain_timeout_s = drain_timeout_s
        self._drain: asyncio.Task[None] | None = None

    async def on_tick(self, counter: int) -> bool:
        """uvicorn's tick (every 0.1 s); holds `should_exit` back until the drain is done."""
        if self.should_exit and not self.force_exit:
            if self._drain is None:
                log.info(
                    "shutdown requested: refusing new requests, draining %d admitted (up to %g s)",
                    self.engine.unanswered,
                    self.drain_timeout_s,
                )
                self._drain = asyncio.create_task(self.engine.drain(self.drain_timeout_s))
            if not self._drain.done():
                return False
            log.info("drained: every admitted request answered; closing the listener")
        return await super().on_tick(counter)


def serve(engine: Engine, settings: Settings) -> None:
    """Serve `engine` over HTTP until SIGTERM or Ctrl-C, then drain and exit."""
    config = uvicorn.Config(
        create_app(engine, settings),
        host=settings.server.host,
        port=settings.server.port,
        log_level=settings.server.log_level,
        timeout_graceful_shutdown=_FLUSH_S,
    )
    DrainingServer(config, engine, settings.server.drain_timeout_s).run()
