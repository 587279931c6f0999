"""`GroupLinear`: weight-only products in groups of 32 with float32 activations (the C++ op
`group_linear`), against float64 products on the same weights and against gguf's own
dequantization of SmolLM2's shipped Q4_1 and Q8_0 blocks.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from lenbatch.runners import decode_attention as da
from lenbatch.runners.rowlinears import (
    GroupLinear,
    Int4Linear,
    Int8Linear,
    SwitchLinear,
    group_op,
    stored_groups,
)
from lenbatch.runners.weightonly import LinearPlan, make_linear
from tests.helpers import needs_op


def _q4_1(out: int, inp: int, seed: int) -> torch.Tensor:
    """What a Q4_1 GGUF dequantizes to: per group of 32, `q * d + m` with float16 `d`, `m`
    and q in 0..15 (0 and 15 both present: llama.cpp's quantizer puts the minimum and the
    maximum there)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (out, inp // 32, 32), generator=gen)
    q[..., 3], q[..., 20] = 0, 15
    d = (torch.rand((out, inp // 32, 1), generator=gen) * 0.01 + 1e-3).half().float()
    m = (torch.randn((out, inp // 32, 1), generator=gen) * 0.05).half().float()
    return (q * d + m).reshape(out, inp)


def _q8_0(out: int, inp: int, seed: int) -> torch.Tensor:
    """What a Q8_0 GGUF dequantizes to: `q * d` with float16 `d`, |q| <= 127 and 127 reached."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (out, inp // 32, 32), generator=gen)
    q[..., 5] = 127
    d = (torch.rand((out, inp // 32, 1), generator=gen) * 0.01 + 1e-3).half().float()
    return (q * d).reshape(out, inp)


@needs_op
@pytest.mark.parametrize("bits", [4, 8])
def test_recovers_gguf_blocks_and_multiplies_exactly(bits: int) -> None:
    """The blocks come back bit for bit, and the product equals float64's to float32 rounding
    at every row count the op specialises (1-7, 8, and 8 + a remainder), with an output count
    that is not a multiple of its four-row work units."""
    out, inp = 37, 96
    w = _q4_1(out, inp, 1) if bits == 4 else _q8_0(out, inp, 1)
    op = group_op()
    lin = GroupLinear(w, bits, op)
    assert torch.equal(lin.dequantized(), w)
    gen = torch.Generator().manual_seed(2)
    for rows in (1, 2, 3, 4, 5, 6, 7, 8, 11, 19):
        x = torch.randn((rows, inp), generator=gen)
        ref = (x.double() @ w.double().T).float()
        torch.testing.assert_close(lin(x, rows), ref, rtol=1e-5, atol=1e-5)


def test_stored_groups_finds_what_a_gguf_ships() -> None:
    """`--quantize auto`'s test: Q4_1 layers with a Q8_0 output matrix are int4, Q8_0
    throughout int8; float weights, a float output matrix, or one value a hundredth of a step
    off its grid are none."""
    layers = [_q4_1(64, 96, s) for s in range(3)]
    head = _q8_0(50, 96, 9)
    assert stored_groups(layers, head) == "int4"
    assert stored_groups([_q8_0(64, 96, s) for s in range(3)], head) == "int8"
    # int4 runs the output matrix as symmetric 8-bit groups: an asymmetric 4-bit one would round
    assert stored_groups(layers, _q4_1(50, 96, 9)) == "none"
    gen = torch.Generator().manual_seed(4)
    assert stored_groups([torch.randn((64, 96), generator=gen)], head) == "none"
    assert stored_groups(layers, torch.randn((50, 96), generator=gen)) == "none"
    off = layers[1].clone()
    step = (off[7, :32].max() - off[7, :32].min()) / 15
    off[7, 5] += step / 100
    assert stored_groups([layers[0], off, layers[2]], head) == "none"
    part = _q4_1(64, 96, 1)[:, :72].contiguous()
    assert stored_groups([part], head) == "none"  # not whole groups of 32


@needs_op
def test_smollm2_blocks_come_back_bit_for_bit() -> None:
    """SmolLM2's shipped Q4_1 layer weights and its Q8_0 output matrix, dequantized by gguf
    (the reference transformers loads), are what GroupLinear computes with."""
    import gguf

    from lenbatch.runners.causal import SMOLLM2_GGUF, smollm2_folder

    reader = gguf.GGUFReader(str(smollm2_folder() / SMOLLM2_GGUF))
    tensors = {t.name: t for t in reader.tensors}
    op = group_op()
    for name, bits, kind in (
        ("blk.4.ffn_down.weight", 4, "Q4_1"),
        ("blk.11.attn_k.weight", 4, "Q4_1"),
        ("token_embd.weight", 8, "Q8_0"),
    ):
        t = tensors[name]
        assert t.tensor_type.name == kind
        w = torch.from_numpy(np.ascontiguousarray(gguf.dequantize(t.data, t.tensor_type)))
        lin = GroupLinear(w.float(), bits, op)
        assert torch.equal(lin.dequantized(), w.float()), name
        x = torch.randn((3, w.shape[1]))
        ref = (x.double() @ w.double().T).float()
        torch.testing.assert_close(lin(x, 3), ref, rtol=1e-4, atol=1e-4)


@needs_op
def test_float32_quantized_linears_take_the_op() -> None:
    """In float32, int4 and int8 run GroupLinear (8-bit in groups of 32, not per channel):
    int4 exact on Q4_1 weights, int8 within 1 % of the product's scale."""
    w = _q4_1(64, 64, 3)
    for quantization, bits in (("int4", 4), ("int8", 8)):
        lin = make_linear(w, LinearPlan(quantization, pack=False, switch_rows=4))
        assert isinstance(lin, SwitchLinear) and isinstance(lin.small, GroupLinear)
        assert lin.small.bits == bits
        x = torch.randn(2, 64)
        ref = F.linear(x, w)
        tol = 1e-5 if bits == 4 else 0.01 * float(ref.abs().max())
        torch.testing.assert_close(lin(x, 2), ref, rtol=tol, atol=tol)


def test_without_the_op_torchs_kernels_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the C++ ops forced off, float32 int4 / int8 fall back to torch's kernels, and
    bfloat16 always takes them."""
    monkeypatch.setenv("LENBATCH_DECODE_ATTENTION", "sdpa")
    monkeypatch.setattr(da, "_loaded", {})
    assert group_op() is None
    w = _q4_1(64, 64, 4)
    small4 = make_linear(w, LinearPlan("int4", pack=False, switch_rows=4)).small  # type: ignore[attr-defined]
    small8 = make_linear(w, LinearPlan("int8", pack=False, switch_rows=4)).small  # type: ignore[attr-defined]
    assert isinstance(small4, Int4Linear) and isinstance(small8, Int8Linear)
    monkeypatch.undo()
    bf = make_linear(w, LinearPlan("int4", pack=False, switch_rows=4), torch.bfloat16)
    assert isinstance(bf.small, Int4Linear)  # type: ignore[attr-defined]


@needs_op
def test_bad_shapes_are_refused() -> None:
    """Input features not a multiple of 32, or an unknown width, are refused."""
    op = group_op()
    with pytest.raises(ValueError, match="multiple of 32"):
        GroupLinear(torch.randn(4, 40), 4, op)
    with pytest.raises(ValueError, match="expected 4 or 8"):
        GroupLinear(torch.randn(4, 64), 2, op)
    lin = GroupLinear(torch.randn(4, 64), 4, op)
    with pytest.raises(RuntimeError, match="group_linear"):
        op.group_linear(torch.randn(2, 32), lin.q, lin.scale, lin.lo)
