"""The preallocated buffers behind the running batch's KV cache: one window per layer.

`WindowLayer` keeps one layer's keys and values in buffers `[row_capacity, heads,
col_capacity, head_dim]` with spare rows and columns; its `keys` and `values` are views of the
live window (rows `[0, rows)`, columns `[start, end)`), which is what attention reads. A decode
step writes its column in place after the window; rows are compacted and leading padding
dropped by moving pointers; rows joining are copied in right-aligned, the window growing left
into the headroom; when the headroom runs out the buffer is reallocated with doubled room (one
copy). `WindowCache` is the transformers `Cache` made of them. `generate.kvcache.KVBatch` (the
right-aligned batch, its mask and per-row decode inputs) drives this surgery; the invariant it
keeps is described there.

Buffers are allocated uninitialised and only what a window can come to read is written: a
claimed row's columns left of its keys (zeros), its keys, and columns right of the window as
decode steps write them. Spare rows stay untouched until a merge claims them. Zero-filling
whole buffers instead cost 9 ms per 500-token prompt (30 layers; a one-row prefill's buffers
hold eight spare rows), measured on an Intel Xeon family 6 model 167, 2 cores.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicLayer

__all__ = ["WindowCache", "WindowLayer"]

# Spare columns on each side and spare rows a fresh buffer gets; growth doubles them.
_SPARE_COLS = 64
_SPARE_ROWS = 8


def _fresh(like: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """An uninitialised buffer of `like`'s dtype and device (tests poison it with NaN)."""
    return like.new_empty(shape)


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
