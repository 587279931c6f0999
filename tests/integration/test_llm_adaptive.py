"""Strategy adaptive serving a tiny random Llama on loopback: it serves and streams, sheds an
overload burst with 429 + Retry-After, frees the row of a client that leaves mid-stream, and
ends every admitted request exactly once."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
import uvicorn

from lenbatch.config import AdaptiveConfig, BatchingConfig, GenerationConfig, Settings
from lenbatch.generate import GenerationEngine
from lenbatch.generate.api import create_llm_app
from tests.llm_reference import PROMPTS

pytestmark = pytest.mark.slow


class _Served:
    def __init__(self, engine: GenerationEngine, url: str) -> None:
        self.engine = engine
        self.url = url


@pytest.fixture(scope="module")
def served(llama_runner: Any) -> Iterator[_Served]:
    """The tiny Llama behind uvicorn with strategy adaptive: TTFT 150 ms, inter-token 40 ms
    (tight, so that a burst of a few dozen streams overloads it)."""
    settings = Settings.model_validate({"model": {"name": "tiny-llama"}})
    engine = GenerationEngine(
        llama_runner,
        BatchingConfig(strategy="adaptive", boundaries=(8, 16, 32), max_batch=4, max_wait_ms=2),
        generation=GenerationConfig(default_max_tokens=16, max_running=16),
        adaptive=AdaptiveConfig(slo_ms=150, itl_slo_ms=40),
    )
    app = create_llm_app(engine, settings)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield _Served(engine, f"http://127.0.0.1:{port}")
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def _stream(url: str, prompt: str, max_tokens: int) -> tuple[int, str | None, int, bool]:
    """One streamed completion: status, Retry-After, content chunks, whether [DONE] came.
    A stream's status line waits for its first token, so one shed from the queue is a 429 like
    one refused at the door: an error event after a 200 fails the test."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    chunks, done = 0, False
    with (
        httpx.Client(base_url=url, timeout=120) as http,
        http.stream("POST", "/v1/completions", json=body) as resp,
    ):
        if resp.status_code != 200:
            resp.read()
            return resp.status_code, resp.headers.get("retry-after"), 0, False
        for line in resp.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                done = True
                break
            event = json.loads(data)
            assert "error" not in event, event
            if event["choices"] and event["choices"][0].get("text"):
                chunks += 1
    return 200, None, chunks, done


def _settle(engine: GenerationEngine) -> None:
    deadline = time.monotonic() + 60
    while (engine.unanswered or engine.decoder.running_rows) and time.monotonic() < deadline:
        time.sleep(0.02)


def test_adaptive_serves_and_streams(served: _Served) -> None:
    """At a light load every request is served, streamed to its last token."""
    for prompt in PROMPTS[:4]:
        status, _, chunks, done = _stream(served.url, prompt, 12)
        assert status == 200 and done
        assert chunks >= 1
    stats = httpx.get(served.url + "/stats", timeout=10).json()
    assert stats["adaptive"]["costs"]["decode_step"]["observed_batches"] > 0
    assert stats["adaptive"]["refused"] == 0


