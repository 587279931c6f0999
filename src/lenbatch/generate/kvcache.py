"""The KV cache of a batch of sequences, kept right-aligned in preallocated buffers.

Every row's newest token sits in the last column; shorter rows are padded on the *left* with
masked columns. That one invariant makes the operations continuous batching needs cheap and
exact, because all rows write their next token to the same column:

* **append** one decode step: the model writes one column into each layer's buffer, in place
  (`WindowLayer.update`); nothing is concatenated or reallocated per step, except when the
  buffer's headroom runs out (it then doubles, so that cost is amortised);
* **select** rows (drop finished or cancelled sequences): compact the kept rows to the front of
  the buffer (in the order `fill_from_tail` gives: one row's copy per row that ended), then move
  the window's start past columns that are padding in every remaining row (a pointer move), so
  finished sequences stop costing attention compute;
* **merge** (newly prefilled rows join the running batch): copy the new rows' keys and values
  into free rows of the buffer, right-aligned; if they are wider than the running batch, the
  window grows to the left into the buffer's headroom (no running row is moved).

Each layer's `keys` and `values` are views `[rows, heads, start:end, head_dim]` of its buffers,
which is what attention reads (SDPA takes the strided view as is). Columns a row does not use
hold zeros or stale keys of an earlier row, always finite, and are masked, so they never change
a row's result; each row carries its own next position id, so absolute-position models (GPT-2)
see the same positions as when the row runs alone.

`KVBatch` keeps this invariant over a `WindowCache` of `WindowLayer`s (`generate.windowcache`:
the per-layer buffers, their windows, headroom and growth, and which columns get written).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from lenbatch.generate.windowcache import WindowCache, WindowLayer

__all__ = ["KVBatch", "cache_bytes", "fill_from_tail", "merge"]


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


def fill_from_tail(done: list[bool]) -> list[int]:
    """The rows to keep, in their new order, when rows `done` leave: a row that stays keeps
    its place unless that place is past the new end, and then it fills the first free place
    (rows after the new end move, in order, to the places the ended rows left)."""
    n = len(done) - sum(done)
    tail = [i for i in range(n, len(done)) if not done[i]]
    movers = iter(tail)
    return [next(movers) if done[i] else i for i in range(n)]
