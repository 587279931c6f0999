"""The lean Llama path (`runners.llama`, its products in `runners.weightonly` and
`runners.rowlinears`) against transformers.

The references are transformers' own: `model.generate()` greedy tokens for the tiny random
Llama (fp32, prepacked or not), `F.linear` on the dequantized weights for the int4/int8 kernels.
GPT-2 is not Llama: it keeps transformers' forward, and a quantization on it is refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from lenbatch.runners.causal import CausalLMRunner
from lenbatch.runners.rowlinears import (
    INT4_GROUP,
    LARGE_ROWS,
    Int4Linear,
    Int8Linear,
    LargeRowsLinear,
)
from lenbatch.runners.weightonly import LinearPlan, make_linear, measure_large_rows, measure_switch
from tests.helpers import needs_op
from tests.llm_reference import MAX_NEW, PROMPTS, reference_greedy


def test_llama_runs_lean_and_gpt2_does_not(llama_runner: Any, gpt2_runner: Any) -> None:
    """The tiny Llama gets the lean path by default; GPT-2 keeps transformers' forward."""
    assert llama_runner.lean is not None
    assert gpt2_runner.lean is None


def test_llama_shapes_are_the_fused_products(llama_runner: Any) -> None:
    """`llama_shapes` names each layer product's weight as the lean path builds it: Q/K/V
    and gate/up fused, then O and down, read off the model's own projections."""
    from lenbatch.runners.llama import llama_shapes

    model = llama_runner.model
    att = model.model.layers[0].self_attn
    hidden, inter = model.config.hidden_size, model.config.intermediate_size
    kv = att.k_proj.weight.shape[0]
    assert kv < att.q_proj.weight.shape[0]  # grouped-query: K and V narrower than Q
    assert llama_shapes(model) == [
        (att.q_proj.weight.shape[0] + 2 * kv, hidden),
        (hidden, att.q_proj.weight.shape[0]),
        (2 * inter, hidden),
        (hidden, inter),
    ]


