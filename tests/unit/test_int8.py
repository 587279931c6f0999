"""`runners.int8`: int8 products with per-row activation scales, against float32 `F.linear`."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lenbatch.runners import int8
from lenbatch.runners.int8 import ACT_LEVELS, WEIGHT_LEVELS, Int8Linear, int8_kind
from lenbatch.runners.linears import fused_ops
from tests.helpers import needs_op


def _data(rows: int = 37, inp: int = 96, out: int = 80) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(out, inp, generator=gen) * 0.05
    b = torch.randn(out, generator=gen) * 0.1
    # rows of very different magnitudes: each must keep its own precision
    x = torch.randn(rows, inp, generator=gen) * torch.logspace(-3, 2, rows)[:, None]
    return w, b, x


def _relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest error of each row relative to that row's largest output."""
    scale = ref.abs().amax(dim=1, keepdim=True)
    return float(((got - ref).abs() / scale).max())


@pytest.mark.parametrize("fused", [True, False], ids=["cpp-ops", "torch-ops"])
@pytest.mark.parametrize("activation", ["none", "gelu"])
def test_int8_linear_tracks_float32_in_every_row(
    fused: bool, activation: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every row, from 1e-3 to 1e2 in magnitude, within 3 % of its own largest output: the
    activations are scaled per row (a per-tensor scale would flatten the small rows to
    zero); the bias and GELU come after the scale."""
    if fused and fused_ops() is None:
        pytest.skip("lenbatch's C++ ops are not built on this CPU")
    w, b, x = _data()
    lin = Int8Linear(w, b, activation)  # type: ignore[arg-type]
    if not fused:
        lin.ops = None
    ref = F.linear(x, w, b)
    if activation == "gelu":
        ref = F.gelu(ref)
    got = lin(x)
    assert got.shape == ref.shape and got.dtype == torch.float32
    assert _relative_error(got, ref) < 0.03
    # and without a bias
    nobias = Int8Linear(w, None)
    assert _relative_error(nobias(x), F.linear(x, w)) < 0.03


@needs_op
def test_quantize_rows_matches_its_torch_form() -> None:
    """The C++ pass gives torch's levels and scales: a zero row has scale 1 and sits at the
    zero point; each row's largest magnitude reaches the outermost level."""
    ops = fused_ops()
    assert ops is not None
    _, _, x = _data()
    x[3] = 0.0
    q, s = ops.quantize_rows(x, ACT_LEVELS)
    q_ref, s_ref = int8._rows_in_torch(x)
    assert q.dtype == torch.uint8 and torch.allclose(s, s_ref)
    assert float(s[3]) == 1.0 and bool((q[3] == ACT_LEVELS + 1).all())
    # the same levels, up to a rounding tie broken the other way by x * (1 / s) against x / s
    assert int((q.int() - q_ref.int()).abs().max()) <= 1
    assert float((q.int() != q_ref.int()).float().mean()) < 1e-3
    assert int(q.min()) >= 1 and int(q.max()) == 2 * ACT_LEVELS + 1


@needs_op
def test_scale_rows_applies_scale_bias_and_exact_gelu() -> None:
    """`scale_rows` is `gelu(y * s + b)` with torch's exact GELU, to float32 rounding."""
    ops = fused_ops()
    assert ops is not None
    gen = torch.Generator().manual_seed(1)
    y = torch.randn(50, 300, generator=gen) * 5
    y[:, :2] = torch.tensor([120.0, -120.0])  # past erf's cap (12 to 132 after scaling)
    s = torch.rand(50, generator=gen) + 0.1
    b = torch.randn(300, generator=gen)
    got = y.clone()
    ops.scale_rows(got, s, b, True)
    assert float((got - F.gelu(y * s[:, None] + b)).abs().max()) < 1e-5
    got = y.clone()
    ops.scale_rows(got, s)
    assert torch.equal(got, y * s[:, None])


def test_weights_use_seven_bits_per_channel() -> None:
    """Weights land in -63..63 with one scale per output channel (the sums of two uint8 x int8
    products then fit the 16 bits an AVX2 CPU adds them in)."""
    w, _, _ = _data()
    w[0] *= 100  # one loud channel does not coarsen the others
    q, scale = int8._quantize_weight(w)
    assert q.dtype == torch.int8 and int(q.abs().max()) == WEIGHT_LEVELS
    assert bool((q.abs().amax(dim=1) == WEIGHT_LEVELS).all())
    assert torch.allclose(q.float() * scale[:, None], w, atol=float(scale.max()) / 2 + 1e-9)
    assert _relative_error(q[1:].float() * scale[1:, None], w[1:]) < 1 / WEIGHT_LEVELS


def test_int8_kind_refuses_a_product_that_saturates(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check at first use compares oneDNN's product with exact integer arithmetic at the
    extremes: a product that saturates its 16-bit sums (full 8-bit operands on AVX2) is
    refused, and a runner then cannot be built with int8."""
    assert int8_kind()[0], int8_kind()[1]  # this torch's oneDNN computes them exactly
    real = int8._product
    assert real is not None

    def saturating(*args: object) -> torch.Tensor:
        out: torch.Tensor = real(*args)  # a stand-in for sums that stop at a limit
        return out.clamp(-1e6, 1e6)

    monkeypatch.setattr(int8, "_product", saturating)
    int8_kind.cache_clear()
    try:
        ok, why = int8_kind()
        assert not ok and "not exact" in why
        w, b, _ = _data()
        with pytest.raises(ValueError, match="int8 is not available here"):
            Int8Linear(w, b)
    finally:
        int8_kind.cache_clear()


def test_quantize_linears_replaces_each_linear_and_counts_its_bytes() -> None:
    """A module's linear layers become int8 in place; the rest stays; the bytes are the int8
    weights, their scales and the biases."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
    x = torch.randn(5, 64)
    ref = model(x).detach()
    nbytes = int8.quantize_linears(model)
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert isinstance(model[1], torch.nn.GELU)
    assert nbytes == 32 * (64 + 4) + 4 * 32 + 8 * (32 + 4) + 4 * 8
    assert _relative_error(model(x), ref) < 0.05
    # a product named in `keep` (dotted, under the module) stays float32
    pair = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    nested = torch.nn.ModuleList([pair])
    int8.quantize_linears(nested, ("0.1",))
    assert not isinstance(nested[0][0], torch.nn.Linear)
    assert isinstance(nested[0][1], torch.nn.Linear)
