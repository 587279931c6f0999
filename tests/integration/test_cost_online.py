"""`--cost http://HOST:PORT`: the online cost model of a live adaptive server, read over HTTP
from a real engine app on loopback (fake runner, no model)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from lenbatch.cli.common import load_cost_model
from lenbatch.config import AdaptiveConfig, BatchingConfig
from lenbatch.embed.engine import Engine
from lenbatch.runners.fake import FakeRunner

ADAPTIVE = BatchingConfig(strategy="adaptive", boundaries=(16, 64), max_wait_ms=0)


def test_the_online_fit_of_a_live_server_becomes_the_cost_model(
    live_server: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """After traffic, the CostModel read from /stats predicts what the engine's own online
    model predicts at every shape, and says where it came from."""
    engine = Engine(FakeRunner(max_length=128), ADAPTIVE, adaptive=AdaptiveConfig(slo_ms=5000))
    with live_server(engine) as srv:
        for n in (2, 10, 30, 60, 100, 5, 50):
            r = httpx.post(f"{srv.url}/v1/embeddings", json={"input": " ".join(["w"] * n)})
            assert r.status_code == 200
        cost = load_cost_model(srv.url)
        assert engine.adaptive is not None
        online = engine.adaptive.cost
        observed = online.observed
    assert observed > 0
    for batch, length in ((1, 16), (4, 64), (8, 128)):
        assert cost.latency(batch, length) == pytest.approx(online.seconds(batch, length))
    assert srv.url in cost.calibration and f"{observed} batches" in cost.calibration
    assert srv.url in capsys.readouterr().err


def test_a_bucketed_server_has_no_online_model(live_server: Any) -> None:
    """A server without strategy adaptive is a clear error naming the fix."""
    engine = Engine(FakeRunner(max_length=128), BatchingConfig(max_wait_ms=0))
    with live_server(engine) as srv, pytest.raises(ValueError, match="strategy adaptive"):
        load_cost_model(srv.url)


def test_an_unreachable_server_is_a_clear_error() -> None:
    """Nothing listening: the error names the URL instead of a traceback."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ValueError, match=f"127.0.0.1:{port}/stats"):
        load_cost_model(f"http://127.0.0.1:{port}")
