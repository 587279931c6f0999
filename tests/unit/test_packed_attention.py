"""The packed encoder attention op (`packed_attention` in `runners/decode_attention.cpp`) against
torch's SDPA, sequence by sequence (the packed runner with and without it:
tests/integration/test_packed_attention_runner.py).

The reference runs `F.scaled_dot_product_attention` in float32 on each sequence's own tokens
(no padding, no mask): the op must give the same output from the packed Q/K/V rows.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from lenbatch.runners import decode_attention as da
from lenbatch.runners.hardware import cpu_flags
from tests.helpers import needs_avx512, needs_op

# float32 runs in every build (AVX-512, or AVX2 + FMA); bfloat16 and the tiles need AVX-512
# (and AMX where marked); causal or grouped heads run on the tiles and, in float32, in an AVX2
# build.


def _reference(qkv: torch.Tensor, lengths: list[int], heads: int) -> torch.Tensor:
    hidden = qkv.shape[1] // 3
    dim = hidden // heads
    out, start = [], 0
    for n in lengths:
        x = qkv[start : start + n].float().view(n, 3, heads, dim)
        q, k, v = x.permute(1, 2, 0, 3).unbind(0)  # [heads, n, dim]
        out.append(F.scaled_dot_product_attention(q, k, v).transpose(0, 1).reshape(n, hidden))
        start += n
    return torch.cat(out)


def _grouped_reference(
    qkv: torch.Tensor, lengths: list[int], heads: int, kv_heads: int, causal: bool
) -> torch.Tensor:
    """float32 SDPA per prompt on fused rows `Q | K | V` with grouped-query heads."""
    dim = qkv.shape[1] // (heads + 2 * kv_heads)
    out, start = [], 0
    for n in lengths:
        x = qkv[start : start + n].float()
        q = x[:, : heads * dim].view(n, heads, dim).transpose(0, 1)
        k = x[:, heads * dim : (heads + kv_heads) * dim].view(n, kv_heads, dim).transpose(0, 1)
        v = x[:, (heads + kv_heads) * dim :].view(n, kv_heads, dim).transpose(0, 1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
        out.append(o.transpose(0, 1).reshape(n, heads * dim))
        start += n
    return torch.cat(out)


AMX = "amx_bf16" in cpu_flags()


@pytest.mark.parametrize("dim", [32, 64, 128])
# 3, 4 and 6 heads: the AVX2 loop lays out 4, 2 or 1 heads at a time, by which divides them
@pytest.mark.parametrize("heads", [3, 4, 6])
@pytest.mark.parametrize(
    ("dtype", "amx"),
    [
        pytest.param(torch.float32, True, marks=needs_op),
        pytest.param(torch.bfloat16, False, marks=needs_avx512),
        pytest.param(torch.bfloat16, True, marks=needs_avx512),
    ],
    ids=["float32", "bfloat16-avx512", "bfloat16-amx-where-present"],
)
def test_equals_sdpa_per_sequence(dim: int, heads: int, dtype: torch.dtype, amx: bool) -> None:
    """bfloat16 runs on the AMX tiles where the CPU has them (`amx`), else on AVX-512."""
    op = da.decode_attention_op()
    assert op is not None
    # lengths around the 16-key blocks and the query blocks, one token, a long one
    lengths = [1, 2, 7, 8, 9, 15, 16, 17, 31, 33, 100, 257]
    gen = torch.Generator().manual_seed(dim)
    qkv = (2 * torch.randn(sum(lengths), 3 * heads * dim, generator=gen)).to(dtype)
    offsets = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.long)
    got = op.packed_attention(qkv, offsets, heads, dim**-0.5, amx)
    assert got.dtype == dtype and got.shape == (sum(lengths), heads * dim)
    want = _reference(qkv, lengths, heads)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    else:  # the output's bfloat16 rounding: half a unit in the last place is 0.4 % relative
        torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=1e-2)


@needs_op
def test_the_tile_unit_is_used_where_the_cpu_has_it() -> None:
    """On an AMX CPU the build holds the tile path and Linux grants it; elsewhere it is absent
    (a Zen 4 has AVX-512 but no tiles). The two paths differ in their rounding (probabilities
    in bfloat16 on the tiles), so they are two computations, both close to SDPA above."""
    op = da.decode_attention_op()
    assert op is not None
    assert op.has_amx() == AMX
    if AMX:
        lengths = [40, 70]
        qkv = torch.randn(sum(lengths), 3 * 2 * 32).bfloat16()
        offsets = torch.tensor([0, 40, 110])
        tiles = op.packed_attention(qkv, offsets, 2, 0.17, True)
        vectors = op.packed_attention(qkv, offsets, 2, 0.17, False)
        assert not torch.equal(tiles, vectors)
        torch.testing.assert_close(tiles.float(), vectors.float(), atol=2e-2, rtol=1e-2)


@pytest.mark.skipif(not AMX, reason="causal and grouped-query heads run only on AMX tiles")
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (4, 4, 32), (8, 2, 128)])
@pytest.mark.parametrize("causal", [True, False])
def test_grouped_causal_prompts_on_tiles(heads: int, kv_heads: int, dim: int, causal: bool) -> None:
    """A causal LM's prompts (SmolLM2: 9 query heads on 3 key/value heads of 64): each query
    head reads its group's key/value head, and causal tokens see only those before them."""
    op = da.decode_attention_op()
    assert op is not None
    lengths = [1, 15, 16, 17, 33, 64, 130, 400]
    gen = torch.Generator().manual_seed(heads * dim)
    width = (heads + 2 * kv_heads) * dim
    qkv = (2 * torch.randn(sum(lengths), width, generator=gen)).bfloat16()
    offsets = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.long)
    got = op.packed_attention(qkv, offsets, heads, dim**-0.5, True, kv_heads, causal)
    want = _grouped_reference(qkv, lengths, heads, kv_heads, causal)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=1e-2)


