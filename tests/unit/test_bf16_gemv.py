"""`Bf16Gemv`: lenbatch's bfloat16 product of a few rows (the C++ op `bf16_linear`) against
float64 products of the same bfloat16 values, and how `make_linear` takes it or leaves it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lenbatch.runners.rowlinears import (
    Bf16Gemv,
    DenseLinear,
    SwitchLinear,
    gemv_op,
    pack_bf16_weight,
)
from lenbatch.runners.weightonly import LinearPlan, make_linear
from tests.helpers import needs_avx512 as needs_op


def _bf16(*shape: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * 0.1).to(torch.bfloat16)


def test_packed_layout_holds_each_weight_once_in_its_block_and_pair() -> None:
    """Block b, pair p, lane j, slot t holds W[16b + j, 2p + t]; the pads are zeros."""
    w = _bf16(37, 9, seed=0)
    wp = pack_bf16_weight(w)
    assert wp.shape == (3, 5, 16, 2) and wp.dtype == torch.bfloat16
    for o in (0, 15, 16, 36):
        for i in (0, 1, 7, 8):
            assert wp[o // 16, i // 2, o % 16, i % 2] == w[o, i]
    assert not wp[2, :, 5:, :].any()  # outputs 37..47
    assert not wp[:, 4, :, 1].any()  # column 9


@needs_op
@pytest.mark.parametrize("use_amx", [True, False])
@pytest.mark.parametrize("out,inp", [(37, 96), (64, 71), (16, 2), (300, 576)])
def test_equals_float64_products_to_bfloat16_rounding(out: int, inp: int, use_amx: bool) -> None:
    """At every row count the op specialises (1-7, 8, 8 + a remainder; on AMX tiles one to
    eleven 16-row tiles, in pairs, whole or with a partial last tile), with output and input
    counts that are not multiples of its 16-output blocks (an odd count of blocks among them)
    or column pairs: the float64 product of the same bfloat16 values, rounded to bfloat16
    (float32 sums: at most one step off). `use_amx=False` keeps the vector loop at every row
    count (on a CPU without AMX both are that loop)."""
    op = gemv_op()
    assert op is not None
    w = _bf16(out, inp, seed=1)
    lin = Bf16Gemv(w, op)
    for rows in (1, 2, 3, 4, 5, 6, 7, 8, 9, 19, 33, 50, 64, 161):
        x = _bf16(rows, inp, seed=rows)
        y = op.bf16_linear(x, lin.packed, out, use_amx)
        assert y.shape == (rows, out) and y.dtype == torch.bfloat16
        exact = x.double() @ w.double().T
        step = exact.abs().clamp(min=1e-6) * 2**-8  # one bfloat16 step
        assert ((y.double() - exact).abs() <= step + 1e-6).all(), rows
        # torch's own bfloat16 product agrees as closely
        assert torch.allclose(y.float(), F.linear(x, w).float(), rtol=2**-7, atol=1e-5)


@needs_op
def test_make_linear_switches_to_the_dense_product_above_gemv_rows() -> None:
    """Up to `gemv_rows` rows the product runs `Bf16Gemv`, above it the dense one."""
    w = _bf16(48, 64, seed=2)
    lin = make_linear(w, LinearPlan(pack=False, gemv_rows=4))
    assert isinstance(lin, SwitchLinear)
    assert isinstance(lin.small, Bf16Gemv) and isinstance(lin.large, DenseLinear)
    assert lin.switch_rows == 4
    plain = make_linear(w, LinearPlan(pack=False))
    assert isinstance(plain, DenseLinear)
    float32 = make_linear(w.float(), LinearPlan(pack=False, gemv_rows=4))
    assert isinstance(float32, DenseLinear)  # bfloat16 only


def test_off_leaves_it_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """`LENBATCH_BF16_GEMV=off` (and any CPU where the op cannot be built) gives the dense
    product whatever the plan says; a misspelt value is refused, saying what it expects."""
    monkeypatch.setenv("LENBATCH_BF16_GEMV", "off")
    assert gemv_op() is None
    w = _bf16(48, 64, seed=3)
    assert isinstance(make_linear(w, LinearPlan(pack=False, gemv_rows=8)), DenseLinear)
    monkeypatch.setenv("LENBATCH_BF16_GEMV", "of")
    with pytest.raises(ValueError, match="expected auto or off"):
        gemv_op()


@pytest.mark.parametrize(
    "outcomes,expected",
    [
        # 1, 2 win; 4 loses twice (noise between wins); 8-32 win; 64 and 128 lose: 32
        ("W W LL W W W LL LL", 32),
        # a loss at 4 won on its second race; 8 and 16 lose: 4
        ("W W LW LL LL", 4),
        # 1 and 2 lose: never
        ("LL LL", 0),
        # every count wins, up to prompt-chunk sizes: 512
        ("W W W W W W W W W W", 512),
    ],
)
def test_probe_takes_the_most_rows_won_ending_at_two_losses_in_a_row(
    monkeypatch: pytest.MonkeyPatch, outcomes: str, expected: int
) -> None:
    """`measure_gemv`'s rule, its races scripted (W: the op is faster, L: the dense product):
    a lost race is raced again, a lone lost row count between wins does not end the probe, two
    in a row do, and every race scripted is run (none more)."""
    from lenbatch.runners import weightonly

    script = [c for c in outcomes if c != " "]
    calls: list[str] = []

    def race(a: object, b: object, reps: int = 9) -> tuple[float, float]:
        calls.append(script[len(calls)])
        return (1.0, 2.0) if calls[-1] == "W" else (2.0, 1.0)

    monkeypatch.setattr(weightonly, "_race", race)
    monkeypatch.setattr(weightonly, "gemv_op", lambda: object())
    monkeypatch.setattr(weightonly, "_probe_weights", lambda shape, dtype: [_bf16(32, 64, seed=4)])
    assert weightonly.measure_gemv((32, 64), pack=False) == expected
    assert len(calls) == len(script)


@pytest.mark.parametrize("outcomes,expected", [("W LL", 256), ("LL LL", 128), ("W W", 512)])
def test_probe_from_a_known_count_races_only_above_it(
    monkeypatch: pytest.MonkeyPatch, outcomes: str, expected: int
) -> None:
    """With `above=128` the probe races 256 and 512 rows only, and keeps 128 where both lose."""
    from lenbatch.runners import weightonly

    script = [c for c in outcomes if c != " "]
    rows: list[int] = []

    def race(a: object, b: object, reps: int = 9) -> tuple[float, float]:
        rows.append(len(rows))
        return (1.0, 2.0) if script[len(rows) - 1] == "W" else (2.0, 1.0)

    monkeypatch.setattr(weightonly, "_race", race)
    monkeypatch.setattr(weightonly, "gemv_op", lambda: object())
    monkeypatch.setattr(weightonly, "_probe_weights", lambda shape, dtype: [_bf16(32, 64, seed=4)])
    assert weightonly.measure_gemv((32, 64), pack=False, above=128) == expected
    assert len(rows) == len(script)


@needs_op
def test_a_shape_measured_apart_gets_its_own_row_count() -> None:
    """`gemv_shapes` overrides `gemv_rows` for weights of that shape only, in `make_linear`
    and in the plan's description; a zero there leaves that shape dense."""
    plan = LinearPlan(pack=False, gemv_rows=4, gemv_shapes=((48, 64, 128), (32, 64, 0)))
    assert plan.gemv_for((48, 64)) == 128 and plan.gemv_for((64, 48)) == 4
    wide = make_linear(_bf16(48, 64, seed=5), plan)
    assert isinstance(wide, SwitchLinear) and wide.switch_rows == 128
    other = make_linear(_bf16(16, 64, seed=6), plan)
    assert isinstance(other, SwitchLinear) and other.switch_rows == 4
    assert isinstance(make_linear(_bf16(32, 64, seed=7), plan), DenseLinear)
    assert plan.describe() == (
        "lenbatch bf16 gemv up to 4 rows (48x64: 128, 32x64: 0), dense F.linear above"
    )