@pytest.mark.slow
@pytest.mark.parametrize("pack", [False, True])
def test_lean_fp32_greedy_equals_generate(tiny_llama_dir: Path, pack: bool) -> None:
    """fp32 greedy through the lean path, dense or prepacked, equals `generate()` alone."""
    runner = CausalLMRunner(tiny_llama_dir, name="tiny-llama", pack=pack)
    assert runner.lean is not None and runner.lean.plan.pack is pack
    for prompt in runner.tokenize(PROMPTS):
        assert runner.greedy_alone(prompt, MAX_NEW) == reference_greedy(runner, prompt, MAX_NEW)


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["auto", "sdpa"])
def test_lean_logits_match_transformers_batched(
    tiny_llama_dir: Path, attention: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A left-padded prefill and a decode step give transformers' logits (fp32), with the
    decode-attention op where this CPU builds it and with the SDPA fallback forced."""
    from lenbatch.runners import decode_attention

    monkeypatch.setenv("LENBATCH_DECODE_ATTENTION", attention)
    monkeypatch.setattr(decode_attention, "_loaded", {})
    lean = CausalLMRunner(tiny_llama_dir, name="tiny-llama", pack=False)
    assert lean.lean is not None
    if attention == "sdpa":
        assert lean.lean.kernel is None
    elif decode_attention.kernel_unavailable() is None:
        assert lean.lean.kernel is not None
    hf = CausalLMRunner(tiny_llama_dir, name="tiny-llama", lean=False)
    ids = torch.tensor([[2, 2, 5, 9, 11, 40], [7, 8, 9, 10, 11, 12]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    c1, c2 = lean.new_cache(), hf.new_cache()
    torch.testing.assert_close(lean.forward(ids, mask, pos, c1), hf.forward(ids, mask, pos, c2))
    step = torch.cat([mask, torch.ones((2, 1), dtype=mask.dtype)], 1)
    nxt, npos = torch.tensor([[3], [4]]), pos[:, -1:] + 1
    torch.testing.assert_close(lean.forward(nxt, step, npos, c1), hf.forward(nxt, step, npos, c2))


@pytest.mark.slow
def test_lean_rounded_row_counts_match_transformers(tiny_llama_dir: Path) -> None:
    """Forwards of more than 32 tokens run their matrix products on a rounded row count (zero
    rows appended): a 2 x 19-token prefill (38 -> 40 rows) and a mixed forward of a decode
    step and a 37-token prompt (39 -> 40 rows) give transformers' logits, each segment its
    own (fp32)."""
    from lenbatch.runners.base import Segment
    from lenbatch.runners.linears import rounded_tokens

    assert rounded_tokens(38) == rounded_tokens(39) == 40
    lean = CausalLMRunner(tiny_llama_dir, name="tiny-llama", pack=False)
    hf = CausalLMRunner(tiny_llama_dir, name="tiny-llama", lean=False)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 200, (2, 19), generator=gen)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # left padding in one row
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    c1, c2 = lean.new_cache(), hf.new_cache()
    torch.testing.assert_close(lean.forward(ids, mask, pos, c1), hf.forward(ids, mask, pos, c2))
    step = torch.cat([mask, torch.ones((2, 1), dtype=mask.dtype)], 1)
    nxt, npos = torch.tensor([[3], [4]]), pos[:, -1:] + 1
    prompt = torch.randint(3, 200, (1, 37), generator=gen)
    ones, ppos = torch.ones_like(prompt), torch.arange(37)[None]
    p2 = hf.new_cache()
    mixed = lean.forward_segments(
        [Segment(nxt, step, npos, c1), Segment(prompt, ones, ppos, lean.new_cache())]
    )
    torch.testing.assert_close(mixed[0], hf.forward(nxt, step, npos, c2))
    torch.testing.assert_close(mixed[1], hf.forward(prompt, ones, ppos, p2))


def test_quantization_needs_the_lean_path(tiny_gpt2_dir: Path, tiny_llama_dir: Path) -> None:
    """A quantization on a model without the lean path is refused, naming why."""
    with pytest.raises(ValueError, match="int8 needs the lean Llama path"):
        CausalLMRunner(tiny_gpt2_dir, quantization="int8")
    with pytest.raises(ValueError, match="lean=False"):
        CausalLMRunner(tiny_llama_dir, quantization="int4", lean=False)
    with pytest.raises(ValueError, match="quantization 'int3'"):
        CausalLMRunner(tiny_llama_dir, quantization="int3")


def _grouped_weight(out: int, inp: int) -> torch.Tensor:
    """A weight every group of 32 input columns of which holds 16 levels `lo + q * step`
    (0 and 15 both present): what a Q4_1 GGUF dequantizes to."""
    gen = torch.Generator().manual_seed(1)
    groups = inp // INT4_GROUP
    q = torch.randint(0, 16, (out, groups, INT4_GROUP), generator=gen)
    q[..., 0], q[..., 1] = 0, 15
    lo = torch.randn((out, groups, 1), generator=gen) * 0.05
    step = torch.rand((out, groups, 1), generator=gen) * 0.01 + 0.001
    return (lo + q * step).reshape(out, inp)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_recovers_q4_groups(dtype: torch.dtype) -> None:
    """Int4 of Q4_1-like weights is the dense product up to the activations' rounding."""
    w = _grouped_weight(96, 128)
    x = torch.randn(5, 128)
    ref = F.linear(x, w)
    got = Int4Linear(w.to(dtype))(x.to(dtype), 5).float()
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got, ref, rtol=tol, atol=tol * float(ref.abs().max()))


def test_int8_is_close_to_dense() -> None:
    """Per-channel int8: within 1 % of the dense product's scale."""
    gen = torch.Generator().manual_seed(2)
    w = torch.randn((64, 96), generator=gen) * 0.02
    x = torch.randn((3, 96), generator=gen)
    ref = F.linear(x, w)
    got = Int8Linear(w)(x, 3)
    assert float((got - ref).abs().max()) < 0.01 * float(ref.abs().max())


def test_switch_takes_dense_above_the_switch_point() -> None:
    """Up to `switch_rows` rows the quantized kernel runs, the dense one above."""
    w = _grouped_weight(64, 64)
    lin = make_linear(w, LinearPlan("int8", pack=False, switch_rows=2))
    x = torch.randn(4, 64)
    torch.testing.assert_close(lin(x, 4), F.linear(x, w))  # dense: exact
    assert not torch.equal(lin(x[:2], 2), F.linear(x[:2], w))  # int8: rounded
    assert 0 <= measure_switch((64, 64), torch.float32, "int4", False) <= 128


