"""A lean forward pass for Llama-family causal LMs (SmolLM2 is one), beside Hugging Face's.

Hugging Face still loads the model (GGUF or safetensors, tokenizer, generation config) and stays
the reference and the fallback for other architectures; `LeanLlama` takes the loaded weights and
runs the same computation with less per-step overhead:

* q/k/v fused into one matrix product, gate/up into another (7 linears per layer become 4); in
  bfloat16 the gate/up product writes its activation `silu(gate) * up` where the C++ op is
  built and measured faster (`weightonly.make_gate_up_silu`), else `silu_mul` follows it;
* every linear behind `weightonly.make_linear`: oneDNN-prepacked weights where that is faster than
  `F.linear` on this CPU (a layer's weight keeps its plain copy for a whole prompt's row counts
  where `F.linear` measured faster for its shape), or weight-only int8 / int4 (`--quantize`)
  for small row counts, dense above the switch point measured on this processor;
* `F.rms_norm`; RoPE cos/sin tables computed once for every position; one boolean attention mask
  per forward (shared by every layer), not a 4-D float mask rebuilt per layer;
* a decode step's attention through a small C++ op (`runners/decode_attention.py`, built just
  in time on a CPU with AVX-512, or AVX2 and FMA) that reads only each row's real columns of the
  KV window, once per key/value head for all its query heads; a prompt's causal attention in
  bfloat16 on a CPU with AMX through the same build's `packed_attention` (tile products
  straight from the fused Q/K/V rows) for a whole prompt, and through its `chunk_attention` for
  a job's left-padded rows and a prompt's later chunks (each row over its real columns, cached
  ones included, read in place from the cache); a whole float32 prompt of up to 640 tokens
  (and each prompt of a left-padded job's first chunk) through the AVX2 build's
  `packed_attention` (a CPU without AVX-512); elsewhere torch's
  `F.scaled_dot_product_attention` with grouped-query heads, reading the window in place
  (`generate.windowcache.WindowLayer` returns views). All of it per segment, in
  `runners.llama_attention`;
* a job's left padding left out of the forward's products: the products, norms and MLP run
  over the real tokens only (`llama_attention.SegmentPlan.keep`); the cache keeps its padded
  layout.

* a decode step of the running batch whose products all take the few-row bfloat16 ops runs
  its decoder layers in one call of the C++ op `decode_layers` (the same ops, in the same order,
  with no Python between them: `_layers_in_one_call`); in float32, one whose products all take
  the group loop (`--quantize int4` up to the switch point) runs them in one call of
  `decode_layers_groups`; `LENBATCH_DECODE_LAYERS=off` keeps either op by op.

The cache contract is transformers' (`cache.update(keys, values, layer_idx)` returns the layer's
keys and values so far), so the engine's window cache, a prefill's `DynamicCache` and the
fixed-shape buffers work unchanged. In float32 with plain `F.linear`, greedy decoding equals
`model.generate()` token for token (tests/integration/test_lean_llama.py).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F

from lenbatch.runners.base import Segment
from lenbatch.runners.decode_attention import amx_allowed, decode_attention_op
from lenbatch.runners.linears import rounded_tokens
from lenbatch.runners.llama_attention import LlamaAttention
from lenbatch.runners.rowlinears import GateUpSilu, GroupLinear, RowLinear
from lenbatch.runners.weightonly import LinearPlan, make_gate_up_silu, make_linear

__all__ = ["LeanLlama", "lean_unsupported"]

log = logging.getLogger("lenbatch.runner")

# `off` runs a decode step's layers one op call at a time from Python even where
# `decode_layers` could run them in one (A/B runs, tests).
_ONE_CALL_ENV = "LENBATCH_DECODE_LAYERS"
_PROMPT_ENV = "LENBATCH_PROMPT_ATTENTION"  # auto, or sdpa: torch's attention for float32 prompts
# Architectures whose forward is exactly the Llama one this module implements.
_LLAMA_TYPES = ("llama",)

# Above this many tokens in one forward, the matrix products run on a row count rounded by
# `rounded_tokens` (zero rows appended): prompts and mixed units come in every length, and each
# new row count builds oneDNN kernels on first use. Decode steps (one row per running sequence,
# at most the batch cap) keep their exact count: few shapes, and the least work.
_ROUND_ABOVE = 32


def lean_unsupported(model: Any) -> str | None:
    """Why `model` cannot run on the lean path (None when it can): only Llama-family models
    with the plain computation (default RoPE, SiLU MLP, no biases, full attention)."""
    cfg = getattr(model, "config", None)
    if cfg is None or getattr(cfg, "model_type", None) not in _LLAMA_TYPES:
        return f"model type {getattr(cfg, 'model_type', None)!r} is not Llama"
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    if rope.get("rope_type", "default") != "default":
        return f"rope type {rope.get('rope_type')!r} (only default RoPE)"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"activation {cfg.hidden_act!r} (only silu)"
    if getattr(cfg, "attention_bias", False) or getattr(cfg, "mlp_bias", False):
        return "biases in attention or MLP"
    if getattr(cfg, "pretraining_tp", 1) not in (None, 1):
        return "pretraining_tp > 1"
    return None


def llama_shapes(model: Any) -> list[tuple[int, int]]:
    """The `[out, in]` shapes of a Llama-family model's layer products as the lean path fuses
    them: Q/K/V, O, gate/up, down (the LM head, run at a decode step's rows, is left out)."""
    layer = model.model.layers[0]
    att, mlp = layer.self_attn, layer.mlp
    hidden = int(att.q_proj.weight.shape[1])
    qkv = sum(int(p.weight.shape[0]) for p in (att.q_proj, att.k_proj, att.v_proj))
    gate_up = int(mlp.gate_proj.weight.shape[0]) + int(mlp.up_proj.weight.shape[0])
    shapes = [(qkv, hidden), tuple(att.o_proj.weight.shape), (gate_up, hidden)]
    shapes.append(tuple(mlp.down_proj.weight.shape))
    return [(int(o), int(i)) for o, i in shapes]


def _rope_theta(cfg: Any) -> float:
    rope = getattr(cfg, "rope_parameters", None) or {}
    return float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))


