"""Loopback HTTP servers with known behaviour, for testing the replay driver.

`FakeEmbeddings`: each body says how long to take and which status to answer
(`{"input": ..., "delay": s, "status": code}`); the server stamps when each request arrived.
`FakeCompletions`: streams `tokens` SSE chunks, the first after `ttft` s, then one every `gap` s.
Both run a real uvicorn server in a thread on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class FakeServer:
    """Records (perf_counter at arrival, body) of every POST; serves /stats from a list."""

    def __init__(self, stats: list[dict[str, Any]] | None = None) -> None:
        self.arrivals: list[tuple[float, dict[str, Any]]] = []
        self.stats = list(stats or [])
        self.app = Starlette(
            routes=[
                Route("/v1/embeddings", self.embeddings, methods=["POST"]),
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/stats", self.get_stats, methods=["GET"]),
                Route("/health", lambda r: JSONResponse({"status": "ok"}), methods=["GET"]),
            ]
        )

    async def get_stats(self, request: Request) -> Response:
        if not self.stats:
            return JSONResponse({"error": "none"}, status_code=404)
        return JSONResponse(self.stats.pop(0))

    async def embeddings(self, request: Request) -> Response:
        body = json.loads(await request.body())
        self.arrivals.append((time.perf_counter(), body))
        await asyncio.sleep(float(body.get("delay", 0.0)))
        status = int(body.get("status", 200))
        if status != 200:
            msg = {"error": {"message": f"fake error {status}", "type": "x", "code": "x"}}
            return JSONResponse(msg, status_code=status)
        return JSONResponse({"object": "list", "data": [{"embedding": [0.0]}]})

    async def completions(self, request: Request) -> Response:
        body = json.loads(await request.body())
        self.arrivals.append((time.perf_counter(), body))
        status = int(body.get("status", 200))
        if status != 200:
            msg = {"error": {"message": f"fake error {status}"}}
            return JSONResponse(msg, status_code=status)
        n = int(body["max_tokens"])
        ttft, gap = float(body.get("ttft", 0.05)), float(body.get("gap", 0.02))
        usage = bool(body.get("stream_options", {}).get("include_usage"))

        async def events() -> AsyncIterator[bytes]:
            await asyncio.sleep(ttft)
            for i in range(n):
                if i:
                    await asyncio.sleep(gap)
                chunk = {"object": "text_completion", "choices": [{"index": 0, "text": f" t{i}"}]}
                yield f"data: {json.dumps(chunk)}\n\n".encode()
            if usage:
                u = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": n}}
                yield f"data: {json.dumps(u)}\n\n".encode()
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")


@contextmanager
def serving(fake: FakeServer) -> Iterator[str]:
    """Run `fake` on a free loopback port for the duration of the block; yields its URL."""
    port = _free_port()
    config = uvicorn.Config(fake.app, host="127.0.0.1", port=port, log_level="error")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline:
            raise RuntimeError("fake server did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
