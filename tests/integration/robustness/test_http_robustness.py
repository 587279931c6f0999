"""HTTP robustness on a real uvicorn (loopback): validation is 4xx and never echoes the request,
limits answer 413/429 with the limit, deadlines 504, disconnects leave the queue, a crashed
runner is reported on /health, the API key guards everything but /health, CORS is off."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from robust_servers import live_server

from lenbatch.config import AdmissionConfig, BatchingConfig, Settings
from lenbatch.embed.api import create_app
from lenbatch.embed.engine import Engine
from lenbatch.runners.fake import FakeRunner
from lenbatch.runners.faulty import FaultyRunner
from lenbatch.serving.lengthlog import LengthLog

pytestmark = pytest.mark.slow

CANARY = "zq9CANARYx7"
FAKE = FakeRunner()


def _settings(**server: Any) -> Settings:
    return Settings.model_validate({"server": {"max_inputs_per_request": 4, **server}})


@pytest.fixture(scope="module")
def canary_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """A server whose model fails on the canary word; batches wait 50 ms to fill."""
    log_path = tmp_path_factory.mktemp("lengthlog") / "lengths.jsonl"
    runner = FaultyRunner(FakeRunner(record=False), poison_token=FAKE.token_id(CANARY))
    engine = Engine(
        runner,
        BatchingConfig(strategy="fifo", max_wait_ms=50),
        length_log=LengthLog(log_path),
    )
    with live_server(engine, _settings(max_body_bytes=4096)) as url:
        yield url, log_path


BAD_BODIES: list[tuple[str, Any, int]] = [
    ("empty string", {"input": ""}, 400),
    ("empty list", {"input": []}, 400),
    ("empty token array", {"input": [[]]}, 400),
    ("one empty string", {"input": ["ok", ""]}, 400),
    ("number", {"input": 5}, 400),
    ("nested lists", {"input": [[[1]]]}, 400),
    ("mixed types", {"input": [1, "a"]}, 400),
    ("booleans", {"input": [True, False]}, 400),
    ("floats", {"input": [1.0, 2.0]}, 400),
    ("object", {"input": {"text": CANARY}}, 400),
    ("null", {"input": None}, 400),
    ("missing input", {"model": "fake"}, 400),
    ("bad encoding_format", {"input": "x", "encoding_format": CANARY}, 400),
    ("bad dimensions type", {"input": "x", "dimensions": CANARY}, 400),
    ("dimensions over the width", {"input": "x", "dimensions": 10**6}, 400),
    ("token id over vocab", {"input": [[101, 10**12]]}, 400),
    ("negative token id", {"input": [-1, 5]}, 400),
    ("too many inputs", {"input": ["a", "b", "c", "d", "e"]}, 400),
    ("unknown model", {"input": "x", "model": CANARY}, 404),
    ("too long", {"input": f"{CANARY} " + "w " * 300}, 413),
    ("body is a list", [CANARY], 400),
]


@pytest.mark.parametrize(("name", "body", "status"), BAD_BODIES, ids=[b[0] for b in BAD_BODIES])
def test_bad_json_bodies_are_4xx_with_a_message(
    canary_server: tuple[str, Path], name: str, body: Any, status: int
) -> None:
    """Each malformed body gets its 4xx, OpenAI's error shape, and no request content."""
    url, _ = canary_server
    r = httpx.post(f"{url}/v1/embeddings", json=body, timeout=10)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"] == "invalid_request_error"
    assert CANARY not in r.text


RAW_BODIES: list[tuple[str, bytes, str]] = [
    ("not UTF-8", b'{"input": "\xff\xfe"}', "application/json"),
    ("malformed JSON", b'{"input": ', "application/json"),
    ("lone surrogate", b'{"input": "\\ud800 ' + CANARY.encode() + b'"}', "application/json"),
    ("no body", b"", "application/json"),
    ("not JSON at all", CANARY.encode(), "text/plain"),
]


@pytest.mark.parametrize(("name", "raw", "ctype"), RAW_BODIES, ids=[b[0] for b in RAW_BODIES])
def test_unparseable_bodies_are_400(
    canary_server: tuple[str, Path], name: str, raw: bytes, ctype: str
) -> None:
    """Bytes that are not a valid JSON request are 400 with a message, never 5xx."""
    url, _ = canary_server
    r = httpx.post(f"{url}/v1/embeddings", content=raw, headers={"content-type": ctype})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"] and CANARY not in r.text


@pytest.mark.parametrize("value", ["0", "-1", "abc", "nan", "inf", ""])
def test_bad_timeout_header_is_400(canary_server: tuple[str, Path], value: str) -> None:
    """X-Request-Timeout must be a positive, finite number of seconds."""
    url, _ = canary_server
    r = httpx.post(
        f"{url}/v1/embeddings", json={"input": "x"}, headers={"x-request-timeout": value}
    )
    assert r.status_code == 400 and "x-request-timeout" in r.json()["error"]["message"]