@needs_op
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (4, 4, 32), (8, 2, 128)])
def test_causal_float32_prompts_in_the_avx2_build(heads: int, kv_heads: int, dim: int) -> None:
    """An AVX2 build (a CPU without AVX-512) runs a causal LM's float32 prompts too, with
    grouped-query heads: equal to float32 SDPA with `is_causal` per prompt, at lengths around
    its blocks of 8 queries and keys. Another build says it does not (`causal_float32`)."""
    op = da.decode_attention_op()
    assert op is not None
    avx2_build = "avx512f" not in cpu_flags()
    assert op.causal_float32() == avx2_build
    if not avx2_build:
        return  # checked above: an AVX-512 build refuses (test_refuses_what_it_cannot_compute)
    lengths = [1, 2, 7, 8, 9, 15, 16, 17, 33, 64, 130, 401]
    gen = torch.Generator().manual_seed(heads * dim)
    width = (heads + 2 * kv_heads) * dim
    qkv = 2 * torch.randn(sum(lengths), width, generator=gen)
    offsets = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.long)
    got = op.packed_attention(qkv, offsets, heads, dim**-0.5, True, kv_heads, True)
    want = _grouped_reference(qkv, lengths, heads, kv_heads, causal=True)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


@pytest.mark.skipif(not AMX, reason="a prompt chunk's attention runs only on AMX tiles")
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (4, 4, 32), (8, 2, 128)])
def test_chunk_attention_over_cached_columns(heads: int, kv_heads: int, dim: int) -> None:
    """A prompt chunk's attention (`chunk_attention`): the chunk's queries are the last `new`
    of each row's window columns, each attends causally over its row's real columns (left
    padding first, none read), keys and values read in place from a strided cache window. The
    reference: float32 SDPA with the causal and padding mask over every column; the chunk's
    padding queries come out zero. Rows: no padding, padding before the chunk, padding into
    the chunk, a chunk off the 16-key blocks, a row whose real columns start in its last
    block, and a row with nothing real yet."""
    op = da.decode_attention_op()
    assert op is not None
    cases = [  # (window width, new columns, each row's first real column)
        (400, 150, [0]),
        (300, 100, [0, 37, 250]),
        (170, 170, [0, 5, 60]),
        (33, 17, [3, 16]),
        (500, 30, [200, 471, 500]),
    ]
    gen = torch.Generator().manual_seed(heads * dim)
    for width, new, starts in cases:
        rows = len(starts)
        qkv = torch.randn(rows * new, (heads + 2 * kv_heads) * dim, generator=gen).bfloat16()
        window = torch.randn(2, rows, kv_heads, width + 9, dim, generator=gen).bfloat16()
        keys, values = window[0, :, :, :width], window[1, :, :, :width]  # views, as a cache's
        first = torch.tensor(starts, dtype=torch.long)
        got = op.chunk_attention(qkv, keys, values, first, heads, dim**-0.5)
        cols = torch.arange(width)
        real = cols[None, :] >= first[:, None]  # [rows, width]
        queries = cols[width - new :]
        allowed = (cols[None, :] <= queries[:, None])[None] & real[:, None, :]
        allowed |= (cols[None, :] == queries[:, None])[None]  # no empty row: padding queries
        q = qkv.float().view(rows, new, -1)[:, :, : heads * dim]
        q = q.view(rows, new, heads, dim).transpose(1, 2)
        want = F.scaled_dot_product_attention(
            q, keys.float(), values.float(), attn_mask=allowed[:, None], enable_gqa=True
        )
        want = want.transpose(1, 2).reshape(rows * new, heads * dim)
        want[~real[:, width - new :].reshape(-1)] = 0
        torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=1e-2)
    with pytest.raises(RuntimeError, match="must be bfloat16"):
        op.chunk_attention(qkv.float(), keys, values, first, heads, 0.1)
    with pytest.raises(RuntimeError, match="starts must be int64"):
        op.chunk_attention(qkv, keys, values, first[:1], heads, 0.1)
    with pytest.raises(RuntimeError, match="starts must lie in"):
        op.chunk_attention(qkv, keys, values, first + width, heads, 0.1)
    with pytest.raises(RuntimeError, match="new at most the keys' width"):
        op.chunk_attention(qkv, keys[:, :, :10], values[:, :, :10], first, heads, 0.1)


