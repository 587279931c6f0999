"""Schemathesis fuzzing of the running app's OpenAPI schema: no input may cause a 5xx.

Cases are generated from the schema the live server publishes (valid and invalid bodies,
headers and parameters), sent over real HTTP to uvicorn on loopback. Bounded here; run
`bench/fuzz_openapi.py` for a longer campaign.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from robust_servers import live_server
from schemathesis import GenerationMode

from lenbatch.config import BatchingConfig, Settings
from lenbatch.embed.api import create_app
from lenbatch.embed.engine import Engine
from lenbatch.runners.fake import FakeRunner

pytestmark = pytest.mark.slow

EXAMPLES_PER_OPERATION = 150
SEEN: Counter[str] = Counter()


def _app_parts() -> tuple[Engine, Settings]:
    engine = Engine(FakeRunner(record=False), BatchingConfig(max_wait_ms=1))
    return engine, Settings.model_validate({"server": {"max_inputs_per_request": 64}})


# The schema is taken from the app object; the test checks the live server publishes the same.
OPENAPI = create_app(*_app_parts()).openapi()
schema = schemathesis.openapi.from_dict(OPENAPI)
schema.config.generation.update(
    modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE],
    max_examples=EXAMPLES_PER_OPERATION,
)


@pytest.fixture(scope="module")
def fuzz_url() -> Iterator[str]:
    with live_server(*_app_parts()) as url:
        assert httpx.get(f"{url}/openapi.json").json() == OPENAPI
        yield url


@schema.parametrize()
@settings(deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_no_input_causes_a_server_error(case: Any, fuzz_url: str) -> None:
    """Whatever the schema-driven generator sends, the answer is below 500 — except the 504
    that answers a deadline the generator itself set too short in X-Request-Timeout."""
    response = case.call(base_url=fuzz_url, timeout=30)
    status = response.status_code
    if status == 504 and response.json()["error"]["code"] == "deadline_exceeded":
        assert float(case.headers["x-request-timeout"]) < 1.0  # only a tiny deadline expires
        status = 0  # counted apart: the documented answer to the client's own deadline
    SEEN[f"{case.method} {case.path} {status or '504-deadline'}"] += 1
    assert status < 500, (case.method, case.path, response.text[:300])


def test_fuzz_ran_enough_cases() -> None:
    """The fuzz run above really exercised the embeddings endpoint (and reports its counts)."""
    total = sum(SEEN.values())
    embeddings = sum(n for k, n in SEEN.items() if k.startswith("POST /v1/embeddings"))
    print(f"\nfuzz: {total} cases, {embeddings} on POST /v1/embeddings; by status: {dict(SEEN)}")
    assert embeddings >= 50
    assert not [k for k in SEEN if k.rsplit(" ", 1)[1][:1] == "5" and "deadline" not in k]