def test_body_over_limit_is_413_by_length_and_when_chunked(
    canary_server: tuple[str, Path],
) -> None:
    """Over max_body_bytes: 413 whether announced by Content-Length or streamed chunked."""
    url, _ = canary_server
    big = json.dumps({"input": "w " * 3000}).encode()
    r = httpx.post(
        f"{url}/v1/embeddings", content=big, headers={"content-type": "application/json"}
    )
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
    assert "4096" in r.json()["error"]["message"]

    def chunks(body: bytes) -> Iterator[bytes]:
        for i in range(0, len(body), 1000):
            yield body[i : i + 1000]

    headers = {"content-type": "application/json"}
    r = httpx.post(f"{url}/v1/embeddings", content=chunks(big), headers=headers)
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
    small = json.dumps({"input": "a b c"}).encode()
    r = httpx.post(f"{url}/v1/embeddings", content=chunks(small), headers=headers)
    assert r.status_code == 200


def test_canary_never_leaks_into_logs_metrics_or_errors(
    canary_server: tuple[str, Path], caplog: pytest.LogCaptureFixture
) -> None:
    """Text through every error path (model failure, deadline, too long, validation) and the
    success path: the canary appears in no response, log record, metric or length log."""
    url, log_path = canary_server
    caplog.set_level(logging.DEBUG)
    bodies = []
    with httpx.Client(base_url=url, timeout=10) as c:
        r = c.post("/v1/embeddings", json={"input": f"hello {CANARY} there"})
        assert r.status_code == 500 and r.json()["error"]["code"] == "model_error"
        bodies.append(r.text)
        r = c.post(
            "/v1/embeddings",
            json={"input": ["fine", f"{CANARY} again"]},
            headers={"x-request-timeout": "0.001"},
        )
        assert r.status_code == 504 and "dropped before running" in r.text
        bodies.append(r.text)
        for body in (
            {"input": f"{CANARY} " * 400},
            {"input": [CANARY, 3]},
            {"input": "x", "user": CANARY, "model": CANARY},
            {"input": f"safe {CANARY[:3]}", "encoding_format": "base64"},
        ):
            bodies.append(c.post("/v1/embeddings", json=body).text)
        bodies.append(c.get("/metrics").text)
        bodies.append(c.get("/stats").text)
    assert all(CANARY not in b for b in bodies)
    logged = caplog.text + "".join(str(rec.__dict__) for rec in caplog.records)
    assert "model failed on request" in logged  # the failure was logged, without the text
    assert CANARY not in logged
    time.sleep(0.1)
    assert CANARY not in log_path.read_text()


# ---------------------------------------------------------------- held runner: load paths


@pytest.fixture
def held() -> Iterator[tuple[threading.Event, FaultyRunner]]:
    hold = threading.Event()
    runner = FaultyRunner(FakeRunner(), hold=hold)
    yield hold, runner
    hold.set()


def _engine(runner: FaultyRunner, **admission: Any) -> Engine:
    batching = BatchingConfig(strategy="fifo", max_batch=1, max_wait_ms=0)
    return Engine(runner, batching, AdmissionConfig(**admission))


def _stats(url: str) -> dict[str, Any]:
    return httpx.get(f"{url}/stats", timeout=5).json()  # type: ignore[no-any-return]


