"""Forward passes of a causal LM over fixed shapes, optionally compiled (`torch.compile`).

A fixed-shape call (`GraphInputs`) runs the model on `[rows, cols]` input ids against **fixed KV
buffers** `[rows, kv_heads, width, head_dim]` per layer: each layer writes its new keys and
values in place at the buffer columns `write` (`index_copy_`, as transformers' `StaticCache`
does) and attends over the whole buffer through a ready-made boolean 4-D mask
`[rows, 1, cols, width]` (True = attend). Nothing in the call depends on a Python integer that
changes between calls, so `torch.compile(dynamic=False)` makes one graph per shape and reuses
it: the shape classes are chosen by the caller (`lenbatch.generate.shapes`: bucket bound x row
class for prefill, row class x cache-width class for decode).

Why not the runner's eager path with the preallocated window cache: its layers move the window's
bounds (Python integers) every step, so dynamo guards on them and recompiles every step
(`bench/compile_probe.py`). Here the buffers are passed in as tensors and the write position is a
tensor, so the guards only see shapes.

Every row of the mask must attend to at least one column (a padded query position attends to
itself): a fully masked row makes SDPA produce NaN, and a NaN key or value, even masked, would
poison every later step that reads its column.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from lenbatch.runners.causal import last_logits

__all__ = ["FixedKV", "GraphInputs", "GraphStats", "ShapeGraphs"]

log = logging.getLogger("lenbatch.runner")

# Shapes one compiled function may be specialised for before dynamo gives up on it; the caller's
# shape classes bound the real number (a few dozen at most).
_MAX_GRAPHS = 256


class _FixedLayer:
    """One layer's fixed key and value buffers (what `generate.kvcache` reads after prefill)."""

    is_sliding = False

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.keys = keys
        self.values = values


class FixedKV:
    """A duck-typed transformers cache over fixed buffers: `update` writes the new columns in
    place at `cols` and returns the whole buffers (the mask says which columns count)."""

    def __init__(
        self, keys: list[torch.Tensor], values: list[torch.Tensor], cols: torch.Tensor
    ) -> None:
        self.keys = keys
        self.values = values
        self.cols = cols

    @property
    def layers(self) -> list[_FixedLayer]:
        """Per-layer views, the shape `generate.kvcache` copies prefilled rows from."""
        return [_FixedLayer(k, v) for k, v in zip(self.keys, self.values, strict=True)]

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        *a: Any,
        **k: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new columns in place; return the layer's whole buffers."""
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        keys.index_copy_(2, self.cols, key_states)
        values.index_copy_(2, self.cols, value_states)
        return keys, values


@dataclass
class GraphStats:
    """What the fixed-shape path did: graphs compiled (shapes seen), their compile seconds,
    calls served by an already compiled graph (hits) and calls that ran eager (misses)."""

    compiled: bool
    graphs: int = 0
    compile_s: float = 0.0
    hits: int = 0
    misses: int = 0
    shapes: dict[str, float] = field(default_factory=dict)  # shape key -> its compile seconds

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready figures for `/stats`."""
        return {
            "enabled": self.compiled,
            "graphs": self.graphs,
            "compile_s": round(self.compile_s, 3),
            "hits": self.hits,
            "misses": self.misses,
        }


class GraphInputs(NamedTuple):
    """One forward pass over fixed shapes: the new columns and the buffers they attend over."""

    ids: torch.Tensor  # [rows, cols] input ids
    mask: torch.Tensor  # [rows, 1, cols, width] bool, True = attend
    pos: torch.Tensor  # [rows, cols] position ids
    write: torch.Tensor  # [cols] buffer columns the new keys and values are written to
    keys: list[torch.Tensor]  # per layer [rows, kv_heads, width, head_dim]
    values: list[torch.Tensor]  # per layer, as `keys`

    @property
    def shape_key(self) -> str:
        """`rows x cols -> width`: what a graph is specialised for."""
        rows, cols = self.ids.shape
        return f"{rows}x{cols}->{self.keys[0].shape[2]}"


class ShapeGraphs:
    """Runs `model` over fixed shapes; with `compile`, through one `torch.compile` graph per
    shape (`dynamic=False`, `fullgraph=True`), compiled on the first call of each shape (or at
    start-up, `FixedShapes.warm_up`) and timed. Calls from one worker thread at a time."""

    def __init__(self, model: Any, *, compile: bool, mode: str | None = None) -> None:
        self.model = model
        self.stats = GraphStats(compiled=compile)
        self._lock = threading.Lock()
        self._fn: Callable[..., torch.Tensor] = self._eager
        if compile:
            import torch._dynamo.config as dynamo_config

            # One function, many fixed shapes: raise dynamo's per-function recompile limit
            # (8 by default) so every shape class gets its graph instead of falling back.
            dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, _MAX_GRAPHS)
            dynamo_config.accumulated_recompile_limit = max(
                dynamo_config.accumulated_recompile_limit, _MAX_GRAPHS
            )
            self._fn = torch.compile(self._eager, dynamic=False, fullgraph=True, mode=mode)

    @torch.no_grad()
    def _eager(
        self,
        ids: torch.Tensor,
        mask: torch.Tensor,
        pos: torch.Tensor,
        write: torch.Tensor,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
    ) -> torch.Tensor:
        return last_logits(self.model, ids, mask, pos, FixedKV(keys, values, write))

    def run(self, step: GraphInputs) -> torch.Tensor:
        """Logits `[rows, vocab]` (float32) of the last column; writes the new keys and values
        into the step's buffers. A shape's first compiled call compiles it (timed)."""
        with torch.no_grad():
            if not self.stats.compiled:
                return self._eager(*step)
            key = step.shape_key
            if key in self.stats.shapes:
                self.stats.hits += 1
                return self._fn(*step)
            with self._lock:
                started = time.perf_counter()
                out = self._fn(*step)
                spent = time.perf_counter() - started
            self.stats.shapes[key] = spent
            self.stats.graphs += 1
            self.stats.compile_s += spent
            log.info("compiled the fixed shape %s in %.1f s", key, spent)
            return out

    def count_eager(self) -> None:
        """A unit that had no fixed shape ran on the eager path (a miss, when compiling)."""
        if self.stats.compiled:
            self.stats.misses += 1
