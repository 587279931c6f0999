"""The lean decode path's matrix products, one class per kernel: `F.linear` (`DenseLinear`),
oneDNN-prepacked (`PackedLinear`), weight-only int8 and int4 (torch's `Int8Linear`,
`Int4Linear`; lenbatch's float32 group loop `GroupLinear`), lenbatch's bfloat16 product of a
few rows (`Bf16Gemv`) and its gate/up product fused with the activation (`GatedGemv`,
`GateUpSilu`), and the row-count switches between two of them (`SwitchLinear`,
`LargeRowsLinear`).

Which kernel a model's linears run, and up to how many rows, is measured on this processor and
built by `runners.weightonly` (`LinearPlan`, `plan_for`, `make_linear`); its docstring says why
each kernel wins where it does.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from lenbatch.runners.linears import Linear

__all__ = [
    "INT4_GROUP",
    "LARGE_ROWS",
    "Bf16Gemv",
    "DenseLinear",
    "GateUpSilu",
    "GatedGemv",
    "GroupLinear",
    "Int4Linear",
    "Int8Linear",
    "LargeRowsLinear",
    "PackedLinear",
    "RowLinear",
    "SwitchLinear",
    "gemv_op",
    "group_op",
    "ops_with",
    "pack_bf16_weight",
    "pack_gate_up",
    "stored_groups",
]

# The kernels below are torch's own (what torch.compile and torchao emit on CPU); they have no
# public name, hence the SLF001 exemptions.

INT4_GROUP = 32
_GEMV_ENV = "LENBATCH_BF16_GEMV"
# Row counts at which `weightonly.measure_large_rows` races the two dense products: a whole
# prompt's prefill (a forward's row count is `linears.rounded_tokens`, so one of few values).
LARGE_ROWS = (256, 384, 512, 768, 1024, 1536, 2048)


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
    return None if choice == "off" else ops_with("bf16_linear")


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


def ops_with(name: str) -> Any | None:
    """lenbatch's C++ ops if they are built here and hold op `name` (None otherwise)."""
    from lenbatch.runners.decode_attention import decode_attention_op

    op = decode_attention_op()
    return op if op is not None and hasattr(op, name) else None


def group_op() -> Any | None:
    """The C++ ops holding `group_linear`, or None where they cannot be built here."""
    return ops_with("group_linear")
