"""The official `openai` client against a real uvicorn on loopback."""

from __future__ import annotations

import numpy as np
import openai
import pytest

from lenbatch.runners import EmbeddingRunner
from tests.integration.conftest import LiveServer

pytestmark = pytest.mark.slow


def _client(srv: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0)


def _expected(minilm: EmbeddingRunner, texts: list[str]) -> np.ndarray:
    from lenbatch.core.collate import collate

    rows = [minilm.embed(collate([ids], 0)) for ids in minilm.tokenize(texts, False)]
    return np.concatenate(rows)


def test_string_list_and_base64(served_minilm: LiveServer, minilm: EmbeddingRunner) -> None:
    """One string, a list, and base64 encoding all decode to the model's vectors."""
    client = _client(served_minilm)
    texts = ["The cat sat on the mat.", "Length-bucketed batching pads less.", "hi"]
    one = client.embeddings.create(
        model="all-MiniLM-L6-v2", input=texts[0], encoding_format="float"
    )
    assert len(one.data) == 1 and len(one.data[0].embedding) == 384
    many = client.embeddings.create(model="all-MiniLM-L6-v2", input=texts, encoding_format="float")
    b64 = client.embeddings.create(model="all-MiniLM-L6-v2", input=texts)  # base64 by default
    want = _expected(minilm, texts)
    for resp in (many, b64):
        got = np.array([d.embedding for d in sorted(resp.data, key=lambda d: d.index)])
        assert np.abs(got - want).max() <= 1e-5
    np.testing.assert_allclose(one.data[0].embedding, want[0], atol=1e-5)
    assert many.usage.prompt_tokens == sum(len(x) for x in minilm.tokenize(texts, False))
    assert many.model == "all-MiniLM-L6-v2"


def test_token_arrays(served_minilm: LiveServer, minilm: EmbeddingRunner) -> None:
    """Token arrays (one or several) are embedded as the model's own token ids."""
    client = _client(served_minilm)
    texts = ["token arrays work too", "and lists of them, of different lengths"]
    ids = minilm.tokenize(texts, False)
    single = client.embeddings.create(
        model="all-MiniLM-L6-v2", input=ids[0], encoding_format="float"
    )
    double = client.embeddings.create(model="all-MiniLM-L6-v2", input=ids, encoding_format="float")
    want = _expected(minilm, texts)
    np.testing.assert_allclose(single.data[0].embedding, want[0], atol=1e-5)
    got = np.array([d.embedding for d in double.data])
    assert np.abs(got - want).max() <= 1e-5
    assert double.usage.prompt_tokens == len(ids[0]) + len(ids[1])


def test_errors_reach_the_client_with_clear_messages(served_minilm: LiveServer) -> None:
    """Too-long input is a 413 naming the limit; an unknown model a 404; bad ids a 400."""
    client = _client(served_minilm)
    with pytest.raises(openai.APIStatusError) as info:
        client.embeddings.create(model="all-MiniLM-L6-v2", input="word " * 400)
    assert info.value.status_code == 413
    assert "limit is 256" in str(info.value)
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="gpt-4", input="x")
    with pytest.raises(openai.BadRequestError, match="outside"):
        client.embeddings.create(model="all-MiniLM-L6-v2", input=[[101, 999999, 102]])
    ok = client.embeddings.create(
        model="all-MiniLM-L6-v2", input="word " * 400, extra_body={"truncate": True}
    )
    assert ok.usage.prompt_tokens == 256
