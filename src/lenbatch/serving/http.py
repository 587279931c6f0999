"""The HTTP shell both servers share: the app, its guard, the error shape, and the uvicorn
server that drains the engine before it exits.

Errors use OpenAI's shape, `{"error": {"message", "type", "code", "param"}}`, are 4xx for
anything the client sent wrong, and never echo request content (validation messages name the
field, not the value).

In front of the app, a plain ASGI guard checks the API key (every path but /health) and the body
size limit, by `Content-Length` and by counting a chunked body as it streams in. A route that
waits on the engine is watched by the app's `DisconnectSweeper` (serving/disconnects.py), so a
client that goes away has its inputs taken out of the queue.

`DrainingServer` is uvicorn's server with lenbatch's drain put in front of uvicorn's own
shutdown: on SIGTERM or Ctrl-C the engine first refuses new requests (503 with the reason) while
the listener stays open, answers everything already admitted (up to `drain_timeout_s`, then
503), and only then lets uvicorn close the listener, flush the responses and run the lifespan
shutdown. A second Ctrl-C forces an immediate exit.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import AsyncIterator, Collection, Coroutine
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import numpy as np
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from lenbatch.config import Settings
from lenbatch.core.errors import LenbatchError, ModelNotFound
from lenbatch.serving.disconnects import DisconnectSweeper
from lenbatch.serving.services import Service

__all__ = [
    "DrainingServer",
    "check_model",
    "engine_app",
    "error_response",
    "guarded",
    "new_app",
    "serve_app",
    "unless_disconnected",
    "until_disconnect",
]

log = logging.getLogger("lenbatch.serving.http")

T = TypeVar("T")

_FLUSH_S = 5  # after the drain, how long uvicorn may take to write the last responses


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


def check_model(requested: str | None, accepted: Collection[str], served: str) -> None:
    """Raise 404 `model_not_found` unless the body names no model or one served here (the
    requested name is not echoed: it is the client's text)."""
    if requested is not None and requested not in accepted:
        raise ModelNotFound(f"the requested model is not served here; use {served!r}")


async def until_disconnect(request: Request) -> None:
    # After FastAPI has read the body, the next ASGI message is the disconnect (uvicorn sends
    # it when the client goes away, or once the response is complete).
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, work: Coroutine[Any, Any, T]) -> T | None:
    """Await `work` unless the client goes away first: then cancel it (so its requests leave
    the queue or the batch before they cost compute), let the cancellation run, and return
    None. Exceptions of `work` propagate. No task is made per request: the work runs in the
    route's task, and the app's `DisconnectSweeper` watches the connection."""
    sweeper = getattr(request.app.state, "disconnects", None)
    if sweeper is None:
        sweeper = request.app.state.disconnects = DisconnectSweeper()
    return await sweeper.run(request.receive, work)


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


def engine_app(
    engine: Service,
    settings: Settings,
    served: str,
    model_card: dict[str, Any] | None = None,
) -> FastAPI:
    """`new_app` whose lifespan starts and drains `engine`, with the routes every lenbatch
    server has: `GET /health`, `/metrics`, `/stats` and `/v1/models` (`served` is the model
    name answered; `model_card` extra fields of its `/v1/models` entry). The caller adds the
    API's own routes."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await engine.start()
        log.info("engine started: %s", engine.describe())
        yield
        await engine.stop(timeout=settings.server.drain_timeout_s)
        log.info("engine stopped")

    app = new_app(settings, lifespan)

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
        return Response(engine.prometheus(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/stats")
    async def stats() -> JSONResponse:
        """JSON summary: waste, latency percentiles, per-bucket figures, state, lanes."""
        out = engine.stats()
        out["model"] = served
        return JSONResponse(out)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        """The one served model, OpenAI style."""
        entry = {"id": served, "object": "model", "owned_by": "lenbatch", "created": 0}
        entry.update(model_card or {})
        return JSONResponse({"object": "list", "data": [entry]})

    return app


def new_app(settings: Settings, lifespan: Any) -> FastAPI:
    """A FastAPI app with what every lenbatch server shares: CORS, the API-key and body-size
    guard, and error handlers that answer in OpenAI's shape without echoing request content."""
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

    return app


class DrainingServer(uvicorn.Server):
    """uvicorn's server, draining the engine before uvicorn's own shutdown begins.

    uvicorn's shutdown closes the listener, then waits for open responses, then runs the
    lifespan shutdown. A shutdown request (signal or `should_exit`) is held here instead until
    `engine.drain()` has answered every admitted request; meanwhile the listener stays open and
    new requests get 503 `shutting_down`, which load balancers treat as "go elsewhere".
    """

    def __init__(self, config: uvicorn.Config, engine: Service, drain_timeout_s: float) -> None:
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


def guarded(app: ASGIApp, settings: Settings) -> ASGIApp:
    """`app` behind the API-key and body-size guard (what `new_app` puts in front of its
    routes), for an ASGI app that reads bodies itself (the several-model router)."""
    return _Guard(app, settings.server.api_key, settings.server.max_body_bytes)


def serve_app(app: ASGIApp, engine: Service, settings: Settings) -> None:
    """Serve `app` (whose lifespan starts `engine`) until SIGTERM or Ctrl-C, drain, exit."""
    config = uvicorn.Config(
        app,
        host=settings.server.host,
        port=settings.server.port,
        log_level=settings.server.log_level,
        timeout_graceful_shutdown=_FLUSH_S,
    )
    DrainingServer(config, engine, settings.server.drain_timeout_s).run()
