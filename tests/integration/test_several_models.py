"""An embedder, a cross-encoder and a causal LM served together by one process on loopback:
routing by the body's `model`, the 404/400 answers, `/v1/models`, `/health`, `/metrics` and
`/stats` per model, and one CPU budget the engines take turns on."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import uvicorn
from sentence_transformers import CrossEncoder, SentenceTransformer

from lenbatch.cli.build import build_model
from lenbatch.cli.main import main
from lenbatch.config import Settings
from lenbatch.runners import resolve_model
from lenbatch.serving.budget import ComputeBudget
from lenbatch.serving.multi import ServedModel, build_router

pytestmark = [pytest.mark.slow, pytest.mark.model]

DOCS = ["Spiders have eight legs.", "Paris is the capital of France, on the Seine."]


class _Server:
    def __init__(self, models: list[ServedModel], budget: ComputeBudget, url: str) -> None:
        self.models = {m.name: m for m in models}
        self.budget = budget
        self.url = url


@pytest.fixture(scope="module")
def server(scorer_dir: Path, tiny_llama_dir: Path) -> Iterator[_Server]:
    settings = Settings.model_validate(
        {
            "models": [
                {"name": "minilm", "dtype": "float32"},
                {"name": str(scorer_dir), "served_name": "reranker", "dtype": "float32"},
                {"name": str(tiny_llama_dir), "served_name": "llm", "dtype": "float32"},
            ],
            "batching": {"max_wait_ms": 5},
            "generation": {"default_max_tokens": 4},
        }
    )
    models = [build_model(settings.for_model(m)) for m in settings.served_models()]
    budget = ComputeBudget()
    for m in models:
        m.engine.use_budget(budget, m.name)
    app, _ = build_router(models, settings, budget)
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on")
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not srv.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    port = srv.servers[0].sockets[0].getsockname()[1]
    try:
        yield _Server(models, budget, f"http://127.0.0.1:{port}")
    finally:
        srv.should_exit = True
        thread.join(timeout=30)


@pytest.fixture
def http(server: _Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


def test_each_model_answers_by_name_and_equals_its_reference(
    http: httpx.Client, scorer_dir: Path
) -> None:
    """Embeddings from the embedder equal sentence-transformers; rerank from the reranker
    equals CrossEncoder; the LLM completes; a call without `model` goes to the one model that
    does its task."""
    st = SentenceTransformer(str(resolve_model("minilm")[0]), device="cpu")
    r = http.post("/v1/embeddings", json={"input": DOCS, "model": "all-MiniLM-L6-v2"})
    assert r.status_code == 200, r.text
    got = np.array([d["embedding"] for d in r.json()["data"]])
    assert float(np.abs(got - st.encode(DOCS)).max()) <= 1e-5
    assert http.post("/v1/embeddings", json={"input": "no model named"}).status_code == 200
    r = http.post("/v1/rerank", json={"query": "spiders", "documents": DOCS})
    assert r.status_code == 200, r.text
    want = CrossEncoder(str(scorer_dir), device="cpu").predict([("spiders", d) for d in DOCS])
    got_scores = {x["index"]: x["relevance_score"] for x in r.json()["results"]}
    assert max(abs(got_scores[i] - want[i]) for i in range(2)) <= 1e-5
    assert r.json()["model"] == "reranker"
    r = http.post("/v1/completions", json={"model": "llm", "prompt": "hello", "max_tokens": 3})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1


def test_routing_errors(http: httpx.Client) -> None:
    """Unknown name: 404 in OpenAI's shape listing the names; a route several models serve
    without `model`: 400 listing them; a task the named model does not do: 400 naming its."""
    r = http.post("/v1/embeddings", json={"input": "x", "model": "nope"})
    assert r.status_code == 404
    err = r.json()["error"]
    assert err["code"] == "model_not_found" and "'reranker'" in err["message"]
    assert "'all-MiniLM-L6-v2'" in err["message"] and "'llm'" in err["message"]
    r = http.post("/tokenize", json={"prompt": "hello"})
    assert r.status_code == 400 and "name one" in r.json()["error"]["message"]
    r = http.post("/tokenize", json={"prompt": "hello", "model": "llm"})
    assert r.status_code == 200 and r.json()["count"] > 0
    r = http.post("/v1/rerank", json={"query": "q", "documents": ["d"], "model": "llm"})
    assert r.status_code == 400 and "serves generate" in r.json()["error"]["message"]
    r = http.post("/v1/embeddings", json={"input": "x", "model": "reranker"})
    assert r.status_code == 400 and "serves score" in r.json()["error"]["message"]


def test_models_stats_metrics_and_budget(http: httpx.Client, server: _Server) -> None:
    """`/v1/models` lists every model with its task; `/stats` keeps the first model's summary
    at the top and adds each model's; `/metrics` labels series by model; the model calls took
    turns on the one CPU budget."""
    http.post("/v1/rerank", json={"query": "q", "documents": DOCS})
    http.post("/v1/embeddings", json={"input": DOCS})
    models = {m["id"]: m["task"] for m in http.get("/v1/models").json()["data"]}
    assert models == {"all-MiniLM-L6-v2": "embed", "reranker": "score", "llm": "generate"}
    stats = http.get("/stats").json()
    assert set(stats["models"]) == set(models)
    first = stats["models"]["all-MiniLM-L6-v2"]
    assert stats["real_tokens"] == first["real_tokens"] > 0  # what calibrate reads, unchanged
    assert stats["models"]["reranker"]["real_tokens"] > 0
    assert stats["cpu_budget"]["turns"] > 0
    metrics = http.get("/metrics").text
    assert 'model="reranker"' in metrics and 'model="all-MiniLM-L6-v2"' in metrics
    helps = [line for line in metrics.splitlines() if line.startswith("# TYPE ")]
    assert len(helps) == len(set(helps)), "each family is written once"


def test_health_names_a_failed_model(http: httpx.Client, server: _Server) -> None:
    """One model crashing makes /health 503 naming it (runs last: it leaves that model
    failed)."""
    assert http.get("/health").status_code == 200
    server.models["reranker"].engine.crash(0, "injected for the test")
    r = http.get("/health")
    assert r.status_code == 503
    assert "model 'reranker': injected for the test" in r.json()["reason"]
    assert http.post("/v1/embeddings", json={"input": "still works"}).status_code == 200


def test_flag_counts_and_duplicate_names(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A count of --served-model-name unlike --model's, or two models served under one name,
    stop serve with exit code 2 and a message (before any model loads)."""
    args = ["serve", "--model", "minilm", "--model", "smollm2", "--served-model-name", "a"]
    assert main(args) == 2
    assert "given 1 times for 2 --model" in capsys.readouterr().err
    a, b = tmp_path / "a" / "m", tmp_path / "b" / "m"
    assert main(["serve", "--model", str(a), "--model", str(b)]) == 2
    assert "both served as 'm'" in capsys.readouterr().err
