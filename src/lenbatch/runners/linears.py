"""Linear layers with their weights laid out once, at load, for the CPU's matrix kernels.

`F.linear` hands oneDNN a plain row-major weight, which it re-lays out into its blocked format
on every call; for the packed encoder's small-to-medium row counts that costs as much as the
product itself. `torch.ops.mkldnn._reorder_linear_weight` does it once, and
`torch.ops.mkldnn._linear_pointwise` runs the product on the blocked weight (what
`torch.compile` with freezing emits on CPU), optionally with the activation fused in (GELU for
BERT's feed-forward). Measured on an AMD EPYC family 25 model 17 (Zen 4, AVX512-BF16), one
thread, alternated A/B on a shared 2-core machine, MiniLM's four shapes: bfloat16 1.09-2.0x
faster than `F.linear` from 1 to 3000 rows (the most at few rows), float32 1.12-1.5x.

`linear_kind()` says which implementation a device gets: `prepacked` where torch has oneDNN
and the op, with a self-check at first use against `F.linear`; else `plain` (`F.linear`), so a
build without oneDNN, a GPU or another CPU architecture falls back cleanly. In float32 it also
times both once per process (`_prepacked_wins`, ~0.3 s) and takes `plain` where that is at
least 1.1x faster: on an AMD EPYC family 25 model 1 (Zen 3, AVX2, no AVX-512), one thread,
MiniLM's four shapes, `F.linear` (then GELU) ran 1.05-1.42x faster than the prepacked product
from 16 to 6,144 rows (90 against 64 GFLOP/s at 3,000). `LENBATCH_LINEARS=plain` or
`=prepacked` forces one (for comparisons).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from functools import cache
from typing import Any, Literal

import torch
import torch.nn.functional as F

__all__ = ["Linear", "fused_ops", "linear_kind", "rounded_tokens"]

log = logging.getLogger("lenbatch.runner")

Activation = Literal["none", "gelu"]


# torch's own oneDNN ops (what inductor emits for frozen CPU linears): private by name only,
# looked up once; None where this torch lacks them.
_MKLDNN = getattr(torch.ops, "mkldnn", None)
_reorder = getattr(_MKLDNN, "_reorder_linear_weight", None)
_pointwise = getattr(_MKLDNN, "_linear_pointwise", None)


def _ops_present() -> bool:
    return _reorder is not None and _pointwise is not None and torch.backends.mkldnn.is_available()


@cache
def _self_check(dtype: torch.dtype) -> tuple[bool, str]:
    """Does the prepacked product match `F.linear` here (with and without GELU)?"""
    try:
        assert _reorder is not None and _pointwise is not None
        gen = torch.Generator().manual_seed(0)
        w = torch.randn(48, 32, generator=gen).to(dtype)
        b = torch.randn(48, generator=gen).to(dtype)
        x = torch.randn(5, 32, generator=gen).to(dtype)
        packed = _reorder(w, None)
        with torch.inference_mode():
            got = _pointwise(x, packed, b, "none", [], "")
            fused = _pointwise(x, packed, b, "gelu", [], "none")
            ref = F.linear(x, w, b)
        tol = 1e-4 if dtype == torch.float32 else 3e-2
        scale = float(ref.abs().max())
        if float((got - ref).float().abs().max()) > tol * scale:
            return False, "the prepacked product disagrees with F.linear"
        if float((fused - F.gelu(ref)).float().abs().max()) > tol * scale:
            return False, "the prepacked product with GELU disagrees with F.linear + GELU"
    except (RuntimeError, NotImplementedError) as exc:
        return False, f"the prepacked product failed ({type(exc).__name__})"
    return True, "oneDNN prepacked weights"


def linear_kind(device: torch.device, dtype: torch.dtype, timed: bool = True) -> tuple[str, str]:
    """(`prepacked` or `plain`, why) for matrix products in `dtype` on `device`; without
    `timed`, `prepacked` wherever it works (for a caller that times its own shapes)."""
    forced = os.environ.get("LENBATCH_LINEARS", "").lower()
    if forced == "plain":
        return "plain", "LENBATCH_LINEARS=plain"
    if device.type != "cpu":
        return "plain", f"device {device.type}"
    if dtype not in (torch.float32, torch.bfloat16):
        return "plain", f"dtype {dtype}"
    if not _ops_present():
        return "plain", "this torch has no oneDNN linear ops"
    ok, why = _self_check(dtype)
    if ok and timed and dtype == torch.float32 and forced != "prepacked":
        ok, why = _prepacked_wins(_time_products)
    return ("prepacked" if ok else "plain"), why


# `plain` is taken only where it is at least this much faster (a margin over timing noise, so
# that the choice does not flip between starts on the same processor).
PLAIN_MARGIN = 1.1


@cache
def _time_products() -> tuple[float, float]:
    """Seconds for one float32 product pair (1,024 rows, 384 -> 1,536 with GELU, then back),
    prepacked and plain: the best of 3 alternated rounds on this process's torch threads."""
    gen = torch.Generator().manual_seed(0)
    shapes = ((1536, 384, "gelu"), (384, 1536, "none"))
    pairs = []
    for kind in ("prepacked", "plain"):
        pairs.append([
            (Linear(0.05 * torch.randn(o, i, generator=gen), torch.zeros(o), torch.float32,
                    kind, act), torch.randn(1024, i, generator=gen))  # type: ignore[arg-type]
            for o, i, act in shapes
        ])  # fmt: skip
    best = [float("inf"), float("inf")]
    with torch.inference_mode():
        for _ in range(4):  # the first round warms each kind's kernels, then counts too
            for k, pair in enumerate(pairs):
                t0 = time.perf_counter()
                for lin, x in pair:
                    lin(x)
                best[k] = min(best[k], time.perf_counter() - t0)
    return best[0], best[1]


