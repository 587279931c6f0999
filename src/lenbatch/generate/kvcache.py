"""The KV cache of a batch of sequences, kept right-aligned in preallocated buffers.

Every row's newest token sits in the last column; shorter rows are padded on the *left* with
masked columns. That one invariant makes the operations continuous batching needs cheap and
exact, because all rows write their next token to the same column:

* **append** one decode step: the model writes one column into each layer's buffer, in place
  (`WindowLayer.update`); nothing is concatenated or reallocated per step, except when the
  buffer's headroom runs out (it then doubles, so that cost is amortised);
* **select** rows (drop finished or cancelled sequences): compact the kept rows to the front of
  the buffer, then move the window's start past columns that are padding in every remaining row
  (a pointer move), so finished sequences stop costing attention compute;
* **merge** (newly prefilled rows join the running batch): copy the new rows' keys and values
  into free rows of the buffer, right-aligned; if they are wider than the running batch, the
  window grows to the left into the buffer's headroom (no running row is moved).

Each layer's `keys` and `values` are views `[rows, heads, start:end, head_dim]` of its buffers,
which is what attention reads (SDPA takes the strided view as is). Columns a row does not use
hold zeros or stale keys of an earlier row, always finite, and are masked, so they never change
a row's result; each row carries its own next position id, so absolute-position models (GPT-2)
see the same positions as when the row runs alone.

Buffers are allocated uninitialised and only what a window can come to read is written: a
claimed row's columns left of its keys (zeros), its keys, and columns right of the window as
decode steps write them. Spare rows stay untouched until a merge claims them. Zero-filling
whole buffers instead cost 9 ms per 500-token prompt (30 layers; a one-row prefill's buffers
hold eight spare rows), measured on an Intel Xeon family 6 model 167, 2 cores.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicLayer

__all__ = ["KVBatch", "WindowCache", "WindowLayer", "cache_bytes", "merge"]

# Spare columns on each side and spare rows a fresh buffer gets; growth doubles them.
_SPARE_COLS = 64
_SPARE_ROWS = 8


def _fresh(like: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """An uninitialised buffer of `like`'s dtype and device (tests poison it with NaN)."""
    return like.new_empty(shape)


def _plain_layers(cache: Any) -> list[Any]:
    layers: list[Any] = cache.layers
    for layer in layers:
        if getattr(layer, "is_sliding", False) or not hasattr(layer, "keys"):
            raise ValueError(
                f"unsupported KV cache layer {type(layer).__name__}: only full-attention "
                "layers can be merged and filtered"
            )
    return layers


def cache_bytes(cache: Any) -> int:
    """Bytes of the keys and values of every layer of `cache` that rows use now (padding
    columns included; a preallocated buffer's headroom is counted by `reserved_bytes`)."""
    total = 0
    for layer in cache.layers:
        for t in (layer.keys, layer.values):
            if t is not None:
                total += t.numel() * t.element_size()
    return total


