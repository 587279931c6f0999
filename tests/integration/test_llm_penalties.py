"""Penalties and logit biases on generation (`repetition_penalty`, `frequency_penalty`,
`presence_penalty`, `logit_bias`), through real HTTP on loopback with the `openai` client.

The references are transformers' `generate()` of the tiny Llama, greedy, each prompt alone:
its own `repetition_penalty` and `sequence_bias` (single-token biases are OpenAI's
`logit_bias`), and, for OpenAI's frequency and presence penalties, which transformers does not
have, a logits processor written here from OpenAI's definition (a token's logit less its count
in the output times the frequency penalty, less the presence penalty if it occurs at all).
"""

from __future__ import annotations

import concurrent.futures
from collections import Counter
from typing import Any

import httpx
import openai
import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from tests.llm_reference import PROMPTS, reference_tokens

pytestmark = pytest.mark.slow

N = 12


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


class _OpenAIPenalties(LogitsProcessor):
    """OpenAI's frequency and presence penalties over the tokens after the prompt."""

    def __init__(self, prompt_len: int, frequency: float, presence: float) -> None:
        self.prompt_len, self.frequency, self.presence = prompt_len, frequency, presence

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> Any:
        for row in range(scores.shape[0]):
            for tok, count in Counter(input_ids[row, self.prompt_len :].tolist()).items():
                scores[row, tok] -= count * self.frequency + self.presence
        return scores


def _served_ids(url: str, prompt: str, **body: Any) -> list[int]:
    """The greedy token ids the server generates for `prompt` with `body`'s options."""
    out = _client(url).completions.create(
        model="tiny-llama",
        prompt=prompt,
        max_tokens=N,
        temperature=0,
        logprobs=0,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True, **body},
    )
    lp = out.choices[0].logprobs
    assert lp is not None and lp.tokens is not None
    return [int(t.removeprefix("token_id:")) for t in lp.tokens]


CASES: list[tuple[str, dict[str, Any]]] = [
    ("repetition 1.5", {"repetition_penalty": 1.5}),
    ("repetition 0.7", {"repetition_penalty": 0.7}),
    ("frequency 1.5", {"frequency_penalty": 1.5}),
    ("presence 2", {"presence_penalty": 2.0}),
    ("frequency -1 with presence 0.5", {"frequency_penalty": -1.0, "presence_penalty": 0.5}),
]


def _reference_kw(runner: Any, prompt: list[int], body: dict[str, Any]) -> dict[str, Any]:
    if "repetition_penalty" in body:
        return {"repetition_penalty": body["repetition_penalty"]}
    processor = _OpenAIPenalties(
        len(prompt), body.get("frequency_penalty", 0.0), body.get("presence_penalty", 0.0)
    )
    return {"logits_processor": LogitsProcessorList([processor])}


@pytest.mark.parametrize(("case", "body"), CASES, ids=[c for c, _ in CASES])
def test_penalties_equal_the_reference_token_for_token(
    llama_runner: Any, tiny_llm_url: str, case: str, body: dict[str, Any]
) -> None:
    """Each penalty's greedy tokens equal the reference's for three prompts, and differ from
    unpenalized greedy decoding for at least one (so the penalty did something)."""
    changed = False
    for text in PROMPTS[:3]:
        prompt = llama_runner.tokenize([text])[0]
        want = reference_tokens(
            llama_runner, prompt, N, **_reference_kw(llama_runner, prompt, body)
        )
        assert _served_ids(tiny_llm_url, text, **body) == want, case
        changed |= want != reference_tokens(llama_runner, prompt, N)
    assert changed, f"{case} changed no prompt's tokens: the test cannot tell"


def test_logit_bias_equals_transformers_sequence_bias(llama_runner: Any, tiny_llm_url: str) -> None:
    """`logit_bias` of -100 on each prompt's first greedy token and +5 on another token
    equals `generate(sequence_bias=...)` of those single-token sequences."""
    for text in PROMPTS[:3]:
        prompt = llama_runner.tokenize([text])[0]
        first = reference_tokens(llama_runner, prompt, N)[0]
        bias = {first: -100.0, 7: 5.0}
        sequence_bias = {(t,): b for t, b in bias.items()}
        want = reference_tokens(llama_runner, prompt, N, sequence_bias=sequence_bias)
        assert want[0] != first
        got = _served_ids(tiny_llm_url, text, logit_bias={str(t): b for t, b in bias.items()})
        assert got == want


def test_penalized_rows_beside_plain_ones_decode_as_alone(
    llama_runner: Any, tiny_llm_url: str
) -> None:
    """Four concurrent calls, two penalized, two not: each gets the tokens it gets alone (a
    row's penalties touch its own logits only)."""
    bodies: list[dict[str, Any]] = [
        {"repetition_penalty": 1.5},
        {},
        {"frequency_penalty": 1.5},
        {},
    ]

    def call(i: int) -> list[int]:
        return _served_ids(tiny_llm_url, PROMPTS[i], **bodies[i])

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        together = list(pool.map(call, range(4)))
    assert together == [call(i) for i in range(4)]


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"repetition_penalty": 5e-324}, "repetition_penalty"),
        ({"repetition_penalty": 11}, "repetition_penalty"),
        ({"logit_bias": {"x": 1}}, "logit_bias keys must be token ids"),
        ({"logit_bias": {"5": 101}}, "must be in [-100, 100]"),
        ({"logit_bias": {"999999": 1}}, "logit_bias names token 999999, outside [0, 512)"),
    ],
)
def test_out_of_range_penalties_and_biases_get_a_clear_400(
    tiny_llm_url: str, body: dict[str, Any], needle: str
) -> None:
    """Penalties out of OpenAI's ranges (repetition: [0.01, 10]; the fuzzer's 5e-324 divided
    logits into infinities), a bias key that is not a token
    id or not in the vocabulary, or a bias outside [-100, 100] are refused 400, saying so."""
    for route, extra in (
        ("/v1/completions", {"prompt": "hi"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ):
        resp = httpx.post(tiny_llm_url + route, json={"max_tokens": 2, **extra, **body}, timeout=30)
        assert resp.status_code == 400, resp.text
        assert needle in resp.json()["error"]["message"], resp.text
