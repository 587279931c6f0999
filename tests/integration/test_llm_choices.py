"""Several choices per prompt (`n`), through real HTTP on loopback with the `openai` client:
greedy choices equal `transformers.generate()`; seeded choices sample with seed + j, as a
call with that seed alone does; choices come prompt by prompt; a prompt's tokens count once
in `usage`, as OpenAI counts them."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from tests.llm_reference import PROMPTS, reference_greedy

pytestmark = pytest.mark.slow


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _texts(choices: list[Any], chat: bool = False) -> list[str]:
    ordered = sorted(choices, key=lambda c: c.index)
    assert [c.index for c in ordered] == list(range(len(choices)))
    return [c.message.content if chat else c.text for c in ordered]


def test_greedy_choices_of_several_prompts_come_prompt_by_prompt(
    llama_runner: Any, tiny_llm_url: str
) -> None:
    """Two prompts with `n=3`: six choices, the first three the first prompt's greedy text,
    the last three the second's; `usage` counts each prompt's tokens once and every
    generated token."""
    prompts = [PROMPTS[0], PROMPTS[1]]
    ids = llama_runner.tokenize(prompts)
    tokens = [reference_greedy(llama_runner, p, 8) for p in ids]
    want = [llama_runner.decode(t) for t in tokens]
    out = _client(tiny_llm_url).completions.create(
        model="tiny-llama", prompt=prompts, n=3, max_tokens=8, temperature=0
    )
    assert _texts(out.choices) == [want[0]] * 3 + [want[1]] * 3
    assert out.usage is not None
    assert out.usage.prompt_tokens == sum(len(p) for p in ids)
    assert out.usage.completion_tokens == 3 * sum(len(t) for t in tokens)


def test_seeded_choices_sample_as_seed_plus_j_alone_streamed_or_not(tiny_llm_url: str) -> None:
    """`n=3, seed=11`: choice j is what `n=1, seed=11+j` samples (so the choices differ and
    each is reproducible), whole or streamed; chat the same."""
    client = _client(tiny_llm_url)
    kw: dict[str, Any] = {"model": "tiny-llama", "max_tokens": 10, "temperature": 1.0}
    together = _texts(client.completions.create(prompt=PROMPTS[2], n=3, seed=11, **kw).choices)
    alone = [
        client.completions.create(prompt=PROMPTS[2], seed=11 + j, **kw).choices[0].text
        for j in range(3)
    ]
    assert together == alone
    assert len(set(together)) > 1
    streamed = ["", "", ""]
    for chunk in client.completions.create(prompt=PROMPTS[2], n=3, seed=11, stream=True, **kw):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == together
    messages = [{"role": "user", "content": "How many bolts in total?"}]
    chat = client.chat.completions.create(messages=messages, n=2, seed=3, **kw)
    chat_alone = [
        client.chat.completions.create(messages=messages, seed=3 + j, **kw)
        .choices[0]
        .message.content
        for j in range(2)
    ]
    assert _texts(chat.choices, chat=True) == chat_alone
