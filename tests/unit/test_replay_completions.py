"""`--endpoint completions`: streamed OpenAI completions against a fake SSE server."""

from __future__ import annotations

import json

import numpy as np
import pytest

from lenbatch.plan.summary import OUTCOME_ERROR, OUTCOME_OK
from lenbatch.replay.driver import ReplayPlan, replay, summarize_replay
from lenbatch.replay.endpoints import CompletionsEndpoint
from tests.unit.replay_fakes import FakeServer, serving


def _plan(bodies: list[bytes], times: list[float]) -> ReplayPlan:
    return ReplayPlan(
        scheduled=np.asarray(times, dtype=np.float64),
        lengths=np.full(len(bodies), 7, dtype=np.int64),
        bodies=bodies,
        output_lengths=np.full(len(bodies), 5, dtype=np.int64),
    )


def _body(ep: CompletionsEndpoint, out: int, **extra: object) -> bytes:
    data = json.loads(ep.body("a prompt", out))
    data.update(extra)
    return json.dumps(data).encode()


def test_body_is_a_streaming_completion_request() -> None:
    """The body asks for a stream, the trace's output length (as `ignore_eos` and as
    `min_tokens`, for servers without `ignore_eos`) and usage in the stream."""
    body = json.loads(CompletionsEndpoint("tiny").body("hello there", 12))
    assert body == {
        "prompt": "hello there",
        "max_tokens": 12,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0.0,
        "ignore_eos": True,
        "min_tokens": 12,
        "model": "tiny",
    }
    free = json.loads(CompletionsEndpoint(ignore_eos=False).body("hi", 5))
    assert "ignore_eos" not in free and "min_tokens" not in free


async def test_ttft_gaps_and_output_tokens_are_measured() -> None:
    """First token after the server's known delay; one gap per later chunk; usage tokens."""
    ep = CompletionsEndpoint()
    bodies = [_body(ep, 5, ttft=0.3, gap=0.05), _body(ep, 3, ttft=0.1, gap=0.1)]
    with serving(FakeServer()) as url:
        res = await replay(url, _plan(bodies, [0.0, 0.0]), ep, progress=False)
    assert res.outcomes.tolist() == [OUTCOME_OK, OUTCOME_OK]
    assert res.output_tokens.tolist() == [5, 3]
    ttft = res.first_token - res.sent
    assert ttft[0] >= 0.3 and ttft[0] < 0.6
    assert ttft[1] >= 0.1 and ttft[1] < 0.4
    assert len(res.token_gaps) == (5 - 1) + (3 - 1)
    assert np.all(res.token_gaps > 0.03)
    assert np.all(res.done - res.sent >= ttft)
    s = summarize_replay(res)
    assert s["output_tokens"] == 8
    assert s["output_tokens_per_s"] == pytest.approx(8 / s["duration_s"])
    assert s["ttft_p50_ms"] == pytest.approx(1000 * ttft.min())
    assert s["itl_p50_ms"] == pytest.approx(
        1000 * np.percentile(res.token_gaps, 50, method="inverted_cdf")
    )


async def test_chunks_are_counted_without_usage() -> None:
    """Without a usage chunk, each text chunk counts as one output token."""
    ep = CompletionsEndpoint()
    body = _body(ep, 4, ttft=0.0, gap=0.0, stream_options={})
    with serving(FakeServer()) as url:
        res = await replay(url, _plan([body], [0.0]), ep, progress=False)
    assert res.output_tokens.tolist() == [4]


async def test_http_errors_in_completions_are_recorded() -> None:
    """A refused completion is an error with the server's message, not a token stream."""
    ep = CompletionsEndpoint()
    bodies = [_body(ep, 4, status=400), _body(ep, 2, ttft=0.0, gap=0.0)]
    with serving(FakeServer()) as url:
        res = await replay(url, _plan(bodies, [0.0, 0.0]), ep, progress=False)
    assert res.outcomes.tolist() == [OUTCOME_ERROR, OUTCOME_OK]
    assert res.errors[0] == "HTTP 400: fake error 400"
    assert np.isnan(res.first_token[0])


async def test_llm_goodput_counts_fast_first_token_and_fast_tokens_only() -> None:
    """`llm_goodput` counts answers with TTFT <= 1 s and mean inter-token <= 150 ms: a stream
    with 50 ms gaps counts, one with 200 ms gaps does not."""
    ep = CompletionsEndpoint()
    bodies = [_body(ep, 4, ttft=0.1, gap=0.05), _body(ep, 4, ttft=0.1, gap=0.2)]
    with serving(FakeServer()) as url:
        res = await replay(url, _plan(bodies, [0.0, 0.0]), ep, progress=False)
    s = summarize_replay(res)
    assert s["llm_goodput"]["good"] == 1
    assert s["llm_goodput"]["per_s"] == pytest.approx(1 / s["duration_s"])
