"""Schemathesis fuzzing of the generation server's OpenAPI schema: no input may cause a 5xx.

`/v1/completions`, `/v1/chat/completions` and `/v1/responses` (valid and invalid bodies,
headers) are sent over real HTTP to uvicorn on loopback, in front of a tiny random Llama loaded
through the real `CausalLMRunner` (real tokenizer and chat template). `max_tokens_limit` keeps
each generation short so the run stays bounded; run `bench/fuzz_openapi.py --llm` for a longer
campaign.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
import torch
import uvicorn
from hypothesis import HealthCheck, settings
from schemathesis import GenerationMode

from lenbatch.config import BatchingConfig, GenerationConfig, Settings
from lenbatch.generate import GenerationEngine
from lenbatch.generate.api import create_llm_app
from lenbatch.runners.base import ModelInfo
from lenbatch.serving.server import DrainingServer

pytestmark = pytest.mark.slow

EXAMPLES_PER_OPERATION = 120
ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/responses")
SEEN: Counter[str] = Counter()


def _app(runner: Any) -> Any:
    settings = Settings.model_validate({"model": {"name": "tiny-llama"}})
    engine = GenerationEngine(
        runner,
        BatchingConfig(boundaries=(16, 64), max_batch=4, max_wait_ms=1),
        generation=GenerationConfig(default_max_tokens=2, max_tokens_limit=4),
    )
    return engine, settings, create_llm_app(engine, settings)


@pytest.fixture(scope="module")
def llm_url(tiny_llama_dir: Path) -> Iterator[str]:
    """The tiny Llama behind the lenbatch DrainingServer on a free loopback port."""
    from lenbatch.runners.causal import CausalLMRunner

    engine, cfg, app = _app(CausalLMRunner(tiny_llama_dir, name="tiny-llama"))
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning")
    server = DrainingServer(config, engine, cfg.server.drain_timeout_s)
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    try:
        assert _routes_only(httpx.get(f"{url}/openapi.json").json()) == OPENAPI
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=30)


class _SchemaOnly:
    """Just enough of a runner to build the app and read its schema at collection time (the
    schema does not depend on the model); the live server runs the real tiny Llama."""

    info = ModelInfo("tiny-llama", 512, 2, "left", True, 512, kind="generate")
    eos_token_ids = frozenset({1})
    device = torch.device("cpu")


def _routes_only(raw: dict[str, Any]) -> dict[str, Any]:
    return dict(raw, paths={p: v for p, v in raw["paths"].items() if p in ROUTES})


OPENAPI = _routes_only(_app(_SchemaOnly())[2].openapi())
schema = schemathesis.openapi.from_dict(OPENAPI)
schema.config.generation.update(
    modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE],
    max_examples=EXAMPLES_PER_OPERATION,
)


@schema.parametrize()
@settings(deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_no_generation_input_causes_a_server_error(case: Any, llm_url: str) -> None:
    """Whatever the generator sends to the completion routes, the answer is below 500 (the 504
    for a deadline the generator itself set too short is counted apart), and every error is in
    OpenAI's shape."""
    response = case.call(base_url=llm_url, timeout=60)
    status = response.status_code
    if status >= 400:
        err = response.json()["error"]
        assert err["message"] and err["type"], response.text[:300]
    if status == 504 and response.json()["error"]["code"] == "deadline_exceeded":
        assert float(case.headers["x-request-timeout"]) < 1.0  # only a tiny deadline expires
        status = 0
    SEEN[f"{case.method} {case.path} {status or '504-deadline'}"] += 1
    assert status < 500, (case.method, case.path, response.text[:300])


def test_llm_fuzz_ran_enough_cases() -> None:
    """The fuzz run above really exercised every generation route (and reports its counts)."""
    print(f"\nllm fuzz: {sum(SEEN.values())} cases; by status: {dict(SEEN)}")
    for route in ROUTES:
        assert sum(n for k, n in SEEN.items() if k.startswith(f"POST {route} ")) >= 50, route
    assert not [k for k in SEEN if k.rsplit(" ", 1)[1][:1] == "5" and "deadline" not in k]
