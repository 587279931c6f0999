"""Longer schemathesis campaign against a live `lenbatch serve` (fake model) on loopback.

    .venv/bin/python bench/fuzz_openapi.py --examples 1000 [--out bench/results/fuzz_openapi.md]

Starts the server on a free port, runs `schemathesis run` (valid and invalid cases, coverage and
fuzzing phases) with the `not_a_server_error` check, and reports the case count and failures.
The 504 a too-short X-Request-Timeout earns is a documented answer, so the 5xx check excludes it
by running with that header pinned to a long timeout. `make test` runs a bounded version of this
(tests/integration/robustness/test_fuzz_openapi.py).
"""

from __future__ import annotations

import argparse
import platform
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--examples", type=int, default=1000, help="max examples per operation")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", type=Path, help="write a Markdown result here")
    args = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    entry = "import sys; from lenbatch.cli import main; sys.exit(main(sys.argv[1:]))"
    server = subprocess.Popen(
        [sys.executable, "-c", entry, "serve", "--model", "fake?batch_ms=1", "--port", str(port),
         "--log-level", "warning"],
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        cmd = [
            str(Path(sys.executable).parent / "schemathesis"), "run", f"{url}/openapi.json",
            "--checks", "not_a_server_error", "--mode", "all", "-n", str(args.examples),
            "--seed", str(args.seed), "--no-color", "-H", "X-Request-Timeout: 60",
        ]  # fmt: skip
        t0 = time.monotonic()
        run = subprocess.run(cmd, capture_output=True, text=True)
        wall = time.monotonic() - t0
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)
    out = run.stdout + run.stderr
    m = re.search(r"Test cases:\s*\n\s*(\d+) generated, (\d+) passed(?:, (\d+) failed)?", out)
    generated, passed, failed = (m.group(1), m.group(2), m.group(3) or "0") if m else ("?",) * 3
    summary = (
        f"schemathesis {args.examples} examples/operation, seed {args.seed}: {generated} cases, "
        f"{passed} passed, {failed} failed (5xx), exit {run.returncode}, {wall:.0f} s"
    )
    print(out[-3000:])
    print(summary)
    if args.out:
        args.out.write_text(
            "# OpenAPI fuzzing (schemathesis) of `lenbatch serve --model fake`\n\n"
            f"Command: `.venv/bin/python bench/fuzz_openapi.py --examples {args.examples} "
            f"--seed {args.seed} --out {args.out}`\n\n"
            f"Machine: {platform.machine()}, {platform.python_version()}; shared CPU.\n\n"
            f"Result: {summary}\n"
        )
    return 0 if run.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
