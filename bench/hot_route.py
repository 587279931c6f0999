#!/usr/bin/env python3
"""The hot embeddings route against FastAPI's, A/B in one process: event-loop CPU per call.

    python bench/hot_route.py --blocks 30

One MiniLM engine behind `create_app`; the same one-line call goes through the ASGI app (no
sockets, no uvicorn: what differs between the arms is the app's own work) in blocks of 50, the
hot route switched on and off between blocks in alternating order, so a host that slows down
hits both arms alike. Reported: the loop thread's CPU (`time.thread_time`) per call, which
includes the route, tokenization and the engine's scheduling and answers, not the forward pass
(worker threads) nor HTTP parsing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
from lenbatch.config import BatchingConfig, Settings
from lenbatch.embed.api import create_app
from lenbatch.embed.engine import Engine
from lenbatch.runners import load_runner

TEXT = "How many apples does Anna have left after giving three to her brother?"
BODY = json.dumps({"input": TEXT}).encode()
SCOPE = {
    "type": "http",
    "asgi": {"version": "3.0"},
    "http_version": "1.1",
    "method": "POST",
    "scheme": "http",
    "path": "/v1/embeddings",
    "raw_path": b"/v1/embeddings",
    "query_string": b"",
    "root_path": "",
    "server": ("127.0.0.1", 8000),
    "client": ("127.0.0.1", 5000),
    "headers": [
        (b"host", b"127.0.0.1"),
        (b"content-type", b"application/json"),
        (b"content-length", str(len(BODY)).encode()),
    ],
}


async def call(app: Any) -> None:
    """One call through the ASGI app; it must answer 200."""
    sent = False
    gone = asyncio.Event()  # never set: the client stays (uvicorn's receive waits likewise)

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": BODY, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    status = []

    async def send(m: dict[str, Any]) -> None:
        if m["type"] == "http.response.start":
            status.append(m["status"])

    await app(dict(SCOPE), receive, send)
    assert status == [200], status


async def measure(blocks: int) -> str:
    """The A/B table's lines."""
    runner = load_runner("minilm", torch_threads=1)
    engine = Engine(runner, BatchingConfig(max_wait_ms=0))
    app = create_app(engine, Settings())
    key = ("POST", "/v1/embeddings")
    hot = app.state.hot_routes[key]
    await engine.start()
    for _ in range(100):
        await call(app)
    res: dict[str, list[float]] = {"hot": [], "fastapi": []}
    for block in range(blocks):
        for arm in ("hot", "fastapi") if block % 2 == 0 else ("fastapi", "hot"):
            if arm == "hot":
                app.state.hot_routes[key] = hot
            else:
                app.state.hot_routes.pop(key, None)
            t = time.thread_time()
            for _ in range(50):
                await call(app)
            res[arm].append((time.thread_time() - t) / 50 * 1e3)
    await engine.stop()
    lines = ["| route | loop-thread CPU per call, median (quartiles) |", "|---|---:|"]
    for arm, xs in res.items():
        q = statistics.quantiles(xs, n=4)
        lines.append(f"| {arm} | {statistics.median(xs):.3f} ms ({q[0]:.3f}-{q[2]:.3f}) |")
    ratio = statistics.median(h / f for h, f in zip(res["hot"], res["fastapi"], strict=True))
    lines.append(
        f"\nhot / fastapi, median of the paired blocks' ratios: **{ratio:.3f}** "
        f"({blocks} blocks of 50 calls per route)"
    )
    return "\n".join(lines)


def main() -> None:
    """Run the A/B and print its table."""
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[1])
    p.add_argument("--blocks", type=int, default=30, help="blocks of 50 calls per route")
    print(asyncio.run(measure(p.parse_args().blocks)))


if __name__ == "__main__":
    main()