def _until(cond: Any, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


async def test_full_queue_is_429_with_retry_after_and_the_limit(
    held: tuple[threading.Event, FaultyRunner],
) -> None:
    """With the runner busy and the queue at its bound, a new call gets 429 `queue_full`."""
    hold, runner = held
    with live_server(_engine(runner, max_queue_total=2)) as url:
        async with httpx.AsyncClient(base_url=url, timeout=20) as c:
            first = []
            for i in range(4):  # one at a time: running, prefetched, then two queued
                first.append(asyncio.create_task(c.post("/v1/embeddings", json={"input": f"w{i}"})))
                await asyncio.to_thread(_until, lambda n=i + 1: _stats(url)["unanswered"] == n)
            assert sum(_stats(url)["queue_depths"]) == 2
            r = await c.post("/v1/embeddings", json={"input": "one more"})
            assert r.status_code == 429 and r.headers["retry-after"] == "1"
            assert r.json()["error"]["code"] == "queue_full"
            assert "max_queue_total=2" in r.json()["error"]["message"]
            hold.set()
            assert [x.status_code for x in await asyncio.gather(*first)] == [200] * 4


async def test_timeout_header_gives_504_before_running(
    held: tuple[threading.Event, FaultyRunner],
) -> None:
    """A call whose X-Request-Timeout passes while it waits is answered 504 and never runs."""
    hold, runner = held
    with live_server(_engine(runner)) as url:
        async with httpx.AsyncClient(base_url=url, timeout=20) as c:
            busy = asyncio.create_task(c.post("/v1/embeddings", json={"input": "a"}))
            await asyncio.to_thread(_until, lambda: _stats(url)["unanswered"] == 1)
            r = await c.post(
                "/v1/embeddings",
                json={"input": "b c d e"},
                headers={"x-request-timeout": "0.05"},
            )
            assert r.status_code == 504 and r.json()["error"]["code"] == "deadline_exceeded"
            hold.set()
            assert (await busy).status_code == 200
    assert [b.lengths for b in runner.inner.batches] == [(3,)]  # type: ignore[attr-defined]


def test_client_disconnect_removes_its_request_from_the_queue(
    held: tuple[threading.Event, FaultyRunner],
) -> None:
    """Closing the connection of a queued request takes it out of the queue (uvicorn's
    disconnect reaches the handler); the model never sees it."""
    hold, runner = held
    with live_server(_engine(runner)) as url:
        port = int(url.rsplit(":", 1)[1])
        socks = []
        for words in ("a", "a b", "a b c"):  # running, prefetched, queued: lengths 3, 4, 5
            body = json.dumps({"input": words}).encode()
            s = socket.create_connection(("127.0.0.1", port))
            s.sendall(
                b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
            )
            socks.append(s)
            sent = len(socks)
            _until(lambda n=sent: _stats(url)["unanswered"] == n)
        assert sum(_stats(url)["queue_depths"]) == 1
        socks[2].close()
        _until(lambda: _stats(url)["requests"].get("cancelled") == 1)
        stats = _stats(url)
        assert sum(stats["queue_depths"]) == 0 and stats["unanswered"] == 2
        hold.set()
        for s in socks[:2]:
            assert s.recv(100).startswith(b"HTTP/1.1 200")
            s.close()
    assert sorted(b.lengths for b in runner.inner.batches) == [(3,), (4,)]  # type: ignore[attr-defined]


def test_runner_crash_is_reported_on_health() -> None:
    """A crashed runner: the call gets 503 with the reason, /health turns 503 with it."""
    runner = FaultyRunner(FakeRunner(), crash_after=0)
    with live_server(_engine(runner)) as url:
        assert httpx.get(f"{url}/health").status_code == 200
        r = httpx.post(f"{url}/v1/embeddings", json={"input": "x"}, timeout=10)
        assert r.status_code == 503 and r.json()["error"]["code"] == "runner_failed"
        assert "retry-after" in r.headers
        health = httpx.get(f"{url}/health")
        assert health.status_code == 503
        assert health.json()["status"] == "failed" and "RunnerCrashed" in health.json()["reason"]
        assert "lenbatch_ready 0.0" in httpx.get(f"{url}/metrics").text


# ---------------------------------------------------------------- security


PROTECTED = ["/v1/models", "/metrics", "/stats", "/docs", "/openapi.json", "/redoc"]


def test_api_key_guards_every_endpoint_but_health() -> None:
    """With an API key, every path but /health needs `Authorization: Bearer <key>`."""
    engine = Engine(FakeRunner(), BatchingConfig(max_wait_ms=0))
    with live_server(engine, _settings(api_key="s3cret")) as url, httpx.Client(base_url=url) as c:
        assert c.get("/health").status_code == 200
        for path in PROTECTED:
            for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "s3cret"}):
                r = c.get(path, headers=headers)
                assert r.status_code == 401, (path, headers)
                assert r.headers["www-authenticate"] == "Bearer"
                assert "s3cret" not in r.text
            assert c.get(path, headers={"authorization": "Bearer s3cret"}).status_code == 200
        assert c.post("/v1/embeddings", json={"input": "x"}).status_code == 401
        ok = c.post(
            "/v1/embeddings", json={"input": "x"}, headers={"authorization": "Bearer s3cret"}
        )
        assert ok.status_code == 200


async def test_cors_is_off_by_default_and_on_when_configured() -> None:
    """No CORS headers unless origins are configured."""
    preflight = {"origin": "http://a.example", "access-control-request-method": "POST"}
    for origins, allowed in (((), False), (("http://a.example",), True)):
        app = create_app(Engine(FakeRunner()), _settings(cors_origins=origins))
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            r = await c.options("/v1/embeddings", headers=preflight)
        assert ("access-control-allow-origin" in r.headers) is allowed


def test_default_bind_is_loopback() -> None:
    """The server binds 127.0.0.1 unless told otherwise, in settings and in `serve --help`."""
    from lenbatch.cli import build_parser

    assert Settings().server.host == "127.0.0.1"
    assert Settings().server.api_key is None and Settings().server.cors_origins == ()
    args = build_parser().parse_args(["serve"])
    assert args.host is None  # not set on the command line: the setting's default applies
