"""Matrix products of the lean decode path: dense, oneDNN-prepacked, weight-only int8 and int4.

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
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F

from lenbatch.runners.hardware import processor_key
from lenbatch.runners.linears import Linear, linear_kind

__all__ = [
    "INT4_GROUP",
    "Bf16Gemv",
    "GateUpSilu",
    "GatedGemv",
    "GroupLinear",
    "LinearPlan",
    "RowLinear",
    "gemv_op",
    "make_gate_up_silu",
    "make_linear",
    "measure_gated",
    "measure_gemv",
    "measure_large_rows",
    "measure_pack",
    "measure_switch",
    "pack_bf16_weight",
    "pack_gate_up",
    "plan_for",
    "stored_groups",
]

log = logging.getLogger("lenbatch.runner")

# The kernels below are torch's own (what torch.compile and torchao emit on CPU); they have no
# public name, hence the SLF001 exemptions.

INT4_GROUP = 32
_GEMV_ENV = "LENBATCH_BF16_GEMV"
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


class RowLinear:
    """`y = x @ W.T` for a 2-D `x`; `rows` is `x.shape[0]` (passed to spare a lookup)."""

    def __call__(self, x: torch.Tensor, rows: int) -> torch.Tensor:
        """The product."""
        raise NotImplementedError

    def packed_at(self, rows: int) -> torch.Tensor | None:
        """The weight as the C++ op `bf16_linear` reads it (`pack_bf16_weight`) when a
        product of `rows` rows runs that op, else None (another kernel runs it)."""
        return None

    def groups_at(self, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The weight as the C++ op `group_linear` reads it (q, scale, lo) when a product of
        `rows` rows runs that op, else None (another kernel runs it)."""
        return None


class DenseLinear(RowLinear):
    """`F.linear` on the weight as loaded."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight

    def __call__(self, x: torch.Tensor, rows: int) -> torch.Tensor:
        """The product."""
        return F.linear(x, self.weight)


class PackedLinear(RowLinear):
    """The weight reordered once into oneDNN's blocked layout (`runners.linears.Linear`)."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.linear = Linear(weight, None, weight.dtype, kind="prepacked")

    def __call__(self, x: torch.Tensor, rows: int) -> torch.Tensor:
        """The product."""
        return self.linear(x)


class Int8Linear(RowLinear):
    """Per-output-channel symmetric int8 weights; activations in `dtype` (default: the
    weight's)."""

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype | None = None) -> None:
        w = weight.float()
        scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127
        self.q = (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8).contiguous()
        self.scale = scale.to(dtype or weight.dtype)

    def __call__(self, x: torch.Tensor, rows: int) -> torch.Tensor:
        """The product."""
        return torch._weight_int8pack_mm(x, self.q, self.scale)  # noqa: SLF001


