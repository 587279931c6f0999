"""Trace loaders on small slices of each format, format detection, and mapping of extra columns."""

from __future__ import annotations

import gzip
import shutil
from datetime import datetime
from pathlib import Path

import numpy as np
import pytest

from lenbatch.plan.trace import ColumnMap, detect_format, load_trace, map_trace

FIX = Path(__file__).parent.parent / "fixtures"


@pytest.mark.parametrize(
    ("name", "fmt"),
    [
        ("azure_conv_head12.csv", "azure"),
        ("mooncake_head8.jsonl", "mooncake"),
        ("sharegpt_head10.csv", "sharegpt"),
        ("lengthlog.jsonl", "lengthlog"),
        ("generic_ms.csv", "csv"),
        ("generic_iso.jsonl", "jsonl"),
    ],
)
def test_detect_format(name: str, fmt: str) -> None:
    """Each fixture's format is recognised from its first line."""
    assert detect_format(FIX / name) == fmt


def test_azure_slice() -> None:
    """Azure CSV: lengths in file order (already sorted), arrivals from 100 ns timestamps."""
    t = load_trace(FIX / "azure_conv_head12.csv")
    assert t.input_lengths.tolist() == [374, 396, 879, 91, 91, 381, 1313, 388, 242, 209, 394, 394]
    assert t.output_lengths is not None and t.output_lengths[:3].tolist() == [44, 109, 55]
    assert t.arrivals is not None
    # 18:15:50.9951690 - 18:15:46.6805900 and 18:15:56.1080580 - 18:15:46.6805900
    assert t.arrivals[1] == pytest.approx(4.314579, abs=1e-6)
    assert t.arrivals[-1] == pytest.approx(9.427468, abs=1e-6)


def test_mooncake_slice() -> None:
    """Mooncake JSONL: millisecond timestamps become seconds; hash_ids are ignored."""
    t = load_trace(FIX / "mooncake_head8.jsonl")
    assert len(t) == 8
    assert t.arrivals is not None
    assert t.arrivals.tolist() == pytest.approx([0, 0, 0.04, 0.277, 0.471, 0.529, 0.639, 0.937])
    assert t.input_lengths[:3].tolist() == [40160, 36640, 23769]
    assert t.output_lengths is not None and t.output_lengths[5] == 445


def test_sharegpt_slice() -> None:
    """ShareGPT CSV: prefill tokens are inputs, decode tokens outputs, no arrivals."""
    t = load_trace(FIX / "sharegpt_head10.csv")
    assert t.arrivals is None
    assert t.input_lengths.tolist() == [74, 290, 1402, 2497, 41, 238, 1045, 2053, 3026, 3455]
    assert t.output_lengths is not None and t.output_lengths[0] == 918


def test_length_log_sorted_with_timings() -> None:
    """The length log is sorted by arrival; timings and status ride along, null as NaN."""
    t = load_trace(FIX / "lengthlog.jsonl")
    assert t.input_lengths.tolist() == [12, 30, 40, 200]
    assert t.arrivals is not None and t.arrivals.tolist() == pytest.approx([0, 0.25, 0.5, 1.5])
    assert t.extra["status"].tolist() == ["ok", "ok", "ok", "expired"]
    assert t.extra["bucket"].tolist()[:2] == ["1-32", "1-32"]
    assert t.extra["queue_wait_ms"][:3].tolist() == [10.0, 2.0, 4.5]
    assert np.isnan(t.extra["exec_ms"][3])


def test_generic_csv_with_columns() -> None:
    """A CSV with named columns; arrivals in milliseconds are sorted and start at zero."""
    cols = ColumnMap(
        length="prompt_tokens", arrival="t_ms", output="completion_tokens", time_unit=1e-3
    )
    t = load_trace(FIX / "generic_ms.csv", columns=cols)
    assert t.input_lengths.tolist() == [40, 12, 5, 300]
    assert t.arrivals is not None and t.arrivals.tolist() == pytest.approx([0, 0.5, 1.25, 3.0])
    assert t.output_lengths is not None and t.output_lengths.tolist() == [7, 3, 1, 20]


