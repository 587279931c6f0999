"""Padding-free execution of BERT-family encoders: a batch costs its real tokens.

The token-wise layers (embeddings, the fused Q/K/V projection, attention output, feed-forward,
LayerNorms) run on the batch's tokens packed end to end, `[tokens, hidden]`. Only attention
needs rows: the packed Q/K/V are scattered into `[rows, width]` (width: the longest row) for
one `scaled_dot_product_attention` call with a key mask, and the result is gathered back. A
batch whose rows all have the same length (a bucket's batch often does) skips the scatter and
the mask. For MiniLM at bucket lengths attention is the small part of the cost, so padding
there costs little; the feed-forward and projections, which dominate, see no padding at all.

Where lenbatch's C++ ops build (an x86 CPU with AVX-512, or AVX2 and FMA for float32, and a
compiler: `runners/decode_attention.py`, whose `LENBATCH_DECODE_ATTENTION=sdpa` forces torch's
path), attention runs on the packed Q/K/V directly (`packed_attention`): each sequence attends
to its own tokens, with no grid, no mask and nothing gathered back. On MiniLM's buckets, 32 rows,
bfloat16, one thread (Intel Xeon family 6 model 167): 1.2-2.2x faster than the grid and torch's
attention, the most on short and on long rows.

The layers are the model's own modules, read in place (weights, epsilons, activation), so the
result equals Hugging Face's forward up to float rounding: within 1e-5 of sentence-transformers
in float32 (a test checks). In bfloat16 the matrix products run in bfloat16 on bfloat16 copies
of the weights made at load, while the residual stream, LayerNorms, pooling and the softmax's
accumulation stay float32, as `torch.autocast` would run them but without re-casting the
weights on every call. With `quantization` int8 the products run in int8 (`runners.int8.Int8Linear`:
weights per channel, activations per token; the first layer's feed-forward output stays
float32) and the rest in float32.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F

from lenbatch.core.collate import Collated, Packed, pack_collated
from lenbatch.runners.decode_attention import amx_allowed, decode_attention_op
from lenbatch.runners.encoder import EncoderRunner
from lenbatch.runners.int8 import FLOAT32_PRODUCTS, Int8Linear, int8_kind
from lenbatch.runners.linears import Activation, Linear, linear_kind, rounded_tokens
from lenbatch.runners.memory import current_rss

__all__ = ["PackedEncoderRunner", "supports_packing"]

log = logging.getLogger("lenbatch.runner")

_PACKABLE = ("bert",)  # model types whose layer layout this module knows


def supports_packing(config: Any) -> tuple[bool, str]:
    """Whether a model config can run packed here, and why not if it cannot."""
    kind = getattr(config, "model_type", "?")
    if kind not in _PACKABLE:
        return False, f"model type {kind!r} is not BERT-family ({', '.join(_PACKABLE)})"
    if getattr(config, "is_decoder", False):
        return False, "a decoder (causal attention) cannot run packed here"
    if getattr(config, "position_embedding_type", "absolute") != "absolute":
        return False, "only absolute position embeddings are supported packed"
    return True, "BERT-family encoder with absolute positions"


class _Layer:
    """One BERT layer's parts, with Q, K and V fused into one matrix product, and GELU fused
    into the feed-forward's first product where the model uses exact GELU."""

    def __init__(
        self, layer: Any, dtype: torch.dtype, kind: str, gelu: bool, down_kind: str | None = None
    ) -> None:
        att = layer.attention.self
        q, k, v = att.query, att.key, att.value
        self.heads = int(att.num_attention_heads)
        self.head_dim = int(att.attention_head_size)

        def linear(w: torch.Tensor, b: torch.Tensor, act: Activation = "none") -> Any:
            if kind == "int8":  # int8 weights and activations, float32 out (runners.int8)
                return Int8Linear(w, b, act)
            return Linear(w, b, dtype, kind, act)

        self.qkv = linear(
            torch.cat([q.weight, k.weight, v.weight]), torch.cat([q.bias, k.bias, v.bias])
        )
        out = layer.attention.output.dense
        self.attn_out = linear(out.weight, out.bias)
        self.attn_norm = layer.attention.output.LayerNorm
        up = layer.intermediate.dense
        self.up = linear(up.weight, up.bias, "gelu" if gelu else "none")
        # Applied after `up`: nothing when GELU is fused into it, else the model's own.
        self.act: Any = (lambda t: t) if gelu else layer.intermediate.intermediate_act_fn
        down = layer.output.dense
        if down_kind is None:
            self.down = linear(down.weight, down.bias)
        else:  # a float32 product under int8 (`runners.int8.FLOAT32_PRODUCTS`)
            self.down = Linear(down.weight, down.bias, dtype, down_kind)
        self.out_norm = layer.output.LayerNorm

    def linears(self) -> tuple[Linear | Int8Linear, ...]:
        """Its four matrix products."""
        return (self.qkv, self.attn_out, self.up, self.down)


