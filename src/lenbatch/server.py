"""The HTTP layer: a thin FastAPI app over `Engine.embed`.

Endpoints: `POST /v1/embeddings` (OpenAI-compatible), `GET /v1/models`, `GET /health`,
`GET /metrics` (Prometheus), `GET /stats` (JSON summary). Errors use OpenAI's shape,
`{"error": {"message", "type", "code", "param"}}`, and never echo request content.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, Literal

import numpy as np
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from lenbatch.config import Settings
from lenbatch.engine import Engine
from lenbatch.errors import BadInput, LenbatchError

__all__ = ["EmbeddingRequest", "create_app"]

log = logging.getLogger("lenbatch.server")

TIMEOUT_HEADER = "x-request-timeout"


class EmbeddingRequest(BaseModel):
    """Body of `POST /v1/embeddings`, as in OpenAI's API, plus TEI's `truncate`."""

    model_config = ConfigDict(extra="ignore")

    input: str | list[str] | list[int] | list[list[int]] = Field(
        description="Text, list of texts, token ids, or list of token-id lists."
    )
    model: str | None = Field(None, description="Model name; must match the served model.")
    encoding_format: Literal["float", "base64"] = Field(
        "float", description="`float` lists or `base64` little-endian float32."
    )
    dimensions: int | None = Field(None, description="Must equal the model's width if given.")
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
    # After FastAPI has read the body, the next ASGI message is the disconnect.
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def create_app(engine: Engine, settings: Settings | None = None) -> FastAPI:
    """The FastAPI app serving `engine`; starts and drains the engine with the app's lifespan."""
    settings = settings or Settings()
    served = settings.server.served_model_name or engine.info.name
    accepted_names = {served, engine.info.name, settings.model.name}
    api_key = settings.server.api_key

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

    app = FastAPI(title="lenbatch", version="0.1.0", lifespan=lifespan)

    if settings.server.cors_origins:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(settings.server.cors_origins),
            allow_methods=["*"],
            allow_headers=["*"],
        )

    @app.middleware("http")
    async def guard(
        request: Request, call_next: Callable[[Request], Awaitable[Response]]
    ) -> Response:
        if api_key is not None and request.url.path != "/health":
            auth = request.headers.get("authorization", "")
            if auth != f"Bearer {api_key}":
                return _error(
                    401,
                    "missing or wrong API key (Authorization: Bearer <key>)",
                    "invalid_request_error",
                    "invalid_api_key",
                )
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > settings.server.max_body_bytes:
            return _error(
                413,
                f"request body of {length} bytes exceeds the limit of "
                f"{settings.server.max_body_bytes} bytes",
                "invalid_request_error",
                "body_too_large",
            )
        return await call_next(request)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        # Pydantic's default detail echoes the offending value: describe the place, not the data.
        parts: list[str] = []
        for e in exc.errors():
            loc = [str(x) for x in e.get("loc", ()) if x != "body"]
            if loc and loc[0] == "input":
                msg = (
                    "input: must be a non-empty string, a list of strings, a list of token "
                    "ids, or a list of token-id lists"
                )
            else:
                msg = f"{'.'.join(loc) or 'body'}: {e.get('msg', 'invalid')}"
            if msg not in parts:
                parts.append(msg)
        return _error(
            400 if request.url.path.startswith("/v1/") else 422,
            "invalid request: " + "; ".join(parts[:5]),
            "invalid_request_error",
            "invalid_input",
        )

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error(exc.status_code, str(exc.detail), "invalid_request_error", "http_error")

    @app.exception_handler(LenbatchError)
    async def on_lenbatch_error(request: Request, exc: LenbatchError) -> JSONResponse:
        return error_response(exc)

    @app.get("/health")
    async def health() -> JSONResponse:
        """200 while accepting work, 503 (with the state) while draining or failed."""
        if engine.ready:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": engine.state.value}, status_code=503)

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
        """JSON summary: waste, latency percentiles, per-bucket figures, configuration."""
        mem = engine.runner.memory()
        engine.metrics.set_memory(mem.weights, mem.peak_activations, mem.device)
        out = engine.metrics.stats()
        out["model"] = served
        out["boundaries"] = list(engine.cfg.boundaries)
        out["default_boundaries"] = engine.uses_default_boundaries
        out["queue_depths"] = engine.queues.depths()
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
    async def embeddings(body: EmbeddingRequest, request: Request) -> Response:
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
        timeout = _timeout_header(request)
        work = asyncio.ensure_future(engine.embed(ids, truncate=body.truncate, timeout=timeout))
        gone = asyncio.ensure_future(_until_disconnect(request))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not work.done():
                work.cancel()  # the client left: its requests leave the queue
            gone.cancel()
        if work.cancelled():
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


def _timeout_header(request: Request) -> float | None:
    raw = request.headers.get(TIMEOUT_HEADER)
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        raise BadInput(f"{TIMEOUT_HEADER} must be a number of seconds") from None
    if not value > 0:
        raise BadInput(f"{TIMEOUT_HEADER} must be positive")
    return value


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
        ids = engine.tokenize(texts, truncate)
    else:
        ids = raw
        vocab = engine.info.vocab_size
        for i, seq in enumerate(ids):
            if not seq:
                raise BadInput(f"input {i} is an empty token array")
            lo, hi = min(seq), max(seq)
            if lo < 0 or hi >= vocab:
                raise BadInput(f"input {i} has token ids outside [0, {vocab})")
    return ids
