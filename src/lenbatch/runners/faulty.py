"""Fault injection for tests: a runner that wraps another and fails on purpose.

`FaultyRunner` passes everything through to the runner it wraps, except:

* **poison** — a batch holding a row with the token id `poison_token`, or a row of exactly
  `poison_length` real tokens, raises `PoisonInput` (as a model raising on one odd input would);
* **out of memory** — a batch over `oom_tokens` padded tokens raises `MemoryError`, or with
  `oom_kind="cuda"` the error type PyTorch raises on a GPU (`torch.cuda.OutOfMemoryError`, which
  exists in CPU builds too);
* **crash** — once `crash_after` batches have run, every later call raises `RunnerCrashed`
  (`crash_kind="fatal"`, the runner says it is unusable) or a plain `RuntimeError`
  (`crash_kind="sticky"`, as a broken device does, for the engine to find out by probing);
* **hold** — with a `threading.Event` as `hold`, every call waits until it is set, so a test can
  keep the runner busy for exactly as long as it needs instead of sleeping.

`runner_from_spec` builds the fake (optionally faulty) runner behind the hidden model alias
`fake`, used by tests that run `lenbatch serve` as a subprocess, e.g.
`--model "fake?batch_ms=20&poison_token=7"`. Not for production use.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import parse_qsl

import numpy as np
import numpy.typing as npt

from lenbatch.core.collate import Collated
from lenbatch.core.errors import RunnerCrashed
from lenbatch.runners.base import EmbeddingRunner, ModelInfo, RunnerMemory
from lenbatch.runners.fake import FakeRunner

__all__ = ["FaultyCausalRunner", "FaultyRunner", "PoisonInput", "runner_from_spec"]


class PoisonInput(ValueError):
    """What `FaultyRunner` raises for a poison row (the message names no input content)."""


def _cuda_oom(message: str) -> Exception:
    try:
        import torch

        return torch.cuda.OutOfMemoryError(message)
    except ImportError:  # torch-less install: an error of the same name and base
        return type("OutOfMemoryError", (RuntimeError,), {})(message)  # type: ignore[no-any-return]


@dataclass
class FaultyRunner:
    """Wraps `inner` and injects poison, out-of-memory and crash faults (see module doc)."""

    inner: EmbeddingRunner
    poison_token: int | None = None
    poison_length: int | None = None
    oom_tokens: int | None = None
    oom_kind: Literal["memory", "cuda"] = "memory"
    crash_after: int | None = None
    crash_kind: Literal["fatal", "sticky"] = "fatal"
    hold: threading.Event | None = None
    info: ModelInfo = field(init=False)  # the wrapped runner's
    calls: int = field(default=0, init=False)  # embed calls so far, failed ones included
    faults: dict[str, int] = field(default_factory=dict, init=False)  # injected, by kind
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    def __post_init__(self) -> None:
        self.info = self.inner.info

    def tokenize(self, texts: Sequence[str], truncate: bool) -> list[list[int]]:
        """The wrapped runner's tokenizer (faults are injected at `embed` only)."""
        return self.inner.tokenize(texts, truncate)

    def memory(self) -> RunnerMemory:
        """The wrapped runner's memory figures."""
        return self.inner.memory()

    def _count(self, kind: str) -> None:
        self.faults[kind] = self.faults.get(kind, 0) + 1

    def embed(self, batch: Collated) -> npt.NDArray[np.float32]:
        """Raise the configured fault for this batch, or pass it to the wrapped runner."""
        if self.hold is not None:
            self.hold.wait()
        with self._lock:
            self.calls += 1
            calls = self.calls
            if self.crash_after is not None and calls > self.crash_after:
                self._count("crash")
                if self.crash_kind == "fatal":
                    raise RunnerCrashed(f"injected crash after {self.crash_after} batches")
                raise RuntimeError(f"injected broken device after {self.crash_after} batches")
            if self.oom_tokens is not None and batch.padded_tokens > self.oom_tokens:
                self._count("oom")
                msg = f"injected: {batch.padded_tokens} padded tokens > {self.oom_tokens}"
                if self.oom_kind == "cuda":
                    raise _cuda_oom(f"CUDA out of memory ({msg})")
                raise MemoryError(msg)
            for row, n in enumerate(batch.lengths):
                poisoned = n == self.poison_length
                if self.poison_token is not None and not poisoned:
                    real = batch.input_ids[row][batch.attention_mask[row] == 1]
                    poisoned = bool((real == self.poison_token).any())
                if poisoned:
                    self._count("poison")
                    raise PoisonInput(f"injected poison in row {row} of {len(batch.lengths)}")
        return self.inner.embed(batch)


