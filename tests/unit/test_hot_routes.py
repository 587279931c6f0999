"""The hot-route middleware: it answers what its route answers, passes the rest on to FastAPI
with the body intact, keeps the guard's limits and answers errors in the error shape."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from lenbatch.config import Settings
from lenbatch.core.errors import BadInput
from lenbatch.serving.hotroute import add_hot_route, hot_headers
from lenbatch.serving.http import new_app


def _app(max_body: int = 4096, api_key: str | None = None, cors: tuple[str, ...] = ()) -> Any:
    settings = Settings.model_validate(
        {"server": {"max_body_bytes": max_body, "api_key": api_key, "cors_origins": cors}}
    )
    app = new_app(settings, None)
    seen: list[bytes] = []
    offered: list[bytes] = []

    @app.post("/echo")
    async def echo(request: Request) -> JSONResponse:
        body = await request.body()
        seen.append(body)
        return JSONResponse({"by": "fastapi", "size": len(body)})

    async def hot(scope: Any, body: bytes, receive: Any) -> Response | None:
        offered.append(body)
        if body.startswith(b"hot"):
            return Response(b"hot:" + body, media_type="text/plain")
        if body.startswith(b"bad"):
            raise BadInput("bad input: the limit is 3 letters")
        return None

    add_hot_route(app, "POST", "/echo", hot)
    app.state.seen = seen
    app.state.offered = offered
    return app


def _post(app: Any, body: bytes, **headers: str) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return await client.post("/echo", content=body, headers=headers)

    return asyncio.run(go())


def test_hot_route_answers_without_fastapi() -> None:
    app = _app()
    r = _post(app, b"hot body")
    assert r.status_code == 200 and r.text == "hot:hot body"
    assert app.state.seen == []


def test_passed_on_with_the_body_intact() -> None:
    app = _app()
    body = bytes(range(256)) * 3
    r = _post(app, body)
    assert r.json() == {"by": "fastapi", "size": len(body)}
    assert app.state.seen == [body]


def test_a_hot_answer_skips_fastapis_stack_and_a_passed_on_call_is_offered_once() -> None:
    app = _app()
    stacked: list[str] = []

    @app.middleware("http")
    async def record(request: Request, call_next: Any) -> Any:
        stacked.append(request.url.path)
        return await call_next(request)

    assert _post(app, b"hot").text == "hot:hot"
    assert stacked == []  # answered in front of FastAPI's middleware
    assert _post(app, b"plain").json()["by"] == "fastapi"
    assert stacked == ["/echo"]
    assert app.state.offered == [b"hot", b"plain"]  # the inner hot-route layer let it pass


def test_with_cors_on_a_hot_answer_carries_the_cors_headers() -> None:
    app = _app(cors=("http://a.example",))
    r = _post(app, b"hot", origin="http://a.example")
    assert r.text == "hot:hot"
    assert r.headers["access-control-allow-origin"] == "http://a.example"
    assert app.state.offered == [b"hot"]


def test_an_error_of_the_hot_route_is_answered_in_the_error_shape() -> None:
    r = _post(_app(), b"bad")
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "bad input: the limit is 3 letters"


def test_the_guard_still_stands_in_front() -> None:
    app = _app(max_body=1024, api_key="k")
    assert _post(app, b"hot").status_code == 401
    r = _post(app, b"hot" * 400, authorization="Bearer k")
    assert r.status_code == 413 and "limit of 1024 bytes" in r.json()["error"]["message"]
    assert _post(app, b"hot", authorization="Bearer k").text == "hot:hot"


def test_a_streamed_body_over_the_limit_is_refused() -> None:
    app = _app(max_body=1024)

    async def chunks() -> Any:
        yield b"hot"
        yield b"x" * 2000

    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return await client.post("/echo", content=chunks())

    r = asyncio.run(go())
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ([(b"content-type", b"application/json")], (None, None)),
        ([(b"content-type", b"Application/JSON; charset=utf-8")], (None, None)),
        ([(b"content-type", b"application/ld+json")], (None, None)),
        ([(b"content-type", b"application/json"), (b"x-request-timeout", b"2.5")], (2.5, None)),
        ([(b"content-type", b"application/json"), (b"x-priority", b"-1")], (None, -1)),
        ([], None),  # FastAPI refuses a body without a content type as JSON
        ([(b"content-type", b"text/plain")], None),
        ([(b"content-type", b"text/x+json")], None),
        ([(b"content-type", b"application/json"), (b"x-request-timeout", b"0")], None),
        ([(b"content-type", b"application/json"), (b"x-request-timeout", b"inf")], None),
        ([(b"content-type", b"application/json"), (b"x-priority", b"1.0")], None),
        (
            [(b"content-type", b"application/json"), (b"x-priority", b"1"), (b"x-priority", b"2")],
            None,
        ),
    ],
)
def test_hot_headers(headers: list[tuple[bytes, bytes]], expected: Any) -> None:
    got = hot_headers({"headers": headers})
    if expected is None:
        assert got is None
    else:
        assert got is not None and (got.timeout, got.priority) == expected
