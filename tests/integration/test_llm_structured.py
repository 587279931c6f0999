"""Structured outputs (OpenAI's `response_format`, vLLM's `structured_outputs`), through real
HTTP on loopback with the `openai` client, on the tiny random Llama.

A random model left alone writes no JSON, so text that parses and validates can only come from
the constraint. The references are someone else's: `jsonschema` validates the JSON and `re`
matches the patterns; and greedy tokens must equal transformers' `generate()` of the prompt
alone with a logits processor that masks what llguidance's own matcher refuses (transformers'
decoding loop and llguidance's grammar, none of the server's batching, cache or masking code).
"""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import jsonschema
import llguidance
import llguidance.hf
import llguidance.numpy
import numpy as np
import openai
import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from tests.llm_reference import PROMPTS, reference_greedy, reference_tokens

pytestmark = pytest.mark.slow

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "answer": {"type": "integer", "minimum": 0, "maximum": 999},
        "unit": {"enum": ["clips", "dollars", "bolts"]},
        "sure": {"type": "boolean"},
    },
    "required": ["answer", "unit", "sure"],
    "additionalProperties": False,
}


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


class _Guided(LogitsProcessor):
    """llguidance's own mask of the next token, over transformers' decoding loop."""

    def __init__(self, matcher: Any, prompt_len: int, vocab: int) -> None:
        self.m, self.prompt_len, self.vocab = matcher, prompt_len, vocab

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> Any:
        new = input_ids[0, self.prompt_len :].tolist()
        if new:
            assert self.m.consume_token(new[-1]), self.m.get_error()
        mask = llguidance.numpy.allocate_token_bitmask(1, self.vocab)
        llguidance.numpy.fill_next_token_bitmask(self.m, mask, 0)
        bits = np.unpackbits(mask.view(np.uint8), bitorder="little")[: scores.shape[1]]
        scores[0, torch.from_numpy(bits == 0)] = float("-inf")
        return scores


def _reference(runner: Any, prompt: list[int], grammar: str, n: int) -> list[int]:
    """Greedy tokens of transformers' generate() under llguidance's matcher of `grammar`,
    stopping at end-of-sequence."""
    vocab = runner.info.vocab_size
    tok = llguidance.hf.from_tokenizer(runner.tokenizer, vocab)
    processor = _Guided(llguidance.LLMatcher(tok, grammar), len(prompt), vocab)
    return reference_greedy(
        runner,
        prompt,
        n,
        eos_token_id=tok.eos_token,
        logits_processor=LogitsProcessorList([processor]),
    )


def _ids(choice: Any) -> list[int]:
    lp = choice.logprobs
    assert lp is not None and lp.tokens is not None
    return [int(t.removeprefix("token_id:")) for t in lp.tokens]


def _complete(url: str, prompt: str | list[str], max_tokens: int = 48, **body: Any) -> Any:
    return _client(url).completions.create(
        model="tiny-llama",
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        logprobs=0,
        extra_body={"return_tokens_as_token_ids": True, **body},
    )


def test_json_schema_in_chat_validates_and_equals_guided_generate(
    tiny_llm_url: str, llama_runner: Any
) -> None:
    messages = [{"role": "user", "content": PROMPTS[0]}]
    out = _client(tiny_llm_url).chat.completions.create(
        model="tiny-llama",
        messages=messages,  # type: ignore[arg-type]
        # Whitespace is free between JSON tokens (as in vLLM), and a random model spends many.
        max_tokens=200,
        temperature=0,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True},
        },
    )
    choice = out.choices[0]
    assert choice.finish_reason == "stop"
    text = choice.message.content or ""
    jsonschema.validate(json.loads(text), SCHEMA)
    # The same tokens as transformers' decoding under llguidance's mask, prompt alone.
    prompt = llama_runner.chat_prompt(messages)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        SCHEMA, defaults={"whitespace_flexible": True}
    )
    ref = _reference(llama_runner, prompt, grammar, 200)
    assert llama_runner.decode(ref) == text
    assert out.usage is not None and out.usage.completion_tokens == len(ref)


def test_unconstrained_model_writes_no_json(tiny_llm_url: str) -> None:
    # What the constraint changes: the same prompt, free, is not JSON of the schema.
    out = _complete(tiny_llm_url, PROMPTS[0], max_tokens=24, ignore_eos=True)
    with pytest.raises((json.JSONDecodeError, jsonschema.ValidationError)):
        jsonschema.validate(json.loads(out.choices[0].text), SCHEMA)


