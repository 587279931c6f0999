"""A deterministic stand-in for a model, for tests of everything above the runner.

`FakeRunner` tokenizes by whitespace (stable CRC32 ids), returns vectors that depend only on a
row's real tokens (so batching must not change them), records every batch it saw, and can charge
a known cost per batch to an injected clock (a `FakeClock` for exact profiling tests) or sleep
for it (engine tests with a real clock).
"""

from __future__ import annotations

import threading
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import numpy.typing as npt

from lenbatch.core.clock import FakeClock
from lenbatch.core.collate import Collated
from lenbatch.runners.base import ModelInfo, RunnerMemory

__all__ = ["FakeRunner", "SeenBatch"]

CostFn = Callable[[int, int], float]  # (batch size, padded length) -> seconds


@dataclass(frozen=True, slots=True)
class SeenBatch:
    """What the fake runner was given: rows, padded length, and each row's real length."""

    size: int
    padded_len: int
    lengths: tuple[int, ...]


@dataclass
class FakeRunner:
    """Deterministic embedding 'model'. Thread-safe enough for the engine's worker thread."""

    max_length: int = 256
    dim: int = 8
    padding_side: str = "right"
    cost: CostFn | None = None
    clock: FakeClock | None = None  # if set, cost is charged here instead of sleeping
    record: bool = True  # keep every batch in `batches` (off when served: it would only grow)
    info: ModelInfo = field(init=False)
    batches: list[SeenBatch] = field(default_factory=list, init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    CLS = 101
    SEP = 102
    VOCAB = 30522

    def __post_init__(self) -> None:
        side: Literal["right", "left"] = "left" if self.padding_side == "left" else "right"
        self.info = ModelInfo(
            name="fake",
            max_length=self.max_length,
            pad_token_id=0,
            padding_side=side,
            needs_position_ids=False,
            vocab_size=self.VOCAB,
            dim=self.dim,
        )

    def token_id(self, word: str) -> int:
        """The id a word maps to (stable across runs)."""
        return 1000 + zlib.crc32(word.encode("utf-8")) % (self.VOCAB - 1000)

    def tokenize(self, texts: Sequence[str], truncate: bool) -> list[list[int]]:
        """[CLS] + one id per whitespace word + [SEP]; cut to max_length if `truncate`."""
        out = []
        for text in texts:
            ids = [self.CLS, *(self.token_id(w) for w in text.split()), self.SEP]
            if truncate and len(ids) > self.max_length:
                ids = [*ids[: self.max_length - 1], self.SEP]
            out.append(ids)
        return out

    def vector(self, ids: Sequence[int]) -> npt.NDArray[np.float32]:
        """The vector for one unpadded sequence: the reference the batched output must equal."""
        arr = np.asarray(ids, dtype=np.float64)
        feats = [len(arr), arr.sum() % 9973, (arr * np.arange(1, len(arr) + 1)).sum() % 7919]
        v = np.array([feats[i % 3] + i for i in range(self.dim)], dtype=np.float64)
        return (v / np.linalg.norm(v)).astype(np.float32)

    def embed(self, batch: Collated) -> npt.NDArray[np.float32]:
        """One vector per row, from the row's unpadded tokens only."""
        rows = batch.input_ids.shape[0]
        width = batch.input_ids.shape[1]
        if self.record:
            with self._lock:
                self.batches.append(SeenBatch(rows, width, batch.lengths))
        if self.cost is not None:
            dt = self.cost(rows, width)
            if self.clock is not None:
                self.clock.advance(dt)
            else:
                time.sleep(dt)
        out = np.empty((rows, self.dim), dtype=np.float32)
        for r in range(rows):
            real = batch.input_ids[r][batch.attention_mask[r] == 1]
            out[r] = self.vector(real.tolist())
        return out

    def memory(self) -> RunnerMemory:
        """A fake has no weights; reports zeros."""
        return RunnerMemory(weights=0, peak_activations=0, device="cpu")