def _prepacked_wins(timings: Callable[[], tuple[float, float]]) -> tuple[bool, str]:
    """Whether the prepacked float32 product is kept here, from `timings()` (prepacked and
    plain seconds), and why, with the figures."""
    packed, plain = timings()
    ratio = packed / plain
    if ratio >= PLAIN_MARGIN:
        return False, f"F.linear timed {ratio:.2f}x faster than oneDNN prepacked weights here"
    return True, f"oneDNN prepacked weights (timed {1 / ratio:.2f}x F.linear's speed here)"


class Linear:
    """`act(x @ weight.T + bias)` in `dtype`, the weight prepacked where `kind` says so."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
        kind: str = "plain",
        activation: Activation = "none",
    ) -> None:
        self.dtype = dtype
        self.kind = kind
        self.activation = activation
        w = weight.detach().to(dtype).contiguous()
        self.bias = None if bias is None else bias.detach().to(dtype).contiguous()
        self.out_features, self.in_features = int(w.shape[0]), int(w.shape[1])
        if kind == "prepacked":
            assert _reorder is not None
            self.weight = _reorder(w, None)
        else:
            self.weight = w

    @property
    def nbytes(self) -> int:
        """Bytes the weight and bias hold (the prepacked weight is the same size)."""
        size = torch.empty((), dtype=self.dtype).element_size()
        n = self.out_features * self.in_features + (0 if self.bias is None else self.out_features)
        return n * size

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.dtype)
        if self.kind == "prepacked":
            assert _pointwise is not None
            if self.activation == "gelu":
                fused: torch.Tensor = _pointwise(x, self.weight, self.bias, "gelu", [], "none")
                return fused
            plain: torch.Tensor = _pointwise(x, self.weight, self.bias, "none", [], "")
            return plain
        if self.activation == "gelu" and x.dim() == 2 and self.dtype == torch.float32:
            ops = fused_ops()
            if ops is not None:  # bias and exact GELU in one pass over the product
                y = torch.mm(x, self.weight.t())
                ops.scale_rows(y, _ones(y.shape[0]), self.bias, True)
                return y
        out = F.linear(x, self.weight, self.bias)
        return F.gelu(out) if self.activation == "gelu" else out


def fused_ops() -> Any | None:
    """lenbatch's C++ ops where built with their row passes (`quantize_rows`, `scale_rows`;
    `runners.decode_attention`), else None."""
    from lenbatch.runners.decode_attention import decode_attention_op

    op = decode_attention_op()
    return op if op is not None and hasattr(op, "quantize_rows") else None


@cache
def _ones(rows: int) -> torch.Tensor:
    """A float32 vector of `rows` ones (`scale_rows`'s row scales when there are none)."""
    return torch.ones(rows)


def rounded_tokens(tokens: int) -> int:
    """`tokens` rounded up to one of 16 steps per power of two (at least 8): the row count
    that a stream of tokens' matrix products see (the packed encoder's, the lean Llama
    forward's). Why: every distinct row count is a new oneDNN kernel in its per-shape cache,
    built on first use (a 500-token prompt's forward took 36 ms longer with a row count not
    seen before), and a trace's batches have thousands of distinct token counts (resident
    memory grew with them); rounded, there are a few hundred, for at most 1/16 more rows."""
    step = max(8, 1 << max(0, tokens.bit_length() - 5))
    return -(-tokens // step) * step
