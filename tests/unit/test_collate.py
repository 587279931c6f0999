"""Collate: padding side, mask, position ids and token accounting."""

from __future__ import annotations

import numpy as np
import pytest

from lenbatch.core.collate import collate


def test_right_padding_to_longest() -> None:
    """Right padding fills after the tokens; the mask marks real tokens only."""
    c = collate([[5, 6, 7], [8]], pad_id=0, side="right")
    np.testing.assert_array_equal(c.input_ids, [[5, 6, 7], [8, 0, 0]])
    np.testing.assert_array_equal(c.attention_mask, [[1, 1, 1], [1, 0, 0]])
    assert c.position_ids is None
    assert (c.real_tokens, c.padded_tokens) == (4, 6)
    assert c.padding_waste == pytest.approx(1 / 3)


def test_left_padding_with_positions() -> None:
    """Left padding puts pads first; positions count from 0 at each row's first real token."""
    c = collate([[5, 6, 7], [8, 9]], pad_id=2, side="left", position_ids=True)
    np.testing.assert_array_equal(c.input_ids, [[5, 6, 7], [2, 8, 9]])
    np.testing.assert_array_equal(c.attention_mask, [[1, 1, 1], [0, 1, 1]])
    assert c.position_ids is not None
    np.testing.assert_array_equal(c.position_ids, [[0, 1, 2], [0, 0, 1]])


def test_fixed_pad_to() -> None:
    """`pad_to` fixes the width (static strategy) and must cover the longest row."""
    c = collate([[1, 2]], pad_id=0, pad_to=5)
    assert c.input_ids.shape == (1, 5)
    assert c.padded_tokens == 5
    with pytest.raises(ValueError, match="shorter"):
        collate([[1, 2, 3]], pad_id=0, pad_to=2)


@pytest.mark.parametrize("seqs", [[], [[]], [[1], []]])
def test_empty_inputs_rejected(seqs: list[list[int]]) -> None:
    """Empty batches and empty sequences are errors, not silent zero rows."""
    with pytest.raises(ValueError):
        collate(seqs, pad_id=0)
