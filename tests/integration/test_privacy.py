"""Privacy: request text never shows up in logs, metrics, stats, error bodies or the length log."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import httpx
import pytest

from lenbatch.config import BatchingConfig
from lenbatch.embed.engine import Engine
from lenbatch.runners import EmbeddingRunner
from lenbatch.serving.lengthlog import LengthLog
from tests.integration.conftest import LiveServer

pytestmark = pytest.mark.slow

CANARY = "zqxcanary7731"


def test_canary_never_leaks(
    minilm: EmbeddingRunner,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    capfd: pytest.CaptureFixture[str],
) -> None:
    """A canary word sent through every path (success and each error) appears nowhere."""
    caplog.set_level(logging.DEBUG)
    log_path = tmp_path / "lengths.jsonl"
    engine = Engine(minilm, BatchingConfig(max_wait_ms=2), length_log=LengthLog(log_path))
    bodies: list[str] = []
    with LiveServer(engine) as srv, httpx.Client(base_url=srv.url, timeout=30) as http:
        cases = [
            {"input": f"a sentence with {CANARY} inside", "model": "all-MiniLM-L6-v2"},
            {"input": [CANARY, f"{CANARY} twice {CANARY}"]},
            {"input": f"{CANARY} " * 400},  # too long
            {"input": [CANARY, 5]},  # mixed types
            {"input": CANARY, "encoding_format": CANARY},  # invalid format
            {"input": CANARY, "model": CANARY},  # unknown model
            {"input": CANARY, "dimensions": 10**6},  # above the width
            {"input": [[CANARY]]},
            {"input": {"text": CANARY}},
        ]
        for body in cases:
            r = http.post("/v1/embeddings", json=body)
            bodies.append(r.text)
        r = http.post(
            "/v1/embeddings",
            content=f'{{"input": "{CANARY}"',
            headers={"content-type": "application/json"},
        )  # malformed JSON
        bodies.append(r.text)
        statuses = [json.loads(b).get("error") is None for b in bodies[:2]]
        assert statuses == [True, True], bodies[:2]
        assert all("error" in json.loads(b) for b in bodies[2:])
        metrics = http.get("/metrics").text
        stats = http.get("/stats").text
    out, err = capfd.readouterr()
    places = {
        "error bodies": "\n".join(bodies[2:]),
        "metrics": metrics,
        "stats": stats,
        "logs": caplog.text + out + err,
        "length log": log_path.read_text(),
    }
    for where, text in places.items():
        assert CANARY not in text, f"canary leaked into {where}"
    assert len(log_path.read_text().splitlines()) == 3  # the three embedded inputs