@pytest.mark.parametrize(
    ("kind", "spec", "check"),
    [
        ("choice", ["yes", "no", "maybe not"], lambda t: t in ("yes", "no", "maybe not")),
        ("regex", r"[0-9]{3}-[a-z]{2}", lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2}", t)),
        (
            "grammar",
            'start: "(" item ("," item)* ")"\nitem: /[a-c]/',
            lambda t: re.fullmatch(r"\([a-c](,[a-c])*\)", t),
        ),
        # A random model's free-form key string may run past max_tokens: its text is then the
        # start of an object, still token for token what llguidance's guided generate() gives.
        ("json_object", True, lambda t: t.startswith("{")),
        ("json", SCHEMA, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
    ],
    ids=["choice", "regex", "grammar", "json_object", "json"],
)
def test_each_constraint_kind_on_completions(
    tiny_llm_url: str, llama_runner: Any, kind: str, spec: Any, check: Any
) -> None:
    prompts = PROMPTS[:3]
    compact = {"disable_any_whitespace": True}  # JSON without free whitespace
    out = _complete(tiny_llm_url, prompts, structured_outputs={kind: spec, **compact})
    assert len(out.choices) == len(prompts)
    for choice, prompt_text in zip(out.choices, prompts, strict=True):
        if kind != "json_object" or choice.finish_reason == "stop":
            assert choice.finish_reason == "stop", (kind, choice.text)
            if kind == "json_object":
                assert isinstance(json.loads(choice.text), dict)
        assert check(choice.text), (kind, choice.text)
        # Batched with the other prompts, each row equals its own guided generate().
        if kind.startswith("json"):
            grammar = llguidance.LLMatcher.grammar_from_json_schema(
                spec if kind == "json" else {"type": "object"},
                defaults={"whitespace_flexible": False},
            )
        else:
            grammar = llguidance.grammar_from(kind, spec)
        prompt = llama_runner.tokenize([prompt_text])[0]
        ref = _reference(llama_runner, prompt, grammar, 48)
        assert _ids(choice) == ref


def test_streamed_json_equals_whole(tiny_llm_url: str) -> None:
    body = {"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}}
    whole = _complete(tiny_llm_url, PROMPTS[2], **body).choices[0].text
    stream = _client(tiny_llm_url).completions.create(
        model="tiny-llama",
        prompt=PROMPTS[2],
        max_tokens=48,
        temperature=0,
        stream=True,
        extra_body=body,
    )
    streamed = "".join(c.choices[0].text for c in stream if c.choices)
    assert streamed == whole
    jsonschema.validate(json.loads(streamed), SCHEMA)


def test_constrained_and_free_rows_share_a_batch(tiny_llm_url: str, llama_runner: Any) -> None:
    # Two calls at once: the free one's tokens are what it generates alone (the mask stays on
    # its own row), and the constrained one still validates.
    import concurrent.futures

    free_prompt = PROMPTS[1]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        free = pool.submit(_complete, tiny_llm_url, free_prompt, 12, ignore_eos=True)
        bound = pool.submit(
            _complete,
            tiny_llm_url,
            PROMPTS[3],
            structured_outputs={"json": SCHEMA, "disable_any_whitespace": True},
        )
        free_out, bound_out = free.result(), bound.result()
    ref = reference_tokens(llama_runner, llama_runner.tokenize([free_prompt])[0], 12)
    assert _ids(free_out.choices[0]) == ref
    jsonschema.validate(json.loads(bound_out.choices[0].text), SCHEMA)


def test_grammar_end_ends_the_text_despite_ignore_eos_and_min_tokens(tiny_llm_url: str) -> None:
    out = _complete(
        tiny_llm_url,
        PROMPTS[0],
        max_tokens=40,
        ignore_eos=True,
        min_tokens=30,
        structured_outputs={"choice": ["yes", "no"]},
    )
    choice = out.choices[0]
    assert choice.text in ("yes", "no")
    assert choice.finish_reason == "stop"


def test_sampled_json_validates(tiny_llm_url: str) -> None:
    out = _client(tiny_llm_url).completions.create(
        model="tiny-llama",
        prompt=PROMPTS[4],
        max_tokens=48,
        temperature=1.0,
        seed=7,
        n=3,
        extra_body={"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
    )
    for choice in out.choices:
        assert choice.finish_reason == "stop", choice.text
        jsonschema.validate(json.loads(choice.text), SCHEMA)


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"structured_outputs": {"json": {"type": "bogus"}}}, "invalid json constraint"),
        ({"structured_outputs": {"regex": "(["}}, "invalid regex constraint"),
        ({"structured_outputs": {"grammar": "start: nothing_defined"}}, "invalid grammar"),
        ({"structured_outputs": {"choice": []}}, "non-empty list"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one"),
        ({"structured_outputs": {}}, "exactly one"),
        ({"response_format": {"type": "json_schema"}}, "needs json_schema.schema"),
        (
            {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
            "not both",
        ),
        ({"structured_outputs": {"json": "{not json"}}, "invalid json constraint"),
        ({"structured_outputs": {"regex": "a" * 100_001}}, "the limit is 100000"),
        # Costs ~1 s a mask even with this 512-token vocabulary: refused before admission.
        ({"structured_outputs": {"regex": "(a{1000}){1000}"}}, "too costly to follow"),
    ],
    ids=[
        "bad-schema",
        "bad-regex",
        "bad-grammar",
        "empty-choice",
        "two-kinds",
        "no-kind",
        "schema-missing",
        "both-fields",
        "schema-not-json",
        "too-long",
        "too-costly",
    ],
)
def test_bad_constraints_are_400s_naming_the_fault(
    tiny_llm_url: str, body: dict[str, Any], needle: str
) -> None:
    r = httpx.post(
        tiny_llm_url + "/v1/completions",
        json={"model": "tiny-llama", "prompt": "Hi", "max_tokens": 4, **body},
        timeout=30,
    )
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]
    # The server still answers afterwards.
    ok = httpx.post(
        tiny_llm_url + "/v1/completions",
        json={"model": "tiny-llama", "prompt": "Hi", "max_tokens": 2},
        timeout=30,
    )
    assert ok.status_code == 200


def test_text_response_format_is_free_text(tiny_llm_url: str, llama_runner: Any) -> None:
    out = _complete(tiny_llm_url, PROMPTS[1], 12, ignore_eos=True, response_format={"type": "text"})
    ref = reference_tokens(llama_runner, llama_runner.tokenize([PROMPTS[1]])[0], 12)
    assert _ids(out.choices[0]) == ref
