"""Int8 matrix products for encoders (`--quantize int8`): int8 weights and activations.

Each product `x @ W.T + b` runs on torch's oneDNN int8 kernel (`onednn::qlinear_prepack`,
`onednn::qlinear_pointwise`, what torch's x86 quantization flow emits), with

* **weights** quantized once per output channel, symmetric, to 7 bits (-63..63);
* **activations** quantized per row (a token), symmetric, to 8 bits: each row is divided by its
  own scale (`max |x| / 127`) and shifted to uint8 around 128. Why per row: a packed batch mixes
  many requests, and the per-tensor scale of torch's dynamic quantization makes one text's
  vector depend on its batchmates and costs accuracy (MiniLM on 388 real texts against
  sentence-transformers float32: min cosine 0.962 per tensor, 0.993 per row);
* the output multiplied back by each row's scale, plus the bias, in float32, and GELU (exact)
  where the layer has it;
* one product left in float32: the first layer's feed-forward output (`FLOAT32_PRODUCTS`).

Why 7-bit weights: a CPU without VNNI (AVX2: a Zen 3) multiplies uint8 by int8 with
`vpmaddubsw`, which adds two products into a saturating 16-bit sum. With full 8-bit operands
oneDNN's product was wrong by up to 22 % of its range on random inputs (AMD EPYC family 25
model 1); 255 x 63 x 2 = 32,130 always fits. With VNNI it is merely one bit of weight
precision (MiniLM, min cosine 0.9935 against 0.9939 with 8-bit weights). `int8_kind` checks the
product against exact integer arithmetic at those extremes before any model uses it.

Quantizing, and scaling with the bias and GELU, run in one pass each where lenbatch's C++ ops
are built (`quantize_rows`, `scale_rows` in `decode_attention.cpp`; its GELU's erf is a
polynomial within 1.5e-7), else in torch ops (the same arithmetic, slower). Everything else
(embeddings, LayerNorm, attention, pooling) stays float32.
"""

from __future__ import annotations

import logging
from functools import cache
from typing import Literal

import torch
import torch.nn.functional as F

from lenbatch.runners.linears import fused_ops

__all__ = [
    "ACT_LEVELS",
    "FLOAT32_PRODUCTS",
    "WEIGHT_LEVELS",
    "Int8Linear",
    "int8_kind",
    "quantize_linears",
]

log = logging.getLogger("lenbatch.runner")

ACT_LEVELS = 127  # activations: round(x / s) in -127..127, stored as uint8 around 128
WEIGHT_LEVELS = 63  # weights: -63..63 per output channel (see the module docstring)

_ONEDNN = getattr(torch.ops, "onednn", None)
_prepack = getattr(_ONEDNN, "qlinear_prepack", None)
_product = getattr(_ONEDNN, "qlinear_pointwise", None)


def _quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 weight, float32 scale per output channel) of float32 `w` [out, in]."""
    scale = w.abs().amax(dim=1).clamp_min(1e-12) / WEIGHT_LEVELS
    q = torch.round(w / scale[:, None]).clamp_(-WEIGHT_LEVELS, WEIGHT_LEVELS).to(torch.int8)
    return q, scale.float()


def _rows_in_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_rows` in torch ops: (uint8 rows, scale per row)."""
    s = x.abs().amax(dim=1) / ACT_LEVELS
    s = torch.where(s > 0, s, torch.ones_like(s))
    q = torch.round(x / s[:, None]).add_(ACT_LEVELS + 1).to(torch.uint8)
    return q, s


