"""Profile a runner: latency and peak memory over batch sizes x padded lengths, and the fitted
`CostModel` that `simulate` and `fit --cost` read.

Each grid point runs `runner.embed(collate(...))` on `B` rows of exactly `L` random tokens:
`warmup` untimed calls, then `repeats` timed ones (the median is kept, the spread reported),
then one more call under a memory probe. Memory is measured apart from the timing so the probe
cannot slow it down, and apart from the weights (`runner.memory().weights`):

- CUDA: `torch.cuda.max_memory_allocated` above what was allocated before the call (exact for
  tensors).
- CPU: the resident set sampled from `/proc/self/statm` by a background thread every
  `interval` seconds during the call, above the resident set just before it, after asking
  glibc to return freed memory (`malloc_trim`) so memory freed by an earlier point does not
  hide this one's. Sampling can miss a peak shorter than the interval, so on CPU the figure
  is a lower bound. (`ru_maxrss` cannot be used: it is one high-water mark for the process.)

The latency model `const + per_row*B + per_token*B*L + per_token_sq*B*L^2` is fitted by
non-negative least squares on relative errors (points span milliseconds to seconds); the
memory model `act_const + act_per_token*B*L + act_per_token_sq*B*L^2` by non-negative least
squares on bytes.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import statistics
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import numpy as np
import numpy.typing as npt

from lenbatch.core.clock import Clock
from lenbatch.core.collate import Collated, collate
from lenbatch.plan.costmodel import CostModel
from lenbatch.runners.base import EmbeddingRunner
from lenbatch.runners.memory import current_rss, release_freed_memory

__all__ = [
    "CudaMemoryProbe",
    "MemoryProbe",
    "NoMemoryProbe",
    "PerfClock",
    "ProfilePoint",
    "RssMemoryProbe",
    "bucket_max_batches",
    "fit_cost_model",
    "format_table",
    "nnls",
    "probe_for",
    "profile_and_fit",
    "profile_runner",
]

T = TypeVar("T")
FloatArray = npt.NDArray[np.float64]


class PerfClock:
    """`time.perf_counter`: the clock for timing calls (finer than monotonic on some systems)."""

    def now(self) -> float:
        """Seconds from an arbitrary origin."""
        import time

        return time.perf_counter()


@dataclass(frozen=True)
class ProfilePoint:
    """One grid point: `batch` rows padded to `padded_len` tokens."""

    batch: int
    padded_len: int
    latency_s: float  # median of the timed repeats
    latency_min_s: float
    latency_max_s: float
    repeats: int
    peak_activation_bytes: float  # peak above the pre-call baseline, weights excluded

    @property
    def tokens(self) -> int:
        """Padded tokens in the batch."""
        return self.batch * self.padded_len


class MemoryProbe(Protocol):
    """Measures the peak memory one call needs above what was in use before it."""

    method: str  # how, for the cost model file and reports

    def measure(self, call: Callable[[], T]) -> tuple[T, float]:
        """Run `call`; return its result and its peak bytes above the baseline."""
        ...


class NoMemoryProbe:
    """Does not measure memory (reports 0)."""

    method = "not measured"

    def measure(self, call: Callable[[], T]) -> tuple[T, float]:
        """Run `call`; memory 0."""
        return call(), 0.0


class CudaMemoryProbe:
    """`torch.cuda.max_memory_allocated` above the bytes allocated before the call."""

    method = "cuda max_memory_allocated above the pre-call allocation"

    def __init__(self, device: Any) -> None:
        self.device = device

    def measure(self, call: Callable[[], T]) -> tuple[T, float]:
        """Run `call` between a peak reset and a synchronised read."""
        import torch

        torch.cuda.synchronize(self.device)
        base = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        result = call()
        torch.cuda.synchronize(self.device)
        return result, float(max(0, torch.cuda.max_memory_allocated(self.device) - base))


class RssMemoryProbe:
    """Resident set sampled by a thread during the call, above the resident set before it."""

    method = "cpu rss sampled during the call above the pre-call rss (a lower bound)"

    def __init__(self, interval: float = 0.0005, read: Callable[[], int] = current_rss) -> None:
        self.interval = interval
        self.read = read

    def measure(self, call: Callable[[], T]) -> tuple[T, float]:
        """Run `call` while sampling; the last sample is taken before the result is released."""
        release_freed_memory()
        base = self.read()
        peak = base
        done = threading.Event()

        def sample() -> None:
            nonlocal peak
            while not done.is_set():
                peak = max(peak, self.read())
                done.wait(self.interval)

        sampler = threading.Thread(target=sample, name="lenbatch-rss-probe", daemon=True)
        sampler.start()
        try:
            result = call()
            peak = max(peak, self.read())
        finally:
            done.set()
            sampler.join()
        return result, float(max(0, peak - base))


def _batch(runner: EmbeddingRunner, rows: int, length: int, rng: np.random.Generator) -> Collated:
    """`rows` sequences of exactly `length` random ordinary tokens (no padding inside)."""
    info = runner.info
    low = 1000 if info.vocab_size > 2000 else 1  # skip special tokens in BERT-like vocabularies
    ids = rng.integers(low, info.vocab_size, size=(rows, length)).tolist()
    return collate(ids, info.pad_token_id, info.padding_side, position_ids=info.needs_position_ids)


def profile_runner(
    runner: EmbeddingRunner,
    batch_sizes: Sequence[int],
    lengths: Sequence[int],
    *,
    repeats: int = 5,
    warmup: int = 1,
    clock: Clock | None = None,
    probe: MemoryProbe | None = None,
    seed: int = 0,
    progress: Callable[[ProfilePoint], None] | None = None,
) -> list[ProfilePoint]:
    """Time `runner.embed` on every (batch size, padded length) pair, smallest first."""
    if not batch_sizes or not lengths:
        raise ValueError("need at least one batch size and one length")
    if min(batch_sizes) < 1 or min(lengths) < 1:
        raise ValueError("batch sizes and lengths must be positive")
    if max(lengths) > runner.info.max_length:
        raise ValueError(
            f"length {max(lengths)} exceeds the model's limit of {runner.info.max_length} tokens"
        )
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats must be >= 1 and warmup >= 0, got {repeats}, {warmup}")
    clock = clock or PerfClock()
    probe = probe or NoMemoryProbe()
    rng = np.random.default_rng(seed)
    grid = sorted(itertools.product(set(batch_sizes), set(lengths)), key=lambda p: p[0] * p[1])
    points = []
    for rows, length in grid:
        batch = _batch(runner, rows, length, rng)
        for _ in range(warmup):
            runner.embed(batch)
        times = []
        for _ in range(repeats):
            start = clock.now()
            runner.embed(batch)
            times.append(clock.now() - start)
        _, peak = probe.measure(lambda b=batch: runner.embed(b))  # type: ignore[misc]
        point = ProfilePoint(
            batch=rows,
            padded_len=length,
            latency_s=statistics.median(times),
            latency_min_s=min(times),
            latency_max_s=max(times),
            repeats=repeats,
            peak_activation_bytes=peak,
        )
        points.append(point)
        if progress is not None:
            progress(point)
    return points


def nnls(a: npt.ArrayLike, y: npt.ArrayLike) -> FloatArray:
    """Non-negative least squares, `min |A x - y|` with `x >= 0`, exactly, for a few columns.

    The optimum is the unconstrained least-squares solution on its own support, so trying
    every subset of columns and keeping the best feasible one finds it (2^p solves; p <= 6).
    """
    a = np.asarray(a, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    p = a.shape[1]
    if p > 6:
        raise ValueError(f"nnls by enumeration is for a few columns, got {p}")
    scale = np.linalg.norm(a, axis=0)
    scale[scale == 0] = 1.0
    a_s = a / scale  # columns of very different size (B vs B*L^2): solve on unit columns
    best, best_res = np.zeros(p), float(np.sum(y * y))
    for k in range(1, p + 1):
        for cols in itertools.combinations(range(p), k):
            sol, *_ = np.linalg.lstsq(a_s[:, cols], y, rcond=None)
            if (sol < 0).any():
                continue
            res = float(np.sum((a_s[:, cols] @ sol - y) ** 2))
            if res < best_res:
                best = np.zeros(p)
                best[list(cols)] = sol
                best_res = res
    out: FloatArray = best / scale
    return out


def fit_cost_model(
    points: Sequence[ProfilePoint],
    *,
    weights_bytes: float = 0.0,
    model: str = "",
    device: str = "cpu",
    memory_method: str = "",
) -> CostModel:
    """Fit latency and memory models to profile points (see the module docstring)."""
    if len(points) < 4:
        raise ValueError(
            f"need at least 4 profile points to fit 4 latency terms, got {len(points)}"
        )
    b = np.array([p.batch for p in points], dtype=np.float64)
    n = np.array([p.padded_len for p in points], dtype=np.float64)
    lat = np.array([p.latency_s for p in points])
    if (lat <= 0).any():
        raise ValueError("every profiled latency must be positive")
    x = np.column_stack([np.ones_like(b), b, b * n, b * n * n])
    coef = nnls(x / lat[:, None], np.ones_like(lat))  # relative errors: (Xc - y) / y
    pred = x @ coef
    fit_error = float(np.sqrt(np.mean(((pred - lat) / lat) ** 2)))
    mem = np.array([p.peak_activation_bytes for p in points])
    xm = np.column_stack([np.ones_like(b), b * n, b * n * n])
    mcoef = nnls(xm, mem) if mem.any() else np.zeros(3)
    mpred = xm @ mcoef
    mem_error = float(np.sqrt(np.mean((mpred - mem) ** 2)) / mem.mean()) if mem.any() else math.nan
    rows = [
        {
            "batch": float(p.batch),
            "padded_len": float(p.padded_len),
            "latency_s": p.latency_s,
            "latency_min_s": p.latency_min_s,
            "latency_max_s": p.latency_max_s,
            "predicted_s": float(pl),
            "peak_activation_bytes": p.peak_activation_bytes,
            "predicted_activation_bytes": float(pm),
        }
        for p, pl, pm in zip(points, pred, mpred, strict=True)
    ]
    return CostModel(
        const=float(coef[0]),
        per_row=float(coef[1]),
        per_token=float(coef[2]),
        per_token_sq=float(coef[3]),
        weights_bytes=float(weights_bytes),
        act_const=float(mcoef[0]),
        act_per_token=float(mcoef[1]),
        act_per_token_sq=float(mcoef[2]),
        model=model,
        device=device,
        fit_error=fit_error,
        memory_fit_error=mem_error,
        memory_method=memory_method,
        points=rows,
    )


def probe_for(runner: EmbeddingRunner) -> MemoryProbe:
    """The memory probe for a runner's device: CUDA allocator on a GPU, sampled RSS on CPU."""
    device: Any = getattr(runner, "device", None)
    if getattr(device, "type", "") == "cuda":
        return CudaMemoryProbe(device)
    return RssMemoryProbe()