@dataclass
class _Layer:
    ln1: torch.Tensor
    qkv: RowLinear
    o: RowLinear
    ln2: torch.Tensor
    gate_up_silu: GateUpSilu  # the MLP's gate/up product and its activation
    down: RowLinear


class LeanLlama:
    """The forward pass of a loaded Hugging Face Llama model, leaner (see the module's doc).

    `plan` says how each linear is built (dense, prepacked, int8, int4 and the switch point);
    the weights are copied out of `model` (which the runner keeps as reference and fallback)
    and run in `dtype` (default: the model's); quantized weights are computed from the
    model's own (load it in float32 to quantize from unrounded weights). The output matrix
    (tied to the embedding in SmolLM2, whose GGUF keeps it in 8 bits) is never quantized below
    int8.
    """

    def __init__(
        self, model: Any, plan: LinearPlan, max_positions: int, dtype: torch.dtype | None = None
    ) -> None:
        why = lean_unsupported(model)
        if why is not None:
            raise ValueError(f"lean path: {why}")
        cfg = model.config
        inner = model.model
        self.heads = int(cfg.num_attention_heads)
        self.kv_heads = int(getattr(cfg, "num_key_value_heads", None) or self.heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads)
        self.hidden = int(cfg.hidden_size)
        self.eps = float(cfg.rms_norm_eps)
        self.scale = self.head_dim**-0.5
        # A decode step's attention: the C++ op over each row's real columns where this CPU
        # can build it, else torch's SDPA (runners/decode_attention.py says which, once).
        self.kernel = decode_attention_op()
        self.plan = plan
        self.dtype: torch.dtype = dtype or inner.embed_tokens.weight.dtype
        # A whole prompt's causal attention on AMX tiles, straight from the fused Q/K/V rows
        # (bfloat16, a CPU with AMX): 0.56 against 1.0 ms per layer for a 517-token prompt with
        # torch's flash attention on 2 threads (Intel Xeon family 6 model 167).
        self.tiles = (
            self.kernel is not None
            and self.dtype == torch.bfloat16
            and self.head_dim in (32, 64, 128)
            and self.kernel.has_amx()
            and amx_allowed()
        )
        # A whole float32 prompt's causal attention (up to `AVX2_PROMPT_MAX` tokens) through
        # the AVX2 build's loop (a CPU without AVX-512: a Zen 3), from the same fused rows: each
        # query block scores only the keys up to its own, in registers, where torch's flash
        # attention tiles and rescales. `bench/results/zen3-model1/prompt-attention-avx2.md`;
        # `LENBATCH_PROMPT_ATTENTION=sdpa` keeps torch's.
        self.prompt_op = self.tiles or (
            self.kernel is not None
            and self.dtype == torch.float32
            and self.head_dim in (32, 64, 128)
            and bool(getattr(self.kernel, "causal_float32", lambda: False)())
            and os.environ.get(_PROMPT_ENV, "auto").strip().lower() != "sdpa"
        )
        self.embed = inner.embed_tokens.weight.detach().to(self.dtype)
        self.layers: list[_Layer] = []
        for layer in inner.layers:
            att, mlp = layer.self_attn, layer.mlp
            qkv = torch.cat([att.q_proj.weight, att.k_proj.weight, att.v_proj.weight]).detach()
            gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).detach()
            self.layers.append(
                _Layer(
                    ln1=layer.input_layernorm.weight.detach().to(self.dtype),
                    qkv=make_linear(qkv, plan, self.dtype, large_rows=True),
                    o=make_linear(att.o_proj.weight.detach(), plan, self.dtype, large_rows=True),
                    ln2=layer.post_attention_layernorm.weight.detach().to(self.dtype),
                    gate_up_silu=make_gate_up_silu(gate_up, plan, self.dtype, self.kernel),
                    down=make_linear(
                        mlp.down_proj.weight.detach(), plan, self.dtype, large_rows=True
                    ),
                )
            )
        self.norm = inner.norm.weight.detach().to(self.dtype)
        # A decode step's layers in one call of the C++ op `decode_layers` where every product
        # of its rows runs the few-row bfloat16 op, or of `decode_layers_groups` where every
        # one runs the float32 group loop (`_layers_in_one_call`).
        one_call_op = {torch.bfloat16: "decode_layers", torch.float32: "decode_layers_groups"}
        self.one_call = (
            self.kernel
            if self.kernel is not None
            and hasattr(self.kernel, one_call_op.get(self.dtype, ""))
            and os.environ.get(_ONE_CALL_ENV, "auto").strip().lower() != "off"
            else None
        )
        self._ln1 = [layer.ln1 for layer in self.layers]
        self._ln2 = [layer.ln2 for layer in self.layers]
        self._packed: dict[int, tuple[list[torch.Tensor], int] | None] = {}
        head_plan = replace(plan, quantization="int8") if plan.quantization == "int4" else plan
        self.lm_head = make_linear(model.lm_head.weight.detach(), head_plan, self.dtype)
        # RoPE tables once for every position, computed as transformers does (float32 product
        # of position and inverse frequency, cos/sin, then cast to the model's dtype).
        dim = self.head_dim
        inv = 1.0 / (_rope_theta(cfg) ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.int64).float(), inv)
        emb = torch.cat([freqs, freqs], dim=-1)
        device = self.embed.device
        self.cos = emb.cos().to(device=device, dtype=self.dtype)
        self.sin = emb.sin().to(device=device, dtype=self.dtype)
        self.attention = LlamaAttention(
            heads=self.heads,
            kv_heads=self.kv_heads,
            head_dim=self.head_dim,
            cos=self.cos,
            sin=self.sin,
            tiles=self.tiles,
            prompt_op=self.prompt_op,
        )

    def describe(self) -> str:
        """One line for the start-up log: how the linears run, and which kernel runs the
        quantized products (lenbatch's group-of-32 loop or torch's)."""
        line = f"lean Llama path: {len(self.layers)} layers, linears {self.plan.describe()}"
        small = getattr(self.layers[0].gate_up_silu.linear, "small", None) if self.layers else None
        if isinstance(small, GroupLinear):
            line += (
                " (quantized products: lenbatch's C++ loop over groups of 32 in float32, GGUF "
                "Q4_1 / Q8_0 blocks; a Q4_1 GGUF's own weights)"
            )
        elif small is not None:
            line += f" (quantized products: torch's {type(small).__name__})"
        if self.one_call is not None:
            line += "; a decode step's layers in one C++ call where its products take few rows"
        if self.prompt_op and not self.tiles:
            line += "; whole prompts' attention in lenbatch's AVX2 loop (float32, causal)"
        return line

    def _add_norm(
        self, h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual `h + delta` and its RMSNorm with `weight`: one pass of the C++ op where
        it is built (it adds into `h`, a tensor this forward owns), else two torch ops."""
        if (
            self.kernel is not None
            and h.dtype == delta.dtype == weight.dtype
            and h.is_contiguous()
            and delta.is_contiguous()
        ):
            return h, self.kernel.add_rms_norm(h, delta, weight, self.eps)
        h = h + delta
        return h, F.rms_norm(h, (self.hidden,), weight, self.eps)

    def _packed_at(self, rows: int) -> tuple[list[torch.Tensor], int] | None:
        """What the one call takes for a decode step of `rows` rows, when each of its products
        runs the kernel that call runs, else None; looked up once per row count. In bfloat16:
        every layer's four packed weights (Q/K/V, O, gate/up, down) for the few-row op, and
        the MLP's width. In float32: every layer's (q, scale, lo) of the same four products
        for the group loop, and 0."""
        if rows in self._packed:
            return self._packed[rows]
        found: tuple[list[torch.Tensor], int] | None = None
        weights: list[torch.Tensor] = []
        inter = 0
        for layer in self.layers:
            if self.dtype == torch.float32:
                gate_up = layer.gate_up_silu
                linears = [layer.qkv, layer.o, gate_up.linear, layer.down]
                blocks = [lin.groups_at(rows) for lin in linears]
                if gate_up.fused_at(rows) is not None or any(b is None for b in blocks):
                    break
                weights += [t for b in blocks if b is not None for t in b]
                continue
            fused = layer.gate_up_silu.fused_at(rows)
            parts = [layer.qkv.packed_at(rows), layer.o.packed_at(rows)]
            parts += [None if fused is None else fused.packed, layer.down.packed_at(rows)]
            if fused is None or any(w is None for w in parts):
                break
            weights += [w for w in parts if w is not None]
            inter = fused.inter
        else:
            found = (weights, inter)
        self._packed[rows] = found
        return found

    def _layers_in_one_call(self, seg: Segment) -> torch.Tensor | None:
        """A decode step's last-column logits with its layers run by one call of the C++ op
        `decode_layers` (the same ops as `forward_segments`, without a Python round trip
        between them), or None where that does not apply: not a decode step (one new column
        per row), a product of this many rows that another kernel runs, or a cache that is
        not the running batch's window cache (`WindowCache.next_column`)."""
        rows, new = (int(n) for n in seg.input_ids.shape)
        op = self.one_call
        if op is None or new != 1:
            return None
        packed = self._packed_at(rows)
        next_column = getattr(seg.cache, "next_column", None)
        if packed is None or next_column is None:
            return None
        buffers = next_column(rows)
        if buffers is None:
            return None
        keys, values, start, end = buffers
        if int(seg.mask.shape[1]) != end - start + 1:
            return None
        weights, inter = packed
        h = F.embedding(seg.input_ids.reshape(-1), self.embed)
        x = F.rms_norm(h, (self.hidden,), self.layers[0].ln1, self.eps)
        pos = seg.positions
        cos, sin, mask = self.cos[pos], self.sin[pos], seg.mask.bool()
        if self.dtype == torch.float32:
            h = op.decode_layers_groups(
                h, x, self._ln1, self._ln2, weights, keys, values, start, end, cos, sin, mask,
                self.heads, self.kv_heads, self.scale, self.eps,
            )  # fmt: skip
        else:
            h = op.decode_layers(
                h, x, self._ln1, self._ln2, weights, keys, values, start, end, cos, sin, mask,
                self.heads, self.kv_heads, inter, self.scale, self.eps,
            )  # fmt: skip
        seg.cache.took_column()
        return self._logits(h)

    def _logits(self, last_h: torch.Tensor) -> torch.Tensor:
        """Float32 logits `[rows, vocab]` of each row's last hidden state."""
        last = F.rms_norm(last_h, (self.hidden,), self.norm, self.eps)
        return self.lm_head(last, int(last.shape[0])).float()

    @torch.no_grad()
    def forward(
        self, input_ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: Any
    ) -> torch.Tensor:
        """Logits `[rows, vocab]` (float32) of the last column; the new columns' keys and
        values go into `cache` (`cache.update(k, v, layer)`), as the runner's HF path does."""
        return self.forward_segments([Segment(input_ids, mask, positions, cache)])[0]

    @torch.no_grad()
    def forward_segments(self, segments: Sequence[Segment]) -> list[torch.Tensor]:
        """One forward pass over several segments, each with its own cache (e.g. the running
        batch's decode step and a prompt's prefill chunk): the matrix products run once over
        every segment's tokens together (one pass over the weights), RoPE, the cache update
        and attention run per segment. Returns each segment's last-column logits
        `[rows, vocab]` (float32), in order."""
        if len(segments) == 1:
            done = self._layers_in_one_call(segments[0])
            if done is not None:
                return [done]
        hidden, kernel = self.hidden, self.kernel
        plans = [self.attention.plan(s, kernel) for s in segments]
        counts = [p.tokens for p in plans]
        offsets = [sum(counts[:j]) for j in range(len(counts))]
        tokens = sum(counts)
        one = len(segments) == 1
        ids = [
            s.input_ids.reshape(-1) if p.keep is None else s.input_ids.reshape(-1)[p.keep]
            for s, p in zip(segments, plans, strict=True)
        ]
        h = F.embedding(ids[0] if one else torch.cat(ids), self.embed)  # [tokens, hidden]
        # Zero rows up to the rounded count stay zero through every layer (RMSNorm of zeros,
        # products of zeros); attention and the cache see only the real tokens.
        stream = rounded_tokens(tokens) if tokens > _ROUND_ABOVE else tokens
        pad = stream - tokens
        if pad:
            h = F.pad(h, (0, 0, 0, pad))
        filler = [h.new_zeros(pad, self.heads * self.head_dim)] if pad else []
        shape = (hidden,)
        x = F.rms_norm(h, shape, self.layers[0].ln1, self.eps)
        last_layer = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            qkv_all = layer.qkv(x, stream)
            parts = [
                self.attention.run(p, qkv_all[off : off + p.tokens], seg.cache, i, kernel)
                for p, off, seg in zip(plans, offsets, segments, strict=True)
            ]
            parts += filler
            a = parts[0] if len(parts) == 1 else torch.cat(parts)
            h, x = self._add_norm(h, layer.o(a, stream), layer.ln2)
            down = layer.down(layer.gate_up_silu(x, stream), stream)
            if i < last_layer:
                h, x = self._add_norm(h, down, self.layers[i + 1].ln1)
            else:
                h = h + down
        if one and plans[0].keep is None:
            last_h = h[:tokens].view(plans[0].rows, plans[0].new, hidden)[:, -1]
        else:
            # each row's last token in the stream
            idx = torch.cat([p.last_rows(off) for p, off in zip(plans, offsets, strict=True)])
            last_h = h.index_select(0, idx.to(h.device))
        logits = self._logits(last_h)
        return [logits] if one else list(logits.split([p.rows for p in plans]))
