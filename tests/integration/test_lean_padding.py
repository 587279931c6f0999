"""A left-padded prefill job on the lean Llama path leaves its padding out of the forward's
products (`runners.llama_attention.SegmentPlan.keep`), against transformers' own forward of
the same padded job (float32, a tiny random Llama with heads of 32, the C++ ops' smallest).

The references: `CausalLMRunner(lean=False)` (transformers' forward with its padding mask)
for every chunk's logits and for the decode step after the job (which reads the cache the
job left), and the lean path's own forward of each prompt alone.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from lenbatch.runners.base import Segment
from lenbatch.runners.causal import CausalLMRunner

LENGTHS, WIDTH = (40, 13, 27), 40


@pytest.fixture(scope="module")
def llama32(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama with heads of 32 on half as many key/value heads."""
    from lenbatch.runners.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("llama-d32"), "llama", hidden=128, heads=4)


def _job() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Three prompts of `LENGTHS`, left-padded to `WIDTH`: ids, mask, positions."""
    gen = torch.Generator().manual_seed(7)
    ids = torch.full((len(LENGTHS), WIDTH), 2, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, n in enumerate(LENGTHS):
        ids[r, WIDTH - n :] = torch.randint(5, 500, (n,), generator=gen)
        mask[r, WIDTH - n :] = 1
    return ids, mask, (mask.cumsum(1) - 1).clamp(min=0)


def _record_rows(runner: CausalLMRunner) -> list[int]:
    """Records the row count of the first layer's Q/K/V product, one entry per forward."""
    assert runner.lean is not None
    layer, rows = runner.lean.layers[0], []
    qkv = layer.qkv

    class Spy:
        def __getattr__(self, name: str) -> Any:  # a decode step's kernels read through
            return getattr(qkv, name)

        def __call__(self, x: torch.Tensor, stream: int) -> torch.Tensor:
            rows.append(int(x.shape[0]))
            return qkv(x, stream)

    layer.qkv = Spy()  # type: ignore[assignment]
    return rows


def _record_offsets(runner: CausalLMRunner) -> list[list[int]]:
    """Records the prompt offsets `packed_attention` is given, one list per call."""
    assert runner.lean is not None
    op, calls = runner.lean.kernel, []

    class Spy:
        def __getattr__(self, name: str) -> Any:
            return getattr(op, name)

        def packed_attention(self, qkv: torch.Tensor, offsets: torch.Tensor, *a: Any) -> Any:
            calls.append(offsets.tolist())
            return op.packed_attention(qkv, offsets, *a)

    if op is not None:
        runner.lean.kernel = Spy()
    return calls