@needs_op
def test_refuses_what_it_cannot_compute() -> None:
    op = da.decode_attention_op()
    assert op is not None
    qkv = torch.randn(10, 3 * 2 * 32)
    with pytest.raises(RuntimeError, match="offsets must run from 0"):
        op.packed_attention(qkv, torch.tensor([0, 4, 9]), 2, 0.1)
    with pytest.raises(RuntimeError, match="no empty sequence"):
        op.packed_attention(qkv, torch.tensor([0, 4, 4, 10]), 2, 0.1)
    with pytest.raises(RuntimeError, match="head_dim must be 32, 64 or 128"):
        op.packed_attention(torch.randn(10, 3 * 2 * 24), torch.tensor([0, 10]), 2, 0.1)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        op.packed_attention(qkv.double(), torch.tensor([0, 10]), 2, 0.1)
    with pytest.raises(RuntimeError, match="multiple of kv_heads"):
        op.packed_attention(torch.randn(10, 7 * 32), torch.tensor([0, 10]), 3, 0.1, True, 2)
    if op.causal_float32():
        # an AVX2 build: grouped heads only as a causal LM's prompt, and no bfloat16
        with pytest.raises(RuntimeError, match="grouped-query heads need causal"):
            op.packed_attention(torch.randn(10, 4 * 32), torch.tensor([0, 10]), 2, 0.1, True, 1)
        with pytest.raises(RuntimeError, match="runs float32 only"):
            op.packed_attention(qkv.bfloat16(), torch.tensor([0, 10]), 2, 0.1)
    else:
        # an AVX-512 build runs float32 encoders only (causal and grouped heads: AMX tiles)
        with pytest.raises(RuntimeError, match="runs only on AMX tiles"):
            op.packed_attention(qkv, torch.tensor([0, 10]), 2, 0.1, True, 2, True)


@needs_op
def test_the_op_lets_other_python_threads_run() -> None:
    """The op runs without the GIL: Python code in another thread keeps running meanwhile (a
    runner thread inside the op must not stop the event loop or the other runner)."""
    import threading
    import time

    op = da.decode_attention_op()
    assert op is not None
    lengths = [256] * 64
    qkv = torch.randn(sum(lengths), 3 * 12 * 32)
    offsets = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.long)
    t = time.perf_counter()
    op.packed_attention(qkv, offsets, 12, 0.17)
    alone = time.perf_counter() - t
    assert alone > 0.02, "the call is too short to tell"
    started = threading.Event()

    def work() -> None:
        started.set()
        time.sleep(0.02)  # the loop below is running by the time the op starts
        op.packed_attention(qkv, offsets, 12, 0.17)

    worker = threading.Thread(target=work)
    worker.start()
    started.wait()
    last = time.perf_counter()
    longest = 0.0
    while worker.is_alive():
        now = time.perf_counter()
        longest, last = max(longest, now - last), now
    longest = max(longest, time.perf_counter() - last)  # a stall inside is_alive() counts too
    worker.join()
    # Holding the GIL, the op would stop this loop for its whole run; released, the loop only
    # waits its turns (the interpreter's switch interval, 5 ms).
    assert longest < alone / 2, (
        f"this thread stood still {longest * 1e3:.0f} ms of {alone * 1e3:.0f}"
    )


def test_amx_switch_reads_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """`LENBATCH_AMX` is auto (the tiles where present) or off; anything else is an error that
    names the variable, not a silent default."""
    monkeypatch.delenv("LENBATCH_AMX", raising=False)
    assert da.amx_allowed()
    monkeypatch.setenv("LENBATCH_AMX", "off")
    assert not da.amx_allowed()
    monkeypatch.setenv("LENBATCH_AMX", "yes")
    with pytest.raises(ValueError, match="LENBATCH_AMX"):
        da.amx_allowed()
