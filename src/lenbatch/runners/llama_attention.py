"""Attention for the lean Llama path (`runners.llama`), one segment of a forward at a time.

A forward pass carries several segments (the running batch's decode step, prompt chunks of
queued jobs), each with its own cache. Its matrix products run once over every segment's
tokens together; what this module does runs per segment, in each layer: RoPE, the cache update,
attention. `LlamaAttention.plan` looks at a segment once per forward and says how it runs
(`SegmentPlan`); `LlamaAttention.run` then takes that layer's fused Q/K/V rows of the segment
and returns its attention output.

A prompt chunk of a job whose rows are left-padded to one width leaves its padding out of the
forward's token stream (`SegmentPlan.keep`): the products, norms and the MLP see only real
tokens. Its rows are put back in place (zeros where the padding was) for the cache and for
the attentions that read a padded layout; a first chunk with nothing cached before it runs as
each prompt's own causal attention straight from the stream's rows where the AVX2 build's
`packed_attention` takes it (float32; each prompt up to `AVX2_PROMPT_MAX` tokens).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from lenbatch.runners.base import Segment

__all__ = ["AVX2_PROMPT_MAX", "PADDING_ENV", "LlamaAttention", "SegmentPlan", "attention_mask"]

# `keep` runs a job's padding through the products as a padded layout, the way it ran before
# padding was left out (A/B runs: bench/llm_padded_prefill.py).
PADDING_ENV = "LENBATCH_PREFILL_PADDING"

# Longest prompt the AVX2 loop takes: it reads a head's values once per pair of queries, which
# stays in L2 to ~600 tokens; torch's flash attention, tiled over keys, wins beyond. SmolLM2's
# shapes on an AMD EPYC family 25 model 1, 2 threads, per layer: 1.29-2.4x torch's up to 512
# tokens, 1.17x at 640, 0.96x at 768, 0.85x at 1024 (bench/prompt_attention.py).
AVX2_PROMPT_MAX = 640


def attention_mask(mask: torch.Tensor, new: int) -> torch.Tensor:
    """Boolean `[rows, 1, new, width]` mask (True = attend) from the 2-D padding mask
    `[rows, width]` whose last `new` columns are the queries: causal over the new columns,
    padding excluded; each query sees at least its own column (a padding query's output is
    unused, but a fully masked row would make attention NaN)."""
    real = mask.bool()
    if new == 1:
        return real[:, None, None, :]
    width = real.shape[1]
    past = width - new
    q = torch.arange(new, device=mask.device)[:, None] + past
    k = torch.arange(width, device=mask.device)[None, :]
    causal = k <= q
    allowed = causal[None] & real[:, None, :]
    allowed |= (k == q)[None]
    return allowed[:, None]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


@dataclass
class SegmentPlan:
    """How one segment of a forward runs its attention, worked out once for all layers."""

    rows: int
    new: int  # new columns a row
    tokens: int  # its tokens in the forward's stream (its padding left out)
    # Where those tokens sit among the segment's `rows x new` (row-major), when some of its
    # new columns are padding; None: every one is real.
    keep: torch.Tensor | None
    row_tokens: torch.Tensor | None  # with `keep`: each row's real tokens
    cos: torch.Tensor  # RoPE tables: `[rows, new, dim]`, or `[1, tokens, dim]` with `offsets`
    sin: torch.Tensor
    mask: torch.Tensor | None  # boolean attention mask; None: a whole unpadded prompt
    first: torch.Tensor | None  # each row's first real column (`chunk_attention`), or None
    # Each prompt's first row in the stream, and the end: its causal attention runs straight
    # from the stream's rows (`packed_attention`); None: from the padded layout.
    offsets: torch.Tensor | None

    def last_rows(self, offset: int) -> torch.Tensor:
        """Each row's last token in the forward's stream (the segment starts at `offset`). A
        row with no real token in this chunk gets the segment's first: its logits are never
        read (only a job's last chunk samples, and there every row ends in a real token)."""
        if self.row_tokens is None:
            return torch.arange(self.rows) * self.new + (offset + self.new - 1)
        return (self.row_tokens.cumsum(0) + (offset - 1)).clamp(min=offset)


class LlamaAttention:
    """RoPE, the cache update and attention of one segment in one layer (module doc).

    `tiles`: a whole bfloat16 prompt's causal attention on AMX tiles, and a job's padded rows'
    through `chunk_attention`; `prompt_op`: a whole prompt's through the C++ op's
    `packed_attention` (AMX, or the AVX2 build in float32). The op itself is passed to each
    call (`LeanLlama.kernel`, which a benchmark or test may wrap)."""

    def __init__(
        self,
        *,
        heads: int,
        kv_heads: int,
        head_dim: int,
        cos: torch.Tensor,
        sin: torch.Tensor,
        tiles: bool,
        prompt_op: bool,
    ) -> None:
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.scale = head_dim**-0.5
        self.cos, self.sin = cos, sin
        self.tiles, self.prompt_op = tiles, prompt_op
        self.skip_padding = os.environ.get(PADDING_ENV, "skip").strip().lower() != "keep"

    def plan(self, seg: Segment, kernel: Any | None) -> SegmentPlan:
        """How `seg` runs its attention in every layer of this forward."""
        rows, new = (int(n) for n in seg.input_ids.shape)
        keep = row_tokens = offsets = None
        if new > 1 and self.skip_padding:  # a decode step's one new column is always real
            real = seg.mask[:, -new:].bool()
            count = int(real.sum())
            if 0 < count < rows * new:
                keep = real.reshape(-1).nonzero().squeeze(1)
                row_tokens = real.sum(1)
                offsets = self._packed_offsets(seg, row_tokens, kernel)
        mask = self._prefill_mask(seg)
        if offsets is not None:
            assert keep is not None
            positions = seg.positions.reshape(-1)[keep][None]
        else:
            positions = seg.positions
        tiles = self.tiles and kernel is not None
        return SegmentPlan(
            rows=rows,
            new=new,
            tokens=rows * new if keep is None else int(keep.numel()),
            keep=keep,
            row_tokens=row_tokens,
            cos=self.cos[positions],
            sin=self.sin[positions],
            mask=mask,
            first=self._first_columns(seg) if tiles and mask is not None else None,
            offsets=offsets,
        )

    def _packed_offsets(
        self, seg: Segment, row_tokens: torch.Tensor, kernel: Any | None
    ) -> torch.Tensor | None:
        """For a left-padded job's first chunk (nothing cached before it) that the AVX2 build's
        causal loop takes: each prompt's first row among the chunk's real tokens, and the end
        (rows with no token in the chunk left out); else None."""
        new = int(seg.input_ids.shape[1])
        if kernel is None or not self.prompt_op or self.tiles or int(seg.mask.shape[1]) != new:
            return None
        lengths = row_tokens[row_tokens > 0]
        if int(lengths.max()) > AVX2_PROMPT_MAX:
            return None
        return F.pad(lengths.cumsum(0), (1, 0))

    def _prefill_mask(self, seg: Segment) -> torch.Tensor | None:
        """The segment's boolean attention mask, or None for a whole unpadded prompt (no
        cached columns before it, no padding): then attention is plain causal, which torch's
        flash attention runs without a mask, skipping the blocks above the diagonal (a
        500-token prompt's attention took 0.86 instead of 1.09 ms per layer, and no mask
        conversion)."""
        new = int(seg.input_ids.shape[1])
        if new > 1 and int(seg.mask.shape[1]) == new and bool(seg.mask.all()):
            return None
        return attention_mask(seg.mask, new)

    @staticmethod
    def _first_columns(seg: Segment) -> torch.Tensor | None:
        """For a prompt chunk (several new columns) whose rows' real columns each run
        unbroken to the end (left padding only, as a prefill job's rows lie): each row's first
        real column, which `chunk_attention` takes. None for a decode step, or for a mask
        with holes."""
        new, width = int(seg.input_ids.shape[1]), int(seg.mask.shape[1])
        if new == 1:
            return None
        real = seg.mask.bool()
        starts = width - real.sum(dim=1)
        cols = torch.arange(width, device=real.device)
        if not torch.equal(real, cols[None, :] >= starts[:, None]):
            return None
        return starts

    def run(
        self, plan: SegmentPlan, qkv: torch.Tensor, cache: Any, layer: int, kernel: Any | None
    ) -> torch.Tensor:
        """The segment's attention output `[plan.tokens, heads x dim]` in layer `layer`, from
        its fused Q/K/V rows `qkv` `[plan.tokens, (heads + 2 kv_heads) x dim]` (contiguous,
        rotated in place where the op is built); its new keys and values go into `cache`."""
        nh, nkv, hd = self.heads, self.kv_heads, self.head_dim
        if plan.offsets is not None and plan.keep is not None and kernel is not None:
            # each prompt's real tokens, straight from the stream; the cache keeps its padded
            # layout (zeros where the padding was: no query reads them)
            kernel.rope(qkv.view(1, plan.tokens, nh + 2 * nkv, hd), plan.cos, plan.sin, nh + nkv)
            kv = qkv.new_zeros(plan.rows * plan.new, 2 * nkv * hd)
            kv.index_copy_(0, plan.keep, qkv[:, nh * hd :])
            kv4 = kv.view(plan.rows, plan.new, 2 * nkv, hd).transpose(1, 2)
            cache.update(kv4[:, :nkv], kv4[:, nkv:], layer)
            out: torch.Tensor = kernel.packed_attention(
                qkv, plan.offsets, nh, self.scale, True, nkv, True
            )
            return out
        if plan.keep is None:
            return self._padded(plan, qkv, cache, layer, kernel)
        full = qkv.new_zeros(plan.rows * plan.new, qkv.shape[1])
        full.index_copy_(0, plan.keep, qkv)
        return self._padded(plan, full, cache, layer, kernel).index_select(0, plan.keep)

    def _padded(
        self, plan: SegmentPlan, qkv: torch.Tensor, cache: Any, layer: int, kernel: Any | None
    ) -> torch.Tensor:
        """`run` over every one of the segment's `rows x new` positions (`qkv` in that
        layout, padding included)."""
        nh, nkv, hd = self.heads, self.kv_heads, self.head_dim
        rows, new = plan.rows, plan.new
        x = qkv.view(rows, new, nh + 2 * nkv, hd)
        if kernel is not None:  # queries and keys rotated in place, one pass
            kernel.rope(x, plan.cos, plan.sin, nh + nkv)
            t = x.transpose(1, 2)
            q, k = t[:, :nh], t[:, nh : nh + nkv]
        else:
            t = x.transpose(1, 2)
            cos, sin = plan.cos[:, None], plan.sin[:, None]
            q, k = _rotate(t[:, :nh], cos, sin), _rotate(t[:, nh : nh + nkv], cos, sin)
        keys, values = cache.update(k, t[:, nh + nkv :], layer)
        if (
            plan.mask is None
            and kernel is not None
            and self.prompt_op
            and (self.tiles or new <= AVX2_PROMPT_MAX)
        ):
            # whole prompts: straight from their rows (rotated in place above)
            starts = torch.arange(0, rows * new + 1, new, dtype=torch.long)
            out: torch.Tensor = kernel.packed_attention(
                qkv, starts, nh, self.scale, True, nkv, True
            )
            return out
        if plan.first is not None and kernel is not None:
            # each row over its real columns; the padding's output is zero
            out = kernel.chunk_attention(qkv, keys, values, plan.first, nh, self.scale)
            return out
        a = self.attend(q, keys, values, plan.mask, kernel).transpose(1, 2)
        return a.reshape(rows * new, nh * hd)

    def attend(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        mask: torch.Tensor | None,
        kernel: Any | None,
    ) -> torch.Tensor:
        """Attention of `q` `[rows, heads, new, dim]` over the cached `keys`/`values`.

        A decode step (one query per row) puts the query heads that share a key/value head
        side by side as that head's queries, `[rows, kv_heads, group, dim]`: one product per
        key/value head, each key read once. Torch's CPU attention with `enable_gqa` runs one
        query at a time per head instead, which in bfloat16 took 10 ms against 1.5 ms per
        layer for 32 rows x 311 columns (AMD EPYC Zen 4, 1 thread, shared machine). Where the
        decode-attention op is built, a decode step runs it instead: the same grouping, over
        each row's real columns only.
        """
        rows, nh, new, hd = q.shape
        nkv = self.kv_heads
        if mask is None:  # a whole unpadded prompt: causal, no mask
            return F.scaled_dot_product_attention(
                q, keys, values, is_causal=True, scale=self.scale, enable_gqa=nh != nkv
            )
        if new == 1 and kernel is not None:
            flat = q.reshape(rows, nh, hd).contiguous()
            out: torch.Tensor = kernel.decode_attention(
                flat, keys, values, mask[:, 0, 0, :], self.scale
            )
            return out.view(rows, nh, 1, hd)
        if new == 1 and nh != nkv:
            grouped = q.view(rows, nkv, nh // nkv, hd)
            out = F.scaled_dot_product_attention(
                grouped, keys, values, attn_mask=mask, scale=self.scale
            )
            return out.view(rows, nh, 1, hd)
        return F.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask, scale=self.scale, enable_gqa=nh != nkv
        )
