"""Log-probabilities of generated tokens (`logprobs` on completions, `logprobs` and
`top_logprobs` on chat), through real HTTP on loopback with the `openai` client.

The reference is transformers' own forward pass of the tiny Llama: for every generated token,
the log-softmax of the model's logits at that position, given the prompt and the tokens
before it (teacher-forced, one sequence alone). The server reports the model's raw
distribution, before temperature or top_p act (as vLLM does by default), so a sampled
request's log-probabilities follow the same reference.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest
import torch

from tests.llm_reference import PROMPTS, reference_tokens

pytestmark = pytest.mark.slow

TOP = 3


@pytest.fixture(scope="module")
def served(llama_runner: Any, tiny_llm_url: str) -> tuple[Any, str]:
    """The tiny Llama's runner and its server's base URL."""
    return llama_runner, tiny_llm_url


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _reference(runner: Any, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """`[len(generated), vocab]` log-probabilities transformers' forward gives each generated
    position, the sequence alone and teacher-forced."""
    ids = torch.tensor([prompt + generated])
    with torch.no_grad():
        logits = runner.model(ids, attention_mask=torch.ones_like(ids)).logits[0]
    steps = logits[len(prompt) - 1 : len(prompt) - 1 + len(generated)]
    return torch.log_softmax(steps.float(), dim=-1)


def _text(runner: Any, token: int) -> str:
    text: str = runner.text.tokenizer.decode([token], skip_special_tokens=False)
    return text


def _check(
    runner: Any,
    prompt: list[int],
    generated: list[int],
    own: list[float],
    tops: list[list[tuple[str, float]]],
    top_n: int,
    name: Callable[[int], str],
) -> None:
    """`own` (each generated token's log-probability) and `tops` (each step's alternatives as
    (`name(token id)`, log-probability) pairs, at least the `top_n` most likely) equal the
    reference."""
    ref = _reference(runner, prompt, generated)
    assert own == pytest.approx([float(ref[t, tok]) for t, tok in enumerate(generated)], abs=2e-4)
    for t, top in enumerate(tops):
        want = ref[t].topk(top_n)
        for tok, lp in zip(want.indices.tolist(), want.values.tolist(), strict=True):
            assert any(n == name(tok) and abs(v - lp) <= 2e-4 for n, v in top), (tok, lp, top)


def _as_ids(tokens: list[str]) -> list[int]:
    """Token ids from `return_tokens_as_token_ids` names (`token_id:N`)."""
    assert all(t.startswith("token_id:") for t in tokens), tokens
    return [int(t.removeprefix("token_id:")) for t in tokens]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_completion_logprobs_equal_transformers_streamed_or_not(
    served: tuple[Any, str], temperature: float
) -> None:
    """`logprobs=3`: each generated token's log-probability and its three most likely
    alternatives (plus itself) equal the reference; tokens come as their text (with
    `return_tokens_as_token_ids`, as `token_id:N`), with their character offsets; a stream
    gives the same, chunk by chunk. Sampled tokens (temperature 0.8, seeded) are reported
    under the model's raw distribution."""
    runner, url = served
    client = _client(url)
    kw: dict[str, Any] = {"model": "tiny-llama", "temperature": temperature, "seed": 5}
    kw |= {"max_tokens": 8, "logprobs": TOP}
    for text in PROMPTS[:3]:
        prompt = runner.tokenize([text])[0]
        named = client.completions.create(
            prompt=text, extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True}, **kw
        ).choices[0]
        named_lp = named.logprobs
        assert named_lp is not None and named_lp.tokens and named_lp.top_logprobs
        assert named_lp.token_logprobs is not None
        ids = _as_ids(named_lp.tokens)
        assert len(ids) == 8
        # each step: its TOP alternatives and the chosen token, which may be one of them
        assert all(len(top) in (TOP, TOP + 1) for top in named_lp.top_logprobs)
        own = list(named_lp.token_logprobs)
        assert [top[t] for top, t in zip(named_lp.top_logprobs, named_lp.tokens, strict=True)] \
            == own  # fmt: skip
        _check(
            runner,
            prompt,
            ids,
            own,
            [list(top.items()) for top in named_lp.top_logprobs],
            TOP,
            lambda i: f"token_id:{i}",
        )
        out = client.completions.create(prompt=text, extra_body={"ignore_eos": True}, **kw)
        lp = out.choices[0].logprobs
        assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
        assert lp.tokens == [_text(runner, i) for i in ids]  # the same seeded tokens, as text
        assert lp.token_logprobs == pytest.approx(own, abs=1e-6)
        offsets = [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
        assert lp.text_offset == offsets
        stream = client.completions.create(
            prompt=text, stream=True, extra_body={"ignore_eos": True}, **kw
        )
        tokens: list[str] = []
        streamed_own: list[float] = []
        streamed_offsets: list[int] = []
        for c in stream:
            if c.choices and c.choices[0].logprobs is not None:
                part = c.choices[0].logprobs
                tokens += part.tokens or []
                streamed_own += part.token_logprobs or []
                streamed_offsets += part.text_offset or []
        assert tokens == lp.tokens
        assert streamed_own == pytest.approx(own, abs=1e-6)
        assert streamed_offsets == offsets


def test_chat_logprobs_equal_transformers_streamed_or_not(served: tuple[Any, str]) -> None:
    """Chat's `logprobs: true, top_logprobs: 2`: per output token its text, log-probability,
    UTF-8 bytes and two most likely alternatives, equal to the reference; a stream gives the
    same; without `logprobs` the choice's `logprobs` is null."""
    runner, url = served
    client = _client(url)
    messages = [{"role": "user", "content": "How many bolts in total?"}]
    prompt = runner.chat_prompt(messages)
    kw: dict[str, Any] = {"model": "tiny-llama", "messages": messages, "max_tokens": 6}
    kw |= {"temperature": 0, "extra_body": {"ignore_eos": True}}
    plain = client.chat.completions.create(**kw)
    assert plain.choices[0].logprobs is None
    out = client.chat.completions.create(logprobs=True, top_logprobs=2, **kw)
    content = out.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 6
    ids = reference_tokens(runner, prompt, 6)
    assert [c.token for c in content] == [_text(runner, i) for i in ids]
    assert all(c.bytes == list(c.token.encode()) for c in content)
    assert all(len(c.top_logprobs) == 2 for c in content)
    tops = [[(t.token, t.logprob) for t in c.top_logprobs] for c in content]
    _check(runner, prompt, ids, [c.logprob for c in content], tops, 2, lambda i: _text(runner, i))
    stream = client.chat.completions.create(logprobs=True, top_logprobs=2, stream=True, **kw)
    streamed = [
        item
        for c in stream
        if c.choices and c.choices[0].logprobs is not None
        for item in c.choices[0].logprobs.content or []
    ]
    assert [(c.token, c.logprob) for c in streamed] == [(c.token, c.logprob) for c in content]


def test_a_request_without_logprobs_in_the_same_batch_gets_none(served: tuple[Any, str]) -> None:
    """Four concurrent calls of which two ask for log-probabilities: each gets what it asked
    for, and the greedy texts are those of the calls alone."""
    import concurrent.futures

    _, url = served
    client = _client(url)

    def call(i: int) -> Any:
        return client.completions.create(
            model="tiny-llama",
            prompt=PROMPTS[i],
            max_tokens=6,
            temperature=0,
            logprobs=1 if i % 2 else None,
        ).choices[0]

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        together = list(pool.map(call, range(4)))
    for i, choice in enumerate(together):
        alone = call(i)
        assert choice.text == alone.text
        assert (choice.logprobs is None) == (i % 2 == 0)
        if choice.logprobs is not None:
            assert alone.logprobs is not None
            assert choice.logprobs.token_logprobs == pytest.approx(
                alone.logprobs.token_logprobs, abs=2e-4
            )


@pytest.mark.parametrize(
    ("route", "body", "needle"),
    [
        ("/v1/completions", {"prompt": "hi", "logprobs": 21}, "less than or equal to 20"),
        ("/v1/completions", {"prompt": "hi", "logprobs": -1}, "greater than or equal to 0"),
        ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs needs logprobs: true"),
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "less than or equal"),
    ],
)
def test_out_of_range_logprobs_get_a_clear_400(
    served: tuple[Any, str], route: str, body: dict[str, Any], needle: str
) -> None:
    """More than 20 alternatives, a negative count, or chat's `top_logprobs` without
    `logprobs: true` (OpenAI's rule) are refused 400, saying so."""
    _, url = served
    if route.endswith("chat/completions"):
        body = {"messages": [{"role": "user", "content": "hi"}], **body}
    resp = httpx.post(url + route, json={"max_tokens": 2, **body}, timeout=30)
    assert resp.status_code == 400, resp.text
    assert needle in resp.json()["error"]["message"]


