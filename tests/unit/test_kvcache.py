"""KV-cache batch surgery: right alignment, merge with left padding, row selection, trimming."""

from __future__ import annotations

import pytest
import torch
from transformers.cache_utils import DynamicCache

from lenbatch.generate import windowcache
from lenbatch.generate.kvcache import KVBatch, cache_bytes, merge

HEADS, DIM, LAYERS = 2, 3, 2


def _batch(lengths: list[int], start: float) -> KVBatch:
    """A right-aligned batch whose key at (row, col) holds a value unique to that token."""
    width = max(lengths)
    cache = DynamicCache()
    mask = torch.zeros((len(lengths), width), dtype=torch.long)
    keys = torch.zeros((len(lengths), HEADS, width, DIM))
    for r, n in enumerate(lengths):
        mask[r, width - n :] = 1
        for j in range(n):
            keys[r, :, width - n + j, :] = start + 100 * r + j + 1
    for layer in range(LAYERS):
        cache.update(keys.clone(), keys.clone() * -1, layer)
    return KVBatch(cache, mask, torch.tensor(lengths), torch.tensor([7] * len(lengths)))


def _rows(b: KVBatch) -> list[list[float]]:
    """Each row's real keys (head 0, dim 0, layer 0), in order."""
    k = b.cache.layers[0].keys
    return [k[r, 0, b.mask[r] == 1, 0].tolist() for r in range(b.rows)]


def test_merge_left_pads_the_narrower_batch_and_keeps_every_row() -> None:
    """Merging a wide and a narrow batch keeps each row's tokens right-aligned and masked."""
    a, b = _batch([5, 2], 0), _batch([3], 1000)
    before = _rows(a) + _rows(b)
    m = merge(a, b)
    assert m.rows == 3 and m.width == 5
    assert _rows(m) == before
    assert m.mask.tolist()[2] == [0, 0, 1, 1, 1]
    assert m.next_pos.tolist() == [5, 2, 3]
    assert torch.equal(m.cache.layers[1].values, -m.cache.layers[1].keys)


def test_select_drops_rows_and_trims_all_padding_columns() -> None:
    """Removing the longest row shrinks the cache to the longest remaining row."""
    b = _batch([6, 2, 3], 0)
    keep = _rows(b)[1:]
    full = b.nbytes()
    b.select([1, 2])
    assert b.width == 3 and b.rows == 2
    assert _rows(b) == keep
    assert b.nbytes() == full * 2 * 3 // (3 * 6)
    assert b.real_tokens == 5


def test_decode_step_inputs_extend_mask_and_use_each_rows_position() -> None:
    """A step feeds each row's last token at its own next position with one more column."""
    b = _batch([4, 1], 0)
    ids, mask, pos = b.step_inputs()
    assert ids.tolist() == [[7], [7]]
    assert mask.tolist() == [[1, 1, 1, 1, 1], [0, 0, 0, 1, 1]]
    assert pos.tolist() == [[4], [1]]


def test_cache_bytes_counts_keys_and_values_of_every_layer() -> None:
    """Bytes = 2 tensors x layers x batch x heads x width x dim x 4 (float32)."""
    b = _batch([4, 2], 0)
    assert cache_bytes(b.cache) == 2 * LAYERS * 2 * HEADS * 4 * DIM * 4


def _append_column(b: KVBatch, values: list[float]) -> None:
    """One decode step as the model does it: every layer writes one new column."""
    col = torch.tensor(values)[:, None, None, None].expand(b.rows, HEADS, 1, DIM).clone()
    for layer in range(LAYERS):
        b.cache.update(col, -col, layer)
    ids, mask, _ = b.step_inputs()
    b.advance(mask, ids[:, 0])


def test_appends_past_the_buffers_headroom_keep_every_token() -> None:
    """Decode steps write in place; when the spare columns run out the buffer grows (more
    than once here) and every row still reads its own tokens in order."""
    b = _batch([3, 1], 0)
    expected = _rows(b)
    reserved = b.reserved_bytes()
    for step in range(300):
        vals = [5000.0 + step, 9000.0 + step]
        _append_column(b, vals)
        for r in range(2):
            expected[r].append(vals[r])
    assert _rows(b) == expected
    assert b.width == 303
    assert b.reserved_bytes() > reserved
    assert torch.equal(b.cache.layers[1].values, -b.cache.layers[1].keys)


def _buffer_ids(b: KVBatch) -> list[int]:
    return [t.data_ptr() for layer in b.cache.layers for t in (layer.kbuf, layer.vbuf)]