def test_plan_measures_the_other_shapes_only_where_the_op_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`plan_for(..., shapes=...)` probes each other shape once (the typical shape and
    repeats are not probed again), from the typical shape's count, when that probe found the
    op faster, and none when it did not."""
    from lenbatch.runners import weightonly

    found = {(96, 32): 64, (32, 32): 512, (32, 48): 256, (48, 32): 64}
    probed: list[tuple[tuple[int, int], int]] = []

    def measure(shape: tuple[int, int], pack: bool, above: int = 0) -> int:
        probed.append((shape, above))
        return found.get(shape, 0)

    monkeypatch.setattr(weightonly, "measure_gemv", measure)
    monkeypatch.setattr(weightonly, "_MEASURED", {})
    shapes = [(96, 32), (32, 32), (32, 48), (32, 32), (48, 32)]
    plan = weightonly.plan_for((96, 32), torch.bfloat16, pack=False, shapes=shapes)
    # the others start from the typical shape's count; one equal to it is not listed apart
    assert probed == [((96, 32), 0), ((32, 32), 64), ((32, 48), 64), ((48, 32), 64)]
    assert plan.gemv_rows == 64 and plan.gemv_shapes == ((32, 32, 512), (32, 48, 256))
    assert plan.gemv_for((32, 48)) == 256 and plan.gemv_for((96, 32)) == 64
    probed.clear()
    none = weightonly.plan_for((40, 8), torch.bfloat16, pack=False, shapes=shapes)
    assert probed == [((40, 8), 0)] and none.gemv_rows == 0 and none.gemv_shapes == ()


def test_gate_up_layout_puts_each_gate_block_beside_its_up_block() -> None:
    """`pack_gate_up`: block 2j holds gate outputs 16j..16j+15, block 2j + 1 the up outputs
    of the same indices, each laid out as `pack_bf16_weight` lays a block; a gate/up weight
    whose halves are not whole blocks is refused."""
    from lenbatch.runners.rowlinears import pack_gate_up

    w = _bf16(96, 10, seed=8)  # inter 48: three blocks a half
    wp = pack_gate_up(w)
    plain = pack_bf16_weight(w)
    assert wp.shape == (6, 5, 16, 2)
    for j in range(3):
        assert torch.equal(wp[2 * j], plain[j])  # gate block j
        assert torch.equal(wp[2 * j + 1], plain[3 + j])  # up block j
    with pytest.raises(ValueError, match="multiple of 16"):
        pack_gate_up(_bf16(48, 10, seed=8))


@needs_op
@pytest.mark.parametrize("use_amx", [True, False])
@pytest.mark.parametrize("inter,inp", [(48, 96), (16, 64), (96, 576), (32, 71)])
def test_gate_up_silu_equals_the_product_then_the_activation(
    inter: int, inp: int, use_amx: bool
) -> None:
    """`bf16_gate_up_silu` gives the bits of `bf16_linear` then `silu_mul` at every row count
    the op specialises (vector loop, one to eleven row tiles, partial last tiles, an odd
    count of block pairs), and is within bfloat16 rounding of silu(gate) * up computed in
    float64 from the rounded products."""
    op = gemv_op()
    assert op is not None
    from lenbatch.runners.rowlinears import GatedGemv

    w = _bf16(2 * inter, inp, seed=9)
    fused = GatedGemv(w, op)
    plain = pack_bf16_weight(w)
    for rows in (1, 2, 3, 4, 5, 8, 9, 16, 17, 33, 50, 161):
        x = _bf16(rows, inp, seed=rows)
        y = op.bf16_gate_up_silu(x, fused.packed, inter, use_amx)
        assert y.shape == (rows, inter) and y.dtype == torch.bfloat16
        gu = op.bf16_linear(x, plain, 2 * inter, use_amx)
        assert torch.equal(y, op.silu_mul(gu)), rows
        g, u = gu.double().chunk(2, dim=-1)
        exact = F.silu(g) * u
        assert ((y.double() - exact).abs() <= exact.abs() * 2**-8 + 1e-6).all(), rows


@needs_op
def test_make_gate_up_silu_fuses_up_to_gated_rows() -> None:
    """Up to `gated_rows` rows the activation comes from the fused op, above it from the
    dense product then `silu_mul`; both give silu(gate) * up of the layer. Without gated
    rows, or in float32, the plain linear under the plan and then the activation."""
    from lenbatch.runners.decode_attention import decode_attention_op
    from lenbatch.runners.rowlinears import GatedGemv
    from lenbatch.runners.weightonly import make_gate_up_silu

    kernel = decode_attention_op()
    w = _bf16(64, 96, seed=10)
    act = make_gate_up_silu(w, LinearPlan(pack=False, gemv_rows=4, gated_rows=16), None, kernel)
    assert isinstance(act.fused, GatedGemv) and act.fused_rows == 16
    assert isinstance(act.linear, DenseLinear)
    for rows in (3, 16, 17, 40):
        x = _bf16(rows, 96, seed=rows)
        gate, up = F.linear(x.double(), w.double()).chunk(2, dim=-1)
        ref = F.silu(gate) * up
        y = act(x, rows)
        assert y.shape == (rows, 32)
        assert torch.allclose(y.double(), ref, rtol=2**-6, atol=1e-4), rows
    torch_ops = make_gate_up_silu(w, LinearPlan(pack=False, gemv_rows=4, gated_rows=16), None, None)
    x = _bf16(40, 96, seed=11)
    assert torch.allclose(torch_ops(x, 40).float(), act(x, 40).float(), rtol=2**-6, atol=1e-4)
    unfused = make_gate_up_silu(w, LinearPlan(pack=False, gemv_rows=4), None, kernel)
    assert unfused.fused is None and isinstance(unfused.linear, SwitchLinear)
    f32 = make_gate_up_silu(w.float(), LinearPlan(pack=False, gated_rows=16), None, kernel)
    assert f32.fused is None and isinstance(f32.linear, DenseLinear)


def test_plan_probes_the_gated_shape_from_its_gemv_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """`plan_for(..., gated=shape)` probes the fused gate/up product once, from the count
    `Bf16Gemv` won for that shape, and not at all where `Bf16Gemv` never won."""
    from lenbatch.runners import weightonly

    found = {(96, 32): 64, (32, 96): 256}
    gated: list[tuple[tuple[int, int], int]] = []

    def measure(shape: tuple[int, int], pack: bool, above: int = 0) -> int:
        return found.get(shape, 0)

    def measure_gated(shape: tuple[int, int], pack: bool, above: int = 0) -> int:
        gated.append((shape, above))
        return 512

    monkeypatch.setattr(weightonly, "measure_gemv", measure)
    monkeypatch.setattr(weightonly, "measure_gated", measure_gated)
    monkeypatch.setattr(weightonly, "_MEASURED", {})
    shapes = [(96, 32), (32, 96)]
    plan = weightonly.plan_for((32, 96), torch.bfloat16, pack=False, shapes=shapes, gated=(96, 32))
    assert gated == [((96, 32), 64)] and plan.gated_rows == 512
    assert plan.describe().endswith("gate/up fused with silu up to 512 rows")
    found.clear()
    gated.clear()
    none = weightonly.plan_for((8, 8), torch.bfloat16, pack=False, shapes=shapes, gated=(96, 32))
    assert gated == [] and none.gated_rows == 0


def test_gated_probe_goes_on_to_a_whole_prompt(monkeypatch: pytest.MonkeyPatch) -> None:
    """`measure_gated` races the fused op against the dense product then the activation at
    each probed count above `above`, up to 1024 rows (a whole prompt runs in one pass)."""
    from lenbatch.runners import weightonly

    calls: list[int] = []

    def race(a: object, b: object, reps: int = 9) -> tuple[float, float]:
        calls.append(1)
        return (1.0, 2.0)

    monkeypatch.setattr(weightonly, "_race", race)
    monkeypatch.setattr(weightonly, "gemv_op", lambda: object())
    monkeypatch.setattr(weightonly, "ops_with", lambda name: object())
    monkeypatch.setattr(weightonly, "_probe_weights", lambda shape, dtype: [_bf16(64, 32, seed=4)])
    monkeypatch.setattr(weightonly, "GatedGemv", lambda w, op: None)
    assert weightonly.measure_gated((64, 32), pack=False, above=128) == 1024
    assert len(calls) == 3  # 256, 512, 1024
    assert weightonly.measure_gated((48, 32), pack=False) == 0  # halves not whole blocks
