#!/usr/bin/env python3
"""What one one-input request costs the server outside its forward pass, in CPU.

    bench/run.py request-cost
    python bench/request_cost.py --requests 300 --config configs/minilm-azure-conv.toml

Starts `lenbatch serve` with the config, sends `--requests` one-line embedding requests one
after another over one keep-alive connection (a hand-written HTTP/1.1 client, so the client
costs little), and reads the server's CPU per thread from /proc before and after: the event
loop's (the main thread: HTTP parsing, JSON, the route, the engine's scheduling and answers)
and every thread's. Then it runs the same one-row batch through the runner in this process
(`embed_packed` or `embed`, the config's thread count) to get the forward pass's own CPU, and
reports, per request: event-loop CPU, all-thread CPU, the forward's CPU, and all-thread CPU
minus the forward's (what the request path costs). It also says which event loop and HTTP
parser the server ran (uvloop / httptools are loaded only if installed), read from the
server's memory map.

The HTTP server's own floor comes last: the same calls to uvicorn (the loop and parser `serve`
gets) running a bare ASGI app that answers each with a fixed body of an answer's size, so the
table can say how much of the loop's CPU is uvicorn's and how much is lenbatch's (route,
tokenization, engine, answer).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent))

from waterfall import DEV_CONFIG, cpu_delta, thread_cpu

TEXT = "How many apples does Anna have left after giving three to her brother?"


async def sequential(url: str, body: bytes, n: int) -> tuple[float, int]:
    """`n` requests one after another on one connection; wall seconds and 200s."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    head = (
        f"POST /v1/embeddings HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    ok = 0
    t0 = time.perf_counter()
    for _ in range(n):
        writer.write(head + body)
        status = await reader.readline()
        size = 0
        while (line := await reader.readline()) not in (b"\r\n", b""):
            if line.lower().startswith(b"content-length:"):
                size = int(line.split(b":")[1])
        await reader.readexactly(size)
        ok += status.split()[1] == b"200"
    wall = time.perf_counter() - t0
    writer.close()
    return wall, ok


def loop_and_parser(pid: int) -> str:
    """Which event loop and HTTP parser a server process has loaded (its memory map)."""
    try:
        maps = Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return "unknown (no /proc maps)"
    loop = "uvloop" if "uvloop" in maps else "asyncio"
    parser = "httptools" if "httptools" in maps else "h11"
    return f"{loop} event loop, {parser} HTTP parser"


def forward_cpu(config: str, n: int) -> tuple[float, str]:
    """CPU seconds of one one-row forward pass in this process, as the server runs it."""
    import torch

    from lenbatch.config.settings import load_settings
    from lenbatch.core.collate import collate, pack
    from lenbatch.runners import load_runner

    m = load_settings(config).model
    threads = m.torch_threads or torch.get_num_threads()
    runner = load_runner(m.name, execution=m.execution, dtype=m.dtype, torch_threads=threads)
    ids = runner.tokenize([TEXT], True)
    packed = hasattr(runner, "embed_packed")
    batch = pack(ids) if packed else collate(ids, runner.info.pad_token_id)
    fn = runner.embed_packed if packed else runner.embed
    for _ in range(20):
        fn(batch)  # type: ignore[arg-type]
    before = thread_cpu(os.getpid())
    for _ in range(n):
        fn(batch)  # type: ignore[arg-type]
    delta = cpu_delta(before, thread_cpu(os.getpid()))
    total = sum(s for _, s in delta.values())
    return total / n, f"{'packed' if packed else 'padded'}, {len(ids[0])} tokens, {threads} threads"


