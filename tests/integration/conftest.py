"""Fixtures with real parts: the MiniLM runner, real text, a real uvicorn on loopback."""

from __future__ import annotations

import json
import socket
import threading
import time
import zipfile
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import Any

import pytest
import uvicorn

from lenbatch.config import Settings
from lenbatch.embed.api import create_app
from lenbatch.embed.engine import Engine
from lenbatch.runners import EmbeddingRunner, load_runner


@pytest.fixture(scope="session")
def minilm() -> EmbeddingRunner:
    """The bundled all-MiniLM-L6-v2, loaded once."""
    return load_runner("minilm")


@pytest.fixture(scope="session")
def real_texts() -> list[str]:
    """Mixed-length real text: short math questions and long speech paragraphs."""
    data = Path(str(resources.files("lenbatch") / "data" / "text"))
    questions = [
        json.loads(line)["question"]
        for line in (data / "gsm8k_test.jsonl").read_text(encoding="utf-8").splitlines()[:8]
    ]
    with zipfile.ZipFile(data / "nltk_inaugural.zip") as z:
        name = sorted(n for n in z.namelist() if n.endswith(".txt"))[5]
        text = z.read(name).decode("utf-8", errors="replace")
    paragraphs = [p.strip() for p in text.split("\n\n") if len(p.split()) > 5][:6]
    words = questions[0].split()
    return [words[0], " ".join(words[:4]), *questions, *paragraphs]


def free_port() -> int:
    """A free TCP port on loopback."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LiveServer:
    """A real uvicorn serving an engine on 127.0.0.1, in a background thread."""

    def __init__(
        self,
        engine: Engine | None,
        settings: Settings | None = None,
        http: Any = None,
        *,
        app: Any = None,
    ) -> None:
        """`http`: uvicorn's protocol (default: the one `serve` runs, which stamps each
        request's read time); `app`: another app to serve than `create_app(engine)` (an LLM
        engine's, say)."""
        from lenbatch.serving.server import stamping_protocol

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        if app is None:
            assert engine is not None
            app = create_app(engine, settings)
        config = uvicorn.Config(
            app,
            host="127.0.0.1",
            port=self.port,
            log_level="warning",
            lifespan="on",
            http=http or stamping_protocol(),
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


@pytest.fixture
def live_server() -> type[LiveServer]:
    """The LiveServer class (tests build the engine they need)."""
    return LiveServer


@pytest.fixture
def served_minilm(minilm: EmbeddingRunner) -> Iterator[LiveServer]:
    """MiniLM behind a real server with the default bucketed strategy."""
    from lenbatch.config import BatchingConfig

    engine = Engine(minilm, BatchingConfig(max_wait_ms=5))
    with LiveServer(engine) as srv:
        yield srv


@pytest.fixture(scope="module")
def tiny_llm_url(llama_runner: Any) -> Iterator[str]:
    """The tiny Llama's OpenAI app (continuous batching, buckets 8/16/32, batches of 4, 16
    tokens by default) behind uvicorn on 127.0.0.1: its base URL."""
    from lenbatch.config import BatchingConfig, GenerationConfig
    from lenbatch.generate import GenerationEngine
    from lenbatch.generate.api import create_llm_app

    engine = GenerationEngine(
        llama_runner,
        BatchingConfig(boundaries=(8, 16, 32), max_batch=4, max_wait_ms=2),
        generation=GenerationConfig(default_max_tokens=16),
    )
    app = create_llm_app(engine, Settings.model_validate({"model": {"name": "tiny-llama"}}))
    with LiveServer(None, app=app) as server:
        yield server.url