class PackedEncoderRunner(EncoderRunner):
    """`EncoderRunner` that runs BERT-family encoders padding-free (`embed_packed`).

    Takes the same arguments; `dtype` bfloat16 runs the matrix products in bfloat16 (module
    docstring). `embed` accepts a padded batch too (it packs its real tokens first).
    """

    packed = True

    def __init__(self, folder: str | Path, **kwargs: Any) -> None:
        super().__init__(folder, **kwargs)
        ok, why = supports_packing(self.model.config)
        if not ok:
            raise ValueError(f"packed execution is not available for {self.folder.name}: {why}")
        # The runner's own modules stay float32 (LayerNorms, embeddings); only the matrix
        # products run in the chosen type.
        self.model.float()
        mm_dtype = self.precision.dtype
        emb = self.model.embeddings
        self._word = emb.word_embeddings
        self._pos = emb.position_embeddings
        # Segment embeddings: a pair's segment ids pick theirs; without them every token is
        # segment 0, as the padded path does without token_type_ids.
        self._types = emb.token_type_embeddings
        self._type0 = emb.token_type_embeddings.weight[0].detach()
        self._emb_norm = emb.LayerNorm
        if self.quantization == "int8":
            ok, linears_why = int8_kind()
            if not ok:
                raise ValueError(f"quantization int8 is not available here: {linears_why}")
            self.linears = "int8"
        else:
            self.linears, linears_why = linear_kind(self.device, mm_dtype)
        gelu = getattr(self.model.config, "hidden_act", None) == "gelu"  # exact GELU
        # Under int8 the first layer's feed-forward output stays float32 (FLOAT32_PRODUCTS).
        exact = linear_kind(self.device, torch.float32)[0] if self.linears == "int8" else None
        self._layers = [
            _Layer(
                layer,
                mm_dtype,
                self.linears,
                gelu,
                exact if f"{i}.output.dense" in FLOAT32_PRODUCTS else None,
            )
            for i, layer in enumerate(self.model.encoder.layer)
        ]
        self._mm_dtype = mm_dtype
        head_dims = {layer.head_dim for layer in self._layers}
        kernel = (
            decode_attention_op()
            if self.device.type == "cpu" and head_dims <= {32, 64, 128}
            else None
        )
        # An AVX2 build's packed attention runs float32 only (an AVX-512 build's, bfloat16
        # too; it alone holds `bf16_linear`): elsewhere torch's runs it.
        float_only = not hasattr(kernel, "bf16_linear")
        usable = mm_dtype == torch.float32 or not float_only
        self._kernel = kernel if hasattr(kernel, "packed_attention") and usable else None
        self._amx = amx_allowed()
        # The layers now hold what they need (fused Q/K/V, bf16 copies); the model's own
        # encoder weights would only take memory.
        del self.model.encoder
        self._weights = sum(t.numel() * t.element_size() for t in self._tensors()) + sum(
            lin.nbytes for layer in self._layers for lin in layer.linears()
        )
        self._rss_after_load = current_rss()
        products = "int8" if self.linears == "int8" else self.precision.name
        log.info(
            "packed execution: %s; matrix products in %s, %s weights (%s)",
            why,
            products,
            self.linears,
            linears_why,
        )

    def _tensors(self) -> Iterator[torch.Tensor]:
        """Every weight the packed forward keeps (each once), but the linear layers' (whose
        prepacked weights count by `Linear.nbytes`)."""
        seen: set[int] = set()
        parts: list[torch.Tensor] = list(self.model.parameters())
        for layer in self._layers:
            parts += list(layer.attn_norm.parameters()) + list(layer.out_norm.parameters())
        for t in parts:
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                yield t

    def _quantize(self, layers: torch.nn.ModuleList) -> int:
        """Nothing: the packed layers take their int8 products from the float32 weights
        (`_Layer`), and the model's own layers are dropped."""
        return 0

    def _load_dtype(self) -> torch.dtype:
        return torch.float32  # the matrix products get their own copies (see __init__)

    def embed(self, batch: Collated) -> npt.NDArray[np.float32]:
        """A padded batch's vectors, computed packed (only its real tokens)."""
        return self.embed_packed(pack_collated(batch))

    @torch.inference_mode()
    def embed_packed(self, batch: Packed) -> npt.NDArray[np.float32]:
        """One vector per row of a packed batch: forward on real tokens, pool, normalise."""
        x = self.hidden_packed(batch)
        pooled = self._pool_packed(x, batch)
        if self.normalize:
            pooled = F.normalize(pooled, p=2, dim=1)
        out: npt.NDArray[np.float32] = pooled.float().cpu().numpy()
        return out

    def hidden_packed(self, batch: Packed) -> torch.Tensor:
        """The last layer's hidden states of a packed batch's real tokens, `[tokens, hidden]`
        in float32 (call under `torch.inference_mode`)."""
        dev = self.device
        ids = torch.from_numpy(batch.input_ids).to(dev)
        pos = torch.from_numpy(batch.position_ids).to(dev)
        if batch.token_type_ids is None:
            types = self._type0
        else:
            types = self._types(torch.from_numpy(batch.token_type_ids).to(dev))
        x = self._word(ids) + self._pos(pos) + types
        x = self._emb_norm(x)
        tokens = x.shape[0]
        rounded = rounded_tokens(tokens)
        if rounded != tokens:  # zero rows: finite through every layer, dropped at the end
            x = F.pad(x, (0, 0, 0, rounded - tokens))
        attend = _Attention(batch, dev, self._mm_dtype, rounded, self._kernel, self._amx)
        for layer in self._layers:
            if self.between_layers is not None:
                self.between_layers()  # the CPU budget may pause here (several models)
            # One expression per sub-block, so no intermediate outlives its use (peak memory).
            ctx = attend(layer.qkv(x), layer.heads, layer.head_dim)
            x = layer.attn_norm(layer.attn_out(ctx).float() + x)
            del ctx
            x = layer.out_norm(layer.down(layer.act(layer.up(x))).float() + x)
        hidden: torch.Tensor = x[:tokens]
        return hidden

    def _pool_packed(self, x: torch.Tensor, batch: Packed) -> torch.Tensor:
        offsets = torch.from_numpy(batch.offsets).to(self.device)
        if self.pooling == "cls":
            return x[offsets[:-1]]
        if self.pooling == "lasttoken":
            return x[offsets[1:] - 1]
        rows = torch.from_numpy(batch.row_ids).to(self.device)
        out = torch.zeros(batch.rows, x.shape[1], dtype=x.dtype, device=x.device)
        if self.pooling == "max":
            index = rows.unsqueeze(1).expand_as(x)
            return out.scatter_reduce(0, index, x, reduce="amax", include_self=False)
        lengths = (offsets[1:] - offsets[:-1]).to(x.dtype).unsqueeze(1)
        return out.index_add_(0, rows, x) / lengths


