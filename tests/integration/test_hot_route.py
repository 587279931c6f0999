"""The hot `/v1/embeddings` route answers exactly as the FastAPI route does.

The same calls go to a real server twice: as it is served (valid calls answered by the hot
route, anything else passed on to FastAPI), and with its hot routes removed (every call through
FastAPI, the reference). Status, headers that matter, errors and vectors must match, and the
hot route must really have answered the valid calls (else this would compare FastAPI with
itself).
"""

from __future__ import annotations

import base64
from typing import Any

import httpx
import numpy as np
import pytest

from lenbatch.config import BatchingConfig
from lenbatch.core.errors import LenbatchError
from lenbatch.embed.engine import Engine
from lenbatch.runners import EmbeddingRunner
from tests.integration.conftest import LiveServer

JSON = {"content-type": "application/json"}

# (name, body, headers, answered by the hot route)
CALLS: list[tuple[str, bytes, dict[str, str], bool]] = [
    ("one text", b'{"input": "The cat sat on the mat."}', JSON, True),
    ("texts, base64", b'{"input": ["a b", "c d e"], "encoding_format": "base64"}', JSON, True),
    ("token ids", b'{"input": [[101, 7592, 2088, 102]]}', JSON, True),
    ("dimensions", b'{"input": "short", "dimensions": 64}', JSON, True),
    ("charset", b'{"input": "x y"}', {"content-type": "application/json; charset=utf-8"}, True),
    ("+json type", b'{"input": "x y"}', {"content-type": "application/vnd.api+json"}, True),
    (
        "timeout and priority headers",
        b'{"input": "x y"}',
        {**JSON, "x-request-timeout": "5.5", "x-priority": "0"},
        True,
    ),
    ("served name", b'{"input": "x", "model": "minilm"}', JSON, True),
    ("unknown model", b'{"input": "x", "model": "no-such-model"}', JSON, True),
    ("too many dimensions", b'{"input": "x", "dimensions": 100000}', JSON, True),
    ("priority out of range", b'{"input": "x", "priority": 99}', JSON, True),
    ("empty text", b'{"input": ""}', JSON, False),
    ("empty list", b'{"input": []}', JSON, False),
    ("no input", b'{"model": "x"}', JSON, False),
    ("not JSON", b'{"input": "x"', JSON, False),
    ("not UTF-8", b'{"input": "\xff\xfe"}', JSON, False),
    ("no content type", b'{"input": "x"}', {}, False),
    ("text/plain", b'{"input": "x"}', {"content-type": "text/plain"}, False),
    ("bad timeout", b'{"input": "x"}', {**JSON, "x-request-timeout": "soon"}, False),
    ("zero timeout", b'{"input": "x"}', {**JSON, "x-request-timeout": "0"}, False),
    ("fractional priority", b'{"input": "x"}', {**JSON, "x-priority": "1.5"}, False),
    ("bad encoding format", b'{"input": "x", "encoding_format": "int8"}', JSON, False),
]


def _send(url: str) -> list[httpx.Response]:
    with httpx.Client(base_url=url, timeout=30) as client:
        return [
            client.post("/v1/embeddings", content=body, headers=headers)
            for _, body, headers, _ in CALLS
        ]


def _vectors(payload: dict[str, Any]) -> list[np.ndarray]:
    out = []
    for item in payload["data"]:
        e = item["embedding"]
        if isinstance(e, str):
            out.append(np.frombuffer(base64.b64decode(e), dtype="<f4"))
        else:
            out.append(np.asarray(e, dtype=np.float32))
    return out


Answers = tuple[list[httpx.Response], list[httpx.Response], list[str]]


@pytest.fixture(scope="module")
def answers(
    minilm: EmbeddingRunner,
) -> tuple[list[httpx.Response], list[httpx.Response], list[str]]:
    """Every call answered by the server as served, then by FastAPI alone; and the names of the
    calls the hot route answered itself."""
    batching = BatchingConfig(max_wait_ms=2)
    hot = LiveServer(Engine(minilm, batching))
    routes = hot.server.config.app.state.hot_routes
    inner = routes[("POST", "/v1/embeddings")]
    answered: list[bool] = []

    async def counted(scope: Any, body: bytes, receive: Any) -> Any:
        try:
            response = await inner(scope, body, receive)
        except LenbatchError:
            answered.append(True)  # answered in the error shape by the hot route's middleware
            raise
        answered.append(response is not None)
        return response

    routes[("POST", "/v1/embeddings")] = counted
    with hot:
        served = _send(hot.url)
    reference = LiveServer(Engine(minilm, batching))
    reference.server.config.app.state.hot_routes.clear()
    with reference:
        plain = _send(reference.url)
    assert len(answered) == len(CALLS)  # the hot route saw every call first
    hot_names = [c[0] for c, by_hot in zip(CALLS, answered, strict=True) if by_hot]
    return served, plain, hot_names


def test_the_hot_route_answers_the_valid_calls(answers: Any) -> None:
    _, _, hot_names = answers
    assert hot_names == [name for name, _, _, by_hot in CALLS if by_hot]


@pytest.mark.parametrize("i", range(len(CALLS)), ids=[c[0] for c in CALLS])
def test_same_answer_as_fastapi(answers: Any, i: int) -> None:
    served, plain, _ = answers
    a, b = served[i], plain[i]
    assert a.status_code == b.status_code, (a.text, b.text)
    assert a.headers.get("content-type") == b.headers.get("content-type")
    assert a.headers.get("retry-after") == b.headers.get("retry-after")
    if a.status_code != 200:
        assert a.json() == b.json()
        return
    ja, jb = a.json(), b.json()
    assert ja["usage"] == jb["usage"] and ja["model"] == jb["model"]
    assert [d["index"] for d in ja["data"]] == [d["index"] for d in jb["data"]]
    for va, vb in zip(_vectors(ja), _vectors(jb), strict=True):
        assert va.shape == vb.shape
        np.testing.assert_allclose(va, vb, atol=1e-5)


def test_the_start_up_heap_is_frozen(minilm: EmbeddingRunner) -> None:
    """Once the server has started, what start-up made is out of the collector's scans."""
    import gc

    gc.unfreeze()
    assert gc.get_freeze_count() == 0
    with LiveServer(Engine(minilm, BatchingConfig(max_wait_ms=2))) as srv:
        frozen = gc.get_freeze_count()
        r = httpx.post(f"{srv.url}/v1/embeddings", json={"input": "x"}, timeout=30)
    gc.unfreeze()
    assert r.status_code == 200
    assert frozen > 10_000  # the model, its tokenizer and the app