def _q4_groups(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit groups of `INT4_GROUP` input columns of `weight` `[out, in]`:
    `(q, scale, lo)` with `w ~ q * scale + lo`, `q` uint8 in 0..15 `[out, in / 32, 32]`,
    `scale` and `lo` float32 `[out, in / 32]` (each group's minimum and 15-step range, as
    llama.cpp's Q4_1 chooses them, so a Q4_1 GGUF's dequantized groups come back exactly)."""
    out, inp = weight.shape
    g = weight.detach().float().view(out, inp // INT4_GROUP, INT4_GROUP)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    scale = ((hi - lo) / 15).clamp(min=1e-12)
    q = ((g - lo[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.uint8)
    return q, scale, lo


# A weight "is" 4- or 8-bit groups when quantizing it moves no value by more than this share of
# its group's step: float32 rounding of a GGUF's dequantized blocks stays ~1e-6 of a step, while
# rounding a float weight moves its values by up to half a step.
_STORED_TOLERANCE = 1e-3


def _q8_groups(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric 8-bit groups of `INT4_GROUP` input columns of `weight` `[out, in]`:
    `(q, scale)` with `w ~ q * scale`, `q` int8 in -127..127 `[out, in / 32, 32]`, `scale`
    float32 `[out, in / 32]` (each group's largest magnitude over 127, as GGUF's Q8_0)."""
    out, inp = weight.shape
    g = weight.detach().float().view(out, inp // INT4_GROUP, INT4_GROUP)
    scale = (g.abs().amax(dim=-1) / 127).clamp(min=1e-12)
    q = (g / scale[..., None]).round().clamp(-127, 127).to(torch.int8)
    return q, scale


def _is_groups(weight: torch.Tensor, bits: int) -> bool:
    out, inp = weight.shape
    if inp % INT4_GROUP:
        return False
    g = weight.detach().float().view(out, inp // INT4_GROUP, INT4_GROUP)
    if bits == 4:
        q, scale, lo = _q4_groups(weight)
        back = q.float() * scale[..., None] + lo[..., None]
    else:
        q8, scale = _q8_groups(weight)
        back = q8.float() * scale[..., None]
    return bool(((back - g).abs() <= _STORED_TOLERANCE * scale[..., None]).all())


def stored_groups(block: Sequence[torch.Tensor], head: torch.Tensor) -> str:
    """What a model's weights already are, as the group-of-32 products hold them: `int4` when
    every weight of the layers (`block`) is 4-bit groups (GGUF's Q4_1: quantizing them gives the
    shipped values back) and the output matrix `head` 8-bit (Q8_0, as `int4` runs it), `int8`
    when all are 8-bit groups (Q8_0), else `none`. `--quantize auto` runs what this finds, so
    it only ever computes with the weights as shipped. Stops at the first weight that fails."""
    for bits, name in ((4, "int4"), (8, "int8")):
        if all(_is_groups(w, bits) for w in block) and _is_groups(head, 8):
            return name
    return "none"


class Int4Linear(RowLinear):
    """Asymmetric 4-bit weights in groups of `INT4_GROUP` input columns:
    `w = (q - 8) * scale + zero` with `zero = min + 8 * scale`, `q` in 0..15; activations in
    `dtype` (default: the weight's)."""

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype | None = None) -> None:
        out, inp = weight.shape
        q, scale, lo = _q4_groups(weight)
        self.packed = torch._convert_weight_to_int4pack_for_cpu(  # noqa: SLF001
            q.to(torch.int32).view(out, inp), 1
        )
        # [in / group, out, 2]: the kernel's layout of (scale, zero) per group and output.
        self.scales_zeros = (
            torch.stack([scale, lo + 8 * scale], dim=-1).transpose(0, 1).contiguous()
        ).to(dtype or weight.dtype)

    def __call__(self, x: torch.Tensor, rows: int) -> torch.Tensor:
        """The product."""
        return torch._weight_int4pack_mm_for_cpu(x, self.packed, INT4_GROUP, self.scales_zeros)  # noqa: SLF001


class GroupLinear(RowLinear):
    """Weights in groups of `INT4_GROUP` input columns with float32 activations, through the C++
    op `group_linear`: 4-bit `w = q * scale + lo` (q in 0..15, GGUF's Q4_1) or 8-bit
    `w = q * scale` (q in -127..127, GGUF's Q8_0). Quantizing a GGUF's dequantized Q4_1 or Q8_0
    weights this way gets its shipped blocks back: each group's minimum is `lo` and its range
    15 (or 127) steps, as llama.cpp chose them."""

    def __init__(self, weight: torch.Tensor, bits: int, op: Any) -> None:
        if bits not in (4, 8):
            raise ValueError(f"GroupLinear: {bits} bits (expected 4 or 8)")
        out, inp = weight.shape
        if inp % INT4_GROUP:
            raise ValueError(f"GroupLinear: {inp} input features are not a multiple of 32")
        self.op, self.bits = op, bits
        if bits == 4:
            q, scale, lo = _q4_groups(weight)
            # Element j of a group in the low nibble of byte j, element j + 16 in the high one.
            self.q = (q[..., :16] | (q[..., 16:] << 4)).reshape(out, inp // 2).contiguous()
            self.lo = lo.contiguous()
        else:
            q8, scale = _q8_groups(weight)
            self.q = q8.reshape(out, inp).contiguous()
            self.lo = torch.empty(0)
        self.scale = scale.contiguous()

    def dequantized(self) -> torch.Tensor:
        """The float32 weight `[out, in]` this product computes with."""
        out = self.q.shape[0]
        if self.bits == 4:
            b = self.q.view(out, -1, 16)
            q = torch.cat([b & 15, b >> 4], dim=-1).float()
            return (q * self.scale[..., None] + self.lo[..., None]).view(out, -1)
        q = self.q.view(out, -1, INT4_GROUP).float()
        return (q * self.scale[..., None]).view(out, -1)

    def __call__(self, x: torch.Tensor, rows: int) -> torch.Tensor:
        """The product."""
        y: torch.Tensor = self.op.group_linear(x.contiguous(), self.q, self.scale, self.lo)
        return y

    def groups_at(self, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(q, scale, lo), as `group_linear` reads them: this product runs it at any rows."""
        return self.q, self.scale, self.lo


def pack_bf16_weight(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [out, in] as `bf16_linear` reads it: bfloat16 [ceil(out / 16), ceil(in / 2), 16,
    2], block `b` holding outputs 16b..16b+15 with their columns in pairs (zeros past the
    ends)."""
    out, inp = weight.shape
    o16, i2 = -(-out // 16) * 16, -(-inp // 2) * 2
    w = torch.zeros(o16, i2, dtype=torch.bfloat16)
    w[:out, :inp] = weight.detach().to(torch.bfloat16)
    return w.view(o16 // 16, 16, i2 // 2, 2).permute(0, 2, 1, 3).contiguous()


class Bf16Gemv(RowLinear):
    """`x @ W.T` for a few bfloat16 rows through the C++ op `bf16_linear` (module docstring),
    on `W` reordered once (`pack_bf16_weight`)."""

    def __init__(self, weight: torch.Tensor, op: Any) -> None:
        self.op, self.out = op, int(weight.shape[0])
        self.packed = pack_bf16_weight(weight)

    def __call__(self, x: torch.Tensor, rows: int) -> torch.Tensor:
        """The product (bfloat16)."""
        y: torch.Tensor = self.op.bf16_linear(x.contiguous(), self.packed, self.out)
        return y

    def packed_at(self, rows: int) -> torch.Tensor | None:
        """The packed weight (this product always runs `bf16_linear`)."""
        return self.packed


def pack_gate_up(weight: torch.Tensor) -> torch.Tensor:
    """A gated MLP's gate/up weight `[2 * inter, in]` (gate rows, then up rows) as
    `bf16_gate_up_silu` reads it: gate block j and up block j (16 outputs each) side by side,
    then reordered as `pack_bf16_weight` does."""
    two_inter, inp = weight.shape
    if two_inter % 32:
        raise ValueError(f"gate/up weight of {two_inter} rows: need 2 x a multiple of 16")
    inter = two_inter // 2
    blocks = [weight[:inter].reshape(inter // 16, 16, inp), weight[inter:].reshape(-1, 16, inp)]
    return pack_bf16_weight(torch.stack(blocks, 1).reshape(two_inter, inp))


class GatedGemv(RowLinear):
    """`silu(x @ G.T) * (x @ U.T)` for bfloat16 rows through the C++ op `bf16_gate_up_silu`, on
    a gated MLP's gate/up weight reordered once (`pack_gate_up`): the same bits as `Bf16Gemv`
    then `silu_mul`, without writing the gate/up output out and reading it back. Why: at a
    prompt's rows that output is the widest a layer writes. SmolLM2's 30 gate/up products
    with their activation, Intel Xeon family 6 model 207, 2 threads, best of 7: 18.7 ms at 400
    rows against 25.9 for oneDNN prepacked then `silu_mul` (28.1 for `Bf16Gemv` then
    `silu_mul`), 8.8 against 12.9 at 160 rows, and at 32 rows 4.0 against 4.6 for `Bf16Gemv`
    then `silu_mul` (6.7 for oneDNN)."""

    def __init__(self, weight: torch.Tensor, op: Any) -> None:
        self.op, self.inter = op, int(weight.shape[0]) // 2
        self.packed = pack_gate_up(weight)

    def __call__(self, x: torch.Tensor, rows: int) -> torch.Tensor:
        """The activation `[rows, inter]` (bfloat16)."""
        y: torch.Tensor = self.op.bf16_gate_up_silu(x.contiguous(), self.packed, self.inter)
        return y

    def packed_at(self, rows: int) -> torch.Tensor | None:
        """The packed gate/up weight, as `bf16_gate_up_silu` reads it (`pack_gate_up`)."""
        return self.packed


class GateUpSilu:
    """A gated MLP's activation `silu(gate) * up` from its input: `fused` (a `GatedGemv`) up to
    `fused_rows` rows, else the gate/up product `linear`, then the C++ op `silu_mul` (`op`,
    one rounding) where it is built, torch's ops otherwise."""

    def __init__(
        self, linear: RowLinear, op: Any | None, fused: RowLinear | None = None, fused_rows: int = 0
    ) -> None:
        self.linear, self.op, self.fused, self.fused_rows = linear, op, fused, fused_rows

    def __call__(self, x: torch.Tensor, rows: int) -> torch.Tensor:
        """The activation `[rows, inter]`."""
        if self.fused is not None and rows <= self.fused_rows:
            return self.fused(x, rows)
        gu = self.linear(x, rows)
        if self.op is not None and gu.dim() == 2 and gu.is_contiguous():
            act: torch.Tensor = self.op.silu_mul(gu)
            return act
        gate, up = gu.chunk(2, dim=-1)
        return F.silu(gate) * up

    def fused_at(self, rows: int) -> GatedGemv | None:
        """The fused product that `rows` rows run (None: the product, then the activation)."""
        if isinstance(self.fused, GatedGemv) and rows <= self.fused_rows:
            return self.fused
        return None


def gemv_op() -> Any | None:
    """The C++ ops holding `bf16_linear`, or None where they cannot be built here or
    `LENBATCH_BF16_GEMV=off` leaves them out."""
    choice = os.environ.get(_GEMV_ENV, "auto").strip().lower()
    if choice not in ("auto", "off"):
        raise ValueError(f"{_GEMV_ENV}={choice!r} (expected auto or off)")
    return None if choice == "off" else _ops_with("bf16_linear")


class SwitchLinear(RowLinear):
    """The quantized kernel up to `switch_rows` rows, the dense one above."""

    def __init__(self, small: RowLinear, large: RowLinear, switch_rows: int) -> None:
        self.small, self.large, self.switch_rows = small, large, switch_rows

    def __call__(self, x: torch.Tensor, rows: int) -> torch.Tensor:
        """The product."""
        if rows <= self.switch_rows:
            return self.small(x, rows)
        return self.large(x, rows)

    def packed_at(self, rows: int) -> torch.Tensor | None:
        """The kernel's packed weight at `rows` rows, if that kernel is `bf16_linear`."""
        return (self.small if rows <= self.switch_rows else self.large).packed_at(rows)

    def groups_at(self, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The kernel's blocks at `rows` rows, if that kernel is `group_linear`."""
        return (self.small if rows <= self.switch_rows else self.large).groups_at(rows)


class LargeRowsLinear(RowLinear):
    """The prepacked product, and `F.linear` on the plain weight at the row counts where that
    measured faster (`measure_large_rows`): a product of `rows` rows takes the choice made at
    the largest probed row count not above it (prepacked below the smallest)."""

    def __init__(self, weight: torch.Tensor, plain_at: tuple[int, ...]) -> None:
        self.packed: RowLinear = PackedLinear(weight)
        self.plain: RowLinear = DenseLinear(weight)
        self.plain_at = frozenset(plain_at)
        self._by_rows: dict[int, RowLinear] = {}  # a forward's row counts are rounded: few

    def choice(self, rows: int) -> RowLinear:
        """The product `rows` rows run through."""
        lin = self._by_rows.get(rows)
        if lin is None:
            probed = [r for r in LARGE_ROWS if r <= rows]
            lin = self.plain if probed and probed[-1] in self.plain_at else self.packed
            self._by_rows[rows] = lin
        return lin

    def __call__(self, x: torch.Tensor, rows: int) -> torch.Tensor:
        """The product."""
        return self.choice(rows)(x, rows)


def _ops_with(name: str) -> Any | None:
    """lenbatch's C++ ops if they are built here and hold op `name` (None otherwise)."""
    from lenbatch.runners.decode_attention import decode_attention_op

    op = decode_attention_op()
    return op if op is not None and hasattr(op, name) else None


def group_op() -> Any | None:
    """The C++ ops holding `group_linear`, or None where they cannot be built here."""
    return _ops_with("group_linear")


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
        gated = _ops_with("bf16_gate_up_silu") if gemv_op() is not None else None
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


# Row counts at which `measure_large_rows` races the two dense products: a whole prompt's
# prefill (a forward's row count is `linears.rounded_tokens`, so one of few values).
LARGE_ROWS = (256, 384, 512, 768, 1024, 1536, 2048)


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
    op = _ops_with("bf16_gate_up_silu") if gemv_op() is not None else None
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