def test_large_row_counts_take_f_linear_where_it_measured_faster() -> None:
    """A prepacked weight that keeps its plain copy runs `F.linear` from each probed row count
    where that won up to the next probed count, the prepacked product elsewhere; both give
    `F.linear`'s product. The probe answers probed row counts only."""
    gen = torch.Generator().manual_seed(4)
    w = torch.randn((48, 64), generator=gen) * 0.02
    lin = LargeRowsLinear(w, plain_at=(384,))
    for rows, plain in ((8, False), (383, False), (384, True), (511, True), (512, False)):
        assert (lin.choice(rows) is lin.plain) is plain, rows
        x = torch.randn((rows, 64), generator=gen)
        torch.testing.assert_close(lin(x, rows), F.linear(x, w), rtol=1e-5, atol=1e-5)
    assert set(measure_large_rows((32, 64), torch.float32)) <= set(LARGE_ROWS)


def test_only_a_layers_prepacked_weights_keep_a_plain_copy(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the probe finds `F.linear` faster at large row counts, the layers' prepacked
    weights keep their plain copy; the output matrix (last rows only) and unpacked plans
    never do."""
    import lenbatch.runners.weightonly as wo

    monkeypatch.setattr(wo, "large_rows_plain", lambda shape, dtype: (256,))
    r = CausalLMRunner(tiny_llama_dir, pack=True)
    assert r.lean is not None
    layer = r.lean.layers[0]
    assert all(isinstance(x, LargeRowsLinear) for x in (layer.qkv, layer.o, layer.down))
    assert not isinstance(r.lean.lm_head, LargeRowsLinear)
    plain = CausalLMRunner(tiny_llama_dir, pack=False)
    assert plain.lean is not None and not isinstance(plain.lean.layers[0].o, LargeRowsLinear)


@pytest.mark.parametrize("ops", ["auto", "sdpa"])
def test_int4_keeps_the_output_matrix_in_int8(
    tiny_llama_dir: Path, ops: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """int4 quantizes the layers' linears, the output matrix only to int8 (an 8-bit tensor in
    a Q4 GGUF): in float32 through the C++ op's groups of 32 where this CPU builds it, else
    (forced off) torch's kernels; bfloat16 compute keeps its dense weights in bfloat16."""
    from lenbatch.runners import decode_attention
    from lenbatch.runners.rowlinears import GroupLinear, SwitchLinear

    monkeypatch.setenv("LENBATCH_DECODE_ATTENTION", ops)
    monkeypatch.setattr(decode_attention, "_loaded", {})
    grouped = ops == "auto" and decode_attention.decode_attention_op() is not None
    r = CausalLMRunner(tiny_llama_dir, quantization="int4", quant_switch_rows=8, pack=False)
    assert r.lean is not None
    layer = r.lean.layers[0].gate_up_silu.linear
    head = r.lean.lm_head
    assert isinstance(layer, SwitchLinear) and isinstance(head, SwitchLinear)
    if grouped:
        assert isinstance(layer.small, GroupLinear) and layer.small.bits == 4
        assert isinstance(head.small, GroupLinear) and head.small.bits == 8
        assert "C++ loop over groups of 32" in r.lean.describe()
    else:
        assert isinstance(layer.small, Int4Linear) and isinstance(head.small, Int8Linear)
        assert "torch's Int4Linear" in r.lean.describe()
    bf = CausalLMRunner(tiny_llama_dir, dtype="bfloat16", quantization="int8", pack=False)
    assert bf.lean is not None and bf.lean.embed.dtype == torch.bfloat16
    assert next(bf.model.parameters()).dtype == torch.bfloat16


