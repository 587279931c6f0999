"""The LLM server through real HTTP on loopback: the `openai` client's completions, chat and
streaming; usage counts; stop strings; the TTFT breakdown; errors; client disconnects."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import openai
import pytest
import torch
import uvicorn

from lenbatch.config import BatchingConfig, GenerationConfig, Settings
from lenbatch.generate import STAGES, GenerationEngine
from lenbatch.generate.api import create_llm_app
from tests.llm_reference import PROMPTS, reference_greedy

pytestmark = pytest.mark.slow


class _Served:
    def __init__(self, engine: GenerationEngine, url: str) -> None:
        self.engine = engine
        self.url = url
        self.runner: Any = engine.runner


def _engine(runner: Any) -> GenerationEngine:
    return GenerationEngine(
        runner,
        BatchingConfig(boundaries=(8, 16, 32), max_batch=4, max_wait_ms=2),
        generation=GenerationConfig(default_max_tokens=16),
    )


@pytest.fixture(scope="module")
def served(llama_runner: Any) -> Iterator[_Served]:
    """The tiny Llama behind a real uvicorn server on 127.0.0.1 (continuous batching)."""
    with _serve(_engine(llama_runner)) as s:
        yield s


@contextmanager
def _serve(engine: GenerationEngine) -> Iterator[_Served]:
    """`engine`'s app behind a real uvicorn server on 127.0.0.1, stopped on exit."""
    settings = Settings.model_validate({"model": {"name": "tiny-llama"}})
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


