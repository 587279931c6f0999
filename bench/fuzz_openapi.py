"""Longer schemathesis campaign against a live `lenbatch serve` (fake model) on loopback.

    bench/run.py fuzz -- --examples 1000 [--out bench/results/fuzz_openapi.md]
    bench/run.py fuzz -- --llm --examples 1000 \
        --out bench/results/fuzz_openapi_llm.md

`--llm` fuzzes the generation routes (`/v1/completions`, `/v1/chat/completions`,
`/v1/responses`) of a server running a tiny random Llama (built into `out/tiny-llama-fuzz` on
first use) with generations capped at 4 tokens (`LENBATCH_GENERATION__MAX_TOKENS_LIMIT`), so
the campaign stays bounded.

Starts the server on a free port, runs `schemathesis run` (valid and invalid cases, coverage and
fuzzing phases) with the `not_a_server_error` check, and reports the case count and failures.
The 504 a too-short X-Request-Timeout earns is a documented answer, so the 5xx check excludes it
by running with that header pinned to a long timeout. `make test` runs a bounded version of this
(tests/integration/robustness/test_fuzz_openapi.py).
"""

from __future__ import annotations

import argparse
import os
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
    p.add_argument("--llm", action="store_true", help="fuzz the generation routes instead")
    args = p.parse_args()
    model, env, only = "fake?batch_ms=1", dict(os.environ), []
    if args.llm:
        from lenbatch.runners.tiny import build_tiny_model

        folder = Path("out/tiny-llama-fuzz")
        if not (folder / "config.json").exists():
            build_tiny_model(folder, "llama")
        model = str(folder)
        env.update(HF_HUB_OFFLINE="1", LENBATCH_GENERATION__MAX_TOKENS_LIMIT="4")
        env["LENBATCH_GENERATION__DEFAULT_MAX_TOKENS"] = "2"
        only = ["--include-path-regex", "^/v1/((chat/)?completions|responses)$"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    entry = "import sys; from lenbatch.cli import main; sys.exit(main(sys.argv[1:]))"
    server = subprocess.Popen(
        [sys.executable, "-c", entry, "serve", "--model", model, "--port", str(port),
         "--log-level", "warning"],
        env=env,
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
            "--seed", str(args.seed), "--no-color", "-H", "X-Request-Timeout: 60", *only,
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
        what = "generation routes, tiny random Llama" if args.llm else "`--model fake`"
        flag = " --llm" if args.llm else ""
        args.out.write_text(
            f"# OpenAPI fuzzing (schemathesis) of `lenbatch serve` ({what})\n\n"
            f"Command: `.venv/bin/python bench/fuzz_openapi.py{flag} --examples {args.examples} "
            f"--seed {args.seed} --out {args.out}`\n\n"
            f"Machine: {platform.machine()}, {platform.python_version()}; shared CPU.\n\n"
            f"Result: {summary}\n"
        )
    return 0 if run.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