@cache
def int8_kind() -> tuple[bool, str]:
    """(available, why): whether this torch has oneDNN's int8 product and it computes the
    extremes this module feeds it exactly (uint8 0..255 around 128 times int8 -63..63)."""
    if _prepack is None or _product is None or not torch.backends.mkldnn.is_available():
        return False, "this torch has no oneDNN int8 linear ops"
    try:
        k, n = 256, 32
        gen = torch.Generator().manual_seed(0)
        w = torch.randint(-WEIGHT_LEVELS, WEIGHT_LEVELS + 1, (n, k), generator=gen)
        w[0] = WEIGHT_LEVELS  # the saturation case: every pair at its largest
        w[1] = -WEIGHT_LEVELS
        x = torch.randint(0, 2 * ACT_LEVELS + 2, (8, k), generator=gen)
        x[0] = 2 * ACT_LEVELS + 1
        x[1] = 0
        packed = _prepack(w.to(torch.int8), None)
        ones = torch.ones(n)
        got = _product(x.to(torch.uint8), 1.0, ACT_LEVELS + 1, packed, ones,
                       torch.zeros(n, dtype=torch.long), None, 1.0, 0, torch.float32,
                       "none", [], "")  # fmt: skip
        ref = (x.double() - (ACT_LEVELS + 1)) @ w.double().T
        if not torch.equal(got.double(), ref):
            return False, "oneDNN's int8 product is not exact here (saturating sums?)"
    except (RuntimeError, NotImplementedError) as exc:
        return False, f"oneDNN's int8 product failed ({type(exc).__name__})"
    return True, "oneDNN int8 products, weights per channel, activations per token"


class Int8Linear:
    """`act(x @ weight.T + bias)` with int8 weights and per-row int8 activations (module
    docstring); float32 in, float32 out. Same call as `runners.linears.Linear`."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        activation: Literal["none", "gelu"] = "none",
    ) -> None:
        ok, why = int8_kind()
        if not ok:
            raise ValueError(f"quantization int8 is not available here: {why}")
        assert _prepack is not None
        w = weight.detach().float()
        self.out_features, self.in_features = int(w.shape[0]), int(w.shape[1])
        q, self.scale = _quantize_weight(w)
        self.weight = _prepack(q, None)
        self.zeros = torch.zeros(self.out_features, dtype=torch.long)
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.activation = activation
        self.ops = fused_ops()

    @property
    def nbytes(self) -> int:
        """Bytes the weight (one byte each), its scales and the bias hold."""
        return self.out_features * (self.in_features + 4) + (
            0 if self.bias is None else 4 * self.out_features
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        assert _product is not None
        x = x.float().contiguous()
        shape = x.shape
        x = x.reshape(-1, self.in_features)
        ops = self.ops
        q, s = ops.quantize_rows(x, ACT_LEVELS) if ops is not None else _rows_in_torch(x)
        y = _product(q, 1.0, ACT_LEVELS + 1, self.weight, self.scale, self.zeros, None, 1.0, 0,
                     torch.float32, "none", [], "")  # fmt: skip
        gelu = self.activation == "gelu"
        if ops is not None:
            ops.scale_rows(y, s, self.bias, gelu)
            gelu = False
        else:
            y.mul_(s[:, None])
            if self.bias is not None:
                y.add_(self.bias)
        if gelu:
            y = F.gelu(y)
        out: torch.Tensor = y.reshape(*shape[:-1], self.out_features)
        return out


class _Int8Module(torch.nn.Module):
    """An `nn.Linear`'s place in a Hugging Face model, computing through `Int8Linear`."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.int8 = Int8Linear(linear.weight, linear.bias)
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.int8(x)


# The one product a BERT-family encoder keeps in float32 under int8: the first layer's
# feed-forward output (`encoder.layer[0].output.dense`). Its input carries the activation
# outliers that one scale per token cannot hold: on 800 real paragraphs MiniLM's worst text
# had cosine 0.9817 against sentence-transformers float32 with it in int8, 0.9957 without
# (every other single product kept in float32 left it at 0.980-0.985). AMD EPYC family 25
# model 1; it costs about a twentieth of the products' int8 gain.
FLOAT32_PRODUCTS = ("0.output.dense",)


def quantize_linears(module: torch.nn.Module, keep: tuple[str, ...] = (), prefix: str = "") -> int:
    """Replace every `nn.Linear` inside `module` by its int8 form, in place, but those whose
    dotted name under `module` is in `keep`; returns the bytes the int8 weights hold."""
    nbytes = 0
    for name, child in list(module.named_children()):
        path = f"{prefix}{name}"
        if isinstance(child, torch.nn.Linear):
            if path in keep:
                continue
            int8 = _Int8Module(child)
            setattr(module, name, int8)
            nbytes += int8.int8.nbytes
        else:
            nbytes += quantize_linears(child, keep, f"{path}.")
    return nbytes
