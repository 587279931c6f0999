"""The model's cost as a function of batch shape: what `profile` writes and `simulate` reads.

    latency_s(B, L) = const + per_row*B + per_token*B*L + per_token_sq*B*L^2
    memory_bytes(B, L) = weights + act_const + act_per_token*B*L + act_per_token_sq*B*L^2

B is the batch size and L the padded length: on this hardware cost follows *padded* tokens,
which is why padding is the thing to remove. Stored as JSON.

A profile times the model alone. A live server adds work around it, which `lenbatch calibrate`
measures from a bench run and stores in more fields (all neutral in a plain profile):
`batch_scale` and `batch_overhead_s` (a live server's batch takes `batch_scale` times the
model's compute plus `batch_overhead_s`: collation, the worker-thread hand-off, pooling,
fan-out, and a model slower in a server than profiled back to back; scale 1 in a profile),
`request_overhead_s` (per request, outside the queue: HTTP, tokenization, JSON), and
`cpu_per_request_s` on `cpu_cores` cores: CPU time each request costs outside the model on the
same machine (the server's event loop, and a load driver if it shares the machine), which
slows the model by `cores / (cores - rate * cpu_per_request_s)` at a given request rate. The
simulator applies all three; `latency()` stays the model's compute. `batch_spread` is how much
one live batch's time varies around that prediction (quantiles of live / predicted, mean 1,
measured by `calibrate` on requests that ran alone); the simulator draws each batch's time from
it, so its tails are a live server's (empty: every batch takes exactly the predicted time).

A cost model is only true for what it was measured with (the project's machine changes
between runs): `processor` holds `runners.hardware.processor_key()` of that machine (vendor,
family, model number, ISA flags, threads), `dtype`, `quantization`, `execution` and `work` the
rest; `cost_key()` says it as a `core.costkey.CostKey`, and `processor_mismatch` says when the
processor is not the one at hand. Files written before a field existed load with its default
(`processor` ""; `quantization` none and `work` encoder_batch, which is what they measured).
`seconds()` makes a cost model a `core.costkey.BatchCost`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lenbatch.core.costkey import CostKey, WorkKind, processor_difference
from lenbatch.core.occupancy import cpu_slowdown

__all__ = ["CostModel", "processor_mismatch"]


@dataclass(frozen=True)
class CostModel:
    """Latency and memory of one batch of `B` rows padded to `L` tokens."""

    const: float
    per_row: float = 0.0
    per_token: float = 0.0
    per_token_sq: float = 0.0
    weights_bytes: float = 0.0
    act_const: float = 0.0
    act_per_token: float = 0.0
    act_per_token_sq: float = 0.0
    model: str = ""
    device: str = "cpu"
    fit_error: float = math.nan  # relative RMS error of the latency fit on its own points
    memory_fit_error: float = math.nan  # RMS error of the memory fit / mean measured activation
    memory_method: str = ""  # how activation memory was measured (CUDA allocator, CPU RSS)
    batch_overhead_s: float = 0.0  # a live server's extra seconds per batch (calibrated)
    batch_scale: float = 1.0  # a live server's batch time over the model's (calibrated)
    request_overhead_s: float = 0.0  # a live server's extra seconds per request (calibrated)
    cpu_per_request_s: float = 0.0  # CPU seconds per request outside the model (calibrated)
    cpu_cores: int = 1  # cores that work and the model share
    calibration: str = ""  # where the overheads were measured, if they were
    # quantiles of a live batch's time over the predicted one at probabilities 0, 1/(n-1), ...,
    # 1, mean 1 (calibrated; empty: no spread)
    batch_spread: list[float] = field(default_factory=list)
    processor: str = ""  # `runners.hardware.processor_key()` where measured ("" in old files)
    dtype: str = ""  # the float type the model ran in (float32, bfloat16)
    execution: str = ""  # padded or packed
    quantization: str = "none"  # weight quantization: none, int8, int4
    work: str = WorkKind.ENCODER_BATCH.value  # the `WorkKind` measured
    points: list[dict[str, float]] = field(default_factory=list)  # measured grid, for reports

    def latency(self, batch: float, padded_len: float) -> float:
        """Predicted seconds to run `batch` rows padded to `padded_len` tokens (fractional
        values give the mean over batches of those mean sizes)."""
        bl = batch * padded_len
        return self._terms(batch, bl, bl * padded_len)

    def _terms(self, rows: float, tokens: float, squares: float) -> float:
        """The latency fit over `rows` rows holding `tokens` tokens whose squares sum to
        `squares` (rows of one length: B, B*L, B*L^2)."""
        return (
            self.const + self.per_row * rows + self.per_token * tokens + self.per_token_sq * squares
        )

    def batch_seconds(self, batch: int, padded_len: int) -> float:
        """Seconds a live server's runner is busy with one batch: the model's compute times
        the calibrated scale, plus the calibrated per-batch overhead."""
        return self.seconds(batch, padded_len)

    def seconds(self, batch: float, padded_len: float) -> float:
        """`batch_seconds` for fractional shapes (the mean over batches of those mean sizes):
        the `core.costkey.BatchCost` protocol."""
        return self.batch_scale * self.latency(batch, padded_len) + self.batch_overhead_s

    def packed_seconds(self, lengths: Sequence[int]) -> float:
        """`batch_seconds` of a packed batch whose rows hold `lengths` real tokens: the
        model's terms over the tokens it computes (`per_token` times their sum, `per_token_sq`
        times the sum of their squares, what rows of one length each measured) rather than
        over every row padded to the longest."""
        latency = self._terms(len(lengths), sum(lengths), sum(n * n for n in lengths))
        return self.batch_scale * latency + self.batch_overhead_s

    def cost_key(self, model: str | None = None) -> CostKey:
        """What this cost model describes, as a `CostKey`; `model`: the served name (default:
        the model name it was measured under)."""
        return CostKey(
            model=self.model if model is None else model,
            work=WorkKind(self.work),
            processor=self.processor,
            dtype=self.dtype,
            quantization=self.quantization,
        )

    def spread_factor(self, u: float) -> float:
        """The factor on a batch's predicted time at quantile `u` in [0, 1] of `batch_spread`
        (linear between its points): a simulator draws `u` uniformly; 1.0 without a spread."""
        q = self.batch_spread
        if len(q) < 2:
            return q[0] if q else 1.0
        pos = min(max(u, 0.0), 1.0) * (len(q) - 1)
        i = min(int(pos), len(q) - 2)
        return q[i] + (pos - i) * (q[i + 1] - q[i])

    def slowdown(self, request_rate: float) -> float:
        """How much slower batches run while requests arrive at `request_rate` per second,
        because their CPU work outside the model takes a share of the cores (1.0 when not
        calibrated; capped at 10x where that work would need every core)."""
        return cpu_slowdown(request_rate, self.cpu_per_request_s, self.cpu_cores)

    def activation_bytes(self, batch: int, padded_len: int) -> float:
        """Predicted activation memory of one batch (excluding weights)."""
        bl = batch * padded_len
        return max(
            0.0, self.act_const + self.act_per_token * bl + self.act_per_token_sq * bl * padded_len
        )

    def memory(self, batch: int, padded_len: int) -> float:
        """Predicted peak bytes while running one batch: weights + activations."""
        return self.weights_bytes + self.activation_bytes(batch, padded_len)

    def max_batch(self, padded_len: int, budget_bytes: float, cap: int = 1024) -> int:
        """Largest batch of `padded_len` tokens whose predicted memory fits `budget_bytes`
        (0 if not even one row fits)."""
        best = 0
        for b in range(1, cap + 1):
            if self.memory(b, padded_len) > budget_bytes:
                break
            best = b
        return best

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CostModel:
        """Build from `to_json()` output (unknown keys are an error)."""
        return cls(**data)

    def save(self, path: str | Path) -> None:
        """Write as JSON."""
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n", encoding="utf-8")

    @classmethod
    def load(cls, path: str | Path) -> CostModel:
        """Read a cost model written by `save` (or `lenbatch profile --out`)."""
        return cls.from_json(json.loads(Path(path).read_text(encoding="utf-8")))


def processor_mismatch(cost: CostModel, here: str) -> str | None:
    """Why `cost` does not describe the processor `here` (a `processor_key()`), or None. A
    cost model with no processor key, or an older one (no model number or ISA flags), never
    describes it."""
    why = processor_difference(cost.processor, here)
    if why is None:
        return None
    what = f"cost model of {cost.model or 'the model'}"
    if not cost.processor:
        return (
            f"{what} does not say which processor it was measured on (it predates processor "
            f"keys); this machine is {here!r}: re-run `lenbatch profile` here"
        )
    return (
        f"{what} was measured on {cost.processor!r}, this machine is {here!r} ({why}): its "
        "latencies do not hold here; re-run `lenbatch profile` (then `lenbatch calibrate`) "
        "on this machine"
    )