@pytest.mark.parametrize("attention", ["auto", "sdpa"])
def test_padded_job_in_one_chunk_matches_transformers(
    llama32: Path, attention: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job of prompts of 40, 13 and 27 tokens padded to 40 runs its products on its 80 real
    tokens, not 120. Its logits equal transformers' on the padded job and each prompt's own
    alone, and the decode step after it (over the cache the job left) equals transformers'
    too: with the C++ ops where this CPU builds them (on an AVX2 build the first chunk's
    attention runs each prompt's causal loop from the stream's rows) and with torch's SDPA
    and RoPE forced."""
    from lenbatch.runners import decode_attention

    monkeypatch.setenv("LENBATCH_DECODE_ATTENTION", attention)
    monkeypatch.setattr(decode_attention, "_loaded", {})
    lean = CausalLMRunner(llama32, pack=False)
    hf = CausalLMRunner(llama32, lean=False)
    assert lean.lean is not None and lean.lean.head_dim == 32
    if attention == "sdpa":
        assert lean.lean.kernel is None
    ids, mask, pos = _job()
    rows, offsets = _record_rows(lean), _record_offsets(lean)
    c1, c2 = lean.new_cache(), hf.new_cache()
    got = lean.forward(ids, mask, pos, c1)
    assert rows == [80]  # rounded_tokens(80) is 80; the padded job would be 120
    packed = lean.lean.prompt_op and not lean.lean.tiles
    assert offsets == ([[0, 40, 53, 80]] * 2 if packed else [])  # two layers
    torch.testing.assert_close(got, hf.forward(ids, mask, pos, c2))
    for r, n in enumerate(LENGTHS):
        one = ids[r : r + 1, WIDTH - n :]
        alone = lean.forward(one, torch.ones_like(one), torch.arange(n)[None], lean.new_cache())
        torch.testing.assert_close(got[r : r + 1], alone, atol=1e-5, rtol=1e-5)
    step = torch.cat([mask, torch.ones((3, 1), dtype=mask.dtype)], 1)
    nxt, npos = torch.tensor([[3], [4], [5]]), pos[:, -1:] + 1
    torch.testing.assert_close(lean.forward(nxt, step, npos, c1), hf.forward(nxt, step, npos, c2))


@pytest.mark.parametrize("attention", ["auto", "sdpa"])
def test_padded_job_in_chunks_matches_transformers(
    llama32: Path, attention: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same job prefilled in three chunks, the second prompt's padding filling the whole
    first chunk and reaching into the second, then mixed with a decode step of another
    batch in one forward: each chunk's products run on its real tokens only, each row whose
    chunk ends in a real token has transformers' logits (the others have none to compare),
    and the last chunk's logits equal the job run in one forward."""
    from lenbatch.runners import decode_attention

    monkeypatch.setenv("LENBATCH_DECODE_ATTENTION", attention)
    monkeypatch.setattr(decode_attention, "_loaded", {})
    lean = CausalLMRunner(llama32, pack=False)
    hf = CausalLMRunner(llama32, lean=False)
    ids, mask, pos = _job()
    rows = _record_rows(lean)
    # another batch's decode step, in front of the job's chunks (a mixed unit)
    other = torch.tensor([[9, 10, 11, 12]])
    oc1, oc2 = lean.new_cache(), hf.new_cache()
    omask, opos = torch.ones_like(other), torch.arange(4)[None]
    lean.forward(other, omask, opos, oc1)
    hf.forward(other, omask, opos, oc2)
    step = torch.ones((1, 5), dtype=torch.long)
    nxt, npos = torch.tensor([[13]]), torch.tensor([[4]])
    c1, c2 = lean.new_cache(), hf.new_cache()
    for lo, hi in ((0, 17), (17, 30), (30, 40)):
        chunk = (ids[:, lo:hi], mask[:, :hi], pos[:, lo:hi])
        mixed = lean.forward_segments([Segment(nxt, step, npos, oc1), Segment(*chunk, cache=c1)])
        want = hf.forward(*chunk, c2)
        real = mask[:, hi - 1].bool()
        torch.testing.assert_close(mixed[1][real], want[real])
        torch.testing.assert_close(mixed[0], hf.forward(nxt, step, npos, oc2))
        step = torch.cat([step, torch.ones((1, 1), dtype=torch.long)], 1)
        nxt, npos = nxt + 1, npos + 1
    real_tokens = [int(mask[:, lo:hi].sum()) for lo, hi in ((0, 17), (17, 30), (30, 40))]
    assert real_tokens == [17 + 0 + 4, 13 + 3 + 13, 10 + 10 + 10]  # of 51, 39 and 30
    assert rows == [4] + [1 + n for n in real_tokens]  # one decode row in front of each
    whole = lean.forward(ids, mask, pos, lean.new_cache())
    torch.testing.assert_close(mixed[1], whole, atol=1e-5, rtol=1e-5)


def test_keeping_the_padding_runs_the_padded_layout(
    llama32: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`LENBATCH_PREFILL_PADDING=keep` (the benchmark's A/B) runs the job's 120 padded tokens
    through the products, as before padding was left out, with the same logits."""
    ids, mask, pos = _job()
    skip = CausalLMRunner(llama32, pack=False)
    monkeypatch.setenv("LENBATCH_PREFILL_PADDING", "keep")
    keep = CausalLMRunner(llama32, pack=False)
    rows = _record_rows(keep)
    got = keep.forward(ids, mask, pos, keep.new_cache())
    assert rows == [120]  # rounded_tokens(120) is 120
    want = skip.forward(ids, mask, pos, skip.new_cache())
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_adaptive_prices_a_chunk_as_the_runner_runs_it(
    llama32: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Adaptive's prefill model learns a chunk by its real tokens on the lean path, where the
    padding runs through no product, and by its padded shape where it does: transformers'
    forward, `LENBATCH_PREFILL_PADDING=keep`, and fixed shapes (whole padded prompts)."""
    from lenbatch.config import BatchingConfig
    from lenbatch.generate.engine import GenerationEngine

    def basis(runner: CausalLMRunner, **kw: Any) -> bool:
        engine = GenerationEngine(runner, BatchingConfig(strategy="adaptive"), **kw)
        assert engine.adaptive is not None
        return engine.adaptive.costs.real_tokens

    lean = CausalLMRunner(llama32, pack=False)
    assert lean.prefill_skips_padding and basis(lean)
    assert not basis(lean, fixed_shapes=True)
    hf = CausalLMRunner(llama32, lean=False)
    assert not hf.prefill_skips_padding and not basis(hf)
    monkeypatch.setenv("LENBATCH_PREFILL_PADDING", "keep")
    keep = CausalLMRunner(llama32, pack=False)
    assert not keep.prefill_skips_padding and not basis(keep)
