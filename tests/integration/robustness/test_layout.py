"""`lenbatch serve` with no layout given runs an encoder one single-threaded batch per usable
core (up to 8), says so in its log, and pins the workers where they are as many as the cores;
a layout given in part is kept as given."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from robust_servers import serve_process

from lenbatch.serving.workers import pinnable_cores, usable_cores

pytestmark = [pytest.mark.slow, pytest.mark.model]

ARGS = ["--model", "minilm", "--log-level", "info"]


def _embed(url: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/embeddings", json={"input": ["one", "two words"]}, timeout=60)


def test_serve_picks_one_batch_per_core_where_none_is_given(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    with serve_process(ARGS, log) as (_, url):
        r = _embed(url)
        stats = httpx.get(f"{url}/stats").json()["workers"]
    assert r.status_code == 200 and len(r.json()["data"]) == 2
    text = log.read_text()
    cores = usable_cores()
    workers = min(cores, 8)
    assert f"batch layout: {workers} batches at once on {cores // workers} torch thread(s)" in text
    pinned = "batch workers: one per core, pinned" in text
    assert pinned == (workers == cores and pinnable_cores(workers) is not None)
    assert stats == {
        "batches_at_once": workers,
        "torch_threads": cores // workers,
        "pinned_cores": pinnable_cores(workers) if pinned else None,
    }


def test_serve_keeps_a_layout_given_in_part(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    with serve_process(ARGS, log, {"LENBATCH_MODEL__TORCH_THREADS": "2"}) as (_, url):
        r = _embed(url)
        stats = httpx.get(f"{url}/stats").json()["workers"]
    assert r.status_code == 200
    text = log.read_text()
    assert "batch layout:" not in text and "pinned to cores" not in text
    assert stats == {"batches_at_once": 1, "torch_threads": 2, "pinned_cores": None}