def test_echo_gives_the_prompt_and_its_log_probabilities_first(served: tuple[Any, str]) -> None:
    """`echo` with `logprobs=2` and `max_tokens=1` (how evaluation harnesses score a text):
    the text is the prompt then the completion; the tokens are the prompt's then the generated
    one; the first has null log-probability and alternatives, every other equals the
    reference (the sequence teacher-forced from its first token). A stream sends the prompt
    first with the same figures; a prompt given as token ids echoes as their text; with
    `n=2` each choice starts with the prompt."""
    runner, url = served
    client = _client(url)
    text = PROMPTS[1]
    ids = runner.tokenize([text])[0]
    kw: dict[str, Any] = {"model": "tiny-llama", "max_tokens": 1, "temperature": 0}
    kw |= {"echo": True, "logprobs": 2, "extra_body": {"return_tokens_as_token_ids": True}}
    out = client.completions.create(prompt=text, **kw).choices[0]
    lp = out.logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs
    got = _as_ids(lp.tokens)
    assert got[: len(ids)] == ids and len(got) == len(ids) + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert out.text.startswith(text) and len(out.text) > len(text)
    tops = [list(t.items()) for t in lp.top_logprobs[1:]]
    _check(runner, ids[:1], got[1:], list(lp.token_logprobs[1:]), tops, 2, _token_id)
    streamed = list(client.completions.create(prompt=text, stream=True, **kw))
    first = streamed[0].choices[0]
    assert first.text == text and first.logprobs is not None
    assert first.logprobs.tokens == lp.tokens[: len(ids)]
    assert first.logprobs.token_logprobs == lp.token_logprobs[: len(ids)]
    whole = "".join(c.choices[0].text for c in streamed if c.choices)
    assert whole == out.text
    plain = client.completions.create(
        model="tiny-llama", prompt=ids, max_tokens=3, temperature=0, echo=True, n=2
    )
    assert all(c.text.startswith(runner.decode(ids)) for c in plain.choices)
    assert all(c.logprobs is None for c in plain.choices)
    assert len(plain.choices) == 2


def _token_id(i: int) -> str:
    return f"token_id:{i}"
