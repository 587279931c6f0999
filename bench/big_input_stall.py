"""Does one huge input hold up everyone else? 20 concurrent one-line requests, alone and with
a 1.1 MB text (`"truncate": true`) sent just before them, against a live `lenbatch serve`.

    .venv/bin/python bench/big_input_stall.py --port 8300 --serve-args '--dtype float32'
    PYTHONPATH=/tmp/old/src .venv/bin/python bench/big_input_stall.py ...   # another tree

Starts the server (the `lenbatch` importable here, so PYTHONPATH picks the tree), waits for
/health, runs `--rounds` rounds of each phase and prints the one-line requests' median and
P95 latency per phase and the huge one's, then stops the server.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import statistics
import subprocess
import sys
import time
import zipfile
from importlib import resources
from pathlib import Path

import httpx


def _huge_text(size: int) -> str:
    data = Path(str(resources.files("lenbatch") / "data" / "text"))
    text = ""
    with zipfile.ZipFile(data / "nltk_state_union.zip") as z:
        for name in sorted(n for n in z.namelist() if n.endswith(".txt")):
            text += z.read(name).decode("utf-8", errors="replace") + "\n"
            if len(text) >= size:
                break
    return text[:size]


async def _phase(url: str, huge: str | None, rounds: int) -> tuple[list[float], list[float]]:
    small_ms: list[float] = []
    huge_ms: list[float] = []
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:

        async def post(text: str, **extra: object) -> float:
            t0 = time.perf_counter()
            r = await client.post("/v1/embeddings", json={"input": text, **extra})
            r.raise_for_status()
            return 1e3 * (time.perf_counter() - t0)

        for k in range(rounds):
            big = asyncio.create_task(post(huge, truncate=True)) if huge else None
            await asyncio.sleep(0)  # the huge body goes out first
            small_ms += await asyncio.gather(
                *(post(f"round {k}: one line request number {i}") for i in range(20))
            )
            if big is not None:
                huge_ms.append(await big)
    return small_ms, huge_ms


def _p95(xs: list[float]) -> float:
    return sorted(xs)[max(0, round(0.95 * len(xs)) - 1)]


def main() -> int:
    """Start the server, run both phases, print the table, stop the server."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, default=8300)
    p.add_argument("--serve-args", default="", help="extra `lenbatch serve` flags")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--size", type=int, default=1_100_000, help="huge input, characters")
    p.add_argument("--label", default="server")
    args = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    cmd = [
        sys.executable, "-c", "import sys; from lenbatch.cli import main; sys.exit(main())",
        "serve", "--port", str(args.port), "--log-level", "warning",
        *shlex.split(args.serve_args),
    ]  # fmt: skip
    server = subprocess.Popen(cmd)
    url = f"http://127.0.0.1:{args.port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or server.poll() is not None:
                raise RuntimeError("server did not start")
            time.sleep(0.2)
        huge = _huge_text(args.size)
        asyncio.run(_phase(url, None, 1))  # warm-up
        alone, _ = asyncio.run(_phase(url, None, args.rounds))
        mixed, big = asyncio.run(_phase(url, huge, args.rounds))
    finally:
        server.terminate()
        server.wait(30)
    print(
        f"| {args.label} | {statistics.median(alone):.0f} / {_p95(alone):.0f} | "
        f"{statistics.median(mixed):.0f} / {_p95(mixed):.0f} | {statistics.median(big):.0f} |"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
