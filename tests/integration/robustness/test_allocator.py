"""`lenbatch serve` picks its malloc: tcmalloc where the machine has it (re-executing itself
once with it preloaded, same pid), glibc's otherwise, and says which in the log and /stats.

Both branches are real: the test asks the same finder the server does whether this machine
has tcmalloc, and checks the process's own memory map, not only what the server reports.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from robust_servers import serve_process

from lenbatch.runners.allocator import find_tcmalloc

pytestmark = pytest.mark.slow

ARGS = ["--model", "fake?batch_ms=1", "--strategy", "fifo", "--log-level", "info"]


def _maps(pid: int) -> str:
    return Path(f"/proc/{pid}/maps").read_text(encoding="ascii", errors="replace")


def test_auto_preloads_tcmalloc_where_installed(tmp_path: Path) -> None:
    found = find_tcmalloc()
    log = tmp_path / "server.log"
    with serve_process(ARGS, log) as (proc, url):
        stats = httpx.get(f"{url}/stats").json()
        r = httpx.post(f"{url}/v1/embeddings", json={"input": "a few words", "model": "fake"})
        maps = _maps(proc.pid)
    assert r.status_code == 200
    text = log.read_text()
    if found is not None:
        assert stats["memory"]["allocator"] == "tcmalloc"
        assert str(found.resolve().name) in maps or found.name in maps
        assert "memory allocator: tcmalloc" in text and "preloaded at start" in text
    else:
        assert stats["memory"]["allocator"] == "glibc"
        assert "libtcmalloc" not in maps
        assert "install libtcmalloc-minimal4" in text
    assert stats["memory"]["rss_mb"] > 0


def test_system_keeps_the_launched_allocator(tmp_path: Path) -> None:
    with serve_process([*ARGS, "--allocator", "system"], tmp_path / "server.log") as (proc, url):
        stats = httpx.get(f"{url}/stats").json()
        maps = _maps(proc.pid)
    assert stats["memory"]["allocator"] == "glibc"
    assert "libtcmalloc" not in maps


def test_tcmalloc_required_refuses_to_start_without_it(tmp_path: Path) -> None:
    """`--allocator tcmalloc` starts on it where installed; elsewhere exits 2 saying so."""
    if find_tcmalloc() is not None:
        with serve_process([*ARGS, "--allocator", "tcmalloc"], tmp_path / "s.log") as (proc, _):
            assert "libtcmalloc" in _maps(proc.pid)
        return
    entry = "import sys; from lenbatch.cli import main; sys.exit(main(sys.argv[1:]))"
    done = subprocess.run(
        [sys.executable, "-c", entry, "serve", *ARGS, "--allocator", "tcmalloc"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "allocator tcmalloc" in done.stderr and "libtcmalloc-minimal4" in done.stderr
