"""The HTTP shell both servers share: the app and its guard. The error shape is
`serving/http_errors.py`, hot routes `serving/hotroute.py`, and the uvicorn server that drains
the engine before it exits `serving/server.py`.

Errors use OpenAI's shape (`serving/http_errors.py`), and never echo request content
(validation messages name the field, not the value).

In front of the app, a plain ASGI guard checks the API key (every path but /health) and the body
size limit, by `Content-Length` and by counting a chunked body as it streams in. A route that
waits on the engine is watched by the app's `DisconnectSweeper` (serving/disconnects.py), so a
client that goes away has its inputs taken out of the queue.

Inside the guard, a hot route (`serving/hotroute.py`) may answer a busy path without FastAPI's
routing, dependency solving and exception middleware, or pass the request on, unchanged, to the
FastAPI route, which stays the reference. Where CORS is off, a hot path's request does not
enter FastAPI's middleware stack at all (its error, telemetry and body-limit layers, each an
await and a wrapped `send`): the app runs its own guard and the hot route in front of it, and
hands FastAPI only what the hot route passes on.
"""

from __future__ import annotations

import gc
import hmac
import logging
from collections.abc import AsyncIterator, Collection, Coroutine
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from lenbatch.config import Settings
from lenbatch.core.errors import LenbatchError, ModelNotFound
from lenbatch.runners.memory import current_rss, release_freed_memory
from lenbatch.serving.disconnects import DisconnectSweeper
from lenbatch.serving.hotroute import HOT_ROUTE_TRIED, HotRoute, HotRoutes
from lenbatch.serving.http_errors import BodyTooLarge, error_json, error_response
from lenbatch.serving.services import Service

__all__ = [
    "check_model",
    "engine_app",
    "freeze_heap",
    "guarded",
    "new_app",
    "unless_disconnected",
    "until_disconnect",
    "watched",
]

log = logging.getLogger("lenbatch.serving.http")

T = TypeVar("T")


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
    return await watched(request.app, request.receive, work)


async def watched(app: Any, receive: Receive, work: Coroutine[Any, Any, T]) -> T | None:
    """`unless_disconnected` for a route that has the app and the ASGI `receive` of its
    request rather than a `Request` (a hot route)."""
    sweeper = getattr(app.state, "disconnects", None)
    if sweeper is None:
        sweeper = app.state.disconnects = DisconnectSweeper()
    return await sweeper.run(receive, work)


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
        if self.key is not None and scope["path"] != "/health":
            given = _header(scope, b"authorization") or b""
            if not hmac.compare_digest(given, self.key):
                response = error_json(
                    401,
                    "missing or wrong API key (send Authorization: Bearer <key>)",
                    "invalid_request_error",
                    "invalid_api_key",
                )
                response.headers["WWW-Authenticate"] = "Bearer"
                await response(scope, receive, send)
                return
        raw_length = _header(scope, b"content-length")
        length = None if raw_length is None else raw_length.decode("latin-1")
        if length is not None and length.isdigit() and int(length) > self.max_body:
            response = error_json(
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
                    raise BodyTooLarge(self.max_body)
            return message

        await self.app(scope, limited, send)


def _header(scope: Scope, name: bytes) -> bytes | None:
    """The first value of header `name` (lower case, as ASGI servers give names), or None:
    a scan of the raw list, without building Starlette's `Headers` for every request."""
    for key, value in scope["headers"]:
        if key == name:
            return bytes(value)
    return None


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
        freeze_heap()
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


def freeze_heap() -> int:
    """Collect once, then move every object alive now (models, tokenizers, the app) out of
    the collector's reach (`gc.freeze`, as vLLM does after start-up); returns how many.

    A full collection walks every tracked object: with MiniLM and the app loaded, ~420k
    objects and 0.27-0.35 s on this project's 2-core machine, a pause of the event loop and,
    through the GIL, of the model thread. One runs when the objects that survived since the
    last grow past a quarter of the long-lived ones: rare in steady serving (none in 4,000
    one-line calls), but a long queue or a growing history makes one. Frozen, collections
    walk only what came after start-up (the largest gen-1 pause in those 4,000 calls: 6.6 ms
    unfrozen, 1.1 ms frozen).

    Then it hands back to the OS what malloc holds freed (`release_freed_memory`): the buffers
    of warm-up's and self-calibration's largest batches, which glibc would otherwise keep for
    good. On an AMD EPYC family 25 model 1 (glibc), `make serve` started at ~1,000 MB resident
    after warm-up and stayed at 1,122 MB through a 10-minute replay at ~12 requests/s.
    """
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    before = current_rss()
    release_freed_memory()
    log.info(
        "start-up heap frozen: %d objects out of the garbage collector's scans; resident "
        "set %.0f MB (%.0f MB freed memory handed back)",
        frozen, current_rss() / 2**20, (before - current_rss()) / 2**20,
    )  # fmt: skip
    return frozen


class _App(FastAPI):
    """FastAPI with its hot routes in front of its middleware stack where `front` is set (see
    the module docstring): a request for a hot path goes to `front` (the guard and the hot
    route), anything else to FastAPI as usual."""

    front: ASGIApp | None = None
    hot_paths: Collection[tuple[str, str]] = ()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        front = self.front
        if (
            front is not None
            and scope["type"] == "http"
            and (scope["method"], scope["path"]) in self.hot_paths
        ):
            await front(scope, receive, send)
            return
        await super().__call__(scope, receive, send)


def new_app(settings: Settings, lifespan: Any) -> FastAPI:
    """A FastAPI app with what every lenbatch server shares: CORS, the API-key and body-size
    guard, and error handlers that answer in OpenAI's shape without echoing request content."""
    app = _App(title="lenbatch", version="0.1.0", lifespan=lifespan)
    routes: dict[tuple[str, str], HotRoute] = {}
    app.state.hot_routes = app.hot_paths = routes
    app.add_middleware(HotRoutes, routes=routes)  # innermost: inside the guard
    if not settings.server.cors_origins:

        async def through_fastapi(scope: Scope, receive: Receive, send: Send) -> None:
            scope[HOT_ROUTE_TRIED] = True  # the hot route passed it on: FastAPI's route answers
            await FastAPI.__call__(app, scope, receive, send)

        app.front = _Guard(
            HotRoutes(through_fastapi, routes),
            settings.server.api_key,
            settings.server.max_body_bytes,
        )

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
        return error_json(
            400 if request.url.path.startswith("/v1/") else 422,
            _describe_validation(exc),
            "invalid_request_error",
            "invalid_input",
        )

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if isinstance(exc, BodyTooLarge):
            return error_json(413, str(exc.detail), "invalid_request_error", "body_too_large")
        detail = str(exc.detail)
        if exc.status_code == 400 and "parsing the body" in detail:
            detail = "the body could not be parsed: send UTF-8 encoded JSON"
        return error_json(exc.status_code, detail, "invalid_request_error", "http_error")

    @app.exception_handler(LenbatchError)
    async def on_lenbatch_error(request: Request, exc: LenbatchError) -> JSONResponse:
        return error_response(exc)

    return app


def guarded(app: ASGIApp, settings: Settings) -> ASGIApp:
    """`app` behind the API-key and body-size guard (what `new_app` puts in front of its
    routes), for an ASGI app that reads bodies itself (the several-model router)."""
    return _Guard(app, settings.server.api_key, settings.server.max_body_bytes)
