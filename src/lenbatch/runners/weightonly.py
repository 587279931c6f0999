"""Which matrix products the lean decode path runs, measured on this processor: the `LinearPlan`,
its probes, and the builders of a layer's products. The kernels are `runners.rowlinears`'.

A `RowLinear` is called with its input `[rows, in]` and the row count (tokens in the product);
`make_linear` builds one from a dense weight `[out, in]` and a `LinearPlan`:

* `pack`: weights reordered once for oneDNN (`runners.linears.Linear`, the encoders' prepacked
  product); taken only where `measure_pack` found it faster than `F.linear` on this processor.
  A layer's weight also keeps its plain copy for the many-row products of a whole prompt where
  `measure_large_rows` found `F.linear` faster for its shape (`LargeRowsLinear`);
* `int8`: per-output-channel symmetric int8 weights, `aten._weight_int8pack_mm`;
* `int4`: group-wise (32 columns) asymmetric 4-bit weights, `aten._weight_int4pack_mm_for_cpu`.
  A model shipped as Q4_1 GGUF (SmolLM2) has exactly such groups along its input features, so
  re-quantizing its dequantized weights gets the shipped 4-bit values back (nearly lossless).

* `gemv` (bfloat16, no quantization): lenbatch's own product of a few rows (`Bf16Gemv`, the op
  `bf16_linear` in `decode_attention.cpp`) on weights reordered once into blocks of 16 outputs
  by column pairs, for AVX512_BF16's dot product. It streams each weight byte once, in order,
  where oneDNN's products read them at under half the two cores' bandwidth. Taken up to
  `plan.gemv_rows` rows, the most at which `measure_gemv` found it faster on this processor;
  the dense product above. `LENBATCH_BF16_GEMV=off` leaves it out (A/B runs). On an Intel Xeon
  family 6 model 207 (2 threads), SmolLM2's 121 products, weights streamed from memory: 12.7 /
  13.1 / 14.7 / 21.1 ms at 1 / 2 / 4 / 8 rows against oneDNN prepacked's 22.8 / 22.4 / 20.8 /
  22.4. On a CPU with AMX the op runs more than four rows on the tile unit, the same packed
  weights read as its B tiles: there it beats oneDNN's product into prompt chunks (SmolLM2's
  120 layer products at 32 / 160 / 400 rows: 8.5 / 19.2 / 44.4 ms against 13.6 / 23.3 / 57.4),
  by how much depending on the weight's shape, so each layer shape gets its own row count
  (`LinearPlan.gemv_shapes`). It keeps its own copy of the weights beside the dense
  product's.

With float32 activations both run lenbatch's own C++ loop instead (`GroupLinear`, the op
`group_linear` in `decode_attention.cpp`), where the CPU has AVX-512 and a compiler: torch's
weight-only kernels are fast only in bfloat16 (float32: 89 ms against 4.0 ms for SmolLM2's
layer products at one row), and bfloat16 activations fail the generation agreement gate. There
`int8` is symmetric in groups of 32 (GGUF's Q8_0, SmolLM2's output matrix) rather than per
channel, so `--dtype float32 --quantize int4` runs a Q4_1 GGUF's own weights, output matrix
included, up to float32 summation order.

Weight-only kernels stream fewer weight bytes, which wins while a product is bound by reading
weights (few rows); with many rows the dense kernel wins. A quantized `RowLinear` therefore keeps
the dense one too and takes the quantized kernel only up to `plan.switch_rows` rows, a point
`measure_switch` measures on this processor (`processor_key`), once per process.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from lenbatch.runners.hardware import processor_key
from lenbatch.runners.linears import linear_kind
from lenbatch.runners.rowlinears import (
    INT4_GROUP,
    LARGE_ROWS,
    Bf16Gemv,
    DenseLinear,
    GatedGemv,
    GateUpSilu,
    GroupLinear,
    Int4Linear,
    Int8Linear,
    LargeRowsLinear,
    PackedLinear,
    RowLinear,
    SwitchLinear,
    gemv_op,
    group_op,
    ops_with,
)

__all__ = [
    "LinearPlan",
    "make_gate_up_silu",
    "make_linear",
    "measure_gated",
    "measure_gemv",
    "measure_large_rows",
    "measure_pack",
    "measure_switch",
    "plan_for",
]

log = logging.getLogger("lenbatch.runner")

_PROBE_ROWS = (1, 2, 4, 8, 16, 32, 64, 128)
# `Bf16Gemv` on AMX tiles can win up to a prompt chunk's rows (SmolLM2's layer products at 400
# rows: 44 ms against oneDNN prepacked's 58, Intel Xeon family 6 model 207), so its probe goes
# on to chunk-sized counts.
_GEMV_PROBE_ROWS = (*_PROBE_ROWS, 256, 512)
# The gate/up product with its activation won at 400 rows by more than the plain product
# (module docstring of `GatedGemv`), and a whole prompt runs in one pass when nothing decodes.
_GATED_PROBE_ROWS = (*_GEMV_PROBE_ROWS, 1024)


@dataclass(frozen=True)
class LinearPlan:
    """How the lean path's linears run: quantization (none, int8, int4), oneDNN prepacking of
    the dense weights, and the most rows a product runs quantized (dense above)."""

    quantization: str = "none"
    pack: bool = False
    switch_rows: int = 0
    gemv_rows: int = 0  # bfloat16, no quantization: most rows `Bf16Gemv` runs (dense above)
    # (out, in, rows): `gemv_rows` for weights of that shape, measured apart (the op's lead over
    # the dense product depends on the shape: on an Intel Xeon family 6 model 207 it won up to
    # 512 rows for SmolLM2's 576-output products and only to 128 for its 3072-output one)
    gemv_shapes: tuple[tuple[int, int, int], ...] = ()
    # Most rows a gated MLP's gate/up product runs fused with its activation (`GatedGemv`;
    # the dense product and `silu_mul` above). 0: never.
    gated_rows: int = 0

    def gemv_for(self, shape: tuple[int, ...]) -> int:
        """The most rows `Bf16Gemv` runs for a weight of `shape` (`gemv_rows` unless measured
        apart)."""
        for out, inp, rows in self.gemv_shapes:
            if (out, inp) == tuple(shape):
                return rows
        return self.gemv_rows

    def describe(self) -> str:
        """E.g. `int4 up to 16 rows, dense prepacked above`."""
        dense = "dense prepacked" if self.pack else "dense F.linear"
        if self.quantization == "none":
            if self.gemv_rows > 0:
                apart = ", ".join(f"{o}x{i}: {r}" for o, i, r in self.gemv_shapes)
                shapes = f" ({apart})" if apart else ""
                gated = f"; gate/up fused with silu up to {self.gated_rows} rows"
                line = f"lenbatch bf16 gemv up to {self.gemv_rows} rows{shapes}, {dense} above"
                return line + (gated if self.gated_rows > 0 else "")
            return dense
        return f"{self.quantization} up to {self.switch_rows} rows, {dense} above"


def _quantized(weight: torch.Tensor, quantization: str, dtype: torch.dtype) -> RowLinear:
    if quantization in ("int8", "int4") and dtype == torch.float32:
        op = group_op()
        if op is not None:
            return GroupLinear(weight, 4 if quantization == "int4" else 8, op)
    if quantization == "int8":
        return Int8Linear(weight, dtype)
    if quantization == "int4":
        if weight.shape[1] % INT4_GROUP:
            raise ValueError(f"int4: {weight.shape[1]} input features are not a multiple of 32")
        return Int4Linear(weight, dtype)
    raise ValueError(f"quantization {quantization!r}: expected none, int8 or int4")


def _dense(weight: torch.Tensor, pack: bool, large_rows: bool = False) -> RowLinear:
    if not pack:
        return DenseLinear(weight)
    if large_rows:
        plain_at = large_rows_plain(tuple(weight.shape), weight.dtype)  # type: ignore[arg-type]
        if plain_at:
            return LargeRowsLinear(weight, plain_at)
    return PackedLinear(weight)


def make_linear(
    weight: torch.Tensor,
    plan: LinearPlan,
    dtype: torch.dtype | None = None,
    *,
    large_rows: bool = False,
) -> RowLinear:
    """The `RowLinear` for a dense `weight` `[out, in]` under `plan`, computing in `dtype`
    (default: the weight's); quantized weights come from `weight` as given. `large_rows`: the
    weight also runs whole prompts (many rows), so a prepacked one keeps its plain copy where
    `F.linear` measured faster at such row counts (`measure_large_rows`)."""
    dtype = dtype or weight.dtype
    dense = _dense(weight.to(dtype), plan.pack, large_rows)
    gemv_rows = plan.gemv_for(tuple(weight.shape))
    if plan.quantization == "none" and gemv_rows > 0 and dtype == torch.bfloat16:
        op = gemv_op()
        if op is not None:
            return SwitchLinear(Bf16Gemv(weight, op), dense, gemv_rows)
    if plan.quantization == "none" or plan.switch_rows <= 0:
        return dense
    return SwitchLinear(_quantized(weight, plan.quantization, dtype), dense, plan.switch_rows)


def make_gate_up_silu(
    weight: torch.Tensor, plan: LinearPlan, dtype: torch.dtype | None, op: Any | None
) -> GateUpSilu:
    """The `GateUpSilu` for a gated MLP's gate/up `weight` `[2 * inter, in]` under `plan`,
    computing in `dtype`; `op` holds `silu_mul` (None: torch's ops). Fused up to
    `plan.gated_rows` rows where `bf16_gate_up_silu` is built (the fused product then stands
    in for `Bf16Gemv`, whose rows it covers), the dense product above."""
    dtype = dtype or weight.dtype
    rows = plan.gated_rows
    if plan.quantization == "none" and rows > 0 and dtype == torch.bfloat16:
        gated = ops_with("bf16_gate_up_silu") if gemv_op() is not None else None
        if gated is not None and weight.shape[0] % 32 == 0:
            dense = _dense(weight.to(dtype), plan.pack, large_rows=True)
            return GateUpSilu(dense, op, GatedGemv(weight, gated), rows)
    return GateUpSilu(make_linear(weight, plan, dtype, large_rows=True), op)


def _race(a: Callable[[], object], b: Callable[[], object], reps: int = 9) -> tuple[float, float]:
    """Best-of-`reps` seconds of `a` and of `b`, called in turns so that a load change on a
    shared machine hits both alike."""
    a()
    b()
    best_a = best_b = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        a()
        t1 = time.perf_counter()
        b()
        t2 = time.perf_counter()
        best_a, best_b = min(best_a, t1 - t0), min(best_b, t2 - t1)
    return best_a, best_b


# Weights a probe streams through per call: more bytes than a server CPU's last-level cache,
# so the probe reads them from memory as a decode step does (a model's layers together are far
# larger than the cache; one hot weight would make every kernel look compute-bound).
_PROBE_BYTES = 96 << 20


def _probe_weights(shape: tuple[int, int], dtype: torch.dtype) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(shape, generator=gen) * 0.02
    size = shape[0] * shape[1] * torch.tensor([], dtype=dtype).element_size()
    return [(w + 1e-4 * i).to(dtype) for i in range(min(256, max(1, _PROBE_BYTES // size)))]


def _sweep(linears: list[RowLinear], x: torch.Tensor, rows: int) -> Callable[[], object]:
    def run() -> None:
        for lin in linears:
            lin(x, rows)

    return run


def measure_pack(shape: tuple[int, int], dtype: torch.dtype) -> bool:
    """Whether oneDNN-prepacked products beat `F.linear` on this processor for weights of
    `shape` in `dtype` (streamed from memory), summed over 1, 8 and 32 rows (False where
    packing is unavailable)."""
    kind, why = linear_kind(torch.device("cpu"), dtype, timed=False)
    if kind != "prepacked":
        log.info("oneDNN prepacking unavailable (%s): dense F.linear", why)
        return False
    ws = _probe_weights(shape, dtype)
    packed: list[RowLinear] = [PackedLinear(w) for w in ws]
    dense: list[RowLinear] = [DenseLinear(w) for w in ws]
    t_dense = t_packed = 0.0
    for rows in (1, 8, 32):
        x = torch.randn(rows, shape[1]).to(dtype)
        d, p = _race(_sweep(dense, x, rows), _sweep(packed, x, rows))
        t_dense, t_packed = t_dense + d, t_packed + p
    return t_packed < t_dense


def measure_large_rows(shape: tuple[int, int], dtype: torch.dtype) -> tuple[int, ...]:
    """The row counts of `LARGE_ROWS` at which `F.linear` beat the oneDNN-prepacked product
    by more than 3 % on this processor, for weights of `shape` in `dtype`. Why: oneDNN's
    prepacked product is faster at few rows, but not at every large count. Measured on an
    Intel Xeon family 6 model 167 (2 threads, bfloat16): 576x576 and 576x1536 weights (a
    SmolLM2 layer's o and down) 1.3-1.5x faster with `F.linear` at 384 and 512 rows, 960x576
    (q/k/v) 1.6x at 768 and 1024, 3072x576 (gate/up) never. SmolLM2's prefill, min / median
    of 8 alternated: 384 tokens 89 / 92 ms against 98 / 98, 448 tokens 101 / 106 against
    112 / 116, 512 tokens 121 / 126 against 126 / 137; the probe adds 1.5 s to its load and
    the plain copies 106 MB. Products of many rows are bound by arithmetic, so four weights
    are raced, not enough to stream from memory."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(shape, generator=gen) * 0.02
    ws = [(w + 1e-4 * i).to(dtype) for i in range(4)]
    packed: list[RowLinear] = [PackedLinear(x) for x in ws]
    plain: list[RowLinear] = [DenseLinear(x) for x in ws]
    wins = []
    for rows in LARGE_ROWS:
        x = torch.randn(rows, shape[1], generator=gen).to(dtype)
        t_plain, t_packed = _race(_sweep(plain, x, rows), _sweep(packed, x, rows), reps=5)
        if t_plain < 0.97 * t_packed:
            wins.append(rows)
    return tuple(wins)


_LARGE: dict[tuple[str, str, tuple[int, int]], tuple[int, ...]] = {}


def large_rows_plain(shape: tuple[int, int], dtype: torch.dtype) -> tuple[int, ...]:
    """`measure_large_rows` once per processor, dtype and shape in this process, logged."""
    key = (processor_key(), str(dtype), shape)
    found = _LARGE.get(key)
    if found is None:
        found = _LARGE[key] = measure_large_rows(shape, dtype)
        where = f"at {', '.join(map(str, found))} rows" if found else "at no row count"
        log.info(
            "linears on %s in %s: F.linear beats prepacked for %dx%d weights %s "
            "(measured; probed %s rows)",
            key[0], dtype, shape[0], shape[1], where, ", ".join(map(str, LARGE_ROWS)),
        )  # fmt: skip
    return found


def measure_switch(
    shape: tuple[int, int], dtype: torch.dtype, quantization: str, pack: bool
) -> int:
    """Most rows for which the `quantization` kernel beats the dense one on this processor
    (every smaller probed row count too), for weights of `shape` in `dtype` streamed from
    memory; 0 when it never does. Probes 1, 2, 4, ... 128 rows."""
    ws = _probe_weights(shape, dtype)
    quant = [_quantized(w, quantization, dtype) for w in ws]
    dense = [_dense(w, pack) for w in ws]
    switch = 0
    for rows in _PROBE_ROWS:
        x = torch.randn(rows, shape[1]).to(dtype)
        t_quant, t_dense = _race(_sweep(quant, x, rows), _sweep(dense, x, rows))
        if t_quant >= t_dense:
            break
        switch = rows
    return switch


def measure_gemv(shape: tuple[int, int], pack: bool, above: int = 0) -> int:
    """Most rows for which `Bf16Gemv` beats the dense bfloat16 product on this processor (at
    every smaller probed row count too, but for lone losses taken as noise, below), for weights
    of `shape` streamed from memory; 0 when it never does or the op is not here. Probes 1, 2,
    4, ... 512 rows (`_GEMV_PROBE_ROWS`). On a shared host one race can lose to a burst of load
    (the op won at every count from 1 to 64 rows in one probe and lost at 4 in the next,
    twice), so a loss is raced again, and only two row counts lost in a row end the probe.
    `above`: a count already known won (another shape's), from which the probe starts."""
    op = gemv_op()
    if op is None:
        return 0
    ws = _probe_weights(shape, torch.bfloat16)
    return _rows_won([Bf16Gemv(w, op) for w in ws], [_dense(w, pack) for w in ws], shape, above)


def measure_gated(shape: tuple[int, int], pack: bool, above: int = 0) -> int:
    """As `measure_gemv`, for a gated MLP's gate/up weight of `shape`: the most rows for which
    `GatedGemv` beats the dense product then `silu_mul`, probed from `above` up (0 where the
    op is not here)."""
    op = ops_with("bf16_gate_up_silu") if gemv_op() is not None else None
    if op is None or shape[0] % 32:
        return 0
    ws = _probe_weights(shape, torch.bfloat16)
    fused: list[Any] = [GatedGemv(w, op) for w in ws]
    dense: list[Any] = [GateUpSilu(_dense(w, pack), op) for w in ws]
    return _rows_won(fused, dense, shape, above, _GATED_PROBE_ROWS)


def _rows_won(
    small: list[Any],
    dense: list[Any],
    shape: tuple[int, int],
    above: int,
    probe_rows: tuple[int, ...] = _GEMV_PROBE_ROWS,
) -> int:
    """The probe of `measure_gemv`: races `small` against `dense` (callables `(x, rows)` over
    the same weights) at each of `probe_rows` above `above`."""
    best, lost = above, 0
    for rows in (r for r in probe_rows if r > above):
        x = torch.randn(rows, shape[1]).to(torch.bfloat16)
        # Above 64 rows the products are bound by arithmetic, not by streaming the weights:
        # a quarter of them times the race as well, in a quarter of the time.
        n = len(small) if rows <= 64 else max(2, len(small) // 4)
        race = _sweep(small[:n], x, rows), _sweep(dense[:n], x, rows)
        t_small, t_dense = _race(*race)
        if t_small >= t_dense:
            t_small, t_dense = _race(*race)
        if t_small < t_dense:
            best, lost = rows, 0
            continue
        lost += 1
        if lost == 2:
            break
    return best


_MEASURED: dict[tuple[object, ...], LinearPlan] = {}


def plan_for(
    shape: tuple[int, int],
    dtype: torch.dtype,
    quantization: str = "none",
    *,
    pack: bool | None = None,
    switch_rows: int | None = None,
    shapes: Sequence[tuple[int, int]] = (),
    gated: tuple[int, int] | None = None,
) -> LinearPlan:
    """The plan for a model whose typical linear weight has `shape`, in `dtype`: `pack` and
    `switch_rows` as given, else measured here (once per processor, dtype, quantization and
    shape in this process) and logged with the processor key. Where `Bf16Gemv` runs, its row
    count is measured for each of the model's other weight `shapes` too (`gemv_shapes`), and
    for a gated MLP's gate/up weight of shape `gated`, the rows it runs fused with its
    activation (`gated_rows`, from that shape's `Bf16Gemv` count up)."""
    others = tuple(sorted({tuple(s) for s in shapes} - {tuple(shape)}))
    key = (processor_key(), str(dtype), quantization, shape, pack, others, gated)
    plan = _MEASURED.get(key)
    if plan is None:
        packed = measure_pack(shape, dtype) if pack is None else pack
        switch = gemv = 0
        apart: tuple[tuple[int, int, int], ...] = ()
        if quantization != "none" and switch_rows is None:
            switch = measure_switch(shape, dtype, quantization, packed)
        if quantization == "none" and dtype == torch.bfloat16:
            gemv = measure_gemv(shape, packed)
            # The other shapes start from the typical shape's count: below it the products
            # only stream their weights, whatever the shape (and their probes are short).
            for o, i in others if gemv else ():
                rows = measure_gemv((o, i), packed, above=gemv)
                apart += ((o, i, rows),) if rows != gemv else ()
        plan = LinearPlan(quantization, packed, switch, gemv, apart)
        if gemv and gated is not None:
            rows = measure_gated(gated, packed, above=plan.gemv_for(gated))
            plan = replace(plan, gated_rows=rows)
        if pack is None or quantization != "none" or gemv:
            log.info("linears on %s in %s: %s (measured)", key[0], dtype, plan.describe())
        _MEASURED[key] = plan
    if switch_rows is not None:
        plan = replace(plan, switch_rows=switch_rows)
    return plan