def test_reserve_takes_room_for_rows_and_steps_at_once() -> None:
    """A batch reserved for `rows` rows and `right` steps takes joiners up to those rows and
    that many decode steps without another reallocation."""
    b = _batch([3, 1], 0)
    b.reserve(20, 80)
    buffers = _buffer_ids(b)
    for k in range(6):
        b = merge(b, _batch([4, 2, 1], 100 * (k + 1)))
    assert b.rows == 20
    expected = _rows(b)
    for step in range(80):
        _append_column(b, [float(step)] * b.rows)
    steps = [float(i) for i in range(80)]
    assert _rows(b) == [[*row, *steps] for row in expected]
    assert _buffer_ids(b) == buffers


def test_merge_of_a_much_wider_and_larger_batch_grows_left_and_down() -> None:
    """Joining rows wider than the running window (beyond its left headroom) and more rows
    than its spare rows keeps every row's tokens right-aligned and masked."""
    a = _batch([2, 1], 0)
    b = _batch([150] + [3] * 11, 10_000)
    before = _rows(a) + _rows(b)
    m = merge(a, b)
    assert m.rows == 14 and m.width == 150
    assert _rows(m) == before
    assert m.mask[0].tolist() == [0] * 148 + [1, 1]
    _append_column(m, [float(i) for i in range(14)])
    assert _rows(m) == [[*row, float(i)] for i, row in enumerate(before)]


def test_select_of_a_non_prefix_then_merge_reuses_freed_rows() -> None:
    """Rows kept out of order are compacted to the front; later joiners land after them."""
    b = _batch([4, 2, 5], 0)
    rows = _rows(b)
    b.select([2, 0])
    assert _rows(b) == [rows[2], rows[0]]
    c = _batch([1], 500)
    m = merge(b, c)
    assert _rows(m) == [rows[2], rows[0], _rows(_batch([1], 500))[0]]


def test_select_in_any_order_keeps_each_rows_keys_and_values() -> None:
    """Rows kept in any order (places swapped, moved forward, kept) carry their own keys and
    values in every layer, though only the rows that change place are copied."""
    lengths = [4, 2, 5, 3, 1, 6]
    for keep in ([5, 1, 2, 0], [0, 1, 5, 3], [3, 2, 1, 0, 4], [4], [0, 5, 2, 3, 4, 1]):
        b = _batch(lengths, 0)
        rows = _rows(b)
        b.select(keep)
        assert _rows(b) == [rows[i] for i in keep]
        assert b.next_pos.tolist() == [lengths[i] for i in keep]
        for layer in b.cache.layers:
            assert torch.equal(layer.values, -layer.keys)


def test_rows_that_end_are_replaced_from_the_tail() -> None:
    """The places of ended rows are filled by the last rows that stay, in order; the others
    keep their places."""
    from lenbatch.generate.kvcache import fill_from_tail

    assert fill_from_tail([False, True, False, False, True, False]) == [0, 5, 2, 3]
    assert fill_from_tail([True, False, False]) == [2, 1]
    assert fill_from_tail([False, False, True]) == [0, 1]
    assert fill_from_tail([True, True]) == []
    assert fill_from_tail([False, False]) == [0, 1]
    assert fill_from_tail([True, True, False, False, True, False]) == [3, 5, 2]


def _poisoned(like: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=like.dtype, device=like.device)


def _window_is_finite(b: KVBatch) -> bool:
    layers = b.cache.layers
    return all(bool(torch.isfinite(t).all()) for x in layers for t in (x.keys, x.values))


def test_uninitialised_buffers_never_reach_a_window(monkeypatch: pytest.MonkeyPatch) -> None:
    """Buffers are allocated uninitialised (here: NaN, which a masked column would still turn
    into a NaN output): through adoption, merges wider and larger than the headroom, appends
    past it and out-of-order selection, every column a window shows is finite, and a
    fixed-shape refit of a buffer never zero-filled gets one that is finite throughout."""
    monkeypatch.setattr(windowcache, "_fresh", _poisoned)
    a = _batch([3, 1], 0)
    assert _window_is_finite(a)
    a = merge(a, _batch([20], 500))  # grows left within the headroom
    assert _window_is_finite(a)
    a = merge(a, _batch([120] + [2] * 10, 1000))  # grows left beyond the headroom, and down
    assert _window_is_finite(a)
    for step in range(70):  # past the right headroom
        _append_column(a, [float(step)] * a.rows)
    assert _window_is_finite(a)
    d = _batch([100, 2], 3000)
    d.select([1])
    for step in range(120):  # past the right headroom after a trim, then a wider join
        _append_column(d, [float(step)])
    d = merge(d, _batch([150], 4000))
    assert _window_is_finite(d)
    a.select([5, 0, 3])
    a = merge(a, _batch([400, 7], 2000))
    assert _window_is_finite(a)
    expected = _rows(a)
    layer = a.cache.layers[0]
    layer.fit(int(layer.kbuf.shape[0]), int(layer.kbuf.shape[2]))  # the very shape it has
    assert bool(torch.isfinite(layer.kbuf).all()) and bool(torch.isfinite(layer.vbuf).all())
    assert _rows(a) == expected
