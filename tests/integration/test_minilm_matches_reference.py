"""Batched == single: padded batches give the same embeddings as sentence-transformers
encoding each text alone."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from sentence_transformers import SentenceTransformer

from lenbatch.config import BatchingConfig
from lenbatch.embed.engine import Engine
from lenbatch.runners import EmbeddingRunner, resolve_model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def reference(real_texts: list[str]) -> np.ndarray:
    """sentence-transformers' own encode of each text alone (no padding at all)."""
    folder, _ = resolve_model("minilm")
    st = SentenceTransformer(str(folder), device="cpu")
    return np.stack([st.encode([t], batch_size=1)[0] for t in real_texts])


@pytest.mark.parametrize("strategy", ["bucketed", "fifo", "sorted", "static"])
async def test_batched_equals_sentence_transformers(
    strategy: str, minilm: EmbeddingRunner, real_texts: list[str], reference: np.ndarray
) -> None:
    """Every strategy's padded batches reproduce the reference within 1e-5."""
    engine = Engine(
        minilm,
        BatchingConfig(strategy=strategy, max_batch=8, max_wait_ms=50),
        default_truncate=True,
    )  # sentence-transformers truncates at 256 too
    await engine.start()
    try:
        ids = engine.tokenize(real_texts)
        assert len({len(x) for x in ids}) > 8, "the texts should have mixed lengths"
        assert max(len(x) for x in ids) == minilm.info.max_length  # one was truncated
        results = await asyncio.gather(*(engine.embed([x]) for x in ids))
    finally:
        await engine.stop()
    ours = np.stack([r[0] for r in results])
    stats = engine.metrics.stats()
    assert stats["mean_batch_size"] > 1, "requests were not batched"
    if strategy != "static":
        assert stats["padded_tokens"] > stats["real_tokens"], "no padding was exercised"
    diff = float(np.abs(ours - reference).max())
    # Shown with `pytest -s`: the figure the closing notes quote.
    print(f"{strategy}: {len(ids)} texts, max abs diff vs sentence-transformers {diff:.2e}")
    assert diff <= 1e-5, f"max abs diff {diff:.2e}"
