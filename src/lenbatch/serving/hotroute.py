"""Hot routes: a busy path answered without FastAPI's routing, dependency solving and exception
middleware (about a third of the event loop's CPU per request for a one-input embeddings call).

A hot route (`add_hot_route`) sits inside the app's guard (`serving/http.py`): it gets the whole
body and answers a request it can validate itself, or returns None and the request goes on to
the FastAPI route, unchanged, which then answers it as it always did (every validation error
included). The FastAPI route stays the reference: the OpenAPI schema, and every request the hot
route passes on. `new_app` (`serving/http.py`) puts `HotRoutes` in front of FastAPI; where CORS
is off, a hot path's request does not enter FastAPI's middleware stack at all.

Split from `serving/http.py`, which wires these into the app.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from fastapi import FastAPI
from fastapi.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from lenbatch.core.errors import LenbatchError
from lenbatch.serving.http_errors import BodyTooLarge, error_json, error_response

__all__ = [
    "HOT_ROUTE_TRIED",
    "HotHeaders",
    "HotRoute",
    "HotRoutes",
    "add_hot_route",
    "hot_headers",
]

HotRoute = Callable[[Scope, bytes, Receive], Awaitable[Response | None]]
"""A hot route: given the request's scope, its whole body and the ASGI `receive` (to watch
for a disconnect), the response, or None to pass the request on to the FastAPI route. It may
raise `LenbatchError` (answered in the error shape, as the FastAPI route's would be)."""


def add_hot_route(app: FastAPI, method: str, path: str, route: HotRoute) -> None:
    """Answer `method path` with `route` first (see the module docstring); `app` comes from
    `serving.http.new_app`, and a FastAPI route for the same path must exist as the reference."""
    app.state.hot_routes[(method, path)] = route


# scope key: the front already offered the request to the hot route
HOT_ROUTE_TRIED = "lenbatch.hot_route_tried"


class HotRoutes:
    """Plain ASGI middleware inside the guard that runs a path's hot route, if it has one."""

    def __init__(self, app: ASGIApp, routes: dict[tuple[str, str], HotRoute]) -> None:
        self.app = app
        self.routes = routes  # filled in after the app is made, before it serves

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = None
        if scope["type"] == "http" and HOT_ROUTE_TRIED not in scope:
            route = self.routes.get((scope["method"], scope["path"]))
        if route is None:
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        more = True
        try:
            while more:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return  # gone before the body arrived: nobody to answer
                chunks.append(message.get("body", b""))
                more = message.get("more_body", False)
        except BodyTooLarge as err:
            too_large = error_json(413, str(err.detail), "invalid_request_error", "body_too_large")
            await too_large(scope, receive, send)
            return
        body = b"".join(chunks)
        try:
            response = await route(scope, body, receive)
        except LenbatchError as err:
            response = error_response(err)
        if response is None:
            await self.app(scope, _replay(body, receive), send)
        else:
            await response(scope, receive, send)


@dataclass(frozen=True, slots=True)
class HotHeaders:
    """What a hot route reads from the headers: `X-Request-Timeout` and `X-Priority`."""

    timeout: float | None = None
    priority: int | None = None


_PLAIN_HEADERS = HotHeaders()
_SECONDS = re.compile(rb"[0-9]{1,9}(\.[0-9]{0,9})?")
_LEVEL = re.compile(rb"-?[0-9]{1,9}")


def hot_headers(scope: Scope) -> HotHeaders | None:
    """The timeout and priority headers of a request that says its body is JSON (content type
    `application/json` or `application/*+json`: what FastAPI parses as JSON), when each is a
    plain number given once; otherwise None, and the FastAPI route, which validates them and
    words the error, takes the request."""
    timeout = priority = None
    seen: set[bytes] = set()
    for name, value in scope["headers"]:
        if name == b"content-type":
            kind = value.split(b";", 1)[0].strip().lower()
            if name in seen or not (
                kind == b"application/json"
                or (kind.startswith(b"application/") and kind.endswith(b"+json"))
            ):
                return None
        elif name == b"x-request-timeout":
            if not _SECONDS.fullmatch(value) or name in seen or float(value) <= 0:
                return None
            timeout = float(value)
        elif name == b"x-priority":
            if not _LEVEL.fullmatch(value) or name in seen:
                return None
            priority = int(value)
        else:
            continue
        seen.add(name)
    if b"content-type" not in seen:
        return None
    if timeout is None and priority is None:
        return _PLAIN_HEADERS
    return HotHeaders(timeout, priority)


def _replay(body: bytes, receive: Receive) -> Receive:
    """`receive` that first hands out the body already read, then the connection's messages."""
    pending = True

    async def replayed() -> Message:
        nonlocal pending
        if pending:
            pending = False
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed
