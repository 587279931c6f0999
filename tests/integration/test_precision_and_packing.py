"""Every dtype/execution option against sentence-transformers fp32 on real text.

Packed float32 must equal the reference within 1e-5; the bfloat16 options must keep every
vector's cosine with the reference at or above 0.999, and a small retrieval set (math questions
against their answers mixed with speech paragraphs) must find the same nearest neighbour for
every query, with top-5 sets that agree. Each runs through the engine (bucketed batches of
mixed lengths), so the packing path of `embed/batches.py` is what is tested. The figures are
printed (`pytest -s`) for the closing note and the README.
"""

from __future__ import annotations

import asyncio
import json
import zipfile
from importlib import resources
from pathlib import Path

import numpy as np
import pytest
from sentence_transformers import SentenceTransformer

from lenbatch.config import BatchingConfig
from lenbatch.embed.engine import Engine
from lenbatch.runners import EmbeddingRunner, load_runner, resolve_model
from lenbatch.runners.base import PackedEmbeddingRunner

pytestmark = pytest.mark.slow

_DATA = Path(str(resources.files("lenbatch") / "data" / "text"))


@pytest.fixture(scope="module")
def retrieval_set() -> tuple[list[str], list[str]]:
    """(queries, corpus): 40 GSM8K questions; their 40 answers and 20 speech paragraphs."""
    rows = [
        json.loads(line)
        for line in (_DATA / "gsm8k_test.jsonl").read_text(encoding="utf-8").splitlines()[100:140]
    ]
    with zipfile.ZipFile(_DATA / "nltk_state_union.zip") as z:
        name = sorted(n for n in z.namelist() if n.endswith(".txt"))[0]
        text = z.read(name).decode("utf-8", errors="replace")
    paragraphs = [p.strip() for p in text.split("\n\n") if len(p.split()) > 5][:20]
    return [r["question"] for r in rows], [r["answer"] for r in rows] + paragraphs