def floor_app(body: bytes) -> Any:
    """A bare ASGI app that reads each call and answers `body` (the HTTP server's floor)."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        more = True
        while more:
            more = (await receive()).get("more_body", False)
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    return app


def serve_floor(port: int, answer: Path) -> None:
    """Run `floor_app` answering the bytes of `answer` under uvicorn on `port` (the subprocess
    `--floor-port` starts)."""
    import uvicorn

    uvicorn.run(floor_app(answer.read_bytes()), host="127.0.0.1", port=port, log_level="warning")


def real_answer(url: str, body: bytes) -> bytes:
    """One answer of the server at `url` to `body`, as sent."""
    from urllib.request import Request, urlopen

    req = Request(f"{url}/v1/embeddings", body, {"Content-Type": "application/json"})
    with urlopen(req, timeout=30) as resp:
        data: bytes = resp.read()
    return data


def floor_cpu(body: bytes, n: int, answer: bytes) -> float:
    """Event-loop CPU seconds per call of uvicorn answering `answer` (`serve_floor`)."""
    import subprocess

    from lenbatch.replay.process import free_port

    port = free_port()
    path = Path(tempfile.mkdtemp(prefix="request-floor-")) / "answer.json"
    path.write_bytes(answer)
    cmd = [sys.executable, __file__, "--floor-port", str(port), "--floor-answer", str(path)]
    proc = subprocess.Popen(cmd)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(100):
            try:
                asyncio.run(sequential(url, body, 20))
                break
            except OSError:
                time.sleep(0.1)
        before = thread_cpu(proc.pid)
        asyncio.run(sequential(url, body, n))
        return cpu_delta(before, thread_cpu(proc.pid)).get(proc.pid, ("", 0.0))[1] / n
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def main() -> int:
    """Measure and print (and with --out write) the per-request figures."""
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--config", default=DEV_CONFIG)
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--serve-args", default="", help="more `lenbatch serve` flags")
    p.add_argument("--out", type=Path)
    p.add_argument("--floor-port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--floor-answer", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.floor_port is not None:
        serve_floor(args.floor_port, args.floor_answer)
        return 0
    # The in-process forward runs on the malloc the server runs on (it preloads tcmalloc where
    # installed, which changes the forward's CPU): re-executed once here likewise.
    from lenbatch.runners.allocator import choose

    allocator = choose("auto", [sys.executable, *sys.argv])

    from lenbatch.replay.process import ServerProcess, free_port
    from lenbatch.replay.targets import LENBATCH_CLI, Target
    from lenbatch.runners.hardware import processor_key

    more = shlex.split(args.serve_args)
    argv = (sys.executable, *LENBATCH_CLI, "serve", "--config", args.config,
            "--log-level", "warning", *more, "--port", "{port}")  # fmt: skip
    log_path = Path(tempfile.mkdtemp(prefix="request-cost-")) / "server.log"
    server = ServerProcess(Target("lenbatch serve", "strategy", argv), free_port(), log_path)
    body = json.dumps({"input": TEXT}).encode()
    try:
        server.wait_ready()
        pid = server.proc.pid
        asyncio.run(sequential(server.url, body, 50))  # warm
        answer = real_answer(server.url, body)
        before = thread_cpu(pid)
        wall, ok = asyncio.run(sequential(server.url, body, args.requests))
        delta = cpu_delta(before, thread_cpu(pid))
        stack = loop_and_parser(pid)
    finally:
        server.stop()
    n = args.requests
    loop_ms = 1e3 * delta.get(pid, ("", 0.0))[1] / n
    all_ms = 1e3 * sum(s for _, s in delta.values()) / n
    fwd_s, fwd_what = forward_cpu(args.config, n)
    fwd_ms = 1e3 * fwd_s
    floor_ms = 1e3 * floor_cpu(body, n, answer)
    busy = sorted(((s, t) for t, (_, s) in delta.items() if s > 0.01), reverse=True)
    lines = [
        "# CPU per one-input request, outside the forward pass",
        "",
        f"Command: `{shlex.join(['python', 'bench/request_cost.py', *sys.argv[1:]])}`  ",
        f"Processor: `{processor_key()}`; server: {stack}; in-process forward on "
        f"{allocator}, the server on its default allocator  ",
        f"{n} sequential requests on one keep-alive connection ({ok} answered 200), "
        f"{1e3 * wall / n:.2f} ms each end to end",
        "",
        "| per request | ms CPU |",
        "|---|---:|",
        f"| event loop (server main thread) | {loop_ms:.2f} |",
        f"| all server threads | {all_ms:.2f} |",
        f"| the forward pass alone, in-process ({fwd_what}) | {fwd_ms:.2f} |",
        f"| all threads outside the forward pass | {all_ms - fwd_ms:.2f} |",
        f"| uvicorn's floor: the same calls answered by a bare ASGI app (its event loop) "
        f"| {floor_ms:.2f} |",
        f"| what lenbatch adds on the event loop (route, tokenization, engine, answer) "
        f"| {loop_ms - floor_ms:.2f} |",
        "",
        "Busy server threads (CPU ms per request): "
        + ", ".join(f"{'main' if t == pid else t} {1e3 * s / n:.2f}" for s, t in busy),
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out is not None:
        args.out.write_text(text, encoding="utf-8")
    return 0 if ok == n else 1


if __name__ == "__main__":
    sys.exit(main())
