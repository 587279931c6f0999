"""`/tokenize`, `/detokenize` and `/decode` on every kind of served model (embedder, scorer,
causal LM): ids equal the model's own Hugging Face tokenizer, in vLLM's and TEI's shapes."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from transformers import AutoTokenizer

from lenbatch.config import BatchingConfig, GenerationConfig, Settings
from lenbatch.embed.api import create_app
from lenbatch.embed.engine import Engine
from lenbatch.embed.score_api import create_scoring_app
from lenbatch.embed.scoring import ScoringEngine
from lenbatch.generate import GenerationEngine
from lenbatch.generate.api import create_llm_app
from lenbatch.runners import load_runner, resolve_model
from lenbatch.runners.base import ScoringRunner

pytestmark = pytest.mark.slow

TEXT = "Tokenizers split text into pieces: ünïcode, numbers 12345 and spaces."


def _embedder(_: Any) -> tuple[FastAPI, str]:
    runner: Any = load_runner("minilm")
    app = create_app(Engine(runner, BatchingConfig(max_wait_ms=5)), Settings(), runner.text)
    return app, str(resolve_model("minilm")[0])


def _scorer(folder: Path) -> tuple[FastAPI, str]:
    runner = load_runner(str(folder), head=True)
    assert isinstance(runner, ScoringRunner)
    engine = ScoringEngine(runner, BatchingConfig(max_wait_ms=5))
    return create_scoring_app(engine, Settings(), getattr(runner, "text", None)), str(folder)


def _llm(folder: Path) -> tuple[FastAPI, str]:
    from lenbatch.runners.causal import CausalLMRunner

    runner = CausalLMRunner(folder, name="tiny-llama")
    engine = GenerationEngine(
        runner,
        BatchingConfig(boundaries=(8, 16, 32), max_batch=4, max_wait_ms=2),
        generation=GenerationConfig(default_max_tokens=4),
    )
    return create_llm_app(engine, Settings(), runner.text), str(folder)


BUILDERS: dict[str, Callable[[Path], tuple[FastAPI, str]]] = {
    "embedder": _embedder,
    "scorer": _scorer,
    "llm": _llm,
}


@pytest.fixture(params=sorted(BUILDERS), scope="module")
def served(
    request: pytest.FixtureRequest, scorer_dir: Path, tiny_llama_dir: Path
) -> Iterator[tuple[TestClient, Any, str]]:
    """(client, the model's own Hugging Face tokenizer, kind) for each kind of model."""
    kind = request.param
    folder = {"embedder": scorer_dir, "scorer": scorer_dir, "llm": tiny_llama_dir}[kind]
    app, tok_folder = BUILDERS[kind](folder)
    with TestClient(app) as client:
        yield client, AutoTokenizer.from_pretrained(tok_folder), kind


def test_vllm_tokenize_and_detokenize(served: tuple[TestClient, Any, str]) -> None:
    """`{prompt}` gives the tokenizer's ids (with and without special tokens) and the limit;
    `/detokenize` gives the tokenizer's decode of them."""
    client, tok, _ = served
    r = client.post("/tokenize", json={"prompt": TEXT, "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    want = tok(TEXT)["input_ids"]
    assert body["tokens"] == want and body["count"] == len(want)
    assert body["max_model_len"] > 0
    assert body["token_strs"] == tok.convert_ids_to_tokens(want)
    bare = client.post("/tokenize", json={"prompt": TEXT, "add_special_tokens": False}).json()
    assert bare["tokens"] == tok(TEXT, add_special_tokens=False)["input_ids"]
    back = client.post("/detokenize", json={"tokens": want}).json()
    assert back == {"prompt": tok.decode(want)}


def test_tei_tokenize_and_decode(served: tuple[TestClient, Any, str]) -> None:
    """`{inputs}` gives TEI's tokens per input: ids equal the tokenizer's, each non-special
    token's text is the slice of the input its offsets name; `/decode` skips specials."""
    client, tok, _ = served
    texts = [TEXT, "short"]
    r = client.post("/tokenize", json={"inputs": texts})
    assert r.status_code == 200, r.text
    rows = r.json()
    assert len(rows) == 2
    for text, row in zip(texts, rows, strict=True):
        assert [t["id"] for t in row] == tok(text)["input_ids"]
        for t in row:
            if not t["special"]:
                assert t["text"] == text[t["start"] : t["stop"]]
    ids = tok(TEXT)["input_ids"]
    decoded = client.post("/decode", json={"ids": [ids, ids[:3]]}).json()
    assert decoded == tok.batch_decode([ids, ids[:3]], skip_special_tokens=True)


def test_chat_messages_and_bad_bodies(served: tuple[TestClient, Any, str]) -> None:
    """vLLM's `messages` render through the chat template where the model has one (else a
    400); no text field, two of them, or ids outside the vocabulary are 4xx."""
    client, tok, kind = served
    messages = [{"role": "user", "content": "hello there"}]
    r = client.post("/tokenize", json={"messages": messages})
    if kind == "llm":
        assert r.status_code == 200, r.text
        want = tok.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        assert r.json()["tokens"] == list(want)
    else:
        assert r.status_code == 400 and "chat template" in r.json()["error"]["message"]
    assert client.post("/tokenize", json={}).status_code == 400
    assert client.post("/tokenize", json={"prompt": "a", "inputs": "b"}).status_code == 400
    r = client.post("/detokenize", json={"tokens": [len(tok) + 5]})
    assert r.status_code == 400 and str(len(tok)) in r.json()["error"]["message"]
    r = client.post("/tokenize", json={"prompt": "a", "model": "other"})
    assert r.status_code == 404