class WindowLayer(DynamicLayer):
    """One layer's keys and values in preallocated buffers; `keys`/`values` are the window.

    The buffers are `[row_capacity, heads, col_capacity, head_dim]`; rows `[0, rows)` and
    columns `[start, end)` are in use. Only the engine's worker thread touches it.
    """

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.kbuf: torch.Tensor | None = None
        self.vbuf: torch.Tensor | None = None
        self.zeroed = False  # every element of the buffers written (`fit`'s fixed shapes)
        # False when whoever reads the cache reads only each row's real columns (the lean
        # path's decode-attention op): the masked columns before a joining row's keys may then
        # hold anything, and are not zeroed (torch's masked attention would turn garbage into
        # NaN: a weight of 0 times NaN).
        self.masked_reads = True
        self.rows = 0
        self.start = 0
        self.end = 0

    # ------------------------------------------------------------------ geometry

    @property
    def width(self) -> int:
        """Columns in the window."""
        return self.end - self.start

    def reserved_bytes(self) -> int:
        """Bytes of both buffers, headroom included."""
        if self.kbuf is None or self.vbuf is None:
            return 0
        return (self.kbuf.numel() + self.vbuf.numel()) * self.kbuf.element_size()

    def reslice(self) -> None:
        """Point `keys` and `values` at the live window of the buffers (rows x start:end)."""
        assert self.kbuf is not None and self.vbuf is not None
        self.keys = self.kbuf[: self.rows, :, self.start : self.end]
        self.values = self.vbuf[: self.rows, :, self.start : self.end]
        self.is_initialized = True

    def adopt(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Start from `keys`/`values` `[rows, heads, width, dim]` (copied into new buffers)."""
        rows, heads, width, kdim = keys.shape
        self.device = keys.device
        self.kbuf = _fresh(keys, (rows + _SPARE_ROWS, heads, width + 2 * _SPARE_COLS, kdim))
        shape_v = (rows + _SPARE_ROWS, heads, width + 2 * _SPARE_COLS, values.shape[-1])
        self.vbuf = _fresh(values, shape_v)
        self.zeroed = False
        self.rows, self.start, self.end = rows, _SPARE_COLS, _SPARE_COLS + width
        for buf, src in ((self.kbuf, keys), (self.vbuf, values)):
            buf[:rows, :, : self.start].zero_()  # read (masked) once the window grows left
            buf[:rows, :, self.start : self.end] = src
        self.reslice()

    def reserve(self, rows: int, left: int, right: int) -> None:
        """Make room for `rows` rows, `left` columns before the window and `right` after it;
        when the buffer is too small it is reallocated with doubled headroom (one copy)."""
        assert self.kbuf is not None and self.vbuf is not None
        cap_rows, cap_cols = self.kbuf.shape[0], self.kbuf.shape[2]
        if rows <= cap_rows and left <= self.start and self.end + right <= cap_cols:
            return
        width = self.width
        new_rows = max(rows, cap_rows if rows <= cap_rows else 2 * cap_rows)
        new_left = max(left, _SPARE_COLS) if left > self.start else self.start
        room = cap_cols - self.end
        new_right = max(right, room if self.end + right <= cap_cols else 2 * (width + right))
        new_cols = new_left + width + new_right
        for name in ("kbuf", "vbuf"):
            old: torch.Tensor = getattr(self, name)
            new = _fresh(old, (new_rows, old.shape[1], new_cols, old.shape[3]))
            new[: self.rows, :, :new_left].zero_()
            new[: self.rows, :, new_left : new_left + width] = old[
                : self.rows, :, self.start : self.end
            ]
            setattr(self, name, new)
        self.zeroed = False
        self.start, self.end = new_left, new_left + width
        self.reslice()

    def fit(self, rows_cap: int, cols_cap: int) -> None:
        """Make the buffers exactly `[rows_cap, heads, cols_cap, dim]` with a free column after
        the window (the fixed-shape decode writes there): reallocate when the shape differs,
        else, when the window reaches the buffer's end, move it back to column 0 (one copy)."""
        assert self.kbuf is not None and self.vbuf is not None
        width = self.width
        if width >= cols_cap or self.rows > rows_cap:
            raise RuntimeError(f"bug: {self.rows}x{width} does not fit {rows_cap}x{cols_cap}")
        # A fixed-shape step reads the whole buffer: only a zero-filled one is kept.
        same = self.zeroed and self.kbuf.shape[0] == rows_cap and self.kbuf.shape[2] == cols_cap
        if same and self.end < cols_cap:
            return
        for name in ("kbuf", "vbuf"):
            old: torch.Tensor = getattr(self, name)
            win = old[: self.rows, :, self.start : self.end]
            if same:
                old[: self.rows, :, :width] = win.clone()  # overlapping ranges: copy first
            else:
                new = old.new_zeros((rows_cap, old.shape[1], cols_cap, old.shape[3]))
                new[: self.rows, :, :width] = win
                setattr(self, name, new)
        self.zeroed = True
        self.start, self.end = 0, width
        self.reslice()

    def wrote_column(self) -> None:
        """A decode step wrote one column at the window's end (the fixed-shape decode, or
        the lean path's `decode_layers`): take it in."""
        self.end += 1
        self.reslice()

    # ------------------------------------------------------------------ what the model calls

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new columns in place after the window; returns the grown window."""
        if self.kbuf is None:
            self.adopt(key_states, value_states)
            return self._window()
        if key_states.shape[0] != self.rows:
            raise RuntimeError(
                f"bug: {key_states.shape[0]} rows written to a {self.rows}-row cache"
            )
        n = key_states.shape[2]
        self.reserve(self.rows, 0, n)
        assert self.kbuf is not None and self.vbuf is not None
        self.kbuf[: self.rows, :, self.end : self.end + n] = key_states
        self.vbuf[: self.rows, :, self.end : self.end + n] = value_states
        self.end += n
        self.reslice()
        return self._window()

    def _window(self) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.keys is not None and self.values is not None
        return self.keys, self.values

    # ------------------------------------------------------------------ batch surgery

    def keep_rows(self, keep: list[int], moved: list[int]) -> None:
        """Keep rows `keep` (in order) at the front; `moved` lists the places `i` whose row
        changes (`keep[i] != i`). Only those rows are copied (a row that ends mid-batch costs
        one row's copy when the caller fills its place from the tail, not the whole cache's)."""
        if moved:
            assert self.kbuf is not None and self.vbuf is not None
            n, cols = len(keep), slice(self.start, self.end)
            if all(keep[i] >= n for i in moved):
                # Every source lies past the new end, where nothing is written: plain row
                # copies, each a few contiguous blocks (a gather and an index_copy_ over the
                # strided window took ~4 % of the decode thread at ten times the light load).
                for buf in (self.kbuf, self.vbuf):
                    for i in moved:
                        buf[i, :, cols].copy_(buf[keep[i], :, cols])
            else:
                dst = torch.tensor(moved, dtype=torch.long, device=self.kbuf.device)
                src = torch.tensor([keep[i] for i in moved], dtype=torch.long, device=dst.device)
                for buf in (self.kbuf, self.vbuf):
                    # Gathered first (a copy), then written: safe for any order of `keep`.
                    buf[:, :, cols].index_copy_(0, dst, buf[:, :, cols].index_select(0, src))
        self.rows = len(keep)
        self.reslice()

    def drop_leading(self, cols: int) -> None:
        """Columns `[start, start + cols)` are padding in every row: leave them out."""
        self.start += cols
        self.reslice()

    def append_rows(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Add rows right-aligned at the window's end, growing the window to the left if they
        are wider than it."""
        n, width = keys.shape[0], keys.shape[2]
        grow = max(0, width - self.width)
        self.reserve(self.rows + n, grow, 0)
        assert self.kbuf is not None and self.vbuf is not None
        self.start -= grow
        rows = slice(self.rows, self.rows + n)
        for buf, src in ((self.kbuf, keys), (self.vbuf, values)):
            if self.masked_reads and not self.zeroed:  # the rows' columns before their keys
                buf[rows, :, : self.end - width].zero_()
            buf[rows, :, self.end - width : self.end] = src
        self.rows += n
        self.reslice()


class WindowCache(Cache):
    """A transformers `Cache` of `WindowLayer`s: what the running decode batch feeds the model."""

    def __init__(self, num_layers: int) -> None:
        super().__init__(layers=[WindowLayer() for _ in range(num_layers)])

    def window_layers(self) -> list[WindowLayer]:
        """The layers, typed."""
        return [layer for layer in self.layers if isinstance(layer, WindowLayer)]

    def reserved_bytes(self) -> int:
        """Bytes of every layer's buffers, headroom included."""
        return sum(layer.reserved_bytes() for layer in self.window_layers())

    def next_column(
        self, rows: int
    ) -> tuple[list[torch.Tensor], list[torch.Tensor], int, int] | None:
        """For a decode step that writes its keys and values itself (the lean Llama path's
        `decode_layers`): room for one column after the window in every layer, then every
        layer's key and value buffers and the window `(start, end)` they share; the step
        writes column `end` and calls `took_column`. None where that does not hold (a layer
        not yet filled, another row count, layers whose windows differ)."""
        layers = self.window_layers()
        if not layers or len(layers) != len(self.layers):
            return None
        if any(layer.kbuf is None or layer.rows != rows for layer in layers):
            return None
        for layer in layers:
            layer.reserve(rows, 0, 1)
        start, end = layers[0].start, layers[0].end
        if any(layer.start != start or layer.end != end for layer in layers):
            return None
        keys = [layer.kbuf for layer in layers if layer.kbuf is not None]
        values = [layer.vbuf for layer in layers if layer.vbuf is not None]
        return keys, values, start, end

    def took_column(self) -> None:
        """Every layer's column after the window was written (`next_column`): take it in."""
        for layer in self.window_layers():
            layer.wrote_column()


def _leading_padding(mask: torch.Tensor) -> int:
    """Leading columns of `mask` that are padding in every row."""
    used = mask.any(dim=0).nonzero()
    return int(used[0]) if used.numel() else int(mask.shape[1])


def _to_window(cache: Any, first: int) -> WindowCache:
    """Copy a prefill cache (any full-attention layers) from column `first` on into buffers."""
    if isinstance(cache, WindowCache):
        for wl in cache.window_layers():
            wl.drop_leading(first)
        return cache
    layers = _plain_layers(cache)
    window = WindowCache(len(layers))
    for src, dst in zip(layers, window.window_layers(), strict=True):
        dst.adopt(src.keys[:, :, first:], src.values[:, :, first:])
    return window


@dataclass
class KVBatch:
    """A right-aligned batch: the cache, its `[batch, width]` mask, and per-row decode inputs.

    `next_pos[i]` is the position id of the next token row `i` feeds (its real length so far);
    `last[i]` is that token. `width` equals the longest row after `trim()`. A cache given in
    another form (a prefill's `DynamicCache`) is copied into a `WindowCache` on creation.
    """

    cache: Any  # WindowCache once constructed
    mask: torch.Tensor  # [B, W] int64, 1 = real token
    next_pos: torch.Tensor  # [B] int64
    last: torch.Tensor  # [B] int64
    # False when the model reads only each row's real columns (`WindowLayer.masked_reads`).
    masked_reads: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.cache, WindowCache):
            first = _leading_padding(self.mask) if self.rows else 0
            self.cache = _to_window(self.cache, first)
            self.mask = self.mask[:, first:]
        for layer in self._layers():
            layer.masked_reads = self.masked_reads

    @property
    def rows(self) -> int:
        """Sequences in the batch."""
        return int(self.mask.shape[0])

    @property
    def width(self) -> int:
        """Cache columns (real tokens plus left padding)."""
        return int(self.mask.shape[1])

    @property
    def real_tokens(self) -> int:
        """Cached tokens that are not padding."""
        return int(self.mask.sum())

    def nbytes(self) -> int:
        """Bytes of the cached keys and values in use (padding columns included)."""
        return cache_bytes(self.cache)

    def reserved_bytes(self) -> int:
        """Bytes of the preallocated buffers, headroom included."""
        reserved: int = self.cache.reserved_bytes()
        return reserved

    def _layers(self) -> list[WindowLayer]:
        layers: list[WindowLayer] = self.cache.window_layers()
        return layers

    def select(self, keep: list[int]) -> None:
        """Keep only rows `keep` (in that order), then drop all-padding leading columns."""
        if keep == list(range(self.rows)):
            return
        idx = torch.tensor(keep, dtype=torch.long, device=self.mask.device)
        moved = [i for i, k in enumerate(keep) if k != i]
        prefix = not moved
        for layer in self._layers():
            layer.keep_rows(keep, moved)
        self.mask = self.mask[: len(keep)] if prefix else self.mask.index_select(0, idx)
        self.next_pos = self.next_pos.index_select(0, idx)
        self.last = self.last.index_select(0, idx)
        self.trim()

    def trim(self) -> None:
        """Drop leading columns that are padding in every row (rows stay right-aligned)."""
        if self.rows == 0:
            return
        first = _leading_padding(self.mask)
        if first == 0:
            return
        for layer in self._layers():
            layer.drop_leading(first)
        self.mask = self.mask[:, first:]

    def join(
        self, cache: Any, mask: torch.Tensor, next_pos: torch.Tensor, last: torch.Tensor
    ) -> None:
        """Append the rows of a prefilled block (`cache` with any full-attention layers, its
        left-padded `mask`), copying their keys and values into this batch's buffers once."""
        first = _leading_padding(mask)
        mask = mask[:, first:]
        src = _plain_layers(cache)
        dst = self._layers()
        if len(src) != len(dst):
            raise RuntimeError(f"bug: merging caches with {len(dst)} and {len(src)} layers")
        for x, y in zip(dst, src, strict=True):
            x.append_rows(y.keys[:, :, first:], y.values[:, :, first:])
        width = max(self.width, int(mask.shape[1]))
        both = self.mask.new_zeros((self.rows + int(mask.shape[0]), width))
        both[: self.rows, width - self.width :] = self.mask
        both[self.rows :, width - int(mask.shape[1]) :] = mask
        self.mask = both
        self.next_pos = torch.cat([self.next_pos, next_pos])
        self.last = torch.cat([self.last, last])

    def reserve(self, rows: int, right: int) -> None:
        """Room in every layer's buffers for `rows` rows and `right` more columns, taken now
        (one copy of the window) rather than in doublings as rows join and steps run: each
        doubling copies the whole cache at a step boundary, a stall of every stream."""
        for layer in self._layers():
            layer.reserve(rows, 0, right)

    def fit_shape(self, classes: Any, needed: int) -> tuple[int, int]:
        """Refit every layer's buffers to the fixed shape class for this batch with `needed`
        columns (`generate.shapes.ShapeClasses`); returns (row class, width class)."""
        layers = self._layers()
        buf = layers[0].kbuf
        assert buf is not None
        rows_cap = classes.row_class(self.rows, int(buf.shape[0]))
        cols_cap = classes.decode_width(needed, int(buf.shape[2]))
        for layer in layers:
            layer.fit(rows_cap, cols_cap)
        return rows_cap, cols_cap

    def window_bounds(self) -> tuple[int, int]:
        """(start, end) of the window in buffer columns (the same in every layer)."""
        first = self._layers()[0]
        return first.start, first.end

    def buffers(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Every layer's whole key and value buffers."""
        layers = self._layers()
        keys = [layer.kbuf for layer in layers]
        values = [layer.vbuf for layer in layers]
        assert all(k is not None for k in keys) and all(v is not None for v in values)
        return keys, values  # type: ignore[return-value]

    def wrote_column(self) -> None:
        """A fixed-shape decode step wrote its column into every layer's buffers."""
        for layer in self._layers():
            layer.wrote_column()

    def rollback(self) -> None:
        """Undo the writes of a decode step that failed part-way (some layers appended their
        column, others not): every layer's window ends at the mask's width again."""
        for layer in self._layers():
            layer.end = layer.start + self.width
            layer.reslice()

    def step_inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(input_ids [B,1], attention mask [B,W+1], position ids [B,1]) for one decode step."""
        ones = torch.ones((self.rows, 1), dtype=self.mask.dtype, device=self.mask.device)
        return self.last[:, None], torch.cat([self.mask, ones], dim=1), self.next_pos[:, None]

    def advance(self, step_mask: torch.Tensor, tokens: torch.Tensor) -> None:
        """Record a finished decode step: the model appended one column to the cache."""
        self.mask = step_mask
        self.next_pos = self.next_pos + 1
        self.last = tokens


def merge(a: KVBatch | None, b: KVBatch) -> KVBatch:
    """Rows of `a` followed by rows of `b`, in one right-aligned batch (`a` may be None).

    `b`'s rows are copied into `a`'s buffers (which may grow); the result is `a`.
    """
    if a is None or a.rows == 0:
        return b
    a.join(b.cache, b.mask, b.next_pos, b.last)
    return a
