"""The request path: truncating cuts before tokenizing (exactly), a 1 MB input
among one-line requests over HTTP, and orjson's float and base64 encodings."""

from __future__ import annotations

import asyncio
import base64
import zipfile
from importlib import resources
from pathlib import Path

import httpx
import numpy as np
import pytest

from lenbatch.core.collate import collate
from lenbatch.runners import EmbeddingRunner
from tests.integration.conftest import LiveServer

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def megabyte_text() -> str:
    """About 1 MB of real English: State of the Union addresses end to end."""
    data = Path(str(resources.files("lenbatch") / "data" / "text"))
    with zipfile.ZipFile(data / "nltk_state_union.zip") as z:
        names = sorted(n for n in z.namelist() if n.endswith(".txt"))
        text = ""
        for name in names:
            text += z.read(name).decode("utf-8", errors="replace") + "\n"
            if len(text) >= 1_000_000:
                break
    assert len(text) >= 1_000_000
    return text


def test_truncating_cut_equals_truncating_the_whole_text(
    minilm: EmbeddingRunner, megabyte_text: str
) -> None:
    """The runner cuts a long text before tokenizing; the ids equal the tokenizer's own
    truncation of the whole text, also where the cut falls short (words of 200 chars)."""
    tokenizer = minilm.tokenizer  # type: ignore[attr-defined]
    long_words = " ".join(["x" * 199 + "y"] * 400)  # one [UNK] per 200 chars: the cut is short
    no_spaces = "z" * 300_000
    texts = [megabyte_text, long_words, no_spaces, "short text"]
    want = tokenizer(texts, truncation=True, max_length=minilm.info.max_length)["input_ids"]
    got = minilm.tokenize(texts, True)
    assert got == [list(x) for x in want]
    assert len(got[0]) == len(got[1]) == minilm.info.max_length


async def test_megabyte_input_among_small_requests(
    served_minilm: LiveServer, minilm: EmbeddingRunner, megabyte_text: str
) -> None:
    """A 1 MB input with `truncate` sent with 20 one-line requests: every one is answered
    200, the big one truncated to the limit and equal to its first 256 tokens alone, the
    small ones (float and base64) equal to their texts alone."""
    small = [f"one line request number {i}" for i in range(20)]
    async with httpx.AsyncClient(base_url=served_minilm.url, timeout=120) as client:

        async def post(text: str, **extra: object) -> httpx.Response:
            return await client.post("/v1/embeddings", json={"input": text, **extra})

        big = asyncio.create_task(post(megabyte_text, truncate=True))
        answers = await asyncio.gather(*(post(t) for t in small))
        b64 = await asyncio.gather(*(post(t, encoding_format="base64") for t in small[:3]))
        big_answer = await big
    assert big_answer.status_code == 200, big_answer.text
    assert big_answer.json()["usage"]["prompt_tokens"] == minilm.info.max_length
    ids = minilm.tokenize([megabyte_text], True)[0]
    alone = minilm.embed(collate([ids], minilm.info.pad_token_id))[0]
    got = np.array(big_answer.json()["data"][0]["embedding"], dtype=np.float32)
    np.testing.assert_allclose(got, alone, atol=1e-5)
    assert all(a.status_code == 200 for a in answers)
    want = np.concatenate([minilm.embed(collate([x], 0)) for x in minilm.tokenize(small, False)])
    floats = np.array([a.json()["data"][0]["embedding"] for a in answers], dtype=np.float32)
    np.testing.assert_allclose(floats, want, atol=1e-5)
    for i, a in enumerate(b64):
        raw = np.frombuffer(base64.b64decode(a.json()["data"][0]["embedding"]), dtype="<f4")
        # another call, maybe batched otherwise: the same vector within 1e-5
        np.testing.assert_allclose(raw, floats[i], atol=1e-5)
        assert raw.shape == (minilm.info.dim,)
