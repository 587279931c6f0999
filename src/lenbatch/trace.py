"""Request traces: arrival times and token lengths, loaded from real logs and mapped to a model.

A `Trace` is columns (numpy arrays) sorted by arrival: seconds from the first request, input
length, and output length where the source has one. Traces without timestamps have
`arrivals=None`. LLM traces need mapping before they fit a small encoder; `map_trace` does it
explicitly and records every step in `Trace.notes` so reports can say what was done.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass, field, replace
from datetime import datetime
from importlib import resources
from pathlib import Path
from typing import Literal

import numpy as np
import numpy.typing as npt

__all__ = ["BUNDLED_TRACES", "Trace", "bundled_path", "load_azure", "load_trace", "map_trace"]

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]

# Traces shipped inside the package (see data/README.md for sources and licences).
BUNDLED_TRACES = {
    "azure-conv": "AzureLLMInferenceTrace_conv.csv",
    "mooncake": "mooncake_synthetic_trace.jsonl",
    "sharegpt": "sharegpt_8k_filtered_stats_llama2_tokenizer.csv",
}


@dataclass(frozen=True)
class Trace:
    """Requests as columns, sorted by arrival time."""

    input_lengths: IntArray
    arrivals: FloatArray | None = None  # seconds from the first request
    output_lengths: IntArray | None = None
    source: str = ""
    notes: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        n = len(self.input_lengths)
        for name in ("arrivals", "output_lengths"):
            col = getattr(self, name)
            if col is not None and len(col) != n:
                raise ValueError(f"trace column {name} has {len(col)} rows, expected {n}")

    def __len__(self) -> int:
        return len(self.input_lengths)

    @property
    def duration(self) -> float:
        """Seconds from the first to the last arrival (0 without timestamps)."""
        if self.arrivals is None or len(self.arrivals) == 0:
            return 0.0
        return float(self.arrivals[-1] - self.arrivals[0])

    def with_note(self, note: str, **changes: object) -> Trace:
        """A copy with columns replaced and `note` appended to the notes."""
        return replace(self, notes=(*self.notes, note), **changes)  # type: ignore[arg-type]


def bundled_path(name: str) -> Path:
    """Path of a bundled trace (`azure-conv`, `mooncake`, `sharegpt`)."""
    if name not in BUNDLED_TRACES:
        raise ValueError(f"unknown bundled trace {name!r}; choose one of {sorted(BUNDLED_TRACES)}")
    ref = resources.files("lenbatch") / "data" / "traces" / BUNDLED_TRACES[name]
    return Path(str(ref))


def _sorted(trace: Trace) -> Trace:
    if trace.arrivals is None:
        return trace
    order = np.argsort(trace.arrivals, kind="stable")
    arr = trace.arrivals[order]
    return replace(
        trace,
        arrivals=arr - arr[0] if len(arr) else arr,
        input_lengths=trace.input_lengths[order],
        output_lengths=None if trace.output_lengths is None else trace.output_lengths[order],
    )


def load_azure(path: str | Path) -> Trace:
    """Azure LLM inference trace CSV: `TIMESTAMP,ContextTokens,GeneratedTokens`."""
    stamps: list[float] = []
    inputs: list[int] = []
    outputs: list[int] = []
    with open(path, newline="", encoding="utf-8") as f:
        for row in csv.DictReader(f):
            # Timestamps carry 7 fractional digits (100 ns); datetime takes at most 6.
            ts = row["TIMESTAMP"].strip()
            head, _, frac = ts.partition(".")
            stamp = datetime.fromisoformat(head).timestamp() + float(f"0.{frac or '0'}")
            stamps.append(stamp)
            inputs.append(int(row["ContextTokens"]))
            outputs.append(int(row["GeneratedTokens"]))
    return _sorted(
        Trace(
            input_lengths=np.asarray(inputs, dtype=np.int64),
            arrivals=np.asarray(stamps, dtype=np.float64),
            output_lengths=np.asarray(outputs, dtype=np.int64),
            source=str(path),
        )
    )


TraceFormat = Literal["azure"]


def load_trace(path: str | Path, fmt: str | None = None) -> Trace:
    """Load a trace file, or a bundled trace by name (`azure-conv`, ...)."""
    p = Path(path)
    if not p.exists() and str(path) in BUNDLED_TRACES:
        p = bundled_path(str(path))
    if not p.exists():
        raise FileNotFoundError(f"trace {path} not found")
    with p.open(encoding="utf-8") as f:
        header = f.readline()
    if fmt in (None, "azure") and header.startswith("TIMESTAMP,ContextTokens"):
        return load_azure(p)
    raise ValueError(f"{p}: unrecognised trace format (header {header[:60].strip()!r})")


Overflow = Literal["clip", "drop", "keep"]


def map_trace(
    trace: Trace,
    *,
    length_scale: float = 1.0,
    max_length: int | None = None,
    overflow: Overflow = "clip",
    rate_scale: float = 1.0,
    limit: int | None = None,
    start_s: float | None = None,
    end_s: float | None = None,
) -> Trace:
    """Map a trace onto a model and a machine, recording each step in `notes`.

    Order: time window, length scale (rounded, at least 1 token), max length (`clip` to it,
    `drop` longer requests, or `keep` them to test rejection), rate scale (arrivals divided by
    `rate_scale`: 2 means twice as fast), then the first `limit` requests.
    """
    t = trace
    if (start_s is not None or end_s is not None) and t.arrivals is not None:
        lo = start_s if start_s is not None else -np.inf
        hi = end_s if end_s is not None else np.inf
        keep = (t.arrivals >= lo) & (t.arrivals < hi)
        t = _take(t, keep, f"window [{start_s}, {end_s}) s: {int(keep.sum())} of {len(t)}")
        if t.arrivals is not None and len(t.arrivals):
            t = replace(t, arrivals=t.arrivals - t.arrivals[0])
    if length_scale != 1.0:
        if length_scale <= 0:
            raise ValueError(f"length_scale must be positive, got {length_scale}")
        scaled = np.maximum(1, np.rint(t.input_lengths * length_scale)).astype(np.int64)
        t = t.with_note(f"input lengths x{length_scale:g}", input_lengths=scaled)
    if max_length is not None:
        over = t.input_lengths > max_length
        n_over = int(over.sum())
        if overflow == "clip":
            clipped = np.minimum(t.input_lengths, max_length)
            t = t.with_note(
                f"clipped {n_over} inputs to {max_length} tokens", input_lengths=clipped
            )
        elif overflow == "drop":
            t = _take(t, ~over, f"dropped {n_over} inputs over {max_length} tokens")
        elif overflow == "keep":
            t = t.with_note(f"kept {n_over} inputs over {max_length} tokens (to be rejected)")
        else:
            raise ValueError(f"overflow must be clip, drop or keep, got {overflow!r}")
    if rate_scale != 1.0:
        if rate_scale <= 0:
            raise ValueError(f"rate_scale must be positive, got {rate_scale}")
        if t.arrivals is not None:
            t = t.with_note(f"arrival rate x{rate_scale:g}", arrivals=t.arrivals / rate_scale)
    if limit is not None and limit < len(t):
        t = _take(t, np.arange(len(t)) < limit, f"first {limit} requests")
    return t


def _take(t: Trace, mask: npt.NDArray[np.bool_], note: str) -> Trace:
    return t.with_note(
        note,
        input_lengths=t.input_lengths[mask],
        arrivals=None if t.arrivals is None else t.arrivals[mask],
        output_lengths=None if t.output_lengths is None else t.output_lengths[mask],
    )
