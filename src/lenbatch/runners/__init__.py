"""Runners: the model behind a narrow protocol (`EmbeddingRunner`, `CausalRunner`), real or fake.

`base` holds the protocols, `loading` the model names and folders, `encoder` and `causal` the
real models, `packed` the padding-free encoder, `hardware` the processor and float type,
`fake`, `faulty` and `tiny` the stand-ins for tests, `memory` the RSS readings.
"""

from __future__ import annotations

from lenbatch.runners.base import CausalRunner, EmbeddingRunner, ModelInfo, RunnerMemory
from lenbatch.runners.fake import FakeRunner
from lenbatch.runners.loading import MODEL_ALIASES, load_runner, resolve_model

__all__ = [
    "MODEL_ALIASES",
    "CausalRunner",
    "EmbeddingRunner",
    "FakeRunner",
    "ModelInfo",
    "RunnerMemory",
    "load_runner",
    "resolve_model",
]
