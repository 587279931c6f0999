"""Request traces: arrival times and token lengths, loaded from real logs and mapped to a model.

A `Trace` is columns (numpy arrays) sorted by arrival: seconds from the first request, input
length, and output length where the source has one. Traces without timestamps have
`arrivals=None`. Formats: the Azure LLM inference CSV, Mooncake JSONL, the ShareGPT length CSV,
the server's own length log, and any CSV/JSONL with named columns (`ColumnMap`); `load_trace`
detects the first four from the file's first line. LLM traces need mapping before they fit a
small encoder; `map_trace` does it explicitly and records every step in `Trace.notes` so reports
can say what was done.
"""

from __future__ import annotations

import csv
import gzip
import json
import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime
from importlib import resources
from pathlib import Path
from typing import IO, Any, Literal

import numpy as np
import numpy.typing as npt

__all__ = [
    "BUNDLED_TRACES",
    "TRACE_FORMATS",
    "ColumnMap",
    "FloatArray",
    "IntArray",
    "Trace",
    "bundled_path",
    "detect_format",
    "load_azure",
    "load_columns",
    "load_length_log",
    "load_mooncake",
    "load_sharegpt",
    "load_trace",
    "map_trace",
]

# The column types of traces and of the plans, results and fits made from them.
FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

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
    # Further per-request columns a source carries (the length log's timings and status).
    extra: Mapping[str, npt.NDArray[Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = len(self.input_lengths)
        cols = [("arrivals", self.arrivals), ("output_lengths", self.output_lengths)]
        for name, col in [*cols, *self.extra.items()]:
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
        extra={k: v[order] for k, v in trace.extra.items()},
    )


def load_azure(path: str | Path) -> Trace:
    """Azure LLM inference trace CSV: `TIMESTAMP,ContextTokens,GeneratedTokens`."""
    stamps: list[float] = []
    inputs: list[int] = []
    outputs: list[int] = []
    with _open(path) as f:
        for line, row in enumerate(csv.DictReader(f), start=2):
            stamps.append(_parse_time(row["TIMESTAMP"], 1.0, path, line))
            inputs.append(_parse_int(row["ContextTokens"], path, line))
            outputs.append(_parse_int(row["GeneratedTokens"], path, line))
    return _finish(path, inputs, stamps, outputs)


def load_mooncake(path: str | Path) -> Trace:
    """Mooncake JSONL: `timestamp` (ms from start), `input_length`, `output_length`."""
    stamps: list[float] = []
    inputs: list[int] = []
    outputs: list[int] = []
    for line, rec in _json_lines(path):
        stamps.append(_parse_time(_field(rec, "timestamp", path, line), 1e-3, path, line))
        inputs.append(_parse_int(_field(rec, "input_length", path, line), path, line))
        outputs.append(_parse_int(_field(rec, "output_length", path, line), path, line))
    return _finish(path, inputs, stamps, outputs)


def load_sharegpt(path: str | Path) -> Trace:
    """ShareGPT length CSV (`num_prefill_tokens`, `num_decode_tokens`, ...): no timestamps."""
    inputs: list[int] = []
    outputs: list[int] = []
    with _open(path) as f:
        for line, row in enumerate(csv.DictReader(f), start=2):
            inputs.append(_parse_int(row["num_prefill_tokens"], path, line))
            outputs.append(_parse_int(row["num_decode_tokens"], path, line))
    return _finish(path, inputs, None, outputs)


def load_length_log(path: str | Path) -> Trace:
    """The server's own length log (`lenbatch serve --length-log`, see `serving/lengthlog.py`).

    Arrivals are unix seconds in the file and seconds from the first request in the trace.
    The timings and outcome ride along in `extra`: `queue_wait_ms` and `exec_ms` (NaN where a
    request never ran), `status` and `bucket` (labels). Every admitted request is traffic,
    whatever its status, so none is dropped here.
    """
    stamps: list[float] = []
    inputs: list[int] = []
    waits: list[float] = []
    execs: list[float] = []
    statuses: list[str] = []
    buckets: list[str] = []
    for line, rec in _json_lines(path):
        stamps.append(_parse_time(_field(rec, "arrival", path, line), 1.0, path, line))
        inputs.append(_parse_int(_field(rec, "length", path, line), path, line))
        wait, exe = rec.get("queue_wait_ms"), rec.get("exec_ms")
        waits.append(math.nan if wait is None else float(wait))
        execs.append(math.nan if exe is None else float(exe))
        statuses.append(str(rec.get("status", "")))
        buckets.append(str(rec.get("bucket", "")))
    extra = {
        "queue_wait_ms": np.asarray(waits, dtype=np.float64),
        "exec_ms": np.asarray(execs, dtype=np.float64),
        "status": np.asarray(statuses, dtype=np.str_),
        "bucket": np.asarray(buckets, dtype=np.str_),
    }
    return _finish(path, inputs, stamps, None, extra)


@dataclass(frozen=True)
class ColumnMap:
    """Which columns (CSV header names or JSON keys) of a generic trace hold what.

    `time_unit` is seconds per unit of the arrival column (1e-3 for milliseconds); arrivals
    that are not numbers are parsed as ISO-8601 date-times.
    """

    length: str
    arrival: str | None = None
    output: str | None = None
    time_unit: float = 1.0


def load_columns(path: str | Path, columns: ColumnMap) -> Trace:
    """A generic CSV or JSONL trace with named columns (see `ColumnMap`)."""
    if _first_line(Path(path)).lstrip().startswith("{"):
        rows: Iterator[tuple[int, dict[str, Any]]] = _json_lines(path)
        return _from_rows(path, rows, columns)
    with _open(path) as f:
        reader = csv.DictReader(f)
        header = reader.fieldnames or []
        missing = [c for c in (columns.length, columns.arrival, columns.output) if c]
        missing = [c for c in missing if c not in header]
        if missing:
            raise ValueError(f"{path}: no column {missing[0]!r}; the header has {header}")
        return _from_rows(path, enumerate(reader, start=2), columns)


def _from_rows(
    path: str | Path, rows: Iterable[tuple[int, Mapping[str, Any]]], cols: ColumnMap
) -> Trace:
    stamps: list[float] = []
    inputs: list[int] = []
    outputs: list[int] = []
    for line, rec in rows:
        inputs.append(_parse_int(_field(rec, cols.length, path, line), path, line))
        if cols.arrival:
            raw = _field(rec, cols.arrival, path, line)
            stamps.append(_parse_time(raw, cols.time_unit, path, line))
        if cols.output:
            outputs.append(_parse_int(_field(rec, cols.output, path, line), path, line))
    return _finish(path, inputs, stamps if cols.arrival else None, outputs if cols.output else None)


TRACE_FORMATS = ("azure", "mooncake", "sharegpt", "lengthlog", "csv", "jsonl")


def detect_format(path: str | Path) -> str:
    """The format of a trace file, from its first line: one of `TRACE_FORMATS`.

    `csv` and `jsonl` mean "a table this module has no loader for": read them with a
    `ColumnMap`.
    """
    first = _first_line(Path(path)).strip()
    if first.startswith("{"):
        try:
            keys = set(json.loads(first))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: first line is not valid JSON ({exc})") from None
        if {"timestamp", "input_length"} <= keys:
            return "mooncake"
        if {"arrival", "length", "status"} <= keys:
            return "lengthlog"
        return "jsonl"
    header = [h.strip() for h in first.split(",")]
    if header[:2] == ["TIMESTAMP", "ContextTokens"]:
        return "azure"
    if "num_prefill_tokens" in header:
        return "sharegpt"
    return "csv"


_LOADERS = {
    "azure": load_azure,
    "mooncake": load_mooncake,
    "sharegpt": load_sharegpt,
    "lengthlog": load_length_log,
}


def load_trace(
    path: str | Path, fmt: str | None = None, *, columns: ColumnMap | None = None
) -> Trace:
    """Load a trace file (plain or `.gz`), or a bundled trace by name (`azure-conv`, ...).

    The format is detected from the first line unless `fmt` names one of `TRACE_FORMATS`.
    With `columns`, the file is read as a generic table with those columns, whatever it is.
    """
    p = Path(path)
    if not p.exists() and str(path) in BUNDLED_TRACES:
        p = bundled_path(str(path))
    if not p.exists():
        raise FileNotFoundError(f"trace {path} not found")
    if fmt is not None and fmt not in TRACE_FORMATS:
        raise ValueError(f"unknown trace format {fmt!r}; choose one of {', '.join(TRACE_FORMATS)}")
    kind = fmt or detect_format(p)
    if columns is not None:
        return load_columns(p, columns)
    if kind in _LOADERS:
        return _LOADERS[kind](p)
    raise ValueError(
        f"{p}: not a format lenbatch knows (first line {_first_line(p)[:80].strip()!r}); "
        "name its columns: --length-column NAME [--arrival-column NAME --time-unit s|ms] "
        "[--output-column NAME]"
    )


# ---------------------------------------------------------------------------- parsing helpers


def _open(path: str | Path) -> IO[str]:
    p = Path(path)
    if p.suffix == ".gz":
        return gzip.open(p, "rt", encoding="utf-8", newline="")
    return p.open(encoding="utf-8", newline="")


def _first_line(path: Path) -> str:
    with _open(path) as f:
        for line in f:
            if line.strip():
                return line
    raise ValueError(f"{path}: the file is empty")


def _json_lines(path: str | Path) -> Iterator[tuple[int, dict[str, Any]]]:
    with _open(path) as f:
        for line, text in enumerate(f, start=1):
            if not text.strip():
                continue
            try:
                rec = json.loads(text)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{line}: not valid JSON ({exc})") from None
            if not isinstance(rec, dict):
                raise ValueError(f"{path}:{line}: expected a JSON object per line")
            yield line, rec


def _field(rec: Mapping[str, Any], key: str, path: str | Path, line: int) -> Any:
    if key not in rec:
        raise ValueError(f"{path}:{line}: no field {key!r} (fields: {sorted(rec)})")
    return rec[key]


def _parse_int(value: Any, path: str | Path, line: int) -> int:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{path}:{line}: expected a token count, got {value!r}") from None
    if not number.is_integer() or number < 0:
        raise ValueError(f"{path}:{line}: expected a whole token count >= 0, got {value!r}")
    return int(number)


def _parse_time(value: Any, unit: float, path: str | Path, line: int) -> float:
    """Seconds from a number in `unit` seconds or an ISO-8601 date-time (naive = local)."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value) * unit
    text = str(value).strip()
    try:
        return float(text) * unit
    except ValueError:
        pass
    # Azure timestamps carry 7 fractional digits (100 ns); datetime takes at most 6.
    head, _, frac = text.partition(".")
    tail = ""
    for i, ch in enumerate(frac):
        if not ch.isdigit():
            frac, tail = frac[:i], frac[i:]
            break
    try:
        stamp = datetime.fromisoformat(head + tail).timestamp()
    except ValueError:
        raise ValueError(f"{path}:{line}: cannot read time {value!r}") from None
    return stamp + float(f"0.{frac or '0'}")


def _finish(
    path: str | Path,
    inputs: list[int],
    stamps: list[float] | None,
    outputs: list[int] | None,
    extra: dict[str, npt.NDArray[Any]] | None = None,
) -> Trace:
    if not inputs:
        raise ValueError(f"{path}: the trace has no requests")
    trace = _sorted(
        Trace(
            input_lengths=np.asarray(inputs, dtype=np.int64),
            arrivals=None if stamps is None else np.asarray(stamps, dtype=np.float64),
            output_lengths=None if outputs is None else np.asarray(outputs, dtype=np.int64),
            source=str(path),
            extra=extra or {},
        )
    )
    empty = trace.input_lengths < 1
    if empty.any():
        # A zero-token input cannot be served or bucketed; keep the rest, say so.
        trace = _take(trace, ~empty, f"dropped {int(empty.sum())} inputs of 0 tokens")
    return trace


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
        extra={k: v[mask] for k, v in t.extra.items()},
    )