def _st_vectors(queries: list[str], corpus: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """sentence-transformers fp32 vectors of `queries` and `corpus`."""
    folder, _ = resolve_model("minilm")
    st = SentenceTransformer(str(folder), device="cpu")
    return st.encode(queries, batch_size=16), st.encode(corpus, batch_size=16)


@pytest.fixture(scope="module")
def reference(retrieval_set: tuple[list[str], list[str]]) -> tuple[np.ndarray, np.ndarray]:
    """sentence-transformers fp32 vectors of the queries and the corpus."""
    return _st_vectors(*retrieval_set)


async def _embed_all(runner: EmbeddingRunner, texts: list[str]) -> np.ndarray:
    engine = Engine(
        runner,
        BatchingConfig(strategy="bucketed", max_batch=8, max_wait_ms=20),
        default_truncate=True,
    )
    await engine.start()
    try:
        ids = engine.tokenize(texts)
        results = await asyncio.gather(*(engine.embed([x]) for x in ids))
    finally:
        await engine.stop()
    assert engine.metrics.stats()["mean_batch_size"] > 1, "requests were not batched"
    return np.stack([r[0] for r in results])


def _top(queries: np.ndarray, corpus: np.ndarray, k: int = 5) -> np.ndarray:
    return np.argsort(-(queries @ corpus.T), axis=1, kind="stable")[:, :k]


@pytest.mark.parametrize(
    ("dtype", "execution"),
    [("float32", "packed"), ("bfloat16", "padded"), ("bfloat16", "packed")],
)
def test_option_matches_sentence_transformers(
    dtype: str,
    execution: str,
    retrieval_set: tuple[list[str], list[str]],
    reference: tuple[np.ndarray, np.ndarray],
) -> None:
    """Each non-default option reproduces the fp32 reference (bounds in the module doc)."""
    runner = load_runner("minilm", dtype=dtype, execution=execution)
    assert isinstance(runner, PackedEmbeddingRunner) == (execution == "packed")
    queries, corpus = retrieval_set
    ours_q = asyncio.run(_embed_all(runner, queries))
    ours_c = asyncio.run(_embed_all(runner, corpus))
    ref_q, ref_c = reference
    cos = np.concatenate([(ours_q * ref_q).sum(1), (ours_c * ref_c).sum(1)])
    diff = max(float(np.abs(ours_q - ref_q).max()), float(np.abs(ours_c - ref_c).max()))
    ref_top, top = _top(ref_q, ref_c), _top(ours_q, ours_c)
    top1 = float((top[:, 0] == ref_top[:, 0]).mean())
    same_order = float((top == ref_top).all(axis=1).mean())
    overlap = float(np.mean([len(set(a) & set(b)) / 5 for a, b in zip(top, ref_top, strict=True)]))
    print(
        f"{dtype} {execution}: {len(cos)} texts, min cosine {cos.min():.6f}, max abs diff "
        f"{diff:.2e}; nearest neighbour agrees {top1:.0%}, top-5 in the same order "
        f"{same_order:.0%}, top-5 overlap {overlap:.1%}"
    )
    # The reference itself retrieves each question's own answer: the set is a fair one.
    assert (ref_top[:, 0] == np.arange(len(queries))).all()
    if dtype == "float32":
        assert diff <= 1e-5, f"max abs diff {diff:.2e}"
    assert cos.min() >= 0.999, f"min cosine {cos.min():.6f}"
    assert top1 == 1.0, "a query's nearest neighbour changed"
    assert overlap >= 0.95, f"top-5 overlap {overlap:.1%}"


def _tiny_encoder(folder: Path, kind: str, pooling: str) -> Path:
    """A small random encoder of `kind` with MiniLM's tokenizer and the given pooling."""
    import shutil

    from transformers import BertConfig, BertModel, RobertaConfig, RobertaModel

    minilm, _ = resolve_model("minilm")
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        if (minilm / name).exists():
            shutil.copy(minilm / name, folder / name)
    cls, model_cls = (BertConfig, BertModel) if kind == "bert" else (RobertaConfig, RobertaModel)
    config = cls(
        vocab_size=30522,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=128,
    )
    model_cls(config).save_pretrained(folder)
    (folder / "pool").mkdir()
    (folder / "pool" / "config.json").write_text(json.dumps({f"pooling_mode_{pooling}": True}))
    modules = [{"type": "sentence_transformers.models.Pooling", "path": "pool"}]
    (folder / "modules.json").write_text(json.dumps(modules))
    return folder


@pytest.mark.parametrize("pooling", ["mean_tokens", "cls_token", "max_tokens", "lasttoken"])
def test_packed_equals_padded_for_each_pooling(
    pooling: str, tmp_path: Path, real_texts: list[str]
) -> None:
    """On a random BERT, packed and Hugging Face's padded forward agree for every pooling."""
    folder = _tiny_encoder(tmp_path, "bert", pooling)
    padded = load_runner(str(folder), execution="padded")
    packed = load_runner(str(folder), execution="packed")
    assert isinstance(packed, PackedEmbeddingRunner)
    ids = padded.tokenize(real_texts, True)
    from lenbatch.core.collate import collate, pack

    want = padded.embed(collate(ids, padded.info.pad_token_id))
    got = packed.embed_packed(pack(ids))
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    assert len({len(x) for x in ids}) > 3  # ragged: the scatter and the key mask ran


def test_packed_refuses_non_bert(tmp_path: Path) -> None:
    """Packed execution names why a model cannot run packed; auto falls back to padded."""
    folder = _tiny_encoder(tmp_path, "roberta", "mean_tokens")
    with pytest.raises(ValueError, match="roberta"):
        load_runner(str(folder), execution="packed")
    runner = load_runner(str(folder), execution="auto")
    assert not isinstance(runner, PackedEmbeddingRunner)


@pytest.mark.parametrize("execution", ["padded", "packed"])
def test_each_layer_offers_a_pause_point(
    execution: str, tmp_path: Path, real_texts: list[str]
) -> None:
    """Both encoder runners call `between_layers` once before each layer (where the CPU
    budget of several models may pause the call), and the vectors do not change."""
    folder = _tiny_encoder(tmp_path, "bert", "mean_tokens")
    runner = load_runner(str(folder), execution=execution)
    from lenbatch.core.collate import collate

    ids = runner.tokenize(real_texts[:4], True)
    batch = collate(ids, runner.info.pad_token_id)
    want = runner.embed(batch)
    calls: list[int] = []
    runner.between_layers = lambda: calls.append(1)  # type: ignore[attr-defined]
    got = runner.embed(batch)
    assert len(calls) == 2  # the tiny encoder's two layers
    np.testing.assert_array_equal(got, want)


@pytest.fixture(scope="module")
def int8_set() -> tuple[list[str], list[str]]:
    """(queries, corpus) for the int8 gate: 120 GSM8K questions; their 120 answers and 100
    paragraphs of State of the Union speeches (220 passages, 340 texts in all)."""
    rows = [
        json.loads(line)
        for line in (_DATA / "gsm8k_test.jsonl").read_text(encoding="utf-8").splitlines()[200:320]
    ]
    paragraphs: list[str] = []
    with zipfile.ZipFile(_DATA / "nltk_state_union.zip") as z:
        for name in sorted(n for n in z.namelist() if n.endswith(".txt"))[1:]:
            text = z.read(name).decode("utf-8", errors="replace")
            paragraphs += [p.strip() for p in text.split("\n\n") if len(p.split()) > 5]
            if len(paragraphs) >= 100:
                break
    return [r["question"] for r in rows], [r["answer"] for r in rows] + paragraphs[:100]


@pytest.fixture(scope="module")
def int8_reference(int8_set: tuple[list[str], list[str]]) -> tuple[np.ndarray, np.ndarray]:
    """sentence-transformers fp32 vectors of the int8 gate's queries and corpus."""
    return _st_vectors(*int8_set)


@pytest.mark.parametrize("execution", ["packed", "padded"])
def test_int8_passes_its_accuracy_gate(
    execution: str,
    int8_set: tuple[list[str], list[str]],
    int8_reference: tuple[np.ndarray, np.ndarray],
) -> None:
    """`--quantize int8` against sentence-transformers float32 on 340 real texts (issue 23's
    gate): min cosine >= 0.99 and the same nearest neighbour for >= 99 % of the queries; the
    top-5 overlap is printed, and must stay above 0.8."""
    queries, corpus = int8_set
    ref_q, ref_c = int8_reference
    runner = load_runner("minilm", dtype="float32", execution=execution, quantization="int8")
    assert runner.quantization == "int8"  # type: ignore[attr-defined]
    ours_q = asyncio.run(_embed_all(runner, queries))
    ours_c = asyncio.run(_embed_all(runner, corpus))
    cos = np.concatenate([(ours_q * ref_q).sum(1), (ours_c * ref_c).sum(1)])
    ref_top, top = _top(ref_q, ref_c), _top(ours_q, ours_c)
    top1 = float((top[:, 0] == ref_top[:, 0]).mean())
    overlap = float(np.mean([len(set(a) & set(b)) / 5 for a, b in zip(top, ref_top, strict=True)]))
    print(
        f"int8 {execution}: {len(cos)} texts, min cosine {cos.min():.5f}, mean "
        f"{cos.mean():.5f}; nearest neighbour agrees {top1:.1%}, top-5 overlap {overlap:.1%}"
    )
    assert cos.min() >= 0.99, f"min cosine {cos.min():.5f}"
    assert top1 >= 0.99, f"nearest neighbour agrees for {top1:.1%}"
    assert overlap >= 0.8, f"top-5 overlap {overlap:.1%}"