class _Attention:
    """Self-attention over a packed batch: packed Q/K/V in, packed context out."""

    def __init__(
        self,
        batch: Packed,
        device: torch.device,
        dtype: torch.dtype,
        rounded: int,
        kernel: Any = None,
        amx: bool = True,
    ) -> None:
        self.rows, self.width, self.tokens = batch.rows, batch.width, batch.real_tokens
        self.rounded = rounded  # rows of the packed stream (the real tokens, then zero rows)
        self.uniform = batch.uniform
        self.dtype = dtype
        self.slots: torch.Tensor | None = None
        self.mask: torch.Tensor | None = None
        # the C++ op, where built: it takes the packed rows and the sequences' offsets
        self.kernel = kernel
        self.amx = amx  # bfloat16 on the AMX tile unit, where the build has it
        self.offsets = torch.from_numpy(batch.offsets) if kernel is not None else None
        if kernel is None and not self.uniform:
            self.slots = torch.from_numpy(batch.slots).to(device)
            lengths = torch.tensor(batch.lengths, device=device)
            keys = torch.arange(self.width, device=device)
            # [rows, 1, 1, width]: True where the key is a real token of that row
            self.mask = (keys[None, :] < lengths[:, None])[:, None, None, :]

    def __call__(self, qkv: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
        hidden = heads * head_dim
        qkv = qkv[: self.tokens]
        if self.kernel is not None:
            out: torch.Tensor = self.kernel.packed_attention(
                qkv, self.offsets, heads, head_dim**-0.5, self.amx
            )
            return (
                out
                if self.rounded == self.tokens
                else F.pad(out, (0, 0, 0, self.rounded - self.tokens))
            )
        if self.uniform:
            rows = qkv.view(self.rows, self.width, 3, heads, head_dim)
        else:
            assert self.slots is not None
            grid = qkv.new_zeros(self.rows * self.width, 3 * hidden)
            grid[self.slots] = qkv
            rows = grid.view(self.rows, self.width, 3, heads, head_dim)
        q, k, v = rows.permute(2, 0, 3, 1, 4).unbind(0)  # each [rows, heads, width, head_dim]
        ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask)
        ctx = ctx.transpose(1, 2).reshape(self.rows * self.width, hidden)
        out = ctx if self.slots is None else ctx[self.slots]
        return (
            out
            if self.rounded == self.tokens
            else F.pad(out, (0, 0, 0, self.rounded - out.shape[0]))
        )