def _on_gguf_grids(tiny_llama_dir: Path, folder: Path, layer_bits: int) -> Path:
    """A copy of the tiny Llama whose layer weights lie on `layer_bits`-bit group grids (4:
    Q4_1, 8: Q8_0) and whose output matrix on Q8_0 grids: what a Q4_1 (or Q8_0) GGUF such as
    SmolLM2's dequantizes to."""
    import shutil

    from transformers import LlamaForCausalLM

    from lenbatch.runners.rowlinears import GroupLinear, group_op

    op = group_op()
    assert op is not None
    model = LlamaForCausalLM.from_pretrained(str(tiny_llama_dir))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("proj.weight"):
                param.copy_(GroupLinear(param, layer_bits, op).dequantized())
            elif name == "lm_head.weight":
                param.copy_(GroupLinear(param, 8, op).dequantized())
    model.save_pretrained(str(folder))
    for f in tiny_llama_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")) and not (folder / f.name).exists():
            shutil.copy(f, folder / f.name)
    return folder


@needs_op  # float32 group-wise products run in the C++ op
def test_int4_on_gguf_grids_decodes_as_generate(tmp_path: Path, tiny_llama_dir: Path) -> None:
    """A tiny Llama on Q4_1 / Q8_0 grids: `--dtype float32 --quantize int4`, forced on at
    every row count, decodes greedily token for token as transformers' `generate()` on those
    weights."""
    from lenbatch.runners.rowlinears import GroupLinear

    folder = _on_gguf_grids(tiny_llama_dir, tmp_path / "llama-q4", 4)
    runner = CausalLMRunner(folder, name="tiny-q4", quantization="int4", quant_switch_rows=1024)
    assert runner.lean is not None
    assert isinstance(runner.lean.layers[0].qkv.small, GroupLinear)  # type: ignore[attr-defined]
    for prompt in runner.tokenize(PROMPTS):
        assert runner.greedy_alone(prompt, MAX_NEW) == reference_greedy(runner, prompt, MAX_NEW)


@needs_op
def test_auto_runs_the_groups_a_model_ships(tmp_path: Path, tiny_llama_dir: Path) -> None:
    """`quantization="auto"` (serve's default) runs int4 for weights on Q4_1 grids with a Q8_0
    output matrix, int8 for Q8_0 grids, and none for float weights or in bfloat16; what it
    found is the runner's `quantization` (the cost models' key). On the Q4_1 grids it decodes
    as `generate()` token for token."""
    from lenbatch.runners.rowlinears import GroupLinear

    q4 = _on_gguf_grids(tiny_llama_dir, tmp_path / "llama-q4", 4)
    q8 = _on_gguf_grids(tiny_llama_dir, tmp_path / "llama-q8", 8)
    runner = CausalLMRunner(q4, name="tiny-q4", quantization="auto", quant_switch_rows=1024)
    assert runner.quantization == "int4"
    assert runner.lean is not None
    assert isinstance(runner.lean.layers[0].qkv.small, GroupLinear)  # type: ignore[attr-defined]
    for prompt in runner.tokenize(PROMPTS):
        assert runner.greedy_alone(prompt, MAX_NEW) == reference_greedy(runner, prompt, MAX_NEW)
    from lenbatch.config import BatchingConfig
    from lenbatch.generate import GenerationEngine

    # /stats says what auto found
    stats = GenerationEngine(runner, BatchingConfig()).stats()
    assert stats["precision"] == {"dtype": "float32", "quantization": "int4"}
    assert CausalLMRunner(q8, quantization="auto", quant_switch_rows=8).quantization == "int8"
    assert CausalLMRunner(tiny_llama_dir, quantization="auto").quantization == "none"
    bf16 = CausalLMRunner(q4, dtype="bfloat16", quantization="auto", pack=False)
    assert bf16.quantization == "none"
    assert next(bf16.model.parameters()).dtype == torch.bfloat16
    assert CausalLMRunner(q4, quantization="auto", lean=False).quantization == "none"