def profile_and_fit(
    runner: EmbeddingRunner,
    batch_sizes: Sequence[int],
    lengths: Sequence[int],
    *,
    repeats: int = 5,
    warmup: int = 1,
    device: str = "cpu",
    progress: Callable[[ProfilePoint], None] | None = None,
) -> CostModel:
    """Profile a real runner with the probe for its device and fit its cost model, recording
    what it was measured with: processor key, dtype, execution and quantization."""
    probe = probe_for(runner)
    points = profile_runner(
        runner,
        batch_sizes,
        lengths,
        repeats=repeats,
        warmup=warmup,
        probe=probe,
        progress=progress,
    )
    cost = fit_cost_model(
        points,
        weights_bytes=runner.memory().weights,
        model=runner.info.name,
        device=device,
        memory_method=probe.method,
    )
    from lenbatch.runners.base import PackedEmbeddingRunner
    from lenbatch.runners.hardware import processor_key

    precision = getattr(runner, "precision", None)
    return dataclasses.replace(
        cost,
        processor=processor_key(device),
        dtype=precision.name if precision is not None else "",
        execution="packed" if isinstance(runner, PackedEmbeddingRunner) else "padded",
        quantization=getattr(runner, "quantization", "none"),
    )


def bucket_max_batches(
    cost: CostModel, uppers: Sequence[int], budget_bytes: float, cap: int = 1024
) -> list[int]:
    """Largest batch per bucket (padded to its upper bound) whose predicted memory, weights
    included, fits `budget_bytes`."""
    return [cost.max_batch(u, budget_bytes, cap) for u in uppers]


