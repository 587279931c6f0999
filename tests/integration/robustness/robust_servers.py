"""Servers and load for the robustness tests: uvicorn in a thread (with any runner, e.g. one
held on an event), `lenbatch serve` as a subprocess (for signals and load), and a bounded
open-loop burst; all on 127.0.0.1 only. (A plain module, not a conftest, so its name is unique.)"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import uvicorn

from lenbatch.config import Settings
from lenbatch.embed.api import create_app
from lenbatch.embed.engine import Engine
from lenbatch.serving.server import DrainingServer


@contextmanager
def live_server(engine: Engine, settings: Settings | None = None) -> Iterator[str]:
    """Serve `engine` with a real uvicorn (the lenbatch DrainingServer) on a free loopback port
    in a background thread; yields the base URL and shuts the server down afterwards."""
    settings = settings or Settings()
    config = uvicorn.Config(
        create_app(engine, settings),
        host="127.0.0.1",
        port=0,
        log_level="warning",
        timeout_graceful_shutdown=5,
    )
    server = DrainingServer(config, engine, settings.server.drain_timeout_s)
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def serve_process(
    args: list[str], log_path: Path, env: dict[str, str] | None = None
) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """Run `lenbatch serve ARGS` on a free loopback port until /health answers; yields the
    process and base URL, and kills the process (by its pid) if it is still running after."""
    port = free_port()
    entry = "import sys; from lenbatch.cli import main; sys.exit(main(sys.argv[1:]))"
    cmd = [sys.executable, "-c", entry, "serve", "--port", str(port), *args]
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited early: {log_path.read_text()[-2000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"server did not start: {log_path.read_text()[-2000:]}")
            time.sleep(0.1)
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)


@dataclass(frozen=True, slots=True)
class Outcome:
    """What one request of a burst got: a status (or the transport error) and its timing."""

    status: int | None
    error: str | None  # transport error class name, when no response came
    code: str | None  # the error body's `code`
    retry_after: str | None
    latency: float


async def burst(url: str, rate: float, seconds: float, *, keepalive: bool = True) -> list[Outcome]:
    """Open-loop load for a bounded time: `rate` single-input calls per second to
    /v1/embeddings, each sent on schedule whatever the earlier ones got. Loopback only."""
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100 if keepalive else 0)

    async def one(c: httpx.AsyncClient, i: int) -> Outcome:
        t = time.monotonic()
        try:
            r = await c.post("/v1/embeddings", json={"input": f"w{i % 7} " * (1 + i % 11)})
        except httpx.TransportError as exc:
            return Outcome(None, type(exc).__name__, None, None, time.monotonic() - t)
        code = None if r.status_code == 200 else r.json()["error"]["code"]
        return Outcome(
            r.status_code, None, code, r.headers.get("retry-after"), time.monotonic() - t
        )

    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as c:
        start = time.monotonic()
        tasks = []
        for i in range(int(rate * seconds)):
            await asyncio.sleep(max(0.0, start + i / rate - time.monotonic()))
            tasks.append(asyncio.create_task(one(c, i)))
        return list(await asyncio.gather(*tasks))