def _client(s: _Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _expected(s: _Served, prompt: str, n: int) -> tuple[list[int], list[int], str]:
    ids = s.runner.tokenize([prompt])[0]
    tokens = reference_greedy(s.runner, ids, n)
    return ids, tokens, s.runner.decode(tokens)


def test_openai_completion_matches_generate_and_counts_usage(served: _Served) -> None:
    """A greedy completion's text and usage match generate() on the same prompt."""
    ids, tokens, text = _expected(served, PROMPTS[0], 12)
    out = _client(served).completions.create(
        model="tiny-llama", prompt=PROMPTS[0], max_tokens=12, temperature=0
    )
    assert out.choices[0].text == text
    assert out.choices[0].finish_reason == ("length" if len(tokens) == 12 else "stop")
    assert out.usage is not None
    assert out.usage.prompt_tokens == len(ids)
    assert out.usage.completion_tokens == len(tokens)
    assert out.usage.total_tokens == len(ids) + len(tokens)


def test_a_stream_that_ends_before_its_first_token_gets_its_own_status(
    llama_runner: Any,
) -> None:
    """A streamed request that ends before its first token (here: its prompt runs out of
    memory even alone) gets the error's status line and body, 503 `out_of_memory`, as the
    same request unstreamed does: never a 200 followed by an error event. The `openai`
    client raises it. A short prompt beside it still streams to the end."""
    from lenbatch.generate.failures import MIN_OOM_CHUNK
    from lenbatch.runners.faulty import FaultyCausalRunner

    faulty = FaultyCausalRunner(llama_runner, oom_prefill_tokens=MIN_OOM_CHUNK - 1)
    assert len(llama_runner.tokenize([PROMPTS[2]])[0]) >= MIN_OOM_CHUNK
    with _serve(_engine(faulty)) as s:
        body = {"prompt": PROMPTS[2], "max_tokens": 3, "stream": True}
        with (
            httpx.Client(base_url=s.url, timeout=60) as http,
            http.stream("POST", "/v1/completions", json=body) as resp,
        ):
            assert resp.status_code == 503
            streamed = json.loads(resp.read())["error"]
        plain = httpx.post(s.url + "/v1/completions", json=dict(body, stream=False), timeout=60)
        assert plain.status_code == 503
        assert streamed["code"] == plain.json()["error"]["code"] == "out_of_memory"
        client = _client(s)
        with pytest.raises(openai.InternalServerError) as err:
            for _ in client.completions.create(
                model="tiny-llama", prompt=PROMPTS[2], max_tokens=3, stream=True
            ):
                pass
        assert err.value.status_code == 503
        short = client.completions.create(
            model="tiny-llama", prompt="Hi", max_tokens=3, stream=True, temperature=0
        )
        assert [c.choices[0].finish_reason for c in short][-1] == "length"
        assert not s.engine.unanswered


def test_openai_streaming_yields_the_same_text(served: _Served) -> None:
    """`stream=True` delivers, chunk by chunk, exactly the non-streaming text and usage."""
    client = _client(served)
    kwargs: dict[str, Any] = {"prompt": PROMPTS[4], "max_tokens": 14, "temperature": 0}
    whole = client.completions.create(model="tiny-llama", **kwargs)
    chunks = list(
        client.completions.create(
            model="tiny-llama", stream=True, stream_options={"include_usage": True}, **kwargs
        )
    )
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert len(texts) > 2, "the stream should arrive in several chunks"
    assert "".join(texts) == whole.choices[0].text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finals[-1] == whole.choices[0].finish_reason
    assert all(f is None for f in finals[:-1])
    assert chunks[-1].usage is not None and whole.usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_openai_chat_uses_the_chat_template(served: _Served) -> None:
    """Chat completions render messages with the tokenizer's template, then generate."""
    messages = [{"role": "user", "content": "How many bolts in total?"}]
    prompt = served.runner.chat_prompt(messages)
    tokens = reference_greedy(served.runner, prompt, 10)
    client = _client(served)
    out = client.chat.completions.create(
        model="tiny-llama",
        messages=messages,  # type: ignore[arg-type]
        max_tokens=10,
        temperature=0,
    )
    assert out.choices[0].message.content == served.runner.decode(tokens)
    assert out.usage is not None and out.usage.prompt_tokens == len(prompt)
    stream = client.chat.completions.create(
        model="tiny-llama",
        messages=messages,  # type: ignore[arg-type]
        max_tokens=10,
        temperature=0,
        stream=True,
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == out.choices[0].message.content


def test_stop_string_ends_the_text_before_it(served: _Served) -> None:
    """A stop string cuts the text where it first appears, finish_reason `stop`, also when
    streaming (text that might start the stop string is held back)."""
    client = _client(served)
    full = client.completions.create(
        model="tiny-llama", prompt=PROMPTS[1], max_tokens=20, temperature=0, extra_body={}
    )
    text = full.choices[0].text
    assert len(text) > 6, "need a longer greedy text to pick a stop string from"
    stop = text[4:7]
    cut = text[: text.index(stop)]
    out = client.completions.create(
        model="tiny-llama", prompt=PROMPTS[1], max_tokens=20, temperature=0, stop=[stop]
    )
    assert out.choices[0].text == cut
    assert out.choices[0].finish_reason == "stop"
    streamed = client.completions.create(
        model="tiny-llama", prompt=PROMPTS[1], max_tokens=20, temperature=0, stop=stop, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == cut


def test_include_stop_str_in_output_keeps_the_stop_string(served: _Served) -> None:
    """vLLM's `include_stop_str_in_output`: the text ends with the stop string that ended it,
    whole or streamed."""
    client = _client(served)
    kw: dict[str, Any] = {"model": "tiny-llama", "prompt": PROMPTS[1], "max_tokens": 20}
    kw["temperature"] = 0
    text = client.completions.create(**kw).choices[0].text
    stop = text[4:7]
    want = text[: text.index(stop) + len(stop)]
    extra = {"include_stop_str_in_output": True}
    out = client.completions.create(stop=[stop], extra_body=extra, **kw).choices[0]
    assert (out.text, out.finish_reason) == (want, "stop")
    streamed = client.completions.create(stop=stop, stream=True, extra_body=extra, **kw)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == want


def test_stop_token_ids_end_the_text_as_generate_eos_does(served: _Served) -> None:
    """vLLM's `stop_token_ids`: the text ends before the first of them, as
    `generate(eos_token_id=...)` stops at it; `min_tokens` holds it back, even with
    `ignore_eos`; an id outside the vocabulary is a 400."""
    runner = served.runner
    ids = runner.tokenize([PROMPTS[2]])[0]
    greedy = reference_greedy(runner, ids, 12)
    stop = greedy[3]
    ref = torch.tensor([ids])
    with torch.no_grad():
        out = runner.model.generate(
            ref, attention_mask=torch.ones_like(ref), max_new_tokens=12, do_sample=False,
            eos_token_id=[stop], pad_token_id=runner.info.pad_token_id,
        )  # fmt: skip
    want = [int(x) for x in out[0, len(ids) :]]
    assert want[-1] == stop and len(want) <= 4
    client = _client(served)
    kw: dict[str, Any] = {"model": "tiny-llama", "prompt": PROMPTS[2], "max_tokens": 12}
    kw["temperature"] = 0
    got = client.completions.create(extra_body={"stop_token_ids": [stop]}, **kw)
    assert got.choices[0].text == runner.decode(want[:-1])
    assert got.choices[0].finish_reason == "stop"
    assert got.usage is not None and got.usage.completion_tokens == len(want)
    held = client.completions.create(
        extra_body={"stop_token_ids": [stop], "min_tokens": 12, "ignore_eos": True}, **kw
    )
    assert held.usage is not None and held.usage.completion_tokens == 12
    resp = httpx.post(
        served.url + "/v1/completions",
        json={"prompt": "hi", "max_tokens": 2, "stop_token_ids": [10**6]},
        timeout=30,
    )
    assert resp.status_code == 400 and "stop_token_ids names token" in resp.text


def test_ignore_eos_generates_exactly_max_tokens(served: _Served) -> None:
    """`ignore_eos` (as in vLLM) keeps going past end-of-sequence to max_tokens."""
    out = _client(served).completions.create(
        model="tiny-llama",
        prompt=PROMPTS[3],
        max_tokens=30,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert out.usage is not None and out.usage.completion_tokens == 30
    assert out.choices[0].finish_reason == "length"


def test_ttft_stages_sum_to_ttft(served: _Served) -> None:
    """Per request and in /metrics, the TTFT stages add up to the TTFT, which is within the
    time the client waited for its first streamed token."""
    body = {"prompt": PROMPTS[2], "max_tokens": 8, "temperature": 0, "stream": True}
    with httpx.Client(base_url=served.url, timeout=60) as http:
        sent = time.monotonic()
        first_at = None
        final = None
        with http.stream("POST", "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                if first_at is None:
                    first_at = time.monotonic()
                obj = json.loads(line[6:])
                if "lenbatch" in obj:
                    final = obj["lenbatch"]["timings"]
        assert first_at is not None and final is not None
        client_ttft_ms = (first_at - sent) * 1000
        stages = final["stages_ms"]
        assert set(stages) == set(STAGES)
        assert all(v >= 0 for v in stages.values())
        assert sum(stages.values()) == pytest.approx(final["ttft_ms"], abs=0.01)
        assert 0 < final["ttft_ms"] <= client_ttft_ms
        assert stages["prefill"] > 0
        metrics = http.get("/metrics").text
    sums = _prom_sums(metrics)
    stage_total = sum(sums[f'lenbatch_llm_ttft_stage_seconds_sum{{stage="{s}"}}'] for s in STAGES)
    assert stage_total == pytest.approx(sums["lenbatch_llm_ttft_seconds_sum"], rel=1e-9)
    assert sums["lenbatch_llm_ttft_seconds_count"] >= 1
    assert (
        "lenbatch_llm_kv_cache_peak_bytes" in sums and sums["lenbatch_llm_kv_cache_peak_bytes"] > 0
    )


def _prom_sums(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def test_kv_cache_accounted_apart_from_weights(served: _Served) -> None:
    """/stats reports KV-cache bytes (exact tensor sizes) apart from weight bytes."""
    _client(served).completions.create(model="tiny-llama", prompt=PROMPTS[5], max_tokens=8)
    stats = httpx.get(served.url + "/stats", timeout=30).json()
    runner = served.runner
    cfg = runner.model.config
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4
    assert stats["kv_cache"]["peak_bytes"] >= per_token * 8
    assert stats["kv_cache"]["peak_bytes"] % per_token == 0
    weights = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    assert stats["memory"]["weights_mb"] == pytest.approx(weights / 2**20)
    # what the model computes in, quantization as resolved at load
    assert stats["precision"] == {"dtype": "float32", "quantization": runner.quantization}
    assert runner.quantization == "none"


_SEED_RANGE = "seed: must be an integer in [-9223372036854775808, 9223372036854775807]"
_BAD_BODIES: list[tuple[dict[str, Any], int, str]] = [
    ({"prompt": "hi", "max_tokens": 100_000}, 413, "context of 512 tokens"),
    ({"prompt": "hi", "n": 17}, 400, "less than or equal to 16"),
    ({"prompt": "hi", "n": 0}, 400, "greater than or equal to 1"),
    ({"prompt": "hi", "model": "gpt-4"}, 404, "not served here"),
    ({"prompt": [], "max_tokens": 3}, 400, "prompt"),
    ({"prompt": [999_999], "max_tokens": 3}, 400, "token ids outside"),
    ({"prompt": "hi", "temperature": 5}, 400, "temperature"),
    ({"prompt": "hi", "temperature": 0.7, "seed": 2**80}, 400, _SEED_RANGE),
    ({"prompt": "hi", "temperature": 0.7, "seed": -(2**64)}, 400, _SEED_RANGE),
    ({"prompt": "hi", "min_tokens": 2**80}, 400, "min_tokens must be between 0"),
    ({"prompt": "hi", "max_tokens": 2**80}, 413, "context of 512 tokens"),
]


def _as_chat(body: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in body.items() if k != "prompt"}
    out["messages"] = [{"role": "user", "content": body["prompt"]}]
    return out


@pytest.mark.parametrize(
    ("route", "body", "status", "needle"),
    [("/v1/completions", *case) for case in _BAD_BODIES]
    + [
        ("/v1/chat/completions", _as_chat(b), status, needle)
        for b, status, needle in _BAD_BODIES
        if isinstance(b["prompt"], str)  # token-id prompts exist only on /v1/completions
    ],
)
def test_bad_requests_get_clear_errors(
    served: _Served, body: dict[str, Any], status: int, needle: str, route: str
) -> None:
    """Invalid requests are refused with OpenAI-shaped errors that say what is wrong (both
    routes: a chat body carries the same options with messages instead of a prompt)."""
    resp = httpx.post(served.url + route, json=body, timeout=30)
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert needle in err["message"]
    assert err["type"] == "invalid_request_error"


def test_client_disconnect_frees_the_sequence(served: _Served) -> None:
    """A client that leaves mid-stream stops costing compute: its sequence leaves the batch."""
    engine = served.engine
    body = {"prompt": PROMPTS[0], "max_tokens": 400, "ignore_eos": True, "stream": True}
    with (
        httpx.Client(base_url=served.url, timeout=60) as http,
        http.stream("POST", "/v1/completions", json=body) as resp,
    ):
        for line in resp.iter_lines():
            if line.startswith("data: "):
                break
    deadline = time.monotonic() + 30
    while (engine.decoder.running_rows or engine.unanswered) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert engine.decoder.running_rows == 0
    assert not engine.unanswered
    assert httpx.get(served.url + "/health", timeout=10).status_code == 200
