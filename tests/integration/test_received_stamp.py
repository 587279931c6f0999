"""A call's age counts from when the server read its first bytes, not from when its route ran.

Real uvicorn on loopback, real MiniLM. A call whose body arrives 0.4 s after its headers (the
shape of a busy event loop: bytes read, the route not yet run) shows that wait in the engine's
intake time with the protocol `serve` runs; with uvicorn's own protocol the wait is invisible.
"""

from __future__ import annotations

import json
import socket
import time
from typing import Any

import httpx
import pytest

from lenbatch.config import BatchingConfig
from lenbatch.core.clock import FakeClock, MonotonicClock
from lenbatch.embed.engine import Engine
from lenbatch.runners import EmbeddingRunner
from lenbatch.serving.server import RECEIVED, received_at

_GAP_S = 0.4


def _send_in_two_parts(port: int, gap_s: float) -> int:
    """POST one embeddings call: headers and half the body, then the rest `gap_s` later."""
    body = json.dumps({"input": "How many apples are left?", "model": "minilm"}).encode()
    head = (
        f"POST /v1/embeddings HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(head + body[:10])
        time.sleep(gap_s)
        s.sendall(body[10:])
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    return int(answer.split(b" ", 2)[1])


def _intake_p95_ms(url: str) -> float:
    stats = httpx.get(url + "/stats", timeout=30).json()
    return float(stats["intake_p95_ms"])


@pytest.mark.parametrize("protocol", ["serve's", "uvicorn's"])
def test_intake_counts_from_the_first_bytes(
    minilm: EmbeddingRunner, live_server: Any, protocol: str
) -> None:
    """With serve's protocol the call's intake is the 0.4 s its body took; with uvicorn's own
    (the route's clock) it is near zero."""
    engine = Engine(minilm, BatchingConfig(max_wait_ms=2))
    http = None if protocol == "serve's" else "httptools"
    with live_server(engine, http=http) as srv:
        assert _send_in_two_parts(srv.port, _GAP_S) == 200
        intake = _intake_p95_ms(srv.url)
    if protocol == "serve's":
        assert _GAP_S * 1000 * 0.9 <= intake < _GAP_S * 1000 + 300
    else:
        assert intake < 100


def test_received_at_takes_the_stamp_only_on_the_real_clock() -> None:
    """The stamp counts on the monotonic clock (capped at now); a test's fake clock, or a scope
    without a stamp, gives now."""
    real = MonotonicClock()
    now = real.now()
    assert received_at({RECEIVED: now - 0.25}, real) == pytest.approx(now - 0.25)
    assert received_at({RECEIVED: now + 5.0}, real) <= real.now()
    assert received_at({}, real) >= now
    fake = FakeClock(100.0)
    assert received_at({RECEIVED: now - 0.25}, fake) == 100.0
