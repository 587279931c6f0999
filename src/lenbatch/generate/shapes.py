"""Fixed shapes for prefill and decode, so a compiler can make one graph per shape class.

With `[generation] compile` on (`serve --compile`), the `Decoder` runs its units through
`lenbatch.runners.graphs.ShapeGraphs` in a few fixed shapes instead of the shapes the batch
happens to have:

* **prefill**: a job's prompt columns are left-padded to the **bucket bound** that holds its
  longest prompt (the lane's upper length; beyond the largest bound, the next power of two), and
  its rows to a **row class** (a power of two); the padded rows are dummies whose results are
  dropped. One shape per bucket x row class.
* **decode**: the running batch's preallocated KV buffers are refitted to a **row class** x
  **width class** (powers of two, at least `MIN_WIDTH` columns), and the step writes its new
  column at the window's end, given as a tensor, and attends over the whole buffer with a mask.
  One shape per row class x width class; the buffers only change shape when the batch outgrows
  its class or shrinks to a quarter of it.

Shapes wider than `max_width` (and prefill chunks that are not a whole job) run on the eager path
and are counted as misses. `shapes()` lists every class the server can meet within `max_width`,
which the engine compiles at start-up.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any

import torch

from lenbatch.core.collate import Collated, collate
from lenbatch.generate.kvcache import KVBatch
from lenbatch.runners.graphs import FixedKV, GraphInputs, ShapeGraphs

__all__ = [
    "MIN_WIDTH",
    "FixedShapes",
    "KVLayout",
    "ShapeClasses",
    "make_fixed_shapes",
    "pow2",
]

MIN_WIDTH = 64


def pow2(n: int, floor: int = 1) -> int:
    """The smallest power of two that is at least `n` and `floor`."""
    n = max(n, floor, 1)
    return 1 << (n - 1).bit_length()


@dataclass(frozen=True)
class ShapeClasses:
    """The shape classes of one server: bucket bounds, largest row class, widest width class."""

    bounds: tuple[int, ...]  # bucket upper lengths, ascending (those above max_width unused)
    max_rows: int  # largest row count (the running cap); its power of two is the last class
    max_width: int  # widest fixed shape; wider runs eager

    def prefill_classes(self) -> list[int]:
        """Prefill column classes: the bucket bounds within `max_width`, then powers of two
        up to `max_width` (the overlong lane's prompts, longer than every bound)."""
        out = [b for b in self.bounds if b <= self.max_width]
        c = pow2(out[-1] + 1) if out else 1
        while c <= self.max_width:
            out.append(c)
            c *= 2
        return out

    def prefill_cols(self, width: int) -> int:
        """Columns a prefill of `width` prompt columns is padded to."""
        classes = self.prefill_classes()
        i = bisect.bisect_left(classes, width)
        return classes[i] if i < len(classes) else pow2(width)

    def rows(self, n: int) -> int:
        """Row class of `n` rows."""
        return pow2(n)

    def decode_width(self, needed: int, current: int | None) -> int:
        """Width class for a cache that needs `needed` columns; keeps `current` while it fits
        and is at most 4x too wide (hysteresis: no refit every time a row leaves); a buffer of
        another width (the eager path's) is refitted."""
        want = pow2(needed, MIN_WIDTH)
        if current is not None and current == pow2(current) and want <= current <= 4 * want:
            return current
        return want

    def row_class(self, n: int, current: int | None) -> int:
        """Row class for `n` rows, keeping `current` while it fits and is at most 4x too big."""
        want = pow2(n)
        if current is not None and current == pow2(current) and want <= current <= 4 * want:
            return current
        return want

    def shapes(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """(prefill shapes `(rows, cols)`, decode shapes `(rows, width)`) within `max_width`."""
        row_classes = []
        r = 1
        while r < pow2(self.max_rows):
            row_classes.append(r)
            r *= 2
        row_classes.append(pow2(self.max_rows))
        prefill = [(r, c) for c in self.prefill_classes() for r in row_classes]
        widths = []
        w = MIN_WIDTH
        while w <= self.max_width:
            widths.append(w)
            w *= 2
        decode = [(r, w) for w in widths for r in row_classes]
        return prefill, decode


@dataclass(frozen=True, slots=True)
class KVLayout:
    """The KV cache's geometry and element type: what a fixed buffer is allocated with."""

    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device

    def buffers(self, rows: int, width: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Zeroed key and value buffers `[rows, kv_heads, width, head_dim]`, one per layer."""
        shape = (rows, self.kv_heads, width, self.head_dim)
        keys = [
            torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)
        ]
        return keys, [torch.zeros_like(k) for k in keys]


@dataclass
class FixedShapes:
    """Builds fixed-shape inputs for prefill and decode and runs them through `graphs`."""

    graphs: ShapeGraphs
    classes: ShapeClasses
    layout: KVLayout
    pad_id: int

    # ------------------------------------------------------------------ prefill

    def prefill_fits(self, width: int) -> bool:
        """True when a whole prefill of `width` columns has a fixed shape."""
        return self.classes.prefill_cols(width) <= self.classes.max_width

    def prefill(self, batch: Collated) -> tuple[torch.Tensor, FixedKV]:
        """Logits `[rows, vocab]` of a whole left-padded prefill and its keys and values as a
        cache aligned with `batch`'s own columns (the extra padding columns left out)."""
        rows, width = batch.rows, batch.width
        cols = self.classes.prefill_cols(width)
        rc = self.classes.rows(rows)
        dev = self.layout.device
        ids = torch.full((rc, cols), self.pad_id, dtype=torch.long, device=dev)
        real = torch.zeros((rc, cols), dtype=torch.bool, device=dev)
        pos = torch.zeros((rc, cols), dtype=torch.long, device=dev)
        ids[:rows, cols - width :] = torch.from_numpy(batch.input_ids).to(dev)
        real[:rows, cols - width :] = torch.from_numpy(batch.attention_mask).to(dev).bool()
        assert batch.position_ids is not None
        pos[:rows, cols - width :] = torch.from_numpy(batch.position_ids).to(dev)
        causal = torch.ones((cols, cols), dtype=torch.bool, device=dev).tril()
        eye = torch.eye(cols, dtype=torch.bool, device=dev)
        # Key j is visible to query i when j <= i and j is a real token; every query sees at
        # least itself (a padding query's output is finite and unused).
        mask = (causal[None] & real[:, None, :]) | eye[None]
        keys, values = self.layout.buffers(rc, cols)
        write = torch.arange(cols, device=dev)
        logits = self.graphs.run(GraphInputs(ids, mask[:, None], pos, write, keys, values))
        lo = cols - width
        cache = FixedKV([k[:rows, :, lo:] for k in keys], [v[:rows, :, lo:] for v in values], write)
        return logits[:rows], cache

    # ------------------------------------------------------------------ decode

    def decode_fits(self, kv: KVBatch) -> bool:
        """True when the next decode step of `kv` has a fixed shape."""
        return pow2(kv.width + 1, MIN_WIDTH) <= self.classes.max_width

    def _decode_tensors(
        self, rc: int, cols: int, end: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(ids, positions, 4-D mask, write column) of a decode step of `rc` dummy rows that
        write column `end`; the caller fills in its real rows."""
        dev = self.layout.device
        ids = torch.full((rc, 1), self.pad_id, dtype=torch.long, device=dev)
        pos = torch.zeros((rc, 1), dtype=torch.long, device=dev)
        mask = torch.zeros((rc, 1, 1, cols), dtype=torch.bool, device=dev)
        mask[:, 0, 0, end] = True  # the new column (dummy rows attend only to it)
        write = torch.tensor([end], dtype=torch.long, device=dev)
        return ids, pos, mask, write

    def decode(self, kv: KVBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode step of every row of `kv` in its fixed shape: returns (logits
        `[rows, vocab]`, the step's 2-D mask for `kv.advance`); the cache has its new column."""
        rows = kv.rows
        rc, cols = kv.fit_shape(self.classes, kv.width + 1)
        start, end = kv.window_bounds()
        ids, pos, mask, write = self._decode_tensors(rc, cols, end)
        step_ids, step_mask, step_pos = kv.step_inputs()
        ids[:rows] = step_ids
        pos[:rows] = step_pos
        mask[:rows, 0, 0, start:end] = kv.mask.bool()
        keys, values = kv.buffers()
        logits = self.graphs.run(GraphInputs(ids, mask, pos, write, keys, values))
        kv.wrote_column()
        return logits[:rows], step_mask

    # ------------------------------------------------------------------ start-up

    def warm_up(self) -> int:
        """Run (and, when compiling, compile) every fixed shape once; returns how many."""
        prefill, decode = self.classes.shapes()
        for rows, cols in prefill:
            pad = self.pad_id
            prompts = [[pad] * cols for _ in range(rows)]
            self.prefill(collate(prompts, pad, "left", position_ids=True))
        for rows, cols in decode:
            ids, pos, mask, write = self._decode_tensors(rows, cols, cols - 1)
            keys, values = self.layout.buffers(rows, cols)
            self.graphs.run(GraphInputs(ids, mask, pos, write, keys, values))
        return len(prefill) + len(decode)


def make_fixed_shapes(
    runner: Any, bounds: tuple[int, ...], max_rows: int, max_width: int, *, compile: bool
) -> FixedShapes:
    """The fixed shapes of a transformers causal LM runner (`runners.causal`): prefill classes
    from the bucket `bounds`, row classes up to `max_rows`, nothing wider than `max_width`."""
    model = getattr(runner, "model", None)
    cfg = getattr(model, "config", None)
    if model is None or cfg is None:
        raise ValueError("fixed shapes and --compile need a transformers causal LM")
    heads = int(cfg.num_attention_heads)
    layout = KVLayout(
        num_layers=int(cfg.num_hidden_layers),
        kv_heads=int(getattr(cfg, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads),
        dtype=next(model.parameters()).dtype,
        device=runner.device,
    )
    classes = ShapeClasses(tuple(sorted(set(bounds))), max_rows, max_width)
    graphs = ShapeGraphs(model, compile=compile)
    return FixedShapes(graphs, classes, layout, runner.info.pad_token_id)