def format_table(cost: CostModel) -> str:
    """The measured grid next to the fitted models, one row per point."""
    head = (
        f"{'batch':>5} {'len':>5} {'tokens':>7} {'median ms':>10} {'min-max ms':>15} "
        f"{'model ms':>9} {'err':>6} {'act MB':>8} {'model MB':>9}"
    )
    lines = [head]
    for p in cost.points:
        err = (p["predicted_s"] - p["latency_s"]) / p["latency_s"]
        spread = f"{1e3 * p['latency_min_s']:.1f}-{1e3 * p['latency_max_s']:.1f}"
        lines.append(
            f"{int(p['batch']):>5} {int(p['padded_len']):>5} "
            f"{int(p['batch'] * p['padded_len']):>7} {1e3 * p['latency_s']:>10.2f} "
            f"{spread:>15} {1e3 * p['predicted_s']:>9.2f} {100 * err:>5.1f}% "
            f"{p['peak_activation_bytes'] / 2**20:>8.1f} "
            f"{p['predicted_activation_bytes'] / 2**20:>9.1f}"
        )
    lines.append("")
    lines.append(
        f"latency_s = {cost.const:.4g} + {cost.per_row:.4g}*B + {cost.per_token:.4g}*B*L + "
        f"{cost.per_token_sq:.4g}*B*L^2   (relative RMS error {100 * cost.fit_error:.1f}%)"
    )
    mem_err = cost.memory_fit_error
    lines.append(
        f"activation_bytes = {cost.act_const:.4g} + {cost.act_per_token:.4g}*B*L + "
        f"{cost.act_per_token_sq:.4g}*B*L^2   (RMS error {100 * mem_err:.1f}% of the mean)"
        if not math.isnan(mem_err)
        else "activation memory: not measured"
    )
    lines.append(f"weights: {cost.weights_bytes / 2**20:.1f} MB; memory: {cost.memory_method}")
    return "\n".join(lines)
