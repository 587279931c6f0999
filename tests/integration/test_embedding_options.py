"""`dimensions`, `prompt_name`, Cohere's `input_type` and the default prompt on
`/v1/embeddings`: vectors equal sentence-transformers' `encode(truncate_dim=...,
normalize_embeddings=True)` and `encode(prompt_name=...)`; prompt tokens count in usage."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient
from sentence_transformers import SentenceTransformer
from transformers import AutoTokenizer

from lenbatch.config import BatchingConfig, Settings
from lenbatch.embed.api import create_app
from lenbatch.embed.engine import Engine
from lenbatch.runners import load_runner, resolve_model

pytestmark = [pytest.mark.slow, pytest.mark.model]

TEXTS = ["how many legs does a spider have", "Spiders have eight legs and most have eight eyes."]
PROMPTS = {"query": "query: ", "passage": "passage: ", "clustering": "Identify the topic: "}


@pytest.fixture(scope="module")
def prompted_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """MiniLM's folder with sentence-transformers prompts added (links to its files)."""
    src = resolve_model("minilm")[0]
    out = tmp_path_factory.mktemp("minilm-prompts")
    for item in src.iterdir():
        if item.name != "config_sentence_transformers.json":
            (out / item.name).symlink_to(item)
    cfg = json.loads((src / "config_sentence_transformers.json").read_text())
    cfg["prompts"] = PROMPTS
    (out / "config_sentence_transformers.json").write_text(json.dumps(cfg))
    return out


@pytest.fixture(scope="module")
def st(prompted_dir: Path) -> SentenceTransformer:
    return SentenceTransformer(str(prompted_dir), device="cpu")


def _client(folder: Path, default_prompt_name: str | None = None) -> TestClient:
    runner = load_runner(str(folder), execution="packed", default_prompt_name=default_prompt_name)
    return TestClient(create_app(Engine(runner, BatchingConfig(max_wait_ms=5)), Settings()))


@pytest.fixture(scope="module")
def client(prompted_dir: Path) -> Iterator[TestClient]:
    with _client(prompted_dir) as c:
        yield c


def _vectors(client: TestClient, **body: object) -> tuple[np.ndarray, int]:
    r = client.post("/v1/embeddings", json={"input": TEXTS, **body})
    assert r.status_code == 200, r.text
    out = r.json()
    return np.array([d["embedding"] for d in out["data"]]), out["usage"]["prompt_tokens"]


@pytest.mark.parametrize("d", [384, 128, 32])
def test_dimensions_equal_sentence_transformers(
    client: TestClient, st: SentenceTransformer, d: int
) -> None:
    """A Matryoshka cut re-normalised (MiniLM normalises) equals ST's truncate_dim ≤ 1e-5."""
    ours, _ = _vectors(client, dimensions=d)
    want = st.encode(TEXTS, truncate_dim=d, normalize_embeddings=True)
    assert ours.shape == (2, d)
    assert float(np.abs(ours - want).max()) <= 1e-5
    assert np.allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)


def test_dimensions_over_the_width_or_zero(client: TestClient) -> None:
    """Above the width: 400 naming the width; 0 or less: 400."""
    r = client.post("/v1/embeddings", json={"input": "x", "dimensions": 385})
    assert r.status_code == 400 and "384 dimensions" in r.json()["error"]["message"]
    assert client.post("/v1/embeddings", json={"input": "x", "dimensions": 0}).status_code == 400


@pytest.mark.parametrize(
    ("body", "name"),
    [
        ({"prompt_name": "query"}, "query"),
        ({"input_type": "search_query"}, "query"),
        ({"input_type": "search_document"}, "passage"),
        ({"input_type": "clustering"}, "clustering"),
    ],
)
def test_prompts_equal_sentence_transformers(
    client: TestClient, st: SentenceTransformer, prompted_dir: Path, body: dict, name: str
) -> None:
    """The prompt's text goes before each input: vectors equal ST's encode(prompt_name=...)
    and usage counts the prompt's tokens."""
    ours, usage = _vectors(client, **body)
    want = st.encode(TEXTS, prompt_name=name)
    assert float(np.abs(ours - want).max()) <= 1e-5
    tok = AutoTokenizer.from_pretrained(prompted_dir)
    assert usage == sum(len(tok(PROMPTS[name] + t)["input_ids"]) for t in TEXTS)


def test_default_prompt_name(prompted_dir: Path, st: SentenceTransformer) -> None:
    """`--default-prompt-name` applies when a call names no prompt; an unknown one refuses
    to start, naming the prompts."""
    with _client(prompted_dir, "passage") as c:
        ours, _ = _vectors(c)
        assert float(np.abs(ours - st.encode(TEXTS, prompt_name="passage")).max()) <= 1e-5
        ours, _ = _vectors(c, prompt_name="query")  # the call's own prompt wins
        assert float(np.abs(ours - st.encode(TEXTS, prompt_name="query")).max()) <= 1e-5
    with pytest.raises(ValueError, match="clustering, passage, query"):
        load_runner(str(prompted_dir), default_prompt_name="nope")


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"input": "x", "prompt_name": "nope"}, "they are: clustering, passage, query"),
        ({"input": "x", "input_type": "classification"}, "no matching prompt"),
        ({"input": [[101, 2000, 102]], "prompt_name": "query"}, "token-id inputs"),
        ({"input": "x", "prompt_name": "query", "input_type": "search_query"}, "not both"),
    ],
)
def test_bad_prompts(client: TestClient, body: dict, words: str) -> None:
    """Unknown prompt names list the model's; a prompt with token ids is refused."""
    r = client.post("/v1/embeddings", json=body)
    assert r.status_code == 400, r.text
    assert words in r.json()["error"]["message"]
