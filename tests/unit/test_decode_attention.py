"""The decode-attention op (`runners/decode_attention.py`) against torch's SDPA.

The reference is `F.scaled_dot_product_attention` in float32 on the same inputs, with the
boolean mask over the whole window; the op must give the same output while reading only the
columns the mask marks real. Both of the op's paths run: 512-bit vectors (head_dim a multiple
of 16) and the plain loop (head_dim 24).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from lenbatch.runners import decode_attention as da
from tests.helpers import OPS


def test_builds_where_the_cpu_allows_and_says_why_not_elsewhere() -> None:
    """On a CPU with AVX-512 or AVX2 and a compiler the op builds; elsewhere the reason is
    named."""
    why = da.kernel_unavailable()
    if OPS:
        assert why is None
        assert da.decode_attention_op() is not None
    else:
        assert why is not None
        assert da.decode_attention_op() is None


def test_forced_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    """LENBATCH_DECODE_ATTENTION=sdpa gives no op (the caller then runs SDPA)."""
    monkeypatch.setenv("LENBATCH_DECODE_ATTENTION", "sdpa")
    monkeypatch.setattr(da, "_loaded", {})
    assert da.kernel_unavailable() == "LENBATCH_DECODE_ATTENTION=sdpa"
    assert da.decode_attention_op() is None
    monkeypatch.setenv("LENBATCH_DECODE_ATTENTION", "fast")
    assert "expected auto, kernel or sdpa" in str(da.kernel_unavailable())


def test_build_lock_clears_an_interrupted_builds_marker_and_excludes_other_builds(
    tmp_path: Path,
) -> None:
    """torch's `lock` marker left by a killed build is removed under the lock (else every
    later `cpp_extension.load` of the folder waits forever), and while one build holds the
    folder another process cannot take it."""
    (tmp_path / "lock").touch()
    probe = (
        "import fcntl, sys; f = open(sys.argv[1], 'a')\n"
        "try:\n    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)\n"
        "except BlockingIOError:\n    sys.exit(3)\n"
    )
    lock_file = str(tmp_path / ".lenbatch-build.lock")
    with da.build_lock(tmp_path):
        assert not (tmp_path / "lock").exists()
        held = subprocess.run([sys.executable, "-c", probe, lock_file], timeout=60)
        assert held.returncode == 3
    free = subprocess.run([sys.executable, "-c", probe, lock_file], timeout=60)
    assert free.returncode == 0


@pytest.mark.skipif(not OPS, reason="the ops are built only on a CPU with AVX-512 or AVX2")
def test_a_start_after_an_interrupted_build_loads_the_op(tmp_path: Path) -> None:
    """The op's own build folder with a killed build's marker in it: a fresh process still
    gets the op (before the fix it waited on the marker until killed)."""
    assert da.decode_attention_op() is not None  # built (or loaded) here first
    folder = Path(sys.prefix) / "lenbatch-ext" / da.build_name()
    (folder / "lock").touch()
    code = "from lenbatch.runners import decode_attention as da; print(da.decode_attention_op())"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "None" not in run.stdout and not (folder / "lock").exists()


def _case(rows: int, kv: int, group: int, dim: int, width: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, kv * group, dim, generator=gen).to(dtype)
    # keys/values as a window view into a wider buffer, as the KV cache hands them over
    kbuf = torch.randn(rows, kv, width + 7, dim, generator=gen).to(dtype)
    vbuf = torch.randn(rows, kv, width + 7, dim, generator=gen).to(dtype)
    keys, values = kbuf[:, :, 7:], vbuf[:, :, 7:]
    lens = torch.randint(1, width + 1, (rows,), generator=gen)
    mask = torch.arange(width)[None] >= (width - lens)[:, None]  # left padding
    holes = torch.rand(rows, width, generator=gen) < 0.1
    mask &= ~holes  # and a few masked columns inside, as a finished prompt's padding leaves
    mask[:, -1] = True  # the query's own column is always real
    return q, keys, values, mask


@pytest.mark.skipif(not OPS, reason="the ops are built only on a CPU with AVX-512 or AVX2")
@pytest.mark.parametrize("dim", [64, 24, 32, 128])
@pytest.mark.parametrize("group", [3, 1, 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_equals_sdpa(dim: int, group: int, dtype: torch.dtype) -> None:
    """Same output as float32 SDPA over the masked window: 1e-5 in float32; bfloat16 within
    its rounding of inputs and output."""
    op = da.decode_attention_op()
    assert op is not None
    rows, kv, width = 9, 2, 70
    q, keys, values, mask = _case(rows, kv, group, dim, width, dtype, seed=dim + group)
    scale = dim**-0.5
    got = op.decode_attention(q, keys, values, mask, scale).float()
    ref = F.scaled_dot_product_attention(
        q.float().view(rows, kv, group, dim),
        keys.float(),
        values.float(),
        attn_mask=mask[:, None, None, :],
        scale=scale,
    ).reshape(rows, kv * group, dim)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, ref, rtol=tol, atol=tol)


@pytest.mark.skipif(not OPS, reason="the ops are built only on a CPU with AVX-512 or AVX2")
def test_rejects_mismatched_shapes() -> None:
    """A wrong mask width is an error, not a read past the window."""
    op = da.decode_attention_op()
    q, keys, values, mask = _case(2, 1, 1, 16, 10, torch.float32, seed=0)
    with pytest.raises(RuntimeError, match="shapes do not match"):
        op.decode_attention(q, keys, values, mask[:, :9], 0.25)


@pytest.mark.skipif(not OPS, reason="the ops are built only on a CPU with AVX-512 or AVX2")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 33])
@pytest.mark.parametrize("hidden", [96, 104])  # whole 16-wide vectors; vectors and a tail
def test_add_rms_norm_equals_torch(rows: int, hidden: int, dtype: torch.dtype) -> None:
    """The fused residual add + RMSNorm: `h` becomes `h + delta` exactly as torch adds, and the
    output equals `F.rms_norm` of it (float32 within 1e-6; bfloat16 within one rounding)."""
    op = da.decode_attention_op()
    assert op is not None
    gen = torch.Generator().manual_seed(rows)
    h = torch.randn(rows, 2, hidden, generator=gen).to(dtype)
    delta = torch.randn(rows, 2, hidden, generator=gen).to(dtype)
    weight = (1 + 0.2 * torch.randn(hidden, generator=gen)).to(dtype)
    want_h = h + delta
    want = F.rms_norm(want_h.float(), (hidden,), weight.float(), 1e-5)
    got = op.add_rms_norm(h, delta, weight, 1e-5)
    assert torch.equal(h, want_h)  # added in place
    tol = 1e-6 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)
    with pytest.raises(RuntimeError, match="shapes do not match"):
        op.add_rms_norm(h, delta[:, :1].contiguous(), weight, 1e-5)


@pytest.mark.skipif(not OPS, reason="the ops are built only on a CPU with AVX-512 or AVX2")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_equals_rotate_half(dtype: torch.dtype) -> None:
    """Rotary embedding in place on the query and key heads, as transformers' Llama computes
    it (`x * cos + rotate_half(x) * sin`); the value heads are left alone."""
    op = da.decode_attention_op()
    assert op is not None
    gen = torch.Generator().manual_seed(3)
    rows, new, heads, rotated, dim = 5, 3, 7, 5, 32
    x = torch.randn(rows, new, heads, dim, generator=gen).to(dtype)
    angles = torch.rand(rows, new, dim // 2, generator=gen) * 6
    cos = torch.cat((angles.cos(), angles.cos()), -1).to(dtype)
    sin = torch.cat((angles.sin(), angles.sin()), -1).to(dtype)
    xf = x.float()
    half = torch.cat((-xf[..., dim // 2 :], xf[..., : dim // 2]), -1)
    want = xf * cos.float()[:, :, None] + half * sin.float()[:, :, None]
    got = x.clone()
    op.rope(got, cos, sin, rotated)
    tol = 1e-6 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(
        got[:, :, :rotated].float(), want[:, :, :rotated], rtol=tol, atol=tol
    )
    assert torch.equal(got[:, :, rotated:], x[:, :, rotated:])
    with pytest.raises(RuntimeError, match="shapes do not match"):
        op.rope(got, cos[:, :2].contiguous(), sin[:, :2].contiguous(), rotated)


@pytest.mark.skipif(not OPS, reason="the ops are built only on a CPU with AVX-512 or AVX2")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_equals_torch(dtype: torch.dtype) -> None:
    """A gated MLP's activation, `silu(gate) * up` of `[gate | up]`, as torch computes it, in
    16-wide vectors and a scalar tail (40 columns), gates far past e^x's float32 range
    included."""
    op = da.decode_attention_op()
    assert op is not None
    gu = (3 * torch.randn(7, 2 * 40, generator=torch.Generator().manual_seed(5))).to(dtype)
    gu[0, :40] = torch.linspace(-120, 120, 40).to(dtype)
    gate, up = gu.float().chunk(2, dim=-1)
    want = F.silu(gate) * up
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(op.silu_mul(gu).float(), want, rtol=tol, atol=tol)
    with pytest.raises(RuntimeError, match="2 \\* inter"):
        op.silu_mul(gu[:, :3])