class FaultyCausalRunner:
    """Wraps a causal-LM runner; its `forward` runs out of memory on purpose.

    A prefill call (more than one column) over more than `oom_prefill_tokens` input tokens
    (rows x columns) raises `MemoryError` before running, so its cache is untouched. A decode
    step (one column) of more than `oom_decode_rows` rows runs the inner forward first, so the
    cache holds the step's new column as a step failing in a late layer leaves it, then raises.
    Everything else passes through to `inner`. For tests.
    """

    def __init__(
        self,
        inner: Any,
        *,
        oom_prefill_tokens: int | None = None,
        oom_decode_rows: int | None = None,
    ) -> None:
        self.inner = inner
        self.oom_prefill_tokens = oom_prefill_tokens
        self.oom_decode_rows = oom_decode_rows
        self.faults: dict[str, int] = {}
        self.calls: list[tuple[int, int]] = []  # (rows, columns) of forward calls that ran

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def forward(self, input_ids: Any, mask: Any, positions: Any, cache: Any) -> Any:
        """The inner forward, or an injected out-of-memory error (see the class doc)."""
        shape = (int(input_ids.shape[0]), int(input_ids.shape[1]))
        self._before([shape])
        out = self.inner.forward(input_ids, mask, positions, cache)
        self._after([shape])
        return out

    def forward_segments(self, segments: Any) -> Any:
        """One forward over several segments (the inner runner's), with the same faults as
        `forward` applied to each segment."""
        shapes = [(int(s.input_ids.shape[0]), int(s.input_ids.shape[1])) for s in segments]
        self._before(shapes)
        out = self.inner.forward_segments(segments)
        self._after(shapes)
        return out

    def _before(self, shapes: list[tuple[int, int]]) -> None:
        """A prefill over the token limit raises before anything runs."""
        limit = self.oom_prefill_tokens
        for rows, cols in shapes:
            if cols > 1 and limit is not None and rows * cols > limit:
                self.faults["prefill_oom"] = self.faults.get("prefill_oom", 0) + 1
                raise MemoryError(f"injected: prefill of {rows}x{cols} tokens > {limit}")

    def _after(self, shapes: list[tuple[int, int]]) -> None:
        """A decode step over the row limit raises after the cache was written."""
        for rows, cols in shapes:
            if cols == 1 and self.oom_decode_rows is not None and rows > self.oom_decode_rows:
                self.faults["decode_oom"] = self.faults.get("decode_oom", 0) + 1
                raise MemoryError(f"injected: decode step of {rows} rows > {self.oom_decode_rows}")
        self.calls.extend(shapes)


_SPEC_KEYS = {
    "batch_ms": "fixed cost per batch, ms (sleeps)",
    "token_us": "cost per padded token, microseconds (sleeps)",
    "max_length": "longest input in tokens (default 256)",
    "dim": "vector width (default 8)",
    "poison_token": "token id that makes a batch raise",
    "poison_length": "input length that makes a batch raise",
    "oom_tokens": "padded tokens above which a batch runs out of memory",
    "oom_kind": "memory | cuda",
    "crash_after": "batches after which every call fails",
    "crash_kind": "fatal | sticky",
}


def runner_from_spec(spec: str) -> EmbeddingRunner:
    """The runner named by a `fake?key=value&...` spec (keys in `_SPEC_KEYS`); for tests."""
    name, _, query = spec.partition("?")
    if name.lower() != "fake":
        raise ValueError(f"not a fake runner spec: {spec!r}")
    try:
        opts = dict(parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query)))
    except ValueError as exc:
        raise ValueError(f"bad fake runner spec {spec!r}: {exc}") from None
    unknown = sorted(set(opts) - set(_SPEC_KEYS))
    if unknown:
        valid = ", ".join(f"{k} ({v})" for k, v in _SPEC_KEYS.items())
        raise ValueError(f"unknown fake runner option(s) {unknown}; valid: {valid}")
    try:
        batch_s = float(opts.pop("batch_ms", 0)) / 1e3
        token_s = float(opts.pop("token_us", 0)) / 1e6
        fake = FakeRunner(
            max_length=int(opts.pop("max_length", 256)),
            dim=int(opts.pop("dim", 8)),
            record=False,
        )
        if batch_s or token_s:
            fake.cost = lambda rows, width: batch_s + token_s * rows * width
        if not opts:
            return fake
        ints = {k: int(opts[k]) for k in opts if k not in ("oom_kind", "crash_kind")}
    except ValueError as exc:
        raise ValueError(f"bad fake runner option in {spec!r}: {exc}") from None
    oom_kind = opts.get("oom_kind", "memory")
    crash_kind = opts.get("crash_kind", "fatal")
    if oom_kind not in ("memory", "cuda") or crash_kind not in ("fatal", "sticky"):
        raise ValueError("oom_kind must be memory|cuda and crash_kind fatal|sticky")
    return FaultyRunner(
        fake,
        poison_token=ints.get("poison_token"),
        poison_length=ints.get("poison_length"),
        oom_tokens=ints.get("oom_tokens"),
        oom_kind="cuda" if oom_kind == "cuda" else "memory",
        crash_after=ints.get("crash_after"),
        crash_kind="sticky" if crash_kind == "sticky" else "fatal",
    )
