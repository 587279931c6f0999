"""The packed MiniLM runner gives the same vectors with lenbatch's packed attention op as with
torch's attention (the op forced off), on real text with ragged rows."""

from __future__ import annotations

import numpy as np
import pytest

from lenbatch.runners import decode_attention as da
from tests.helpers import needs_avx512, needs_op


@pytest.mark.parametrize(
    "dtype",
    [pytest.param("float32", marks=needs_op), pytest.param("bfloat16", marks=needs_avx512)],
)
def test_the_packed_runner_with_the_op_equals_it_without(
    dtype: str, monkeypatch: pytest.MonkeyPatch, real_texts: list[str]
) -> None:
    """MiniLM packed: the same vectors with the op as with torch's attention (forced)."""
    from lenbatch.core.collate import pack
    from lenbatch.runners import load_runner

    with_op = load_runner("minilm", dtype=dtype, execution="packed")
    assert with_op._kernel is not None  # type: ignore[attr-defined]
    monkeypatch.setenv("LENBATCH_DECODE_ATTENTION", "sdpa")
    monkeypatch.setattr(da, "_loaded", {})
    without = load_runner("minilm", dtype=dtype, execution="packed")
    assert without._kernel is None  # type: ignore[attr-defined]
    ids = with_op.tokenize(real_texts, True)
    assert len({len(x) for x in ids}) > 3  # ragged rows
    batch = pack(ids)
    got, want = with_op.embed_packed(batch), without.embed_packed(batch)
    cos = (got * want).sum(1)
    if dtype == "float32":
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    assert cos.min() >= 0.9995, f"min cosine {cos.min():.6f}"
