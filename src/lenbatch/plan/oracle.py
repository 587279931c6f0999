"""The offline oracle: how fast the model could serve a trace if every length were known up front.

No waiting, no arrival order: sort all admissible lengths and cut them into the batches that
minimise total predicted execution time under the same limits the engine obeys (`max_batch`
rows, `max_batch_tokens` padded tokens, optionally a memory budget). That total, spread over
the runner's concurrent slots, is the physical limit for this model and cost model; simulated
and live throughput are reported as a fraction of it.

Why cutting the *sorted* lengths into contiguous runs is optimal: take any set of batches,
order them by their longest member, and refill them with the same sizes from the sorted list.
The k-th batch's new longest member is then no longer than its old one (at least as many
lengths fit under that bound), so no batch gets slower or breaks a budget. The best contiguous
cut is found exactly by dynamic programming over the sorted list.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from lenbatch.config import BatchingConfig
from lenbatch.plan.costmodel import CostModel

__all__ = ["Oracle", "oracle", "oracle_for"]


@dataclass(frozen=True)
class Oracle:
    """The ideal offline schedule of a set of lengths."""

    requests: int
    real_tokens: int
    padded_tokens: int
    batches: int
    busy_s: float  # sum of predicted batch latencies
    concurrency: int  # batches that run at once

    @property
    def duration_s(self) -> float:
        """Seconds to serve everything with `concurrency` slots kept busy."""
        return self.busy_s / self.concurrency

    @property
    def throughput_rps(self) -> float:
        """Requests per second at the physical limit."""
        return self.requests / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def real_tokens_per_s(self) -> float:
        """Real (unpadded) tokens per second at the physical limit."""
        return self.real_tokens / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def padding_waste(self) -> float:
        """Token-weighted padding waste of the ideal batches."""
        return 1 - self.real_tokens / self.padded_tokens if self.padded_tokens else 0.0

    @property
    def mean_batch_size(self) -> float:
        """Mean rows per ideal batch."""
        return self.requests / self.batches if self.batches else 0.0


def oracle(
    lengths: Sequence[int] | npt.NDArray[np.int64],
    cost: CostModel,
    *,
    max_batch: int,
    max_batch_tokens: int,
    concurrency: int = 1,
    memory_budget_bytes: float | None = None,
) -> Oracle:
    """The minimum-time batching of `lengths` (all of which must fit one row of the budget)."""
    if max_batch < 1 or max_batch_tokens < 1 or concurrency < 1:
        raise ValueError(
            f"oracle needs max_batch, max_batch_tokens and concurrency >= 1 "
            f"(got {max_batch}, {max_batch_tokens}, {concurrency})"
        )
    lens = np.sort(np.asarray(lengths, dtype=np.int64))
    n = len(lens)
    if n and lens[0] < 1:
        raise ValueError(f"lengths must be at least 1 token, got {int(lens[0])}")
    if n and lens[-1] > max_batch_tokens:
        raise ValueError(
            f"length {int(lens[-1])} exceeds the batch token budget {max_batch_tokens}"
        )
    # best[j]: least total time for the j shortest lengths; cut[j]: size of the last batch.
    # Plain Python over a per-length table of cost.latency(k, pad): faster than numpy for
    # the short inner loop (k <= max_batch), and it keeps the cost model the only formula.
    best = [0.0] * (n + 1)
    cut = [0] * (n + 1)
    table: dict[int, list[float]] = {}  # pad -> [latency(k, pad) for k in 0..k_max]
    sorted_lens: list[int] = lens.tolist()
    for j in range(1, n + 1):
        pad = sorted_lens[j - 1]  # the longest of any batch ending at j
        row = table.get(pad)
        if row is None:
            k_cap = min(max_batch, max_batch_tokens // pad)
            if memory_budget_bytes is not None:
                k_cap = min(k_cap, cost.max_batch(pad, memory_budget_bytes, cap=max_batch))
            if k_cap < 1:
                raise ValueError(f"not even one row of {pad} tokens fits the memory budget")
            row = [0.0] + [cost.latency(k, pad) for k in range(1, k_cap + 1)]
            table[pad] = row
        k_best = 1
        t_best = best[j - 1] + row[1]
        for k in range(2, min(len(row) - 1, j) + 1):
            t = best[j - k] + row[k]
            if t < t_best:
                t_best, k_best = t, k
        best[j] = t_best
        cut[j] = k_best
    batches = 0
    padded = 0
    j = n
    while j > 0:
        k = cut[j]
        padded += k * sorted_lens[j - 1]
        batches += 1
        j -= k
    return Oracle(
        requests=n,
        real_tokens=int(lens.sum()),
        padded_tokens=padded,
        batches=batches,
        busy_s=best[n],
        concurrency=concurrency,
    )


def oracle_for(
    lengths: Sequence[int] | npt.NDArray[np.int64],
    cost: CostModel,
    batching: BatchingConfig,
    *,
    max_length: int = 256,
    truncate: bool = False,
    memory_budget_bytes: float | None = None,
) -> Oracle:
    """The oracle for what a server with `batching` could serve: lengths it would reject
    (over the model limit unless `truncate`, or over the batch token budget) are left out, and
    batches may be as large as the loosest cap of any lane or strategy of that config."""
    lens = np.asarray(lengths, dtype=np.int64)
    if truncate:
        lens = np.minimum(lens, max_length)
    limit = min(max_length, batching.max_batch_tokens)
    lens = lens[(lens >= 1) & (lens <= limit)]
    caps = (batching.max_batch, batching.overlong_max_batch, *(batching.bucket_max_batch or ()))
    return oracle(
        lens,
        cost,
        max_batch=max(caps),
        max_batch_tokens=batching.max_batch_tokens,
        concurrency=batching.max_concurrent_batches,
        memory_budget_bytes=memory_budget_bytes,
    )
