"""Collate: padding side, mask, position ids and token accounting; packing (no padding)."""

from __future__ import annotations

import numpy as np
import pytest

from lenbatch.core.collate import collate, pack, pack_collated


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


def test_pack_layout() -> None:
    """Packed tokens run end to end; each token's slot is its place in a padded grid."""
    p = pack([[5, 6, 7], [8], [9, 10]])
    np.testing.assert_array_equal(p.input_ids, [5, 6, 7, 8, 9, 10])
    np.testing.assert_array_equal(p.position_ids, [0, 1, 2, 0, 0, 1])
    np.testing.assert_array_equal(p.row_ids, [0, 0, 0, 1, 2, 2])
    np.testing.assert_array_equal(p.offsets, [0, 3, 4, 6])
    np.testing.assert_array_equal(p.slots, [0, 1, 2, 3, 6, 7])  # width 3
    assert (p.rows, p.width, p.uniform) == (3, 3, False)
    assert (p.real_tokens, p.padded_tokens, p.attention_tokens) == (6, 6, 9)
    assert p.padding_waste == 0.0


def test_pack_scatter_matches_padding() -> None:
    """Scattering packed tokens to their slots rebuilds the right-padded batch exactly."""
    rng = np.random.default_rng(3)
    seqs = [rng.integers(1, 100, int(n)).tolist() for n in rng.integers(1, 20, 9)]
    p = pack(seqs)
    c = collate(seqs, pad_id=0, side="right")
    grid = np.zeros(p.rows * p.width, dtype=np.int64)
    grid[p.slots] = p.input_ids
    np.testing.assert_array_equal(grid.reshape(p.rows, p.width), c.input_ids)
    assert len(set(p.slots.tolist())) == p.real_tokens  # no two tokens share a slot


@pytest.mark.parametrize("side", ["right", "left"])
def test_pack_collated_keeps_real_tokens(side: str) -> None:
    """A padded batch packs to its real tokens whatever its padding side."""
    seqs = [[5, 6, 7], [8], [9, 10]]
    c = collate(seqs, pad_id=0, side=side)  # type: ignore[arg-type]
    p = pack_collated(c)
    np.testing.assert_array_equal(p.input_ids, pack(seqs).input_ids)
    assert p.lengths == c.lengths


@pytest.mark.parametrize("n", [1, 2, 17])
def test_pack_one_row_has_the_general_layout(n: int) -> None:
    """A one-row batch (its own short path) packs exactly as that row does beside others:
    the general layout's arrays with the other rows taken away, and its figures."""
    row = list(range(40, 40 + n))
    one = pack([row])
    both = pack([row, [7] * (n + 3)])  # a longer second row: the width is not the row's
    k = one.real_tokens
    for name in ("input_ids", "position_ids", "row_ids"):
        got, want = getattr(one, name), getattr(both, name)[:k]
        assert got.dtype == want.dtype == np.int64
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(one.slots, np.arange(n))
    np.testing.assert_array_equal(one.offsets, [0, n])
    assert one.offsets.dtype == np.int64
    assert (one.rows, one.width, one.uniform, one.lengths) == (1, n, True, (n,))
    assert one.token_type_ids is None
    with pytest.raises(ValueError, match="empty sequence"):
        pack([[]])
    typed = pack([row], [[1] * n])  # segment ids take the general path
    assert typed.token_type_ids is not None
    np.testing.assert_array_equal(typed.input_ids, one.input_ids)


def test_pack_uniform_and_empty() -> None:
    """Equal lengths are flagged uniform (no scatter needed); empty inputs are refused."""
    assert pack([[1, 2], [3, 4]]).uniform
    with pytest.raises(ValueError, match="empty batch"):
        pack([])
    with pytest.raises(ValueError, match="empty sequence"):
        pack([[1], []])


@pytest.mark.parametrize("side", ["right", "left"])
def test_segment_ids_are_padded_like_the_tokens(side: str) -> None:
    """A pair's segment ids sit under its tokens; padding and rows without them are 0."""
    c = collate([[5, 6, 7, 8], [9, 4]], pad_id=0, side=side, segments=[[0, 0, 1, 1], None])
    assert c.token_type_ids is not None
    want = [[0, 0, 1, 1], [0, 0, 0, 0]]
    np.testing.assert_array_equal(c.token_type_ids, want)
    assert collate([[5, 6]], pad_id=0).token_type_ids is None


def test_segment_ids_survive_packing() -> None:
    """Packed end to end, and packed from a padded batch, the segment ids follow the tokens."""
    p = pack([[5, 6, 7], [8, 9]], segments=[[0, 1, 1], [0, 1]])
    assert p.token_type_ids is not None
    np.testing.assert_array_equal(p.token_type_ids, [0, 1, 1, 0, 1])
    c = collate([[5, 6, 7], [8, 9]], pad_id=0, side="left", segments=[[0, 1, 1], [0, 1]])
    again = pack_collated(c)
    assert again.token_type_ids is not None
    np.testing.assert_array_equal(again.token_type_ids, [0, 1, 1, 0, 1])
    np.testing.assert_array_equal(
        pack([[1, 2], [3]], segments=[None, [1]]).token_type_ids, [0, 0, 1]
    )
    assert pack([[1, 2]]).token_type_ids is None


def test_segment_ids_must_match_the_tokens() -> None:
    """One segment id per token and one row per sequence, or a ValueError naming the counts."""
    with pytest.raises(ValueError, match="2 segment ids for 3 tokens"):
        collate([[1, 2, 3]], pad_id=0, segments=[[0, 1]])
    with pytest.raises(ValueError, match="1 rows of segment ids for 2 sequences"):
        pack([[1], [2]], segments=[[0]])