@needs_op
def test_float32_prompts_attend_in_the_avx2_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a CPU without AVX-512, a float32 prompt's causal attention runs the AVX2 build's loop
    (`prompt_op`; `LENBATCH_PROMPT_ATTENTION=sdpa` keeps torch's): the same logits as torch's,
    and greedy decoding still equals `generate()` token for token. A tiny Llama with heads of
    32 (the loop's smallest) on half as many key/value heads."""
    from lenbatch.runners.decode_attention import decode_attention_op
    from lenbatch.runners.tiny import build_tiny_model

    op = decode_attention_op()
    assert op is not None
    folder = build_tiny_model(tmp_path / "llama-d32", "llama", hidden=128, heads=4)
    r = CausalLMRunner(folder, pack=False)
    assert r.lean is not None and r.lean.head_dim == 32
    assert r.lean.prompt_op == bool(op.causal_float32())
    assert ("AVX2 loop" in r.lean.describe()) == r.lean.prompt_op
    monkeypatch.setenv("LENBATCH_PROMPT_ATTENTION", "sdpa")
    torch_attention = CausalLMRunner(folder, pack=False)
    assert torch_attention.lean is not None and not torch_attention.lean.prompt_op
    ids = torch.tensor([list(range(3, 60))])
    pos = torch.arange(ids.shape[1])[None]
    got = r.forward(ids, torch.ones_like(ids), pos, r.new_cache())
    want = torch_attention.forward(ids, torch.ones_like(ids), pos, torch_attention.new_cache())
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    for prompt in r.tokenize(PROMPTS):
        assert r.greedy_alone(prompt, MAX_NEW) == reference_greedy(r, prompt, MAX_NEW)


@pytest.mark.slow
def test_quantized_tiny_llama_stays_close(tiny_llama_dir: Path) -> None:
    """int8 and int4 (forced on at every row count) keep the tiny Llama's logits close: cosine
    similarity to the dense logits (random weights are int4's worst case: no Q4 groups)."""
    dense = CausalLMRunner(tiny_llama_dir, pack=False)
    ids = torch.tensor([[5, 9, 11, 40, 41, 42]])
    mask, pos = torch.ones_like(ids), torch.arange(6)[None]
    ref = dense.forward(ids, mask, pos, dense.new_cache())
    for q, least in (("int8", 0.999), ("int4", 0.9)):
        r = CausalLMRunner(tiny_llama_dir, quantization=q, pack=False, quant_switch_rows=1024)
        assert r.lean is not None and r.lean.plan.switch_rows == 1024
        got = r.forward(ids, mask, pos, r.new_cache())
        assert float(F.cosine_similarity(got, ref).min()) > least, q


# A prompt's attention runs on AMX tiles only on a CPU that has them.
_NEEDS_AMX = pytest.mark.skipif(
    "amx_bf16" not in __import__("lenbatch.runners.hardware").runners.hardware.cpu_flags(),
    reason="a prompt's attention runs on AMX tiles only on a CPU that has them",
)


def _tiles_and_torch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """A tiny bfloat16 Llama twice: prompts' attention on AMX tiles ("auto") and torch's
    ("off")."""
    from lenbatch.runners.tiny import build_tiny_model

    folder = build_tiny_model(tmp_path / "llama-hd32", "llama", hidden=128, heads=4)
    runners = {}
    for amx in ("auto", "off"):
        monkeypatch.setenv("LENBATCH_AMX", amx)
        runner = CausalLMRunner(folder, name="tiny-llama", dtype="bfloat16")
        assert runner.lean is not None and runner.lean.tiles is (amx == "auto")
        runners[amx] = runner
    return runners


@_NEEDS_AMX
def test_whole_prompts_on_amx_tiles_match_torch_attention(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In bfloat16 on an AMX CPU, a whole unpadded prompt's causal attention (grouped-query
    heads) runs as tile products from the fused Q/K/V rows; its logits agree with torch's
    flash attention (`LENBATCH_AMX=off`) within bfloat16 rounding, and greedy decoding from
    them picks the same tokens. Two prompts of one length in one forward: two sequences."""
    runners = _tiles_and_torch(tmp_path, monkeypatch)
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(5, 500, (2, 70), generator=gen)
    mask = torch.ones_like(ids)
    pos = torch.arange(70).expand(2, 70)
    tiles = runners["auto"].forward(ids, mask, pos, runners["auto"].new_cache())
    torch_ = runners["off"].forward(ids, mask, pos, runners["off"].new_cache())
    scale = float(torch_.abs().max())
    torch.testing.assert_close(tiles, torch_, atol=0.03 * scale, rtol=0)
    assert torch.equal(tiles.argmax(-1), torch_.argmax(-1))
    prompt = ids[0].tolist()
    assert runners["auto"].greedy_alone(prompt, 8) == runners["off"].greedy_alone(prompt, 8)


@_NEEDS_AMX
def test_left_padded_prompts_on_amx_tiles_match_torch_attention(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prompts of different lengths in one job (left-padded, nothing cached before them): each
    row's real tokens take the tile attention (`chunk_attention`, each row from its first real
    column). The logits agree with torch's masked attention (`LENBATCH_AMX=off`) within
    bfloat16 rounding and pick the same tokens, and each row's agree with that prompt run
    alone."""
    runners = _tiles_and_torch(tmp_path, monkeypatch)
    gen = torch.Generator().manual_seed(4)
    lengths = (70, 23, 49)
    ids = torch.zeros((3, 70), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, n in enumerate(lengths):
        ids[r, 70 - n :] = torch.randint(5, 500, (n,), generator=gen)
        mask[r, 70 - n :] = 1
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    auto = runners["auto"]
    starts = _spy_chunk_attention(auto)
    tiles = auto.forward(ids, mask, pos, auto.new_cache())
    assert starts == [[0, 47, 21]] * 2  # every layer, each row from its first real column
    torch_ = runners["off"].forward(ids, mask, pos, runners["off"].new_cache())
    scale = float(torch_.abs().max())
    torch.testing.assert_close(tiles, torch_, atol=0.03 * scale, rtol=0)
    assert torch.equal(tiles.argmax(-1), torch_.argmax(-1))
    for r, n in enumerate(lengths):
        one = ids[r : r + 1, 70 - n :]
        alone = auto.forward(one, torch.ones_like(one), torch.arange(n)[None], auto.new_cache())
        torch.testing.assert_close(tiles[r : r + 1], alone, atol=0.03 * scale, rtol=0)


def _spy_chunk_attention(runner: Any) -> list[list[int]]:
    """Records the first real columns `chunk_attention` is given, one list per call."""
    assert runner.lean is not None
    op, starts = runner.lean.kernel, []

    class Spy:
        def __getattr__(self, name: str) -> Any:
            return getattr(op, name)

        def chunk_attention(self, qkv: torch.Tensor, k: Any, v: Any, first: Any, *a: Any) -> Any:
            starts.append(first.tolist())
            return op.chunk_attention(qkv, k, v, first, *a)

    runner.lean.kernel = Spy()
    return starts


@_NEEDS_AMX
def test_later_prompt_chunks_on_amx_tiles_match_torch_attention(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A left-padded job prefilled in three chunks (the padding of one row reaching into the
    second): every chunk takes the tile attention over its rows' cached columns and its own.
    Each chunk's logits agree with torch's masked attention (`LENBATCH_AMX=off`) within
    bfloat16 rounding (rows whose chunk ends in padding have no logits to compare), the last
    picks the same tokens, and it agrees with the whole job run in one forward."""
    runners = _tiles_and_torch(tmp_path, monkeypatch)
    gen = torch.Generator().manual_seed(5)
    lengths, width = (90, 60, 41), 90
    ids = torch.zeros((3, width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, n in enumerate(lengths):
        ids[r, width - n :] = torch.randint(5, 500, (n,), generator=gen)
        mask[r, width - n :] = 1
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    auto, off = runners["auto"], runners["off"]
    starts = _spy_chunk_attention(auto)
    caches = {"auto": auto.new_cache(), "off": off.new_cache()}
    for lo, hi in ((0, 37), (37, 70), (70, 90)):
        part = (ids[:, lo:hi], mask[:, :hi], pos[:, lo:hi])
        real = mask[:, hi - 1].bool()
        tiles = auto.forward(*part, caches["auto"])[real]
        torch_ = off.forward(*part, caches["off"])[real]
        scale = float(torch_.abs().max())
        torch.testing.assert_close(tiles, torch_, atol=0.03 * scale, rtol=0)
    assert torch.equal(tiles.argmax(-1), torch_.argmax(-1))
    # two layers a chunk; the last row has no real column in the first chunk
    assert starts == [[0, 30, 37]] * 2 + [[0, 30, 49]] * 4
    whole = auto.forward(ids, mask, pos, auto.new_cache())
    torch.testing.assert_close(tiles, whole, atol=0.03 * scale, rtol=0)