def test_generic_jsonl_iso_times() -> None:
    """A JSONL with ISO date-times as arrivals."""
    t = load_trace(FIX / "generic_iso.jsonl", columns=ColumnMap(length="n_in", arrival="when"))
    assert t.input_lengths.tolist() == [9, 17, 130]
    assert t.arrivals is not None and t.arrivals.tolist() == pytest.approx([0, 0.25, 2.5])


def test_generic_lengths_only() -> None:
    """Without an arrival column the trace has no arrivals and keeps file order."""
    t = load_trace(FIX / "generic_ms.csv", columns=ColumnMap(length="prompt_tokens"))
    assert t.arrivals is None and t.input_lengths.tolist() == [12, 40, 5, 300]


def test_gzip(tmp_path: Path) -> None:
    """A gzipped trace loads the same as the plain file."""
    gz = tmp_path / "azure.csv.gz"
    with open(FIX / "azure_conv_head12.csv", "rb") as src, gzip.open(gz, "wb") as dst:
        shutil.copyfileobj(src, dst)
    a, b = load_trace(FIX / "azure_conv_head12.csv"), load_trace(gz)
    assert a.input_lengths.tolist() == b.input_lengths.tolist()
    assert a.arrivals is not None and b.arrivals is not None
    assert np.array_equal(a.arrivals, b.arrivals)


def test_bundled_by_name() -> None:
    """Bundled traces load by name with their documented row counts."""
    assert len(load_trace("azure-conv")) == 19366
    assert len(load_trace("sharegpt")) == 30731


def test_unknown_format_says_how() -> None:
    """A table lenbatch has no loader for fails with a message naming --length-column."""
    with pytest.raises(ValueError, match="--length-column"):
        load_trace(FIX / "generic_ms.csv")


def test_missing_column_named() -> None:
    """A missing column is named together with the header found."""
    with pytest.raises(ValueError, match=r"'tokens'.*prompt_tokens"):
        load_trace(FIX / "generic_ms.csv", columns=ColumnMap(length="tokens"))


def test_bad_value_has_line(tmp_path: Path) -> None:
    """A malformed token count is reported with its file and line."""
    bad = tmp_path / "bad.csv"
    bad.write_text("n\n3\nlots\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"bad.csv:3: expected a token count"):
        load_trace(bad, columns=ColumnMap(length="n"))


def test_zero_length_rows_dropped_with_note(tmp_path: Path) -> None:
    """Inputs of 0 tokens cannot be served; they are dropped and the drop is noted."""
    f = tmp_path / "z.csv"
    f.write_text("n\n3\n0\n5\n", encoding="utf-8")
    t = load_trace(f, columns=ColumnMap(length="n"))
    assert t.input_lengths.tolist() == [3, 5]
    assert any("0 tokens" in n for n in t.notes)


def test_iso_time_with_seven_digits_matches_datetime() -> None:
    """A 100 ns Azure timestamp equals datetime's parse of its first 6 digits plus the 7th."""
    t = load_trace(FIX / "azure_conv_head12.csv")
    first = datetime.fromisoformat("2023-11-16 18:15:46.680590").timestamp()
    third = datetime.fromisoformat("2023-11-16 18:15:51.222467").timestamp()
    assert t.arrivals is not None
    assert t.arrivals[2] == pytest.approx(third - first, abs=1e-6)


def test_map_trace_keeps_extra_aligned() -> None:
    """Mapping (window, drop) filters the length log's extra columns with the rows."""
    t = load_trace(FIX / "lengthlog.jsonl")
    m = map_trace(t, max_length=100, overflow="drop", start_s=0.2)
    assert m.input_lengths.tolist() == [30, 40]
    assert m.extra["queue_wait_ms"].tolist() == [2.0, 4.5]
    assert len(m.notes) == 2
