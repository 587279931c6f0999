"""The KV cache of a batch of sequences, kept right-aligned so rows can join and leave.

Every row's newest token sits in the last column; shorter rows are padded on the *left* with
masked columns. That one invariant makes the three operations continuous batching needs cheap
and exact:

* **select** rows (drop finished or cancelled sequences): index the batch dimension, then trim
  leading columns that are padding in every remaining row, so finished sequences stop costing
  attention compute and memory;
* **merge** two batches (newly prefilled rows join the running decode batch): left-pad the
  narrower one's keys, values and mask with masked zeros to the wider one's width, then concatenate
  along the batch dimension;
* **append** one decode step: every row gets one new column.

Padding columns are excluded by the attention mask, so they never change a row's result; each
row carries its own next position id, so absolute-position models (GPT-2) see the same positions
as when the row runs alone. Tensors are `[batch, heads, width, head_dim]` per layer, as in
`transformers.cache_utils.DynamicLayer`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["KVBatch", "cache_bytes", "merge"]


def _layers(cache: Any) -> list[Any]:
    layers: list[Any] = cache.layers
    for layer in layers:
        if getattr(layer, "is_sliding", False) or not hasattr(layer, "keys"):
            raise ValueError(
                f"unsupported KV cache layer {type(layer).__name__}: only full-attention "
                "dynamic layers can be merged and filtered"
            )
    return layers


def cache_bytes(cache: Any) -> int:
    """Bytes held by the keys and values of every layer of `cache`."""
    total = 0
    for layer in cache.layers:
        for t in (layer.keys, layer.values):
            if t is not None:
                total += t.numel() * t.element_size()
    return total


@dataclass
class KVBatch:
    """A right-aligned batch: the cache, its `[batch, width]` mask, and per-row decode inputs.

    `next_pos[i]` is the position id of the next token row `i` feeds (its real length so far);
    `last[i]` is that token. `width` equals the longest row after `trim()`.
    """

    cache: Any  # transformers DynamicCache
    mask: torch.Tensor  # [B, W] int64, 1 = real token
    next_pos: torch.Tensor  # [B] int64
    last: torch.Tensor  # [B] int64

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
        """Bytes of the cached keys and values (padding columns included)."""
        return cache_bytes(self.cache)

    def select(self, keep: list[int]) -> None:
        """Keep only rows `keep` (in that order), then drop all-padding leading columns."""
        if keep == list(range(self.rows)):
            return
        idx = torch.tensor(keep, dtype=torch.long, device=self.mask.device)
        for layer in _layers(self.cache):
            if layer.keys is not None and layer.keys.numel():
                layer.keys = layer.keys.index_select(0, idx)
                layer.values = layer.values.index_select(0, idx)
        self.mask = self.mask.index_select(0, idx)
        self.next_pos = self.next_pos.index_select(0, idx)
        self.last = self.last.index_select(0, idx)
        self.trim()

    def trim(self) -> None:
        """Drop leading columns that are padding in every row (rows stay right-aligned)."""
        if self.rows == 0:
            return
        used = self.mask.any(dim=0).nonzero()
        first = int(used[0]) if used.numel() else self.width
        if first == 0:
            return
        for layer in _layers(self.cache):
            if layer.keys is not None and layer.keys.numel():
                layer.keys = layer.keys[:, :, first:, :].contiguous()
                layer.values = layer.values[:, :, first:, :].contiguous()
        self.mask = self.mask[:, first:]

    def step_inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(input_ids [B,1], attention mask [B,W+1], position ids [B,1]) for one decode step."""
        ones = torch.ones((self.rows, 1), dtype=self.mask.dtype, device=self.mask.device)
        return self.last[:, None], torch.cat([self.mask, ones], dim=1), self.next_pos[:, None]

    def advance(self, step_mask: torch.Tensor, tokens: torch.Tensor) -> None:
        """Record a finished decode step: the model appended one column to the cache."""
        self.mask = step_mask
        self.next_pos = self.next_pos + 1
        self.last = tokens


def _pad_left(batch: KVBatch, width: int) -> None:
    extra = width - batch.width
    if extra <= 0:
        return
    for layer in _layers(batch.cache):
        k, v = layer.keys, layer.values
        pad_k = k.new_zeros((k.shape[0], k.shape[1], extra, k.shape[3]))
        pad_v = v.new_zeros((v.shape[0], v.shape[1], extra, v.shape[3]))
        layer.keys = torch.cat([pad_k, k], dim=2)
        layer.values = torch.cat([pad_v, v], dim=2)
    pad_m = batch.mask.new_zeros((batch.rows, extra))
    batch.mask = torch.cat([pad_m, batch.mask], dim=1)


def merge(a: KVBatch | None, b: KVBatch) -> KVBatch:
    """Rows of `a` followed by rows of `b`, in one right-aligned batch (`a` may be None).

    Both caches are modified in place (padded); the result reuses `a`'s cache object.
    """
    if a is None or a.rows == 0:
        return b
    la, lb = _layers(a.cache), _layers(b.cache)
    if len(la) != len(lb):
        raise RuntimeError(f"bug: merging caches with {len(la)} and {len(lb)} layers")
    width = max(a.width, b.width)
    _pad_left(a, width)
    _pad_left(b, width)
    for x, y in zip(la, lb, strict=True):
        x.keys = torch.cat([x.keys, y.keys], dim=0)
        x.values = torch.cat([x.values, y.values], dim=0)
    return KVBatch(
        cache=a.cache,
        mask=torch.cat([a.mask, b.mask], dim=0),
        next_pos=torch.cat([a.next_pos, b.next_pos]),
        last=torch.cat([a.last, b.last]),
    )
