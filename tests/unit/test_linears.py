"""runners/linears.py: prepacked oneDNN products agree with F.linear, and fall back cleanly."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lenbatch.runners.linears import Linear, linear_kind

CPU = torch.device("cpu")


def _case(rows: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 64, generator=gen)
    b = torch.randn(96, generator=gen)
    x = torch.randn(rows, 64, generator=gen)
    return w, b, x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 130])
@pytest.mark.parametrize("activation", ["none", "gelu"])
def test_prepacked_matches_f_linear(
    dtype: torch.dtype, rows: int, activation: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepacked wherever it works, whichever kind the float32 timing would pick here.
    monkeypatch.setenv("LENBATCH_LINEARS", "prepacked")
    kind, why = linear_kind(CPU, dtype)
    if kind != "prepacked":
        pytest.skip(f"no prepacked linears here: {why}")
    w, b, x = _case(rows, dtype)
    lin = Linear(w, b, dtype, kind, activation)  # type: ignore[arg-type]
    ref = F.linear(x.to(dtype).float(), w.to(dtype).float(), b.to(dtype).float())
    if activation == "gelu":
        ref = F.gelu(ref)
    got = lin(x)  # a float32 input is cast to the product's type
    assert got.dtype == dtype and got.shape == (rows, 96)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert (got.float() - ref).abs().max() <= tol * ref.abs().max()
    assert lin.nbytes == (96 * 64 + 96) * got.element_size()


def test_plain_is_forced_by_the_environment_and_used_off_cpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("LENBATCH_LINEARS", "plain")
    assert linear_kind(CPU, torch.float32) == ("plain", "LENBATCH_LINEARS=plain")
    monkeypatch.delenv("LENBATCH_LINEARS")
    assert linear_kind(torch.device("meta"), torch.float32)[0] == "plain"
    assert linear_kind(CPU, torch.float16)[0] == "plain"
    for rows in (5, 130):  # GELU and bias in lenbatch's one pass where its op is built
        w, b, x = _case(rows, torch.float32)
        lin = Linear(w, b, torch.float32, "plain", "gelu")
        ref = F.gelu(F.linear(x, w, b))
        torch.testing.assert_close(lin(x), ref, atol=1e-5 * float(ref.abs().max()), rtol=1e-5)
        assert torch.equal(Linear(w, b, torch.float32, "plain")(x), F.linear(x, w, b))


@pytest.mark.parametrize(
    ("packed_s", "plain_s", "kept"),
    [(1.0, 0.8, False), (1.0, 0.95, True), (0.8, 1.0, True)],
    ids=["plain-1.25x-faster", "plain-within-the-margin", "prepacked-faster"],
)
def test_float32_keeps_prepacked_unless_plain_is_clearly_faster(
    packed_s: float, plain_s: float, kept: bool
) -> None:
    """The float32 choice follows the timing, with a margin so that noise cannot flip it."""
    from lenbatch.runners.linears import _prepacked_wins

    ok, why = _prepacked_wins(lambda: (packed_s, plain_s))
    assert ok is kept
    # the figure said: plain's speedup where it is taken, else prepacked's speed against it
    assert f"{(plain_s / packed_s if kept else packed_s / plain_s):.2f}x" in why


def test_float32_timing_runs_both_kinds() -> None:
    """The timing itself: two positive durations, and a choice with its figure."""
    from lenbatch.runners.linears import _prepacked_wins, _time_products

    packed_s, plain_s = _time_products()
    assert 0 < packed_s < 5 and 0 < plain_s < 5
    assert "x" in _prepacked_wins(_time_products)[1]


def test_packed_row_counts_are_rounded_to_few_shapes() -> None:
    """The packed stream's row count: never below the tokens, at most 1/16 above them past
    128 tokens, and few distinct counts (each is a oneDNN kernel in the per-shape cache)."""
    from lenbatch.runners.linears import rounded_tokens

    counts = {rounded_tokens(n) for n in range(1, 8193)}
    for n in range(1, 8193):
        r = rounded_tokens(n)
        assert r >= n
        assert r - n < 8 or (n > 128 and (r - n) * 16 <= n)
    assert len(counts) <= 128
    assert rounded_tokens(1000) == 1024 and rounded_tokens(8) == 8