def test_the_engine_tells_the_policy_each_running_rows_progress(
    served: _Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before each unit the engine gives adaptive every running row's tokens delivered and
    first-token time (`observe_rows`, which sizes the next prefill chunk): a stream of 12
    tokens is seen from 1 to at least 10 tokens delivered, its first token never after the
    call, and the slack it earns decoding faster than the 40 ms objective becomes the unit
    allowance that `/stats` shows."""
    engine = served.engine
    _settle(engine)
    policy = engine.adaptive
    assert policy is not None
    seen: list[tuple[float, list[tuple[int, float]], float]] = []
    real = policy.observe_rows

    def spy(now: float, rows: Any) -> None:
        rows = list(rows)
        real(now, rows)
        seen.append((now, rows, policy.unit_allowance))

    monkeypatch.setattr(policy, "observe_rows", spy)
    status, _, _, done = _stream(served.url, PROMPTS[0], 12)
    assert status == 200 and done
    delivered = [n for _, rows, _ in seen for n, _ in rows]
    assert 1 in delivered and max(delivered) >= 10
    assert all(first <= now for now, rows, _ in seen for n, first in rows if n > 0)
    assert max(allowance for _, _, allowance in seen) > 0
    assert "unit_allowance_ms" in httpx.get(served.url + "/stats", timeout=10).json()["adaptive"]


def test_overload_burst_is_shed_with_retry_after_and_nothing_is_lost(served: _Served) -> None:
    """A burst of 64 streams at once, far past what the objectives allow: some are refused
    429 with Retry-After (at the door, or shed from the queue before their first token), the
    rest stream to [DONE]; every admitted request ends once."""
    engine = served.engine
    _settle(engine)
    before = dict(engine.stats()["requests"])
    n, max_tokens = 64, 48
    prompts = [PROMPTS[i % len(PROMPTS)] * 3 for i in range(n)]
    with ThreadPoolExecutor(max_workers=n) as pool:
        results = list(pool.map(lambda p: _stream(served.url, p, max_tokens), prompts))
    refused = [r for r in results if r[0] == 429]
    ok = [r for r in results if r[0] == 200]
    assert refused, "no request was refused under a 64-stream burst"
    assert all(r[1] is not None and float(r[1]) >= 1 for r in refused)
    assert ok, "adaptive served nothing of the burst"
    assert all(r[3] for r in ok)  # every admitted stream reached [DONE]
    assert len(ok) + len(refused) == n
    _settle(engine)
    assert engine.unanswered == 0
    after = engine.stats()["requests"]
    ended = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    # every admitted request ended once: ok, or shed from the queue (a 429 too)
    assert ended.get("ok", 0) == len(ok)
    shed_in_queue = ended.get("shed", 0)
    at_door = len(refused) - shed_in_queue
    # the door prices what it admits: most refusals come from it, not from the queue
    assert shed_in_queue <= at_door
    assert ended.get("error", 0) == 0 and ended.get("expired", 0) == 0
    decisions = httpx.get(served.url + "/stats", timeout=10).json()["adaptive"]["decisions"]
    assert decisions["totals"]["admission"] >= at_door


def test_client_that_leaves_mid_stream_frees_its_row(served: _Served) -> None:
    """A stream closed after its first event leaves the running batch; nothing stays open."""
    engine = served.engine
    _settle(engine)
    body = {"prompt": PROMPTS[0], "max_tokens": 400, "ignore_eos": True, "stream": True}
    with (
        httpx.Client(base_url=served.url, timeout=60) as http,
        http.stream("POST", "/v1/completions", json=body) as resp,
    ):
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: "):
                break
    _settle(engine)
    assert engine.decoder.running_rows == 0
    assert engine.unanswered == 0


def test_a_priority_out_of_range_is_a_400_naming_the_range(served: _Served) -> None:
    """X-Priority beyond the server's levels is refused with 400 `invalid_priority`."""
    body = {"prompt": PROMPTS[0], "max_tokens": 2}
    resp = httpx.post(
        served.url + "/v1/completions", json=body, headers={"X-Priority": "3"}, timeout=30
    )
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["code"] == "invalid_priority" and "one priority level" in err["message"]
    ok = httpx.post(
        served.url + "/v1/completions", json=body, headers={"X-Priority": "0"}, timeout=30
    )
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("value", ["abc", "-1", "1e3", "99999999999999999999999"])
def test_a_malformed_priority_is_a_4xx(served: _Served, value: str) -> None:
    """Whatever the X-Priority header holds, the answer is a 4xx, never a 5xx."""
    body = {"prompt": PROMPTS[0], "max_tokens": 2}
    resp = httpx.post(
        served.url + "/v1/completions", json=body, headers={"X-Priority": value}, timeout=30
    )
    assert 400 <= resp.status_code < 500, resp.text


def test_start_up_line_names_adaptive_and_its_objectives(served: _Served) -> None:
    """The start-up log says strategy adaptive with its TTFT and inter-token objectives."""
    line = served.engine.describe()
    assert "strategy adaptive" in line and "TTFT 150 ms, inter-token 40 ms" in line
